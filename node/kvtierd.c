/* kvtierd: the kvtier node daemon (DESIGN.md §8).
 *
 * Assembles, in this order: the shared primary region, the primary tier, the
 * secondary tiers in the configured order (storage, network with its peer links),
 * the manager, the local engine API and /metrics; then runs the step loop on one
 * thread. Engines drive steps with on_schedule_end; when none did for tick_ms the
 * loop steps on its own, so peers are served and transfers progress on an idle node.
 *
 * Signals (signalfd): SIGTERM/SIGINT stop accepting engines, drain transfers,
 * release leases, unpublish and exit 0; SIGHUP reloads the keys that can change at
 * run time and keeps the old configuration when the new one is bad.
 *
 * Restart after SIGKILL: a lock file next to the region (flock) tells a live daemon
 * from a dead one; a dead one's socket is removed by the engine server, its region
 * file here, under the rule below.
 *
 * Other users of the host (nothing here trusts a name another user could have made):
 * - The folders of primary.path and engine.socket (the runtime folder, by default
 *   /run/kvtier/<id>) are opened through kvt_private_dir_open: created 0700 (0750 with
 *   node.group) when missing; refused when another user owns them, when group or
 *   others may write to them, when they are symbolic links, or when a folder above
 *   them could be changed by another user. Refusals exit with KVTIERD_EXIT_UNSAFE.
 * - The lock file is opened inside that folder (openat, O_NOFOLLOW, 0600) and must be
 *   our own regular file with no group/other bits; a lock held by a process of
 *   another user is reported with its pid and uid.
 * - Stale region rule: the daemon deletes only what it created. Once its region is
 *   created it writes the file's device and inode into the lock file. At the next
 *   start, holding the lock, it removes an existing file at primary.path only when it
 *   is a regular file of our user with one link whose device and inode are the ones
 *   recorded; anything else there (another user's file, an unrelated file that
 *   primary.path happens to name, a file with no record) is left alone and the start
 *   is refused, naming the file. The region itself is then created exclusively
 *   (O_EXCL, never joined), so a file that appears in between is refused too. */
#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <grp.h>
#include <linux/magic.h>
#include <sys/file.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/sysmacros.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include "kvt/alloc.h"
#include "kvt/auth.h"
#include "kvt/backpressure.h"
#include "kvt/clock.h"
#include "kvt/common.h"
#include "kvt/config.h"
#include "kvt/engine_api.h"
#include "kvt/log.h"
#include "kvt/manager.h"
#include "kvt/metrics_http.h"
#include "kvt/net_tier.h"
#include "kvt/peers.h"
#include "kvt/primary.h"
#include "kvt/prom.h"
#include "kvt/region.h"
#include "kvt/service.h"
#include "kvt/safe_path.h"
#include "kvt/storage_tier.h"
#include "kvt/version.h"

#define MOD "kvtierd"
/* Start refused because a path is not safe to use (another user's file or folder, a
 * symbolic link, a folder others may write to): sysexits.h EX_NOPERM. */
#define KVTIERD_EXIT_UNSAFE 77
#define LOCK_RECORD         "kvtierd region %llu %llu\n" /* device, inode of the region */

struct daemon {
    struct kvt_config cfg;
    const char *cfg_path;
    char **sets;
    size_t n_sets;

    int lock_fd;
    bool lock_created; /* by this start: removed again if the start fails */
    int run_fd;        /* the runtime folder of primary.path */
    char lock_path[4096];
    char region_name[NAME_MAX + 1], lock_name[NAME_MAX + 1];
    struct kvt_region *region;
    struct kvt_primary *primary;
    struct kvt_tier *tiers[KVT_CONFIG_TIERS_MAX];
    size_t n_tiers;
    struct kvt_tier *net;
    struct kvt_peers *peers;
    uint8_t secret[KVT_AUTH_SECRET_MAX];
    size_t secret_len;
    struct kvt_manager *m;
    struct kvt_engine_server *engines;
    struct kvt_metrics_http *http;
    struct kvt_prom_acc prom;
    uint64_t render_failures; /* renders of /metrics that failed */
    int render_failing;       /* the last render's error while failing, else 0 */

    int ep, sig_fd, tick_fd;
    uint64_t last_step_ns, last_metrics_ns;
    bool stopping;
};

static void usage(FILE *f)
{
    fprintf(f, "usage: kvtierd [--config FILE] [--set key=value]... [--check] [--dump]\n"
               "               [--help] [--version]\n\n"
               "  --config FILE   YAML configuration (default: none, built-in defaults)\n"
               "  --set KEY=VAL   override one key (repeatable; applied after the file)\n"
               "  --check         validate the configuration and exit (0 or 78)\n"
               "  --dump          print the effective configuration as YAML and exit\n\n"
               "exit status: 0 stopped cleanly, 78 bad configuration, 77 a path is not safe\n"
               "to use (another user's file or folder, a link, a folder others may write),\n"
               "1 any other failure\n\n");
    kvt_config_print_help(f);
}

static int ep_add(struct daemon *d, int fd);

/* ---- assembly ------------------------------------------------------------------ */

/* node.group as a gid (the loader checked that it exists). */
static int node_gid(const struct kvt_config *cfg, gid_t *gid_p)
{
    struct group gr, *found = NULL;
    char buf[4096], *end;
    unsigned long v;

    *gid_p = KVT_GROUP_NONE;
    if (cfg->node_group == NULL)
        return 0;
    v = strtoul(cfg->node_group, &end, 10);
    if (*end == '\0' && end != cfg->node_group) {
        *gid_p = (gid_t)v;
        return 0;
    }
    if (getgrnam_r(cfg->node_group, &gr, buf, sizeof(buf), &found) != 0 || found == NULL) {
        kvt_error(MOD, "node.group: no group named %s", cfg->node_group);
        return -EINVAL;
    }
    *gid_p = gr.gr_gid;
    return 0;
}

/* Opens (creating if missing) the runtime folder that holds file; *name_p gets the
 * file's name in it. */
static int open_runtime_dir(struct daemon *d, const char *key, const char *file, char *name,
                            size_t name_len, int *fd_p)
{
    char dir[4096];
    struct kvt_dir_policy pol = {.mode = 0700, .create = true};
    int rc = kvt_path_split(file, dir, sizeof(dir), name, name_len);

    if (rc < 0) {
        kvt_error(MOD, "%s %s: not a file name", key, file);
        return -EINVAL;
    }
    rc = node_gid(&d->cfg, &pol.gid);
    if (rc < 0)
        return rc;
    if (pol.gid != KVT_GROUP_NONE)
        pol.mode = 0750;
    rc = kvt_private_dir_open(dir, &pol, fd_p);
    if (rc < 0)
        kvt_error(MOD, "%s %s: its folder %s cannot be used (%s)", key, file, dir,
                  rc == -EPERM ? "not safe: see above" : strerror(-rc));
    return rc;
}

/* The effective uid of process pid (/proc/<pid>/status: its owner is not enough, a
 * process that changed its uid is not dumpable and its /proc files stay root's). */
static uid_t proc_euid(int pid)
{
    char path[64], line[256];
    unsigned ruid, euid;
    uid_t uid = (uid_t)-1;
    FILE *f;

    snprintf(path, sizeof(path), "/proc/%d/status", pid);
    f = fopen(path, "re");
    if (f == NULL)
        return uid;
    while (fgets(line, sizeof(line), f) != NULL) {
        if (sscanf(line, "Uid: %u %u", &ruid, &euid) == 2) {
            uid = (uid_t)euid;
            break;
        }
    }
    fclose(f);
    return uid;
}

/* Who holds the flock on the file st describes (/proc/locks); 0 and *pid_p, *uid_p,
 * or -ENOENT. */
static int lock_holder(const struct stat *st, int *pid_p, uid_t *uid_p)
{
    FILE *f = fopen("/proc/locks", "re");
    char line[256];
    int rc = -ENOENT;

    if (f == NULL)
        return -errno;
    while (fgets(line, sizeof(line), f) != NULL) {
        unsigned maj, min;
        unsigned long ino;
        char type[16];
        int pid;

        if (sscanf(line, "%*d: %15s %*s %*s %d %x:%x:%lu", type, &pid, &maj, &min, &ino) != 5 ||
            strcmp(type, "FLOCK") != 0 || ino != (unsigned long)st->st_ino ||
            makedev(maj, min) != st->st_dev)
            continue;
        *pid_p = pid;
        *uid_p = proc_euid(pid);
        rc = 0;
        break;
    }
    fclose(f);
    return rc;
}

/* The lock is busy: say who holds it. Another user's process holding our lock file
 * is refused as unsafe; another daemon of ours is -EBUSY, as before. */
static int lock_busy(struct daemon *d, const struct stat *st)
{
    uid_t uid = (uid_t)-1;
    int pid = 0;

    if (lock_holder(st, &pid, &uid) == 0 && uid != geteuid()) {
        kvt_error(MOD,
                  "the lock %s is held by pid %d of another user (uid %d): refusing to start "
                  "(a process of another user has our lock file open)",
                  d->lock_path, pid, (int)uid);
        return -EPERM;
    }
    if (pid > 0)
        kvt_error(MOD, "another kvtierd runs with region %s (lock %s is held by pid %d)",
                  d->cfg.primary_path, d->lock_path, pid);
    else
        kvt_error(MOD, "another kvtierd runs with region %s (lock %s is held)", d->cfg.primary_path,
                  d->lock_path);
    return -EBUSY;
}

/* Opens the lock file in the runtime folder, checks it is ours and takes it. The
 * file a previous daemon unlinked while we opened it would lock nothing: the path
 * must still name the file we locked. */
static int lock_file(struct daemon *d)
{
    for (int attempt = 0; attempt < 8; attempt++) {
        struct stat st, there;
        bool created = true;
        int fd, rc;

        fd = openat(d->run_fd, d->lock_name, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                    0600);
        if (fd < 0 && errno == EEXIST) {
            created = false;
            fd = openat(d->run_fd, d->lock_name, O_RDWR | O_NOFOLLOW | O_CLOEXEC);
            if (fd < 0 && errno == ENOENT)
                continue; /* removed in between: create it */
        }
        if (fd < 0) {
            rc = -errno;
            if (rc == -ELOOP) {
                kvt_error(MOD, "lock file %s is a symbolic link: refusing it", d->lock_path);
                return -EPERM;
            }
            kvt_error(MOD, "cannot open lock file %s: %s", d->lock_path, strerror(-rc));
            return rc;
        }
        rc = kvt_private_file_check(fd, d->lock_path, 0600, &st);
        if (rc < 0) {
            kvt_error(MOD, "lock file %s is not this daemon's own: refusing to start",
                      d->lock_path);
            close(fd);
            return rc;
        }
        if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
            rc = errno == EWOULDBLOCK ? lock_busy(d, &st) : -errno;
            close(fd);
            return rc;
        }
        if (fstatat(d->run_fd, d->lock_name, &there, AT_SYMLINK_NOFOLLOW) == 0 &&
            there.st_dev == st.st_dev && there.st_ino == st.st_ino) {
            d->lock_fd = fd;
            d->lock_created = created;
            return 0;
        }
        close(fd); /* unlinked by the daemon that just stopped: take the new one */
    }
    kvt_error(MOD, "lock file %s keeps changing: is another kvtierd starting?", d->lock_path);
    return -EBUSY;
}

/* The stale region rule (see the top of this file). */
static int remove_stale_region(struct daemon *d)
{
    unsigned long long dev = 0, ino = 0;
    char rec[128], why[160];
    struct stat st;
    ssize_t n;

    if (fstatat(d->run_fd, d->region_name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
        int rc = -errno;

        if (rc == -ENOENT)
            return 0;
        kvt_error(MOD, "%s: %s", d->cfg.primary_path, strerror(-rc));
        return rc;
    }
    n = pread(d->lock_fd, rec, sizeof(rec) - 1, 0);
    rec[n > 0 ? n : 0] = '\0';
    if (S_ISLNK(st.st_mode))
        snprintf(why, sizeof(why), "it is a symbolic link");
    else if (!S_ISREG(st.st_mode))
        snprintf(why, sizeof(why), "it is not a regular file");
    else if (st.st_uid != geteuid())
        snprintf(why, sizeof(why), "it is owned by uid %u", (unsigned)st.st_uid);
    else if (sscanf(rec, LOCK_RECORD, &dev, &ino) != 2)
        snprintf(why, sizeof(why), "the lock file records no region");
    else if (st.st_dev != dev || st.st_ino != ino || st.st_nlink != 1)
        snprintf(why, sizeof(why), "it is not the file the lock file records");
    else if (unlinkat(d->run_fd, d->region_name, 0) != 0)
        snprintf(why, sizeof(why), "unlink: %s", strerror(errno));
    else {
        kvt_warn(MOD, "removed the stale region %s of a daemon that died", d->cfg.primary_path);
        return 0;
    }
    kvt_error(MOD,
              "primary.path %s exists and is not a region this daemon created (%s): not "
              "removing it and not joining it; if it is a stale region remove it yourself, "
              "else choose another primary.path",
              d->cfg.primary_path, why);
    return -EPERM;
}

/* After the region is created: the lock file records which file it is. */
static void record_region(struct daemon *d)
{
    char rec[128];
    struct stat st;
    int n;

    if (fstat(d->region->fd, &st) != 0)
        return;
    n = snprintf(rec, sizeof(rec), LOCK_RECORD, (unsigned long long)st.st_dev,
                 (unsigned long long)st.st_ino);
    if (ftruncate(d->lock_fd, 0) != 0 || pwrite(d->lock_fd, rec, (size_t)n, 0) != n)
        kvt_warn(MOD,
                 "cannot record the region in %s: %s (a restart after a crash will not "
                 "remove it)",
                 d->lock_path, strerror(errno));
}

static int take_lock(struct daemon *d)
{
    char sock_name[NAME_MAX + 1];
    int sock_fd, rc;

    rc = open_runtime_dir(d, "primary.path", d->cfg.primary_path, d->region_name,
                          sizeof(d->region_name), &d->run_fd);
    if (rc < 0)
        return rc;
    /* The socket's folder (usually the same one) passes the same rules. */
    rc = open_runtime_dir(d, "engine.socket", d->cfg.engine_socket, sock_name, sizeof(sock_name),
                          &sock_fd);
    if (rc < 0)
        return rc;
    close(sock_fd);
    if ((size_t)snprintf(d->lock_name, sizeof(d->lock_name), "%s.lock", d->region_name) >=
        sizeof(d->lock_name)) {
        kvt_error(MOD, "primary.path %s: name too long for its lock file", d->cfg.primary_path);
        return -EINVAL;
    }
    snprintf(d->lock_path, sizeof(d->lock_path), "%s.lock", d->cfg.primary_path);
    rc = lock_file(d);
    if (rc < 0)
        return rc;
    /* We hold the lock: a region file of a dead daemon of ours may be there. */
    return remove_stale_region(d);
}

/* How much of the (populated) region is on huge pages, and how to get them when it is
 * not: peers' READs pin or walk one 2 MiB page instead of 512 (docs/bench-pull.md:
 * 2.7 -> 4.6 GB/s over shared memory on a test host). */
static void report_pages(const struct kvt_region *r)
{
    size_t huge = 0;

    if (kvt_region_huge_bytes(r, &huge) != 0)
        return;
    kvt_info(MOD, "primary region: %.0f%% on huge pages", 100.0 * (double)huge / (double)r->size);
    if (huge < r->size / 2)
        kvt_info(MOD, "for huge pages put primary.path on a tmpfs mounted huge=advise (mount -o "
                      "remount,huge=advise on its mount point, e.g. /run) or on hugetlbfs");
}

/* The region belongs in memory: on a disk file system its pages are written back. */
static void check_tmpfs(const struct kvt_region *r)
{
    struct statfs sf;

    if (fstatfs(r->fd, &sf) == 0 && sf.f_type != TMPFS_MAGIC && sf.f_type != HUGETLBFS_MAGIC)
        kvt_warn(MOD,
                 "primary.path %s is not on a tmpfs or hugetlbfs: the region's pages are "
                 "written back to that file system",
                 r->path);
}

static int open_region(struct daemon *d)
{
    struct kvt_region_config rc = {
        .path = d->cfg.primary_path,
        .num_chunks = d->cfg.primary_size / d->cfg.primary_row_bytes,
        .page_bytes = d->cfg.primary_row_bytes / d->cfg.primary_workers,
        .num_workers = d->cfg.primary_workers,
        .rank = KVT_REGION_RANK_ALL,
        .join_timeout_s = 5,
        .populate = true,
        .exclusive = true, /* a file there now is not ours: never join it */
    };
    struct kvt_primary_config pc = {
        .num_chunks = rc.num_chunks,
        .row_bytes = d->cfg.primary_row_bytes,
        .policy = kvt_policy_kind_name(d->cfg.primary_policy),
        .enable_events = true,
        .checksum_on_complete = true, /* grants carry the checksum of what was stored */
    };
    int rc_;

    d->region = kvt_calloc(1, sizeof(*d->region));
    if (d->region == NULL)
        return -ENOMEM;
    rc_ = kvt_region_open(&rc, d->region);
    if (rc_ != 0) {
        kvt_error(MOD, "primary region %s (%" PRIu64 " bytes): %s", rc.path, d->cfg.primary_size,
                  strerror(-rc_));
        kvt_free(d->region);
        d->region = NULL;
        return rc_;
    }
    record_region(d);
    check_tmpfs(d->region);
    report_pages(d->region);
    rc_ = kvt_primary_create(&pc, d->region, &d->primary);
    if (rc_ != 0) {
        kvt_error(MOD, "primary tier: %s", strerror(-rc_));
        kvt_region_cleanup(d->region);
        kvt_free(d->region);
        d->region = NULL;
    }
    return rc_;
}

static int open_storage(struct daemon *d, struct kvt_tier **t_p)
{
    struct kvt_storage_tier_config sc = {
        .root = d->cfg.storage_root,
        .capacity_bytes = d->cfg.storage_capacity,
        .read_depth = d->cfg.storage_read_depth,
        .enable_events = true,
    };
    struct kvt_bp_config bp;
    uint8_t secret[KVT_AUTH_SECRET_MAX];
    size_t secret_len = 0;
    int rc;

    /* The chunk files' MAC keys derive from the cluster secret when there is one;
     * without, the tier keeps a random key of its own in its root. */
    if (d->cfg.cluster_secret_file != NULL) {
        rc = kvt_auth_load_secret(d->cfg.cluster_secret_file, secret, sizeof(secret), &secret_len);
        if (rc != 0) {
            kvt_error(MOD, "secret file %s: %s", d->cfg.cluster_secret_file, strerror(-rc));
            return rc;
        }
        sc.key = secret;
        sc.key_len = secret_len;
    }
    kvt_auth_namespace(d->cfg.node_namespace, sc.namespace_id);
    kvt_bp_default_config("storage", KVT_LOCAL, &bp);
    if (d->cfg.storage_high_water_us > 0) { /* config: microseconds per MiB */
        bp.high_water_s = d->cfg.storage_high_water_us * 1e-6;
        bp.low_water_s = d->cfg.storage_low_water_us * 1e-6;
    }
    sc.bp = &bp;
    rc = kvt_storage_tier_create(&sc, t_p);
    explicit_bzero(secret, sizeof(secret));
    if (rc != 0)
        kvt_error(MOD, "storage tier at %s: %s", sc.root, strerror(-rc));
    return rc;
}

static int open_network(struct daemon *d, struct kvt_tier **t_p)
{
    struct kvt_peers_config pc = {0};
    struct kvt_net_tier_config nc = {0};
    int rc;

    if (d->cfg.cluster_secret_file == NULL) {
        /* One node, no cluster configured: listen with a secret nobody else knows,
         * so the tier runs (and answers MISS) and no peer can get in. */
        rc = kvt_auth_nonce(d->secret);
        d->secret_len = KVT_AUTH_NONCE_BYTES;
        kvt_info(MOD, "no cluster.secret_file: the network tier admits no peer");
    } else {
        rc = kvt_auth_load_secret(d->cfg.cluster_secret_file, d->secret, sizeof(d->secret),
                                  &d->secret_len);
    }
    if (rc != 0) {
        kvt_error(MOD, "secret file %s: %s", d->cfg.cluster_secret_file, strerror(-rc));
        return rc;
    }
    pc.node_id = d->cfg.node_id;
    kvt_auth_namespace(d->cfg.node_namespace, pc.ns);
    pc.secret = d->secret;
    pc.secret_len = d->secret_len;
    pc.listen_addr = d->cfg.network_listen;
    pc.listen_port = d->cfg.network_port;
    pc.seeds = (const char *const *)d->cfg.network_peers;
    pc.n_seeds = d->cfg.n_network_peers;
    pc.heartbeat_ms = d->cfg.network_heartbeat_ms;
    pc.heartbeat_misses = d->cfg.network_heartbeat_misses;
    pc.transport.backend = kvt_transport_kind_name(d->cfg.network_transport);
    pc.transport.op_timeout_ms = d->cfg.network_fetch_timeout_ms;
    rc = kvt_peers_create(&pc, &d->peers);
    if (rc != 0) {
        kvt_error(MOD, "network on %s:%u (%s): %s", pc.listen_addr, pc.listen_port,
                  pc.transport.backend, strerror(-rc));
        return rc;
    }
    nc.peers = d->peers;
    nc.primary = d->primary;
    nc.lease_ms = d->cfg.network_lease_ms;
    nc.fetch_timeout_ms = d->cfg.network_fetch_timeout_ms;
    rc = kvt_net_tier_create(&nc, t_p);
    if (rc != 0)
        kvt_error(MOD, "network tier: %s", strerror(-rc));
    else
        d->net = *t_p;
    kvt_info(MOD, "network: node %016" PRIx64 " incarnation %016" PRIx64 " on %s:%u (%s)",
             d->cfg.node_id, kvt_peers_incarnation(d->peers), pc.listen_addr,
             kvt_peers_port(d->peers), pc.transport.backend);
    return rc;
}

static int assemble(struct daemon *d)
{
    int rc = take_lock(d);

    if (rc == 0)
        rc = open_region(d);
    for (size_t i = 0; rc == 0 && i < d->cfg.n_tiers; i++) {
        struct kvt_tier *t = NULL;

        if (d->cfg.tiers[i] == KVT_TIER_STORAGE && d->cfg.storage_enabled)
            rc = open_storage(d, &t);
        else if (d->cfg.tiers[i] == KVT_TIER_NETWORK && d->cfg.network_enabled)
            rc = open_network(d, &t);
        if (t != NULL)
            d->tiers[d->n_tiers++] = t;
    }
    if (rc == 0)
        rc = kvt_manager_create(d->primary, d->tiers, d->n_tiers, &d->m);
    if (rc != 0)
        return rc;
    return 0;
}

/* ---- the loop ------------------------------------------------------------------ */

static int ep_add(struct daemon *d, int fd)
{
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = fd};

    if (fd < 0)
        return 0;
    return epoll_ctl(d->ep, EPOLL_CTL_ADD, fd, &ev) == 0 ? 0 : -errno;
}

/* The node's own series beside the tiering core's (cumulative counts). */
static size_t node_samples(struct daemon *d, struct kvt_prom_sample *v, size_t cap)
{
    struct kvt_engine_server_counters ec;
    size_t n = 0;

#define SAMPLE(nm, hp, k, val)                                                                     \
    do {                                                                                           \
        assert(n < cap);                                                                           \
        v[n++] = (struct kvt_prom_sample){                                                         \
            .name = (nm), .help = (hp), .kind = (k), .value = (double)(val)};                      \
    } while (0)
#define LSAMPLE(nm, hp, k, ln, lv, val)                                                            \
    do {                                                                                           \
        assert(n < cap);                                                                           \
        v[n++] = (struct kvt_prom_sample){.name = (nm),                                            \
                                          .help = (hp),                                            \
                                          .kind = (k),                                             \
                                          .label_name = (ln),                                      \
                                          .label_value = (lv),                                     \
                                          .value = (double)(val)};                                 \
    } while (0)
    kvt_engine_server_get_counters(d->engines, &ec);
    SAMPLE("kvtier_engine_clients", "Engines attached now", KVT_METRIC_GAUGE, ec.clients);
    SAMPLE("kvtier_engine_requests", "Engine API requests executed", KVT_METRIC_COUNTER,
           ec.requests);
    SAMPLE("kvtier_engine_malformed", "Engine API frames refused (malformed or oversized)",
           KVT_METRIC_COUNTER, ec.malformed + ec.oversized);
    SAMPLE("kvtier_engine_cleanups", "Pins released for engines that went away", KVT_METRIC_COUNTER,
           ec.released_pins);
    {
        size_t chunks = kvt_primary_num_chunks(d->primary), row = kvt_primary_row_bytes(d->primary);
        size_t used = kvt_primary_num_entries(d->primary);

        SAMPLE("kvtier_primary_chunks", "Chunks in the primary tier now (stored or being written)",
               KVT_METRIC_GAUGE, used);
        SAMPLE("kvtier_primary_capacity_chunks", "Chunks the primary tier holds at most",
               KVT_METRIC_GAUGE, chunks);
        SAMPLE("kvtier_primary_used_bytes", "Bytes of the primary tier's chunks now",
               KVT_METRIC_GAUGE, (double)used * (double)row);
        SAMPLE("kvtier_primary_capacity_bytes", "Bytes of the primary region", KVT_METRIC_GAUGE,
               (double)chunks * (double)row);
        SAMPLE("kvtier_primary_evictions", "Chunks evicted from the primary tier to make room",
               KVT_METRIC_COUNTER, kvt_primary_num_evicted(d->primary));
    }
    SAMPLE("kvtier_metrics_render_failures", "Renders of /metrics that failed (answered 500)",
           KVT_METRIC_COUNTER, d->render_failures);
    for (int r = 0; r < KVT_EREF_COUNT; r++) {
        if (r == KVT_EREF_EVENTS_DROPPED)
            continue;
        LSAMPLE("kvtier_engine_refused",
                "Engine API connections and requests refused or closed, by reason",
                KVT_METRIC_COUNTER, "reason", kvt_engine_refusal_name(r), ec.refused_by[r]);
    }
    SAMPLE("kvtier_engine_events_dropped",
           "Events dropped, oldest first, because no engine took them (engine.max_event_keys)",
           KVT_METRIC_COUNTER, ec.refused_by[KVT_EREF_EVENTS_DROPPED]);
    SAMPLE("kvtier_engine_event_keys_queued", "Keys of the events waiting for take_events",
           KVT_METRIC_GAUGE, ec.event_keys);
    if (d->http != NULL) {
        struct kvt_metrics_http_counters hc;

        kvt_metrics_http_get_counters(d->http, &hc);
        for (int r = 0; r < KVT_MHTTP_DROP_COUNT; r++)
            LSAMPLE("kvtier_metrics_http_dropped",
                    "HTTP connections to /metrics and /healthz closed early, by reason",
                    KVT_METRIC_COUNTER, "reason", kvt_metrics_http_drop_name(r), hc.dropped[r]);
    }
    SAMPLE("kvtier_engine_attach_refused", "Engine regions refused (no fd, bad geometry)",
           KVT_METRIC_COUNTER, ec.attach_refused);
    SAMPLE("kvtier_engine_jobs_refused", "Engine job requests refused whole (bad rows or kinds)",
           KVT_METRIC_COUNTER, ec.jobs_refused);
    SAMPLE("kvtier_engine_job_rows_stored", "Rows of engine store jobs validated in the primary",
           KVT_METRIC_COUNTER, ec.job_rows_stored);
    SAMPLE("kvtier_engine_job_rows_loaded", "Rows of engine load jobs validated in their region",
           KVT_METRIC_COUNTER, ec.job_rows_loaded);
    SAMPLE("kvtier_engine_job_rows_failed", "Rows of engine jobs reported failed",
           KVT_METRIC_COUNTER, ec.job_rows_failed);
    SAMPLE("kvtier_engine_ring_requests", "Engine API requests served from shared-memory rings",
           KVT_METRIC_COUNTER, ec.ring_requests);
    SAMPLE("kvtier_engine_ring_redirects",
           "Ring replies too large for the ring, sent on the socket", KVT_METRIC_COUNTER,
           ec.ring_redirects);
    SAMPLE("kvtier_engine_ring_wakeups", "Times an engine woke the sleeping loop through its ring",
           KVT_METRIC_COUNTER, ec.ring_wakeups);
    if (d->net != NULL) {
        struct kvt_net_tier_counts c;
        struct kvt_peers_counts pc;
        uint64_t ids[KVT_MEMBERS_MAX];

        kvt_net_tier_counts(d->net, &c);
        kvt_peers_counts(d->peers, &pc);
        SAMPLE("kvtier_peers_up", "Live cluster members, this node included", KVT_METRIC_GAUGE,
               kvt_peers_live(d->peers, ids, KVT_MEMBERS_MAX));
        SAMPLE("kvtier_peers_refused", "Peer handshakes refused (auth, namespace, version...)",
               KVT_METRIC_COUNTER, pc.refused);
        SAMPLE("kvtier_peers_malformed", "Malformed messages from authenticated peers",
               KVT_METRIC_COUNTER, pc.malformed);
        SAMPLE("kvtier_net_leases", "Leases peers hold on our chunks", KVT_METRIC_GAUGE,
               c.active_leases);
        SAMPLE("kvtier_net_checksum_failures", "Pulled chunks refused by their checksum",
               KVT_METRIC_COUNTER, c.checksum_failures);
    }
#undef SAMPLE
#undef LSAMPLE
    return n;
}

/* The manager's stats are return-and-reset; the node has several consumers (each
 * engine's get_stats, /metrics): one collector hands every delta to all of them. */
static void collect_stats(void *arg)
{
    struct daemon *d = arg;
    struct kvt_stats st;

    kvt_stats_init(&st);
    if (kvt_manager_get_stats(d->m, &st) == 0) {
        kvt_prom_acc_add(&d->prom, &st);
        if (d->engines != NULL)
            kvt_engine_server_fanout_stats(d->engines, &st);
    }
    kvt_stats_cleanup(&st);
}

/* `kvtier stats`: what /metrics shows, taken now. */
static int total_stats(void *arg, struct kvt_stats *out)
{
    struct daemon *d = arg;

    collect_stats(d);
    return kvt_stats_aggregate(out, &d->prom.totals);
}

/* A page that cannot be rendered is never replaced by the last good one: /metrics
 * answers 500 with the cause, the failure is counted (shown on the next good page)
 * and logged once per run of failures. */
static void publish_metrics(struct daemon *d)
{
    struct kvt_prom_sample samples[64];
    char *text = NULL;
    size_t len = 0, n;
    int rc;

    collect_stats(d);
    if (d->http == NULL)
        return;
    n = node_samples(d, samples, KVT_ARRAY_SIZE(samples));
    rc = kvt_prom_render(&d->prom.totals, samples, n, 0, &text, &len);
    if (rc == 0)
        rc = kvt_metrics_http_publish(d->http, text, len);
    else
        kvt_metrics_http_publish_failure(d->http, rc);
    free(text);
    if (rc != 0) {
        if (d->render_failing == 0)
            kvt_error(MOD, "/metrics: cannot render the page: %s (answering 500)", strerror(-rc));
        d->render_failing = rc;
        d->render_failures++;
    } else if (d->render_failing != 0) {
        kvt_info(MOD, "/metrics: rendering again");
        d->render_failing = 0;
    }
}

static int start_services(struct daemon *d)
{
    struct kvt_engine_server_config ec = {
        .socket_path = d->cfg.engine_socket,
        .socket_mode = d->cfg.engine_socket_mode,
        .socket_group = d->cfg.engine_socket_group,
        .max_requests = d->cfg.engine_max_requests,
        .max_params_bytes = (uint32_t)d->cfg.engine_max_params_bytes,
        .max_client_params_bytes = d->cfg.engine_max_client_params,
        .max_output_bytes = d->cfg.engine_max_output_bytes,
        .hello_timeout_ms = d->cfg.engine_hello_timeout_ms,
        .max_event_keys = d->cfg.engine_max_event_keys,
        .ring_bytes = d->cfg.engine_ring_bytes ? (int64_t)d->cfg.engine_ring_bytes : -1,
        .ring_spin_us = d->cfg.engine_ring_spin_us,
        .manager = d->m,
        .region = d->region,
        .collect_stats = collect_stats,
        .total_stats = total_stats,
        .collect_arg = d,
    };
    int rc = kvt_engine_server_create(&ec, &d->engines);

    if (rc != 0) {
        kvt_error(MOD, "engine socket %s: %s", ec.socket_path, strerror(-rc));
        return rc;
    }
    rc = ep_add(d, kvt_engine_server_fd(d->engines));
    if (rc == 0 && d->peers != NULL)
        rc = ep_add(d, kvt_peers_event_fd(d->peers));
    if (rc == 0 && d->net != NULL)
        rc = ep_add(d, kvt_net_tier_wake_fd(d->net));
    if (rc != 0)
        return rc;
    if (d->cfg.metrics_port != 0) {
        struct kvt_metrics_http_config hc = {
            .listen = d->cfg.metrics_listen,
            .port = d->cfg.metrics_port,
            .max_connections = d->cfg.metrics_max_connections,
            .read_timeout_ms = d->cfg.metrics_read_timeout_ms,
            .write_timeout_ms = d->cfg.metrics_write_timeout_ms,
        };

        rc = kvt_metrics_http_create_cfg(&hc, &d->http);
        if (rc != 0) {
            kvt_error(MOD, "/metrics on %s:%u: %s", d->cfg.metrics_listen, d->cfg.metrics_port,
                      strerror(-rc));
            return rc;
        }
        publish_metrics(d);
        kvt_metrics_http_set_healthy(d->http, true);
        kvt_info(MOD, "/metrics and /healthz on %s:%u", d->cfg.metrics_listen,
                 kvt_metrics_http_port(d->http));
    }
    kvt_info(MOD, "engines attach at %s%s", ec.socket_path,
             d->http != NULL ? "; /metrics and /healthz served" : "");
    return 0;
}

static void reload(struct daemon *d)
{
    struct kvt_config next;
    struct kvt_config_diff diff;
    char err[512];

    if (kvt_config_load(&next, d->cfg_path, d->sets, d->n_sets, err, sizeof(err)) != 0) {
        kvt_error(MOD, "SIGHUP: %s; keeping the running configuration", err);
        return;
    }
    if (!kvt_config_diff_reloadable(&d->cfg, &next, &diff)) {
        kvt_error(MOD,
                  "SIGHUP: %s cannot change while running (restart to apply); keeping "
                  "the running configuration",
                  diff.first_fixed);
        kvt_config_free(&next);
        return;
    }
    for (size_t i = 0; i < diff.n_changed; i++)
        kvt_info(MOD, "SIGHUP: %s changed", diff.changed[i]);
    kvt_log_set_level(next.log_level);
    kvt_config_free(&d->cfg);
    d->cfg = next;
}

static void step(struct daemon *d)
{
    kvt_manager_on_schedule_end(d->m, NULL);
    d->last_step_ns = kvt_now_ns();
}

static int run(struct daemon *d)
{
    struct itimerspec its = {{0, 0}, {0, 0}};
    uint64_t tick_ns = (uint64_t)d->cfg.loop_tick_ms * 1000000ull;

    its.it_interval.tv_sec = (time_t)(tick_ns / 1000000000ull);
    its.it_interval.tv_nsec = (long)(tick_ns % 1000000000ull);
    its.it_value = its.it_interval;
    timerfd_settime(d->tick_fd, 0, &its, NULL);

    while (!d->stopping) {
        struct epoll_event evs[16];
        /* Sleep only when the network tier has nothing in flight and the transport
         * nothing pending (a peer's READ over tcp is served by our progress). */
        bool idle = d->peers == NULL || ((d->net == NULL || !kvt_tier_has_pending_work(d->net)) &&
                                         kvt_peers_arm(d->peers) == 0);
        int wait_ms = idle ? (int)d->cfg.loop_tick_ms : 0;
        int n;

        /* The engines' rings are polled while they are busy (at most 50 us a turn,
         * so the rest of the loop still turns); the loop sleeps only once they are
         * quiet and their engines know to wake it. */
        if (d->engines != NULL && kvt_engine_server_spin(d->engines, 50000))
            wait_ms = 0;
        n = epoll_wait(d->ep, evs, 16, wait_ms);

        for (int i = 0; i < n; i++) {
            int fd = evs[i].data.fd;

            if (fd == d->sig_fd) {
                struct signalfd_siginfo si;

                while (read(d->sig_fd, &si, sizeof(si)) == sizeof(si)) {
                    if (si.ssi_signo == SIGHUP) {
                        reload(d);
                    } else {
                        kvt_info(MOD, "%s: stopping", strsignal((int)si.ssi_signo));
                        d->stopping = true;
                    }
                }
            } else if (fd == d->tick_fd) {
                uint64_t x;

                if (read(d->tick_fd, &x, sizeof(x)) < 0) { /* EAGAIN */
                }
            }
        }
        if (d->engines != NULL)
            kvt_engine_server_progress(d->engines);
        /* Engines step the manager at their schedule ends; the node steps once a
         * tick besides, so peers are served and transfers progress when idle. */
        if (kvt_now_ns() - d->last_step_ns >= tick_ns)
            step(d);
        if (d->net != NULL)
            kvt_net_tier_poll(d->net);
        kvt_service_tick(); /* the watchdog: this loop still turns */
        if (kvt_now_ns() - d->last_metrics_ns >= 1000000000ull) {
            publish_metrics(d);
            d->last_metrics_ns = kvt_now_ns();
        }
    }
    return 0;
}

/* A start that failed half-way: release what was built, in reverse order. */
static void abandon(struct daemon *d)
{
    if (d->http != NULL)
        kvt_metrics_http_destroy(d->http);
    if (d->engines != NULL)
        kvt_engine_server_destroy(d->engines);
    if (d->m != NULL) {
        kvt_manager_shutdown(d->m);
        kvt_manager_destroy(d->m); /* owns the primary and the tiers */
    } else {
        for (size_t i = 0; i < d->n_tiers; i++) {
            kvt_tier_shutdown(d->tiers[i]);
            kvt_tier_destroy(d->tiers[i]);
        }
        if (d->primary != NULL)
            kvt_primary_destroy(d->primary); /* and its region */
    }
    if (d->peers != NULL)
        kvt_peers_destroy(d->peers);
    kvt_prom_acc_cleanup(&d->prom);
    if (d->lock_fd >= 0) {
        /* We hold it. One that was there before may record a dead daemon's region
         * for the next start: kept. One this start created goes. */
        if (d->lock_created)
            unlinkat(d->run_fd, d->lock_name, 0);
        close(d->lock_fd);
    }
    if (d->run_fd >= 0)
        close(d->run_fd);
    kvt_config_free(&d->cfg);
}

/* SIGTERM: no new engines, drain, release leases, unpublish, exit 0. */
static int stop(struct daemon *d)
{
    uint64_t t0 = kvt_now_ns();
    int rc;

    kvt_service_stopping();
    if (d->http != NULL)
        kvt_metrics_http_set_healthy(d->http, false); /* draining: not ready for new work */
    if (d->engines != NULL)
        kvt_engine_server_destroy(d->engines); /* engines' pins and requests are cleaned up */
    d->engines = NULL;
    step(d);
    /* Drain every tier (our pulls end, peers' leases are released), let the manager
     * take the results, then look for leaks before the primary goes away. */
    for (size_t i = 0; i < d->n_tiers; i++)
        kvt_tier_drain_jobs(d->tiers[i]);
    step(d);
    step(d);
    {
        size_t entries = kvt_primary_num_entries(d->primary);
        size_t wp = kvt_primary_num_write_pending(d->primary);
        size_t pinned = entries - wp - kvt_primary_num_evictable(d->primary);

        /* Every engine, lease and transfer is gone: anything pinned now leaked. */
        if (pinned != 0 || wp != 0)
            kvt_error(MOD, "at exit: %zu pinned, %zu write-pending chunks (a leak)", pinned, wp);
        else
            kvt_info(MOD, "at exit: %zu chunks, 0 pinned, 0 write-pending", entries);
    }
    rc = kvt_manager_shutdown(d->m); /* frees the primary and its region */
    if (rc != 0)
        kvt_error(MOD, "shutdown: %s", strerror(-rc));
    kvt_manager_destroy(d->m);
    d->m = NULL;
    if (d->peers != NULL)
        kvt_peers_destroy(d->peers);
    if (d->http != NULL)
        kvt_metrics_http_destroy(d->http);
    kvt_prom_acc_cleanup(&d->prom);
    if (d->lock_fd >= 0) {
        unlinkat(d->run_fd, d->lock_name, 0); /* ours: we hold it, in our folder */
        close(d->lock_fd);
    }
    if (d->run_fd >= 0)
        close(d->run_fd);
    kvt_info(MOD, "stopped in %.2f s", (double)(kvt_now_ns() - t0) / 1e9);
    kvt_config_free(&d->cfg);
    return rc == 0 ? 0 : 1;
}

static int daemon_main(struct daemon *dp, int argc, char **argv)
{
    static const struct option opts[] = {
        {"config", required_argument, NULL, 'c'},
        {"set", required_argument, NULL, 's'},
        {"check", no_argument, NULL, 'k'},
        {"dump", no_argument, NULL, 'd'},
        {"help", no_argument, NULL, 'h'},
        {"version", no_argument, NULL, 'V'},
        {NULL, 0, NULL, 0},
    };
    bool check = false, dump = false;
    char err[512];
    sigset_t mask;
    int c, rc;

    while ((c = getopt_long(argc, argv, "c:s:h", opts, NULL)) != -1) {
        switch (c) {
        case 'c':
            dp->cfg_path = optarg;
            break;
        case 's':
            dp->sets[dp->n_sets++] = optarg;
            break;
        case 'k':
            check = true;
            break;
        case 'd':
            dump = true;
            break;
        case 'h':
            usage(stdout);
            return 0;
        case 'V':
            printf("kvtierd %s\n", kvt_version_string());
            return 0;
        default:
            usage(stderr);
            return 2;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "kvtierd: unexpected argument '%s'\n", argv[optind]);
        return 2;
    }
    rc = kvt_config_load(&dp->cfg, dp->cfg_path, dp->sets, dp->n_sets, err, sizeof(err));
    if (rc != 0) {
        fprintf(stderr, "kvtierd: %s\n", err);
        return KVT_CONFIG_EXIT;
    }
    kvt_log_set_level(dp->cfg.log_level);
    if (dump)
        kvt_config_dump(stdout, &dp->cfg);
    if (check || dump) {
        kvt_config_free(&dp->cfg);
        return 0;
    }

    sigemptyset(&mask);
    sigaddset(&mask, SIGTERM);
    sigaddset(&mask, SIGINT);
    sigaddset(&mask, SIGHUP);
    sigprocmask(SIG_BLOCK, &mask, NULL);
    signal(SIGPIPE, SIG_IGN);
    dp->sig_fd = signalfd(-1, &mask, SFD_NONBLOCK | SFD_CLOEXEC);
    dp->tick_fd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
    dp->ep = epoll_create1(EPOLL_CLOEXEC);
    if (dp->sig_fd < 0 || dp->tick_fd < 0 || dp->ep < 0) {
        kvt_error(MOD, "cannot set up the loop: %s", strerror(errno));
        return 1;
    }
    kvt_prom_acc_init(&dp->prom);
    rc = assemble(dp);
    if (rc == 0)
        rc = start_services(dp);
    if (rc != 0) {
        kvt_error(MOD, "start failed: %s", strerror(-rc));
        abandon(dp);
        if (rc == -EPERM || rc == -EEXIST || rc == -ELOOP)
            return KVTIERD_EXIT_UNSAFE;
        return rc == -EINVAL ? KVT_CONFIG_EXIT : 1;
    }
    ep_add(dp, dp->sig_fd);
    ep_add(dp, dp->tick_fd);
    kvt_info(MOD, "ready: node %016" PRIx64 ", %" PRIu64 " MiB primary at %s, %zu tier(s)",
             dp->cfg.node_id, dp->cfg.primary_size >> 20, dp->cfg.primary_path, dp->n_tiers);
    {
        char status[256];

        snprintf(status, sizeof(status), "serving: node %016" PRIx64 ", engines at %s",
                 dp->cfg.node_id, dp->cfg.engine_socket);
        kvt_service_ready(status);
    }
    run(dp);
    return stop(dp);
}

int main(int argc, char **argv)
{
    struct daemon d = {.lock_fd = -1, .run_fd = -1, .ep = -1, .sig_fd = -1, .tick_fd = -1};
    int rc;

    d.sets = kvt_calloc((size_t)argc + 1, sizeof(*d.sets));
    if (d.sets == NULL)
        return 1;
    rc = daemon_main(&d, argc, argv);
    kvt_free(d.sets);
    return rc;
}

/* SPDX-License-Identifier: Apache-2.0 */
/* kvt_node: the assembly of one kvtier node from its configuration (kvt/node.h), for
 * kvtierd and kvtier-simnode alike.
 *
 * Opens, in this order: the runtime folders and the lock, the shared primary region
 * and the primary tier, the secondary tiers in the configured order (storage,
 * network with its peer links), the manager, the local engine API and /metrics; the
 * loop's sources (the engine server's fd, every tier's event fds) go into one epoll fd
 * the program's loop sleeps on. Stopping undoes it in reverse order after draining.
 *
 * The stats fan-out: the manager's stats are return-and-reset, and the node has several
 * consumers (each engine's get_stats, /metrics, `kvtier stats`): one collector takes
 * every delta and hands it to all of them. /metrics shows those totals and the node's
 * own series (engines, peers, its build, this process, how full each tier is).
 *
 * The model fingerprint (kvtier/client.h): node.model_fingerprint, when set, is the
 * engine server's and the storage tier's from the start; else the first engine that
 * declares one sets it, and the storage tier is told (it keeps or drops its files,
 * which it withholds until then). The engine API's PEERS reads the member table
 * (kvt/peers.h, kvt/members.h) and the per-peer byte totals; members that went down
 * are listed while the table knows them, by the ids seen live before.
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
 *   them could be changed by another user. Refusals are -EPERM (kvtierd exits 77).
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
#include <grp.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/magic.h>
#include <sys/epoll.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/sysmacros.h>
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
#include "kvt/metrics.h"
#include "kvt/metrics_http.h"
#include "kvt/net_tier.h"
#include "kvt/node.h"
#include "kvt/peers.h"
#include "kvt/primary.h"
#include "kvt/proc_stats.h"
#include "kvt/prom.h"
#include "kvt/region.h"
#include "kvt/safe_path.h"
#include "kvt/storage_tier.h"
#include "kvt/version.h"

#define MOD         "node"
#define LOCK_RECORD "kvtierd region %llu %llu\n" /* device, inode of the region */
/* Series of the node's own on /metrics, at most. */
#define SAMPLES_MAX 160

/* Everything the node owns. The manager owns the primary (and its region) and the
 * tiers once it exists; before, the node does. Loop thread only; the /metrics HTTP
 * server has a thread of its own that sees only published pages. */
struct kvt_node {
    struct kvt_config cfg; /* a copy of its own */

    int lock_fd;
    bool lock_created; /* by this start: removed again if the start fails */
    int run_fd;        /* the runtime folder of primary.path */
    char lock_path[PATH_MAX];
    char region_name[NAME_MAX + 1], lock_name[NAME_MAX + 1];
    struct kvt_region *region;
    struct kvt_primary *primary;
    struct kvt_tier *tiers[KVT_CONFIG_TIERS_MAX];
    enum kvt_tier_kind kinds[KVT_CONFIG_TIERS_MAX];
    char labels[KVT_CONFIG_TIERS_MAX][KVT_STAT_LABEL_MAX]; /* "<index + 1>:<type>" */
    size_t n_tiers;
    struct kvt_tier *net; /* among tiers[], or NULL */
    struct kvt_peers *peers;
    struct kvt_manager *m;
    struct kvt_engine_server *engines;
    struct kvt_metrics_http *http;
    struct kvt_prom_acc prom;
    uint64_t render_failures; /* renders of /metrics that failed */
    int render_failing;       /* the last render's error while failing, else 0 */

    int ep; /* kvt_node_fd */
    uint64_t last_step_ns, last_metrics_ns;
    uint64_t news;   /* the tiers' news (tiers_news) at the last step */
    bool rings_busy; /* the engines' rings had work: the loop must not sleep */
    bool stopped;
    /* Members ever seen live (PEERS lists them whatever their state now). */
    uint64_t seen[KVT_MEMBERS_MAX];
    size_t n_seen;
};

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
static int open_runtime_dir(struct kvt_node *nd, const char *key, const char *file, char *name,
                            size_t name_len, int *fd_p)
{
    char dir[4096];
    struct kvt_dir_policy pol = {.mode = 0700, .create = true};
    int rc = kvt_path_split(file, dir, sizeof(dir), name, name_len);

    if (rc < 0) {
        kvt_error(MOD, "%s %s: not a file name", key, file);
        return -EINVAL;
    }
    rc = node_gid(&nd->cfg, &pol.gid);
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
static int lock_busy(struct kvt_node *nd, const struct stat *st)
{
    uid_t uid = (uid_t)-1;
    int pid = 0;

    if (lock_holder(st, &pid, &uid) == 0 && uid != geteuid()) {
        kvt_error(MOD,
                  "the lock %s is held by pid %d of another user (uid %d): refusing to start "
                  "(a process of another user has our lock file open)",
                  nd->lock_path, pid, (int)uid);
        return -EPERM;
    }
    if (pid > 0)
        kvt_error(MOD, "another kvtierd runs with region %s (lock %s is held by pid %d)",
                  nd->cfg.primary_path, nd->lock_path, pid);
    else
        kvt_error(MOD, "another kvtierd runs with region %s (lock %s is held)",
                  nd->cfg.primary_path, nd->lock_path);
    return -EBUSY;
}

/* Opens the lock file in the runtime folder, checks it is ours and takes it. The
 * file a previous daemon unlinked while we opened it would lock nothing: the path
 * must still name the file we locked. */
static int lock_file(struct kvt_node *nd)
{
    for (int attempt = 0; attempt < 8; attempt++) {
        struct stat st, there;
        bool created = true;
        int fd, rc;

        fd = openat(nd->run_fd, nd->lock_name, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                    0600);
        if (fd < 0 && errno == EEXIST) {
            created = false;
            fd = openat(nd->run_fd, nd->lock_name, O_RDWR | O_NOFOLLOW | O_CLOEXEC);
            if (fd < 0 && errno == ENOENT)
                continue; /* removed in between: create it */
        }
        if (fd < 0) {
            rc = -errno;
            if (rc == -ELOOP) {
                kvt_error(MOD, "lock file %s is a symbolic link: refusing it", nd->lock_path);
                return -EPERM;
            }
            kvt_error(MOD, "cannot open lock file %s: %s", nd->lock_path, strerror(-rc));
            return rc;
        }
        rc = kvt_private_file_check(fd, nd->lock_path, 0600, &st);
        if (rc < 0) {
            kvt_error(MOD, "lock file %s is not this daemon's own: refusing to start",
                      nd->lock_path);
            close(fd);
            return rc;
        }
        if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
            rc = errno == EWOULDBLOCK ? lock_busy(nd, &st) : -errno;
            close(fd);
            return rc;
        }
        if (fstatat(nd->run_fd, nd->lock_name, &there, AT_SYMLINK_NOFOLLOW) == 0 &&
            there.st_dev == st.st_dev && there.st_ino == st.st_ino) {
            nd->lock_fd = fd;
            nd->lock_created = created;
            return 0;
        }
        close(fd); /* unlinked by the daemon that just stopped: take the new one */
    }
    kvt_error(MOD, "lock file %s keeps changing: is another kvtierd starting?", nd->lock_path);
    return -EBUSY;
}

/* The stale region rule (see the top of this file). */
static int remove_stale_region(struct kvt_node *nd)
{
    unsigned long long dev = 0, ino = 0;
    char rec[128], why[160];
    struct stat st;
    ssize_t n;

    if (fstatat(nd->run_fd, nd->region_name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
        int rc = -errno;

        if (rc == -ENOENT)
            return 0;
        kvt_error(MOD, "%s: %s", nd->cfg.primary_path, strerror(-rc));
        return rc;
    }
    n = pread(nd->lock_fd, rec, sizeof(rec) - 1, 0);
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
    else if (unlinkat(nd->run_fd, nd->region_name, 0) != 0)
        snprintf(why, sizeof(why), "unlink: %s", strerror(errno));
    else {
        kvt_warn(MOD, "removed the stale region %s of a daemon that died", nd->cfg.primary_path);
        return 0;
    }
    kvt_error(MOD,
              "primary.path %s exists and is not a region this daemon created (%s): not "
              "removing it and not joining it; if it is a stale region remove it yourself, "
              "else choose another primary.path",
              nd->cfg.primary_path, why);
    return -EPERM;
}

/* After the region is created: the lock file records which file it is. */
static void record_region(struct kvt_node *nd)
{
    char rec[128];
    struct stat st;
    int n;

    if (fstat(nd->region->fd, &st) != 0)
        return;
    n = snprintf(rec, sizeof(rec), LOCK_RECORD, (unsigned long long)st.st_dev,
                 (unsigned long long)st.st_ino);
    if (ftruncate(nd->lock_fd, 0) != 0 || pwrite(nd->lock_fd, rec, (size_t)n, 0) != n)
        kvt_warn(MOD,
                 "cannot record the region in %s: %s (a restart after a crash will not "
                 "remove it)",
                 nd->lock_path, strerror(errno));
}

static int take_lock(struct kvt_node *nd)
{
    char sock_name[NAME_MAX + 1];
    int sock_fd, rc;

    rc = open_runtime_dir(nd, "primary.path", nd->cfg.primary_path, nd->region_name,
                          sizeof(nd->region_name), &nd->run_fd);
    if (rc < 0)
        return rc;
    /* The socket's folder (usually the same one) passes the same rules. */
    rc = open_runtime_dir(nd, "engine.socket", nd->cfg.engine_socket, sock_name, sizeof(sock_name),
                          &sock_fd);
    if (rc < 0)
        return rc;
    close(sock_fd);
    if ((size_t)snprintf(nd->lock_name, sizeof(nd->lock_name), "%s.lock", nd->region_name) >=
        sizeof(nd->lock_name)) {
        kvt_error(MOD, "primary.path %s: name too long for its lock file", nd->cfg.primary_path);
        return -EINVAL;
    }
    snprintf(nd->lock_path, sizeof(nd->lock_path), "%s.lock", nd->cfg.primary_path);
    rc = lock_file(nd);
    if (rc < 0)
        return rc;
    /* We hold the lock: a region file of a dead daemon of ours may be there. */
    return remove_stale_region(nd);
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

static int open_region(struct kvt_node *nd)
{
    struct kvt_region_config rc = {
        .path = nd->cfg.primary_path,
        .num_chunks = nd->cfg.primary_size / nd->cfg.primary_row_bytes,
        .page_bytes = nd->cfg.primary_row_bytes / nd->cfg.primary_workers,
        .num_workers = nd->cfg.primary_workers,
        .rank = KVT_REGION_RANK_ALL,
        .join_timeout_s = 5,
        .populate = true,
        .exclusive = true, /* a file there now is not ours: never join it */
    };
    struct kvt_primary_config pc = {
        .num_chunks = rc.num_chunks,
        .row_bytes = nd->cfg.primary_row_bytes,
        .policy = kvt_policy_kind_name(nd->cfg.primary_policy),
        .enable_events = true,
        .checksum_on_complete = true, /* grants carry the checksum of what was stored */
    };
    int rc_;

    nd->region = kvt_calloc(1, sizeof(*nd->region));
    if (nd->region == NULL)
        return -ENOMEM;
    rc_ = kvt_region_open(&rc, nd->region);
    if (rc_ != 0) {
        kvt_error(MOD, "primary region %s (%" PRIu64 " bytes): %s", rc.path, nd->cfg.primary_size,
                  strerror(-rc_));
        kvt_free(nd->region);
        nd->region = NULL;
        return rc_;
    }
    record_region(nd);
    check_tmpfs(nd->region);
    report_pages(nd->region);
    rc_ = kvt_primary_create(&pc, nd->region, &nd->primary);
    if (rc_ != 0) {
        kvt_error(MOD, "primary tier: %s", strerror(-rc_));
        kvt_region_cleanup(nd->region);
        kvt_free(nd->region);
        nd->region = NULL;
    }
    return rc_;
}

static int open_storage(struct kvt_node *nd, struct kvt_tier **t_p)
{
    struct kvt_storage_tier_config sc = {
        .root = nd->cfg.storage_root,
        .capacity_bytes = nd->cfg.storage_capacity,
        .read_depth = nd->cfg.storage_read_depth,
        .enable_events = true,
    };
    struct kvt_bp_config bp;
    uint8_t secret[KVT_AUTH_SECRET_MAX];
    size_t secret_len = 0;
    int rc;

    /* The chunk files' MAC keys derive from the cluster secret when there is one;
     * without, the tier keeps a random key of its own in its root. */
    if (nd->cfg.cluster_secret_file != NULL) {
        rc = kvt_auth_load_secret(nd->cfg.cluster_secret_file, secret, sizeof(secret), &secret_len);
        if (rc != 0) {
            kvt_error(MOD, "secret file %s: %s", nd->cfg.cluster_secret_file, strerror(-rc));
            return rc;
        }
        sc.key = secret;
        sc.key_len = secret_len;
    }
    kvt_auth_namespace(nd->cfg.node_namespace, sc.namespace_id);
    sc.fingerprint = nd->cfg.node_model_fingerprint;
    kvt_bp_default_config("storage", KVT_LOCAL, &bp);
    if (nd->cfg.storage_high_water_us > 0) { /* config: microseconds per MiB */
        bp.high_water_s = nd->cfg.storage_high_water_us * 1e-6;
        bp.low_water_s = nd->cfg.storage_low_water_us * 1e-6;
    }
    sc.bp = &bp;
    rc = kvt_storage_tier_create(&sc, t_p);
    explicit_bzero(secret, sizeof(secret));
    if (rc != 0)
        kvt_error(MOD, "storage tier at %s: %s", sc.root, strerror(-rc));
    return rc;
}

static int open_network(struct kvt_node *nd, struct kvt_tier **t_p)
{
    struct kvt_peers_config pc = {0};
    struct kvt_net_tier_config nc = {0};
    uint8_t secret[KVT_AUTH_SECRET_MAX];
    size_t secret_len = 0;
    int rc;

    if (nd->cfg.cluster_secret_file == NULL) {
        /* One node, no cluster configured: listen with a secret nobody else knows,
         * so the tier runs (and answers MISS) and no peer can get in. */
        rc = kvt_auth_nonce(secret);
        secret_len = KVT_AUTH_NONCE_BYTES;
        kvt_info(MOD, "no cluster.secret_file: the network tier admits no peer");
    } else {
        rc = kvt_auth_load_secret(nd->cfg.cluster_secret_file, secret, sizeof(secret), &secret_len);
    }
    if (rc != 0) {
        kvt_error(MOD, "secret file %s: %s", nd->cfg.cluster_secret_file, strerror(-rc));
        return rc;
    }
    pc.node_id = nd->cfg.node_id;
    kvt_auth_namespace(nd->cfg.node_namespace, pc.ns);
    pc.secret = secret; /* the peer links keep a copy of their own */
    pc.secret_len = secret_len;
    pc.listen_addr = nd->cfg.network_listen;
    pc.advertise_addr = nd->cfg.network_advertise;
    pc.advertise_port = nd->cfg.network_advertise_port;
    pc.listen_port = nd->cfg.network_port;
    pc.seeds = (const char *const *)nd->cfg.network_peers;
    pc.n_seeds = nd->cfg.n_network_peers;
    pc.heartbeat_ms = nd->cfg.network_heartbeat_ms;
    pc.heartbeat_misses = nd->cfg.network_heartbeat_misses;
    pc.transport.backend = kvt_transport_kind_name(nd->cfg.network_transport);
    pc.transport.op_timeout_ms = nd->cfg.network_fetch_timeout_ms;
    pc.transport.max_preauth = nd->cfg.network_max_unauthenticated;
    rc = kvt_peers_create(&pc, &nd->peers);
    explicit_bzero(secret, sizeof(secret));
    if (rc != 0) {
        kvt_error(MOD, "network on %s:%u (%s): %s", pc.listen_addr, pc.listen_port,
                  pc.transport.backend, strerror(-rc));
        return rc;
    }
    nc.peers = nd->peers;
    nc.primary = nd->primary;
    nc.lease_ms = nd->cfg.network_lease_ms;
    nc.fetch_timeout_ms = nd->cfg.network_fetch_timeout_ms;
    nc.locate_timeout_ms = nd->cfg.network_locate_timeout_ms;
    nc.keys_per_fetch = nd->cfg.network_keys_per_fetch;
    nc.fetches_per_peer = nd->cfg.network_fetches_per_peer;
    nc.max_ops_per_batch = nd->cfg.network_reads_per_batch;
    nc.verify = nd->cfg.network_verify == KVT_VERIFY_CHECKSUM ? KVT_NET_VERIFY_CHECKSUM
                                                              : KVT_NET_VERIFY_FENCE;
    nc.fetch =
        nd->cfg.network_fetch == KVT_FETCH_DIRECT ? KVT_NET_FETCH_DIRECT : KVT_NET_FETCH_LEASE;
    nc.busy_poll_us = nd->cfg.network_busy_poll_us;
    nc.max_records_per_node = nd->cfg.network_max_records_per_peer;
    if (nc.max_records_per_node == 0) {
        /* A peer homes here about its share of what it holds; in a cluster of
         * nodes like this one, at most what this node holds. Four times that. */
        uint64_t own = kvt_primary_num_chunks(nd->primary);
        size_t row = kvt_primary_row_bytes(nd->primary);

        if (nd->cfg.storage_enabled && nd->cfg.storage_capacity == 0)
            own = UINT32_MAX; /* unbounded storage: no bound here */
        else if (nd->cfg.storage_enabled && row > 0)
            own += nd->cfg.storage_capacity / row;
        nc.max_records_per_node = (uint32_t)KVT_MIN(KVT_MAX(4 * own, 1ull << 20), UINT32_MAX);
    }
    nc.serve_per_peer = nd->cfg.network_serve_per_peer;
    rc = kvt_net_tier_create(&nc, t_p);
    if (rc != 0)
        kvt_error(MOD, "network tier: %s", strerror(-rc));
    else
        nd->net = *t_p;
    kvt_info(MOD, "network: node %016" PRIx64 " incarnation %016" PRIx64 " on %s:%u (%s)",
             nd->cfg.node_id, kvt_peers_incarnation(nd->peers), pc.listen_addr,
             kvt_peers_port(nd->peers), pc.transport.backend);
    return rc;
}

static int assemble(struct kvt_node *nd)
{
    int rc = take_lock(nd);

    if (rc == 0)
        rc = open_region(nd);
    for (size_t i = 0; rc == 0 && i < nd->cfg.n_tiers; i++) {
        struct kvt_tier *t = NULL;

        if (nd->cfg.tiers[i] == KVT_TIER_STORAGE && nd->cfg.storage_enabled)
            rc = open_storage(nd, &t);
        else if (nd->cfg.tiers[i] == KVT_TIER_NETWORK && nd->cfg.network_enabled)
            rc = open_network(nd, &t);
        if (t != NULL) {
            /* The tiering core's label of the tier (kvt_metrics_label). */
            snprintf(nd->labels[nd->n_tiers], sizeof(nd->labels[0]), "%zu:%s", nd->n_tiers + 1,
                     t->type);
            nd->kinds[nd->n_tiers] = nd->cfg.tiers[i];
            nd->tiers[nd->n_tiers++] = t;
        }
    }
    if (rc == 0)
        rc = kvt_manager_create(nd->primary, nd->tiers, nd->n_tiers, &nd->m);
    return rc;
}

/* ---- /metrics and the stats fan-out -------------------------------------------- */

static int ep_add(struct kvt_node *nd, int fd)
{
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = fd};

    if (fd < 0)
        return 0;
    return epoll_ctl(nd->ep, EPOLL_CTL_ADD, fd, &ev) == 0 ? 0 : -errno;
}

/* The node's own series beside the tiering core's (cumulative counts). */
static size_t node_samples(struct kvt_node *nd, struct kvt_prom_sample *v, size_t cap)
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
#define SAMPLE2(nm, hp, k, ln, lv, ln2, lv2, val)                                                  \
    do {                                                                                           \
        assert(n < cap);                                                                           \
        v[n++] = (struct kvt_prom_sample){.name = (nm),                                            \
                                          .help = (hp),                                            \
                                          .kind = (k),                                             \
                                          .label_name = (ln),                                      \
                                          .label_value = (lv),                                     \
                                          .label2_name = (ln2),                                    \
                                          .label2_value = (lv2),                                   \
                                          .value = (double)(val)};                                 \
    } while (0)
    kvt_engine_server_get_counters(nd->engines, &ec);
    SAMPLE("kvtier_engine_clients", "Engines attached now", KVT_METRIC_GAUGE, ec.clients);
    SAMPLE("kvtier_engine_requests", "Engine API requests executed", KVT_METRIC_COUNTER,
           ec.requests);
    SAMPLE("kvtier_engine_malformed", "Engine API frames refused (malformed or oversized)",
           KVT_METRIC_COUNTER, ec.malformed + ec.oversized);
    SAMPLE("kvtier_engine_accept_failures",
           "Engine connections the socket could not accept (open files limit, memory): "
           "left waiting while the socket rests 100 ms",
           KVT_METRIC_COUNTER, ec.accept_failed);
    SAMPLE("kvtier_engine_cleanups", "Pins released for engines that went away", KVT_METRIC_COUNTER,
           ec.released_pins);
    {
        size_t chunks = kvt_primary_num_chunks(nd->primary),
               row = kvt_primary_row_bytes(nd->primary);
        size_t used = kvt_primary_num_entries(nd->primary);

        SAMPLE("kvtier_primary_chunks", "Chunks in the primary tier now (stored or being written)",
               KVT_METRIC_GAUGE, used);
        SAMPLE("kvtier_primary_capacity_chunks", "Chunks the primary tier holds at most",
               KVT_METRIC_GAUGE, chunks);
        SAMPLE("kvtier_primary_used_bytes", "Bytes of the primary tier's chunks now",
               KVT_METRIC_GAUGE, (double)used * (double)row);
        SAMPLE("kvtier_primary_capacity_bytes", "Bytes of the primary region", KVT_METRIC_GAUGE,
               (double)chunks * (double)row);
        SAMPLE("kvtier_primary_evictions", "Chunks evicted from the primary tier to make room",
               KVT_METRIC_COUNTER, kvt_primary_num_evicted(nd->primary));
    }
    SAMPLE("kvtier_metrics_render_failures", "Renders of /metrics that failed (answered 500)",
           KVT_METRIC_COUNTER, nd->render_failures);
    for (int r = 0; r < KVT_EREF_COUNT; r++) {
        if (r == KVT_EREF_EVENTS_DROPPED)
            continue;
        LSAMPLE("kvtier_engine_refused",
                "Engine API connections and requests refused or closed, by reason",
                KVT_METRIC_COUNTER, "reason", kvt_engine_refusal_name(r), ec.refused_by[r]);
    }
    SAMPLE("kvtier_engine_resets", "Resets of the node's cache done through the engine API",
           KVT_METRIC_COUNTER, ec.resets);
    SAMPLE("kvtier_engine_events_dropped",
           "Events dropped, oldest first, because no engine took them (engine.max_event_keys)",
           KVT_METRIC_COUNTER, ec.refused_by[KVT_EREF_EVENTS_DROPPED]);
    SAMPLE("kvtier_engine_event_keys_queued", "Keys of the events waiting for take_events",
           KVT_METRIC_GAUGE, ec.event_keys);
    if (nd->http != NULL) {
        struct kvt_metrics_http_counters hc;

        kvt_metrics_http_get_counters(nd->http, &hc);
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
    SAMPLE("kvtier_engine_job_rows_read_direct",
           "Rows of engine load jobs READ from a peer straight into their region",
           KVT_METRIC_COUNTER, ec.job_rows_read_direct);
    SAMPLE("kvtier_engine_job_rows_failed", "Rows of engine jobs reported failed",
           KVT_METRIC_COUNTER, ec.job_rows_failed);
    SAMPLE("kvtier_engine_job_keys_relooked",
           "Keys of engine load jobs waiting for a chunk, looked up again by the loop",
           KVT_METRIC_COUNTER, ec.job_keys_relooked);
    SAMPLE("kvtier_engine_ring_requests", "Engine API requests served from shared-memory rings",
           KVT_METRIC_COUNTER, ec.ring_requests);
    SAMPLE("kvtier_engine_ring_binary_requests",
           "Engine API requests served from rings as binary messages (lookups and per-block calls)",
           KVT_METRIC_COUNTER, ec.ring_binary);
    SAMPLE("kvtier_engine_ring_redirects",
           "Ring replies too large for the ring, sent on the socket", KVT_METRIC_COUNTER,
           ec.ring_redirects);
    SAMPLE("kvtier_engine_ring_wakeups", "Times an engine woke the sleeping loop through its ring",
           KVT_METRIC_COUNTER, ec.ring_wakeups);
    SAMPLE("kvtier_engine_ring_spin_rests",
           "Times the loop's spin on the rings lost its core (no core to spare), then polled "
           "them only on wake-ups for 100 ms",
           KVT_METRIC_COUNTER, ec.ring_spin_rests);
    if (nd->net != NULL) {
        struct kvt_net_tier_counts c;
        struct kvt_peers_counts pc;
        uint64_t ids[KVT_MEMBERS_MAX];

        kvt_net_tier_counts(nd->net, &c);
        kvt_peers_counts(nd->peers, &pc);
        SAMPLE("kvtier_peers_up", "Live cluster members, this node included", KVT_METRIC_GAUGE,
               kvt_peers_live(nd->peers, ids, KVT_MEMBERS_MAX));
        SAMPLE("kvtier_peers_refused", "Peer handshakes refused (auth, namespace, version...)",
               KVT_METRIC_COUNTER, pc.refused);
        SAMPLE("kvtier_peers_malformed", "Malformed messages from authenticated peers",
               KVT_METRIC_COUNTER, pc.malformed);
        SAMPLE("kvtier_peers_down", "Times this node called a member down (any cause)",
               KVT_METRIC_COUNTER, pc.members_down);
        SAMPLE("kvtier_peers_down_silent",
               "Of those, members gone silent (missed heartbeats); each closes the member's "
               "links and makes both sides publish their chunks again",
               KVT_METRIC_COUNTER, pc.members_silent);
        SAMPLE("kvtier_peers_lost_our_records",
               "Members that had called this node down (a stall of ours) while it held them "
               "live; each makes this node publish its chunks again",
               KVT_METRIC_COUNTER, pc.lost_our_records);
        SAMPLE("kvtier_net_leases", "Leases peers hold on our chunks", KVT_METRIC_GAUGE,
               c.active_leases);
        SAMPLE("kvtier_net_checksum_failures", "Pulled chunks refused by their checksum",
               KVT_METRIC_COUNTER, c.checksum_failures);
        /* network.fetch direct, holder side: links our primary was exposed on. */
        SAMPLE("kvtier_net_direct_exposures",
               "Peer links our primary and fence words were exposed to for direct reads",
               KVT_METRIC_COUNTER, c.direct_exposures);
        SAMPLE("kvtier_net_direct_exposed_links",
               "Peer links our primary and fence words are exposed to now", KVT_METRIC_GAUGE,
               c.direct_exposed_links);
        /* The loop's busy poll: its wall time spent polling the transport with
         * transfers in flight and nothing arriving (network.busy_poll_us bounds it);
         * process CPU less this is the work the node did. */
        SAMPLE("kvtier_net_idle_polls",
               "Progress calls of the loop that found no transport event with transfers in flight",
               KVT_METRIC_COUNTER, c.idle_polls);
        SAMPLE("kvtier_net_idle_poll_seconds",
               "Wall time the loop spent busy-polling the transport with transfers in flight",
               KVT_METRIC_COUNTER, (double)c.idle_poll_ns / 1e9);
        /* network.verify: fence. Rows whose fence word had moved on (rewritten or
         * reused), was odd (being written), or could not be read: misses. */
        for (unsigned r = 0; r < KVT_NET_FENCE_N_REASONS; r++)
            LSAMPLE("kvtier_net_fence_failures",
                    "Pulled chunks refused by their generation fence, by reason",
                    KVT_METRIC_COUNTER, "reason", kvt_net_fence_reason_name(r), c.fence_fail[r]);
        /* What the transport refused on the peer port, by reason: READs before the
         * handshake, outside our registrations or not granted; connections beyond the
         * pre-auth bound, malformed or too slow before it; messages naming no
         * connection of ours. */
        for (unsigned r = 0; r < KVT_TP_N_REFUSALS; r++)
            LSAMPLE("kvtier_net_refused",
                    "Refused by the peer transport (READs, connections, messages), by reason",
                    KVT_METRIC_COUNTER, "reason", kvt_tp_refusal_name(r), pc.tp.refused[r]);
    }
    SAMPLE2("kvtier_build_info", "The kvtier version and git revision this node was built from",
            KVT_METRIC_GAUGE, "version", kvt_version(), "revision", kvt_git_revision(), 1);
    {
        struct kvt_proc_stats ps;

        /* /proc unreadable (a sandbox): the page goes without them. */
        if (kvt_proc_stats_read(&ps) == 0) {
            SAMPLE("process_cpu_seconds", "Total user and system CPU time spent in seconds",
                   KVT_METRIC_COUNTER, ps.cpu_seconds);
            SAMPLE("process_resident_memory_bytes", "Resident memory size in bytes",
                   KVT_METRIC_GAUGE, ps.resident_bytes);
            SAMPLE("process_open_fds", "Number of open file descriptors", KVT_METRIC_GAUGE,
                   ps.open_fds);
            SAMPLE("process_max_fds", "Maximum number of open file descriptors", KVT_METRIC_GAUGE,
                   ps.max_fds);
            SAMPLE("process_start_time_seconds",
                   "Start time of the process since unix epoch in seconds", KVT_METRIC_GAUGE,
                   ps.start_time_s);
        }
    }
    /* How full each tier is, used and capacity, in chunks and bytes, by the tiering
     * core's tier label: the primary, then every secondary tier that keeps chunks of
     * its own (the network tier keeps none: its chunks are the peers' primaries). */
    {
        static const char *const help[4] = {
            "Chunks a tier holds now (stored or being written)",
            "Chunks a tier can hold at most",
            "Bytes a tier holds now (the storage tier: its files, headers included)",
            "Bytes a tier can hold at most (the storage tier without a bound: its files "
            "and the free space of their file system)",
        };
        uint64_t row = kvt_primary_row_bytes(nd->primary);
        struct kvt_tier_usage u[KVT_CONFIG_TIERS_MAX + 1] = {{
            .used_chunks = kvt_primary_num_entries(nd->primary),
            .capacity_chunks = kvt_primary_num_chunks(nd->primary),
        }};
        const char *lv[KVT_CONFIG_TIERS_MAX + 1] = {KVT_PRIMARY_LABEL};
        size_t m = 1;

        u[0].used_bytes = u[0].used_chunks * row;
        u[0].capacity_bytes = u[0].capacity_chunks * row;
        for (size_t i = 0; i < nd->n_tiers; i++) {
            if (kvt_tier_usage(nd->tiers[i], &u[m]) == 0)
                lv[m++] = nd->labels[i];
        }
        for (size_t i = 0; i < m; i++) {
            LSAMPLE("kvtier_tier_used_chunks", help[0], KVT_METRIC_GAUGE, "tier", lv[i],
                    u[i].used_chunks);
            LSAMPLE("kvtier_tier_capacity_chunks", help[1], KVT_METRIC_GAUGE, "tier", lv[i],
                    u[i].capacity_chunks);
            LSAMPLE("kvtier_tier_used_bytes", help[2], KVT_METRIC_GAUGE, "tier", lv[i],
                    u[i].used_bytes);
            LSAMPLE("kvtier_tier_capacity_bytes", help[3], KVT_METRIC_GAUGE, "tier", lv[i],
                    u[i].capacity_bytes);
        }
    }
#undef SAMPLE
#undef LSAMPLE
#undef SAMPLE2
    return n;
}

/* The manager's stats are return-and-reset; the node has several consumers (each
 * engine's get_stats, /metrics): one collector hands every delta to all of them. */
static void collect_stats(void *arg)
{
    struct kvt_node *nd = arg;
    struct kvt_stats st;

    kvt_stats_init(&st);
    if (kvt_manager_get_stats(nd->m, &st) == 0) {
        kvt_prom_acc_add(&nd->prom, &st);
        if (nd->engines != NULL)
            kvt_engine_server_fanout_stats(nd->engines, &st);
    }
    kvt_stats_cleanup(&st);
}

/* `kvtier stats` and `kvtier status`: what /metrics shows, taken now - the tiering
 * core's totals, then the node's own series (a labelled one's label values, joined by
 * commas, in the stat's label). */
static int total_stats(void *arg, struct kvt_stats *out)
{
    struct kvt_node *nd = arg;
    struct kvt_prom_sample samples[SAMPLES_MAX];
    size_t n;
    int rc;

    collect_stats(nd);
    rc = kvt_stats_aggregate(out, &nd->prom.totals);
    n = node_samples(nd, samples, KVT_ARRAY_SIZE(samples));
    for (size_t i = 0; rc == 0 && i < n; i++) {
        char label[KVT_STAT_LABEL_MAX];

        snprintf(label, sizeof(label), "%s%s%s",
                 samples[i].label_value != NULL ? samples[i].label_value : "",
                 samples[i].label2_value != NULL ? "," : "",
                 samples[i].label2_value != NULL ? samples[i].label2_value : "");
        if (samples[i].kind == KVT_METRIC_COUNTER)
            rc = kvt_stats_increase(out, samples[i].name, label, samples[i].value);
        else
            rc = kvt_stats_set_gauge(out, samples[i].name, label, samples[i].value);
    }
    return rc;
}

/* An engine's HELLO set the node's model fingerprint: the storage tier keeps its files
 * of that model (or drops another's). Its failure refuses that engine. */
static int fingerprint_set(void *arg, const char *fp)
{
    struct kvt_node *nd = arg;

    for (size_t i = 0; i < nd->n_tiers; i++) {
        if (strcmp(nd->tiers[i]->type, "storage") == 0) {
            int rc = kvt_storage_tier_set_fingerprint(nd->tiers[i], fp);

            if (rc != 0)
                return rc;
        }
    }
    return 0;
}

/* Remembers the members live now (PEERS lists the ones gone down too). */
static void note_live(struct kvt_node *nd)
{
    uint64_t ids[KVT_MEMBERS_MAX];
    size_t n = kvt_peers_live(nd->peers, ids, KVT_MEMBERS_MAX);

    for (size_t i = 0; i < n; i++) {
        bool known = ids[i] == nd->cfg.node_id;

        for (size_t j = 0; j < nd->n_seen && !known; j++)
            known = nd->seen[j] == ids[i];
        if (!known && nd->n_seen < KVT_MEMBERS_MAX)
            nd->seen[nd->n_seen++] = ids[i];
    }
}

/* The engine API's PEERS: this node, then every member seen, with the bytes pulled
 * from and served to each since the start (the totals /metrics shows). */
static int list_peers(void *arg, struct kvtier_peer *out, size_t cap, size_t *n_p)
{
    struct kvt_node *nd = arg;
    const struct kvt_members *mem = kvt_peers_members(nd->peers);
    uint64_t now = kvt_now_ns();
    size_t n = 0;

    if (cap == 0)
        return -ENOBUFS;
    collect_stats(nd); /* the byte totals up to now */
    note_live(nd);
    out[n++] = (struct kvtier_peer){.node_id = nd->cfg.node_id,
                                    .incarnation = kvt_peers_incarnation(nd->peers),
                                    .port = nd->cfg.network_advertise_port != 0
                                                ? nd->cfg.network_advertise_port
                                                : kvt_peers_port(nd->peers),
                                    .state = KVTIER_PEER_SELF};
    snprintf(out[0].addr, sizeof(out[0].addr), "%s",
             nd->cfg.network_advertise != NULL ? nd->cfg.network_advertise
                                               : nd->cfg.network_listen);
    for (size_t i = 0; i < nd->n_seen && n < cap; i++) {
        const struct kvt_member *m = kvt_members_find(mem, nd->seen[i]);
        struct kvtier_peer *p = &out[n];
        char label[KVT_STAT_LABEL_MAX];

        if (m == NULL)
            continue;
        *p = (struct kvtier_peer){
            .node_id = m->node_id,
            .incarnation = m->incarnation,
            .port = m->port,
            .state = m->state == KVT_MEMBER_ALIVE ? KVTIER_PEER_ALIVE : KVTIER_PEER_DOWN,
            .last_heard_ms = now > m->last_heard_ns ? (now - m->last_heard_ns) / 1000000u : 0};
        snprintf(p->addr, sizeof(p->addr), "%s", m->addr);
        snprintf(label, sizeof(label), "peer:%016" PRIx64, m->node_id);
        p->pulled_bytes =
            (uint64_t)kvt_stats_value(&nd->prom.totals, KVT_M_NET_PEER_PULLED_BYTES, label);
        p->served_bytes =
            (uint64_t)kvt_stats_value(&nd->prom.totals, KVT_M_NET_PEER_SERVED_BYTES, label);
        n++;
    }
    *n_p = n;
    return 0;
}

/* A page that cannot be rendered is never replaced by the last good one: /metrics
 * answers 500 with the cause, the failure is counted (shown on the next good page)
 * and logged once per run of failures. */
static int render(struct kvt_node *nd, char **text_p, size_t *len_p)
{
    struct kvt_prom_sample samples[SAMPLES_MAX];
    size_t n = node_samples(nd, samples, KVT_ARRAY_SIZE(samples));

    return kvt_prom_render(&nd->prom.totals, samples, n, 0, text_p, len_p);
}

int kvt_node_render_metrics(struct kvt_node *nd, char **text_p, size_t *len_p)
{
    collect_stats(nd);
    return render(nd, text_p, len_p);
}

static void publish_metrics(struct kvt_node *nd)
{
    char *text = NULL;
    size_t len = 0;
    int rc;

    collect_stats(nd);
    if (nd->http == NULL)
        return;
    rc = render(nd, &text, &len);
    if (rc == 0)
        rc = kvt_metrics_http_publish(nd->http, text, len);
    else
        kvt_metrics_http_publish_failure(nd->http, rc);
    kvt_free(text);
    if (rc != 0) {
        if (nd->render_failing == 0)
            kvt_error(MOD, "/metrics: cannot render the page: %s (answering 500)", strerror(-rc));
        nd->render_failing = rc;
        nd->render_failures++;
    } else if (nd->render_failing != 0) {
        kvt_info(MOD, "/metrics: rendering again");
        nd->render_failing = 0;
    }
}

static int start_services(struct kvt_node *nd)
{
    struct kvt_engine_server_config ec = {
        .socket_path = nd->cfg.engine_socket,
        .socket_mode = nd->cfg.engine_socket_mode,
        .socket_group = nd->cfg.engine_socket_group,
        .max_requests = nd->cfg.engine_max_requests,
        .max_params_bytes = (uint32_t)nd->cfg.engine_max_params_bytes,
        .max_client_params_bytes = nd->cfg.engine_max_client_params,
        .max_output_bytes = nd->cfg.engine_max_output_bytes,
        .hello_timeout_ms = nd->cfg.engine_hello_timeout_ms,
        .max_event_keys = nd->cfg.engine_max_event_keys,
        .ring_bytes = nd->cfg.engine_ring_bytes ? (int64_t)nd->cfg.engine_ring_bytes : -1,
        .ring_spin_us = nd->cfg.engine_ring_spin_us,
        .manager = nd->m,
        .region = nd->region,
        .collect_stats = collect_stats,
        .total_stats = total_stats,
        .fingerprint = nd->cfg.node_model_fingerprint,
        .fingerprint_set = fingerprint_set,
        .peers = nd->peers != NULL ? list_peers : NULL,
        .collect_arg = nd,
    };
    int rc = kvt_engine_server_create(&ec, &nd->engines);

    if (rc != 0) {
        kvt_error(MOD, "engine socket %s: %s", ec.socket_path, strerror(-rc));
        return rc;
    }
    /* The loop's sources: the engines, then whatever each tier wakes up on. */
    rc = ep_add(nd, kvt_engine_server_fd(nd->engines));
    for (size_t i = 0; rc == 0 && i < nd->n_tiers; i++) {
        int fds[8];
        size_t n = kvt_tier_event_fds(nd->tiers[i], fds, KVT_ARRAY_SIZE(fds));

        for (size_t j = 0; rc == 0 && j < n; j++)
            rc = ep_add(nd, fds[j]);
    }
    if (rc != 0) {
        kvt_error(MOD, "epoll: %s", strerror(-rc));
        return rc;
    }
    if (nd->cfg.metrics_port != 0) {
        struct kvt_metrics_http_config hc = {
            .listen = nd->cfg.metrics_listen,
            .port = nd->cfg.metrics_port,
            .max_connections = nd->cfg.metrics_max_connections,
            .read_timeout_ms = nd->cfg.metrics_read_timeout_ms,
            .write_timeout_ms = nd->cfg.metrics_write_timeout_ms,
        };

        rc = kvt_metrics_http_create_cfg(&hc, &nd->http);
        if (rc != 0) {
            kvt_error(MOD, "/metrics on %s:%u: %s", nd->cfg.metrics_listen, nd->cfg.metrics_port,
                      strerror(-rc));
            return rc;
        }
        publish_metrics(nd);
        kvt_metrics_http_set_healthy(nd->http, true);
        kvt_info(MOD, "/metrics and /healthz on %s:%u", nd->cfg.metrics_listen,
                 kvt_metrics_http_port(nd->http));
    }
    kvt_info(MOD, "engines attach at %s%s", ec.socket_path,
             nd->http != NULL ? "; /metrics and /healthz served" : "");
    return 0;
}

/* ---- the loop ------------------------------------------------------------------ */

static uint64_t tick_ns(const struct kvt_node *nd)
{
    return (uint64_t)nd->cfg.loop_tick_ms * 1000000ull;
}

int kvt_node_fd(const struct kvt_node *nd)
{
    return nd->ep;
}

int kvt_node_timeout_ms(struct kvt_node *nd)
{
    uint64_t now = kvt_now_ns(), next = nd->last_step_ns + tick_ns(nd);

    /* Not while the engines' rings are busy (progress polls them), and only when
     * every tier armed: nothing in flight, the transport armed. */
    if (nd->rings_busy)
        return 0;
    for (size_t i = 0; i < nd->n_tiers; i++) {
        uint64_t at = kvt_tier_wake_at_ns(nd->tiers[i]);

        if (kvt_tier_arm(nd->tiers[i]) != 0)
            return 0;
        if (at != 0)
            next = KVT_MIN(next, at);
    }
    next = KVT_MIN(next, nd->last_metrics_ns + 1000000000ull);
    if (next <= now)
        return 0;
    return (int)KVT_MIN((next - now + 999999) / 1000000, (uint64_t)nd->cfg.loop_tick_ms);
}

/* The sum of every tier's news count: it moves when any of them moved. */
static uint64_t tiers_news(const struct kvt_node *nd)
{
    uint64_t sum = 0;

    for (size_t i = 0; i < nd->n_tiers; i++)
        sum += kvt_tier_news(nd->tiers[i]);
    return sum;
}

void kvt_node_step(struct kvt_node *nd)
{
    nd->news = tiers_news(nd);
    kvt_manager_on_schedule_end(nd->m, NULL);
    nd->last_step_ns = kvt_now_ns();
}

int kvt_node_progress(struct kvt_node *nd)
{
    int rc = 0;

    if (nd->engines != NULL)
        rc = kvt_engine_server_progress(nd->engines);
    /* Engines step the manager at their schedule ends; the node steps once a tick
     * besides, so peers are served and transfers progress when idle. */
    if (kvt_now_ns() - nd->last_step_ns >= tick_ns(nd))
        kvt_node_step(nd);
    for (size_t i = 0; i < nd->n_tiers; i++)
        kvt_tier_poll(nd->tiers[i]);
    /* A tier has news (kvt_tier_news): a peer's FETCH parked, a job ended (a load of
     * ours, a peer's lease, a storage tier's promotion a parked FETCH waits for).
     * Step now rather than at the tick, so the FETCH is served (a GRANT goes out) and
     * the job reported while the requester waits; meanwhile the loop would only poll
     * (the network tier does not arm with work parked), and a polling loop waits for
     * a core on a loaded host where a sleeping one is woken by the next message. */
    if (tiers_news(nd) != nd->news) {
        kvt_node_step(nd);
        for (size_t i = 0; i < nd->n_tiers; i++)
            kvt_tier_poll(nd->tiers[i]); /* what the step sent leaves now */
    }
    if (kvt_now_ns() - nd->last_metrics_ns >= 1000000000ull) {
        if (nd->peers != NULL)
            note_live(nd);
        publish_metrics(nd);
        nd->last_metrics_ns = kvt_now_ns();
    }
    /* The engines' rings are polled while they are busy (at most 50 us a turn, so
     * the rest of the loop still turns); the loop sleeps only once they are quiet
     * and their engines know to wake it. */
    nd->rings_busy = nd->engines != NULL && kvt_engine_server_spin(nd->engines, 50000);
    return rc;
}

static bool same_peers(const struct kvt_config *a, const struct kvt_config *b)
{
    if (a->n_network_peers != b->n_network_peers)
        return false;
    for (size_t i = 0; i < a->n_network_peers; i++)
        if (strcmp(a->network_peers[i], b->network_peers[i]) != 0)
            return false;
    return true;
}

int kvt_node_reload(struct kvt_node *nd, const struct kvt_config *next)
{
    struct kvt_config c;
    int rc = kvt_config_copy(&c, next);

    if (rc != 0)
        return rc;
    /* network.peers: the peer links dial the new seeds (the other reloadable keys are
     * read where they are used). */
    if (nd->peers != NULL && !same_peers(&nd->cfg, &c)) {
        rc =
            kvt_peers_set_seeds(nd->peers, (const char *const *)c.network_peers, c.n_network_peers);
        if (rc != 0) {
            kvt_config_free(&c);
            return rc;
        }
    }
    kvt_log_set_level(c.log_level);
    kvt_config_free(&nd->cfg);
    nd->cfg = c;
    return 0;
}

/* ---- start and stop ------------------------------------------------------------ */

/* A start that failed half-way: release what was built, in reverse order. */
static void abandon(struct kvt_node *nd)
{
    if (nd->http != NULL)
        kvt_metrics_http_destroy(nd->http);
    if (nd->engines != NULL)
        kvt_engine_server_destroy(nd->engines);
    if (nd->m != NULL) {
        kvt_manager_shutdown(nd->m);
        kvt_manager_destroy(nd->m); /* owns the primary and the tiers */
    } else {
        for (size_t i = 0; i < nd->n_tiers; i++) {
            kvt_tier_shutdown(nd->tiers[i]);
            kvt_tier_destroy(nd->tiers[i]);
        }
        if (nd->primary != NULL)
            kvt_primary_destroy(nd->primary); /* and its region */
    }
    if (nd->peers != NULL)
        kvt_peers_destroy(nd->peers);
    if (nd->lock_fd >= 0) {
        /* We hold it. One that was there before may record a dead daemon's region
         * for the next start: kept. One this start created goes. */
        if (nd->lock_created)
            unlinkat(nd->run_fd, nd->lock_name, 0);
        close(nd->lock_fd);
    }
    if (nd->run_fd >= 0)
        close(nd->run_fd);
}

static void node_free(struct kvt_node *nd)
{
    kvt_prom_acc_cleanup(&nd->prom);
    if (nd->ep >= 0)
        close(nd->ep);
    kvt_config_free(&nd->cfg);
    kvt_free(nd);
}

int kvt_node_open(const struct kvt_config *cfg, struct kvt_node **node_p)
{
    struct kvt_node *nd = kvt_calloc(1, sizeof(*nd));
    int rc;

    if (nd == NULL)
        return -ENOMEM;
    nd->lock_fd = nd->run_fd = -1;
    kvt_prom_acc_init(&nd->prom);
    nd->ep = epoll_create1(EPOLL_CLOEXEC);
    if (nd->ep < 0) {
        rc = -errno;
        kvt_error(MOD, "epoll: %s", strerror(-rc));
        kvt_prom_acc_cleanup(&nd->prom);
        kvt_free(nd);
        return rc;
    }
    rc = kvt_config_copy(&nd->cfg, cfg);
    if (rc != 0) {
        close(nd->ep);
        kvt_prom_acc_cleanup(&nd->prom);
        kvt_free(nd);
        return rc;
    }
    rc = assemble(nd);
    if (rc == 0)
        rc = start_services(nd);
    if (rc != 0) {
        abandon(nd);
        node_free(nd);
        return rc;
    }
    nd->last_step_ns = nd->last_metrics_ns = kvt_now_ns();
    *node_p = nd;
    return 0;
}

int kvt_node_stop(struct kvt_node *nd)
{
    uint64_t t0 = kvt_now_ns();
    int rc;

    if (nd->stopped)
        return 0;
    nd->stopped = true;
    if (nd->http != NULL)
        kvt_metrics_http_set_healthy(nd->http, false); /* draining: not ready for new work */
    if (nd->engines != NULL)
        kvt_engine_server_destroy(nd->engines); /* engines' pins and requests are cleaned up */
    nd->engines = NULL;
    kvt_node_step(nd);
    /* Drain every tier (our pulls end, peers' leases are released), let the manager
     * take the results, then look for leaks before the primary goes away. */
    for (size_t i = 0; i < nd->n_tiers; i++)
        kvt_tier_drain_jobs(nd->tiers[i]);
    kvt_node_step(nd);
    kvt_node_step(nd);
    {
        size_t entries = kvt_primary_num_entries(nd->primary);
        size_t wp = kvt_primary_num_write_pending(nd->primary);
        size_t pinned = entries - wp - kvt_primary_num_evictable(nd->primary);

        /* Every engine, lease and transfer is gone: anything pinned now leaked. */
        if (pinned != 0 || wp != 0)
            kvt_error(MOD, "at exit: %zu pinned, %zu write-pending chunks (a leak)", pinned, wp);
        else
            kvt_info(MOD, "at exit: %zu chunks, 0 pinned, 0 write-pending", entries);
    }
    rc = kvt_manager_shutdown(nd->m); /* frees the primary and its region */
    if (rc != 0)
        kvt_error(MOD, "shutdown: %s", strerror(-rc));
    kvt_manager_destroy(nd->m);
    nd->m = NULL;
    nd->primary = NULL;
    nd->region = NULL;
    nd->n_tiers = 0;
    nd->net = NULL;
    if (nd->peers != NULL)
        kvt_peers_destroy(nd->peers);
    nd->peers = NULL;
    if (nd->http != NULL)
        kvt_metrics_http_destroy(nd->http);
    nd->http = NULL;
    if (nd->lock_fd >= 0) {
        unlinkat(nd->run_fd, nd->lock_name, 0); /* ours: we hold it, in our folder */
        close(nd->lock_fd);
        nd->lock_fd = -1;
    }
    if (nd->run_fd >= 0)
        close(nd->run_fd);
    nd->run_fd = -1;
    kvt_info(MOD, "stopped in %.2f s", (double)(kvt_now_ns() - t0) / 1e9);
    return rc;
}

void kvt_node_close(struct kvt_node *nd)
{
    if (nd == NULL)
        return;
    kvt_node_stop(nd);
    node_free(nd);
}

/* ---- the parts ----------------------------------------------------------------- */

const struct kvt_config *kvt_node_config(const struct kvt_node *nd)
{
    return &nd->cfg;
}

struct kvt_manager *kvt_node_manager(struct kvt_node *nd)
{
    return nd->m;
}

struct kvt_primary *kvt_node_primary(struct kvt_node *nd)
{
    return nd->primary;
}

struct kvt_region *kvt_node_region(struct kvt_node *nd)
{
    return nd->region;
}

struct kvt_peers *kvt_node_peers(struct kvt_node *nd)
{
    return nd->peers;
}

struct kvt_tier *kvt_node_tier(struct kvt_node *nd, enum kvt_tier_kind kind)
{
    for (size_t i = 0; i < nd->n_tiers; i++)
        if (nd->kinds[i] == kind)
            return nd->tiers[i];
    return NULL;
}

uint16_t kvt_node_metrics_port(const struct kvt_node *nd)
{
    return nd->http != NULL ? kvt_metrics_http_port(nd->http) : 0;
}

/* SPDX-License-Identifier: Apache-2.0 */
/* kvtierd: the kvtier node daemon. The node itself (runtime folders, lock, region,
 * tiers, peers, manager, engine API, /metrics) is kvt_node (kvt/node.h); this file is
 * what makes it a daemon: its command line, its signals, systemd's notify protocol
 * and the loop around the node.
 *
 * Signals (signalfd): SIGTERM/SIGINT stop accepting engines, drain transfers,
 * release leases, unpublish and exit 0; SIGHUP reloads the keys that can change at
 * run time and keeps the old configuration when the new one is bad.
 *
 * The loop sleeps on the signals and the node's fd for at most what the node allows
 * (kvt_node_timeout_ms: nothing when a tier has work in flight, else until its next
 * tick), lets the node do what is due and tells the service manager's watchdog that
 * it still turns. */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include "kvt/alloc.h"
#include "kvt/common.h"
#include "kvt/config.h"
#include "kvt/log.h"
#include "kvt/node.h"
#include "kvt/service.h"
#include "kvt/version.h"

#define MOD "kvtierd"
/* Start refused because a path is not safe to use (another user's file or folder, a
 * symbolic link, a folder others may write to): sysexits.h EX_NOPERM. */
#define KVTIERD_EXIT_UNSAFE 77

/* Open files the node needs at least to start (its own sockets, region, storage
 * ring and threads, the transport's): below it a library (UCX) may abort half-way
 * through the start instead of failing. Engines and peers need one more each. */
#define KVTIERD_MIN_FDS 64

struct daemon {
    struct kvt_config cfg; /* as loaded: what SIGHUP compares a new load with */
    const char *cfg_path;
    char **sets;
    size_t n_sets;
    struct kvt_node *node;
    int ep, sig_fd;
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

/* A soft limit on open files too low to start: refused with the limit named, before
 * anything is created. */
static int check_fd_limit(void)
{
    struct rlimit rl;

    if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY ||
        rl.rlim_cur >= KVTIERD_MIN_FDS)
        return 0;
    kvt_error(MOD,
              "the open files limit is %llu: kvtierd needs at least %d, and one more per "
              "engine and peer (raise it: ulimit -n, or LimitNOFILE= in the unit)",
              (unsigned long long)rl.rlim_cur, KVTIERD_MIN_FDS);
    return -EMFILE;
}

static void reload(struct daemon *d)
{
    struct kvt_config next;
    struct kvt_config_diff diff;
    char err[512];
    int rc;

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
    rc = kvt_node_reload(d->node, &next);
    if (rc != 0) {
        kvt_error(MOD, "SIGHUP: %s; keeping the running configuration",
                  rc == -ENOMEM ? "out of memory" : "network.peers refused (see above)");
        kvt_config_free(&next);
        return;
    }
    for (size_t i = 0; i < diff.n_changed; i++)
        kvt_info(MOD, "SIGHUP: %s changed", diff.changed[i]);
    kvt_config_free(&d->cfg);
    d->cfg = next;
}

static void on_signals(struct daemon *d)
{
    struct signalfd_siginfo si;

    while (read(d->sig_fd, &si, sizeof(si)) == sizeof(si)) {
        if (si.ssi_signo == SIGHUP) {
            reload(d);
        } else {
            kvt_info(MOD, "%s: stopping", strsignal((int)si.ssi_signo));
            d->stopping = true;
        }
    }
}

static void run(struct daemon *d)
{
    while (!d->stopping) {
        struct epoll_event evs[4];
        int n = epoll_wait(d->ep, evs, KVT_ARRAY_SIZE(evs), kvt_node_timeout_ms(d->node));

        for (int i = 0; i < n; i++)
            if (evs[i].data.fd == d->sig_fd)
                on_signals(d);
        /* Its error is the engine server's own epoll failing: logged there, and the
         * node goes on serving its peers and /metrics as before. */
        (void)kvt_node_progress(d->node);
        kvt_service_tick(); /* the watchdog: this loop still turns */
    }
}

static int ep_add(int ep, int fd)
{
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = fd};

    return epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev) == 0 ? 0 : -errno;
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

    if (check_fd_limit() != 0) {
        kvt_config_free(&dp->cfg);
        return 1;
    }
    sigemptyset(&mask);
    sigaddset(&mask, SIGTERM);
    sigaddset(&mask, SIGINT);
    sigaddset(&mask, SIGHUP);
    sigprocmask(SIG_BLOCK, &mask, NULL);
    signal(SIGPIPE, SIG_IGN);
    dp->sig_fd = signalfd(-1, &mask, SFD_NONBLOCK | SFD_CLOEXEC);
    dp->ep = epoll_create1(EPOLL_CLOEXEC);
    if (dp->sig_fd < 0 || dp->ep < 0) {
        kvt_error(MOD, "cannot set up the loop: %s", strerror(errno));
        kvt_config_free(&dp->cfg);
        return 1;
    }
    rc = kvt_node_open(&dp->cfg, &dp->node);
    if (rc != 0) {
        kvt_error(MOD, "start failed: %s", strerror(-rc));
        kvt_config_free(&dp->cfg);
        if (rc == -EPERM || rc == -EEXIST || rc == -ELOOP)
            return KVTIERD_EXIT_UNSAFE;
        return rc == -EINVAL ? KVT_CONFIG_EXIT : 1;
    }
    rc = ep_add(dp->ep, dp->sig_fd);
    if (rc == 0)
        rc = ep_add(dp->ep, kvt_node_fd(dp->node));
    if (rc != 0) {
        kvt_error(MOD, "cannot set up the loop: %s", strerror(-rc));
        kvt_node_close(dp->node);
        kvt_config_free(&dp->cfg);
        return 1;
    }
    {
        const struct kvt_config *nc = kvt_node_config(dp->node);
        size_t tiers = (kvt_node_tier(dp->node, KVT_TIER_STORAGE) != NULL) +
                       (kvt_node_tier(dp->node, KVT_TIER_NETWORK) != NULL);
        char status[256];

        kvt_info(MOD, "ready: node %016" PRIx64 ", %" PRIu64 " MiB primary at %s, %zu tier(s)",
                 nc->node_id, nc->primary_size >> 20, nc->primary_path, tiers);
        snprintf(status, sizeof(status), "serving: node %016" PRIx64 ", engines at %s", nc->node_id,
                 nc->engine_socket);
        kvt_service_ready(status);
    }
    run(dp);
    /* SIGTERM: no new engines, drain, release leases, unpublish, exit 0. */
    kvt_service_stopping();
    rc = kvt_node_stop(dp->node);
    kvt_node_close(dp->node);
    kvt_config_free(&dp->cfg);
    return rc == 0 ? 0 : 1;
}

int main(int argc, char **argv)
{
    struct daemon d = {.ep = -1, .sig_fd = -1};
    int rc;

    d.sets = kvt_calloc((size_t)argc + 1, sizeof(*d.sets));
    if (d.sets == NULL)
        return 1;
    rc = daemon_main(&d, argc, argv);
    if (d.sig_fd >= 0)
        close(d.sig_fd);
    if (d.ep >= 0)
        close(d.ep);
    kvt_free(d.sets);
    return rc;
}

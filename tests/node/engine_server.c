/* SPDX-License-Identifier: Apache-2.0 */
/* kvt-test-engine-server: the engine API on a real manager, for the node tests until
 * kvtierd assembles it (a stand-in, not the daemon). One region (creator, in the
 * given folder), a primary with events, no secondary tiers, the engine server,
 * and the loop: poll, progress, on a 1 ms tick when idle.
 *
 *   kvt-test-engine-server SOCKET REGION_FILE NUM_CHUNKS PAGE_BYTES WORKERS
 *
 * Prints "ready" once it listens. On SIGTERM it stops, waits (up to 2 s) for the
 * connected clients to be gone, and prints one line of
 * what it cleaned up and what is left (the tests read it):
 *   disconnects=N finished_reqs=N released_pins=N aborted_stores=N malformed=N
 *   requests_left=N write_pending=N pinned=N
 * then destroys everything and exits 0. */
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvt/alloc.h"
#include "kvt/engine_api.h"
#include "kvt/manager.h"
#include "kvt/primary.h"
#include "kvt/primary_test.h"
#include "kvt/region.h"

static volatile sig_atomic_t g_stop;

static void on_term(int sig)
{
    (void)sig;
    g_stop = 1;
}

static void count_pinned(void *arg, const struct kvt_key *key,
                         const struct kvt_primary_entry_info *info)
{
    (void)key;
    if (info->ref_cnt > 0)
        ++*(size_t *)arg;
}

int main(int argc, char **argv)
{
    struct kvt_region *r;
    struct kvt_primary *p;
    struct kvt_manager *m;
    struct kvt_engine_server *srv;
    struct kvt_engine_server_counters c;
    size_t pinned = 0;
    int rc;

    if (argc != 6) {
        fprintf(stderr, "usage: %s SOCKET REGION_FILE NUM_CHUNKS PAGE_BYTES WORKERS\n", argv[0]);
        return 64;
    }
    struct kvt_region_config rcfg = {.path = argv[2],
                                     .num_chunks = strtoul(argv[3], NULL, 10),
                                     .page_bytes = strtoul(argv[4], NULL, 10),
                                     .num_workers = (unsigned)strtoul(argv[5], NULL, 10),
                                     .rank = KVT_REGION_RANK_ALL,
                                     .join_timeout_s = 5};
    signal(SIGPIPE, SIG_IGN);
    signal(SIGTERM, on_term);
    signal(SIGINT, on_term);
    r = kvt_calloc(1, sizeof(*r));
    if (r == NULL || (rc = kvt_region_open(&rcfg, r)) != 0) {
        fprintf(stderr, "region %s: %s\n", argv[2], strerror(r ? -rc : ENOMEM));
        return 1;
    }
    struct kvt_primary_config pcfg = {
        .num_chunks = r->num_chunks, .row_bytes = r->row_bytes, .enable_events = true};
    if ((rc = kvt_primary_create(&pcfg, r, &p)) != 0 ||
        (rc = kvt_manager_create(p, NULL, 0, &m)) != 0) {
        fprintf(stderr, "manager: %s\n", strerror(-rc));
        return 1;
    }
    struct kvt_engine_server_config scfg = {.socket_path = argv[1], .manager = m};
    if ((rc = kvt_engine_server_create(&scfg, &srv)) != 0) {
        fprintf(stderr, "engine server: %s\n", strerror(-rc));
        kvt_manager_destroy(m);
        return 1;
    }
    printf("ready\n");
    fflush(stdout);
    while (!g_stop) {
        struct pollfd pfd = {.fd = kvt_engine_server_fd(srv), .events = POLLIN};

        if (poll(&pfd, 1, 1) < 0 && errno != EINTR)
            break;
        if (kvt_engine_server_progress(srv) != 0)
            break;
    }
    /* Drain: the tests close their clients before SIGTERM, but the EOFs may not have
     * been read yet. Up to 2 s for every client to be gone. */
    for (int i = 0; i < 2000; i++) {
        struct pollfd pfd = {.fd = kvt_engine_server_fd(srv), .events = POLLIN};

        kvt_engine_server_get_counters(srv, &c);
        if (c.clients == 0)
            break;
        poll(&pfd, 1, 1);
        kvt_engine_server_progress(srv);
    }
    kvt_engine_server_get_counters(srv, &c);
    kvt_primary_for_each(kvt_manager_primary(m), count_pinned, &pinned);
    printf("disconnects=%llu finished_reqs=%llu released_pins=%llu aborted_stores=%llu "
           "malformed=%llu requests_left=%zu write_pending=%zu pinned=%zu\n",
           (unsigned long long)c.disconnects, (unsigned long long)c.finished_reqs,
           (unsigned long long)c.released_pins, (unsigned long long)c.aborted_stores,
           (unsigned long long)c.malformed, kvt_manager_num_requests(m),
           kvt_primary_num_write_pending(kvt_manager_primary(m)), pinned);
    fflush(stdout);
    kvt_engine_server_destroy(srv);
    kvt_manager_destroy(m);
    return 0;
}

/* SPDX-License-Identifier: Apache-2.0 */
/* kvt_node: one kvtier node assembled from its configuration, the way kvtierd runs it:
 * the runtime folders and the lock, the shared primary region and the primary tier,
 * the secondary tiers in the configured order (storage; network with its peer links),
 * the manager, the local engine API, /metrics and /healthz, and the stats fan-out that
 * hands the manager's return-and-reset stats to every consumer. kvtierd and
 * kvtier-simnode both open their node here, so the cluster tests run the daemon's own
 * wiring and defaults.
 *
 * The loop around a node belongs to its program (signals, systemd, a simulator's
 * commands): it sleeps on kvt_node_fd (plus fds of its own) for at most
 * kvt_node_timeout_ms, then calls kvt_node_progress. Engines step the manager at
 * their schedule ends; the node steps once every loop.tick_ms besides, so that peers
 * are served and transfers progress on an idle node.
 *
 * Threads: every call on the one thread that runs the loop (the manager's). */
#ifndef KVT_NODE_H
#define KVT_NODE_H

#include <stddef.h>
#include <stdint.h>

#include "kvt/config.h"

struct kvt_node;
struct kvt_manager;
struct kvt_peers;
struct kvt_primary;
struct kvt_region;
struct kvt_tier;

/* Builds the node (the configuration is copied). On failure nothing is left behind
 * but what the stale-region rule keeps (a lock file that recorded a region), the
 * cause is logged once and the return value says its class: -EPERM, -EEXIST or
 * -ELOOP a path that is not safe to use (another user's file or folder, a link, a
 * folder others may write), -EINVAL a configuration the host refuses (no such
 * group, ...), -EBUSY another daemon holds the lock, another negative errno else. */
int kvt_node_open(const struct kvt_config *cfg, struct kvt_node **node_p);

/* The orderly stop (kvtierd's SIGTERM): /healthz turns unhealthy, engines are
 * detached (their pins and requests cleaned up), every tier is drained (our pulls
 * end, peers' leases are released), the manager is shut down, the region, lock and
 * socket are removed; a pinned or write-pending chunk left at that point is logged as
 * a leak. 0, or the manager's shutdown error. Afterwards only kvt_node_close. */
int kvt_node_stop(struct kvt_node *node);
/* Frees the node; one that was not stopped is stopped first. NULL is fine. */
void kvt_node_close(struct kvt_node *node);

/* ---- the loop ---- */

/* One fd (an epoll fd) that turns readable when the node has work: the engine socket
 * and its clients, every tier's event fds (kvt_tier_event_fds). */
int kvt_node_fd(const struct kvt_node *node);
/* How long the loop may sleep on kvt_node_fd: 0 when a tier has work now (it did not
 * arm, kvt_tier_arm), else until the next tick's step, at most loop.tick_ms. */
int kvt_node_timeout_ms(struct kvt_node *node);
/* Does what is due, never blocks: the engines' requests, the tick's step when no
 * engine stepped for loop.tick_ms, every tier's poll, /metrics once a second; then,
 * while the engines' shared-memory rings are busy, polls them for up to 50 us (and
 * kvt_node_timeout_ms says 0 until they are quiet).
 * 0, or the engine server's error (the server itself failed). */
int kvt_node_progress(struct kvt_node *node);
/* One schedule end (what an engine's on_schedule_end does): the manager steps. */
void kvt_node_step(struct kvt_node *node);
/* SIGHUP: adopts next's values of the keys that may change at run time (the caller
 * checked with kvt_config_diff_reloadable that no other key changed): the log level
 * and the tick read where they are used, network.peers handed to the peer links
 * (new seeds are dialled). 0, -EINVAL (a seed the links refuse) or -ENOMEM (nothing
 * changed). */
int kvt_node_reload(struct kvt_node *node, const struct kvt_config *next);

/* ---- the parts (the simulator, tests); of a node that was not stopped ---- */

const struct kvt_config *kvt_node_config(const struct kvt_node *node);
struct kvt_manager *kvt_node_manager(struct kvt_node *node);
struct kvt_primary *kvt_node_primary(struct kvt_node *node);
struct kvt_region *kvt_node_region(struct kvt_node *node);
/* The network tier's peer links; NULL when the node runs no network tier. */
struct kvt_peers *kvt_node_peers(struct kvt_node *node);
/* The running tier of that kind, or NULL (not listed in tiers, or disabled). */
struct kvt_tier *kvt_node_tier(struct kvt_node *node, enum kvt_tier_kind kind);
/* The port /metrics listens on; 0 when it is off. */
uint16_t kvt_node_metrics_port(const struct kvt_node *node);
/* The /metrics page as it would be published now (stats collected first): a new
 * NUL-terminated text (*text_p, kvt_free it). 0, -ENOMEM or -EINVAL (as
 * kvt_prom_render). */
int kvt_node_render_metrics(struct kvt_node *node, char **text_p, size_t *len_p);

#endif

/* SPDX-License-Identifier: Apache-2.0 */
/* The engine API's attached regions and jobs (node/engine_jobs.c), private to
 * kvt_node: node/engine_api.c dispatches ATTACH and JOBS here and calls
 * kvt__ejobs_progress on every pass of its loop. */
#ifndef KVT_ENGINE_JOBS_INT_H
#define KVT_ENGINE_JOBS_INT_H

#include <stdbool.h>
#include <stdint.h>

#include "kvt/engine_api.h"
#include "kvtier/engine_proto.h"

struct kvt_manager;
struct kvt_ejobs;

/* The manager request of a client's jobs is this prefix and its client id; the
 * manager's request ids are one namespace, so no engine may create one (its
 * NEW_REQUEST is refused) lest it take the name of a later engine's jobs. */
#define KVT_EJOBS_REQ_PREFIX "kvtier-jobs-"

/* Maps the region the client passed (fd, geometry in q->geom, KVT_EA_*) after
 * checking it against the fd's size and the node's rows, and registers the client's
 * jobs request with the manager. Takes fd in every case (closes it on failure).
 * r's GEOM gets the node's geometry. -EBADF no fd passed, -EINVAL bad geometry,
 * -EBUSY the client attached already, -ENOMEM. */
int kvt__ejobs_attach(struct kvt_ejobs **jobs_p, struct kvt_manager *m, uint64_t client_id, int fd,
                      const struct kvt_emsg *q, struct kvt_emsg *r,
                      struct kvt_engine_server_counters *ctr, uint32_t keys_per_pass);

/* One JOBS request: answers q's lookup keys (r->results), starts q's jobs and
 * hands r the jobs finished since the last call (r->jobs, r->ok). The whole
 * request is checked before anything runs: -EINVAL (nothing done) for a row out
 * of the region, an unknown kind or counts that do not add up; -ENOBUFS when the
 * client has too many keys waiting. */
int kvt__ejobs_step(struct kvt_ejobs *j, const struct kvt_emsg *q, struct kvt_emsg *r,
                    uint32_t max_keys);

/* Advances the load jobs waiting for a chunk (a promotion in the node): those at the
 * head of the list until keys_per_pass keys were looked up again, which then go to
 * its tail. Returns whether some wait still. */
bool kvt__ejobs_progress(struct kvt_ejobs *j);

/* Whether load jobs wait for a chunk (a reset would wipe what they wait for). */
bool kvt__ejobs_waiting(const struct kvt_ejobs *j);
/* Whether jobs are waiting or finished and not yet reported. */
bool kvt__ejobs_unreported(const struct kvt_ejobs *j);

/* Fails nothing (the client is gone): drops the jobs, finishes the request,
 * unmaps the region. NULL is ignored. */
void kvt__ejobs_destroy(struct kvt_ejobs *j);

#endif

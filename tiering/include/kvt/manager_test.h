/* SPDX-License-Identifier: Apache-2.0 */
/* Test hooks of the manager (kvt/manager.h): a request's inner state, which the
 * ports of vLLM's tests check and the node never reads. Included by the tests and
 * by manager.c only. */
#ifndef KVT_MANAGER_TEST_H
#define KVT_MANAGER_TEST_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvt/manager.h"

/* Request state: -ENOENT if unknown. */
struct kvt_manager_req_info {
    int pending_primary_stores;
    bool is_finished;
    uint32_t request_level_tiers; /* bit i = tier i */
    size_t n_pending_cascade_keys;
};
int kvt_manager_request_info(const struct kvt_manager *m, const char *req_id,
                             struct kvt_manager_req_info *info_p);

#endif

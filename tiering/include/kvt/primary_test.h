/* SPDX-License-Identifier: Apache-2.0 */
/* Test hooks of the primary tier (kvt/primary.h): what the ports of vLLM's tests and
 * the invariant recounts reach that the node never does. Included by the tests and
 * by the primary's own files only. */
#ifndef KVT_PRIMARY_TEST_H
#define KVT_PRIMARY_TEST_H

#include "kvt/primary.h"

/* Upstream's tests set arc_policy.target_t1_size directly. */
void kvt__primary_arc_set_target(struct kvt_primary *p, double target);

/* Walks every entry (tests' recount of the invariants). */
typedef void (*kvt_primary_entry_cb)(void *arg, const struct kvt_key *key,
                                     const struct kvt_primary_entry_info *info);
void kvt_primary_for_each(const struct kvt_primary *p, kvt_primary_entry_cb cb, void *arg);

#endif

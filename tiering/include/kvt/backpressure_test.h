/* SPDX-License-Identifier: Apache-2.0 */
/* Test hooks of the back-pressure detector (kvt/backpressure.h): what the ports of
 * vLLM's tests reach that the node never does. Included by the tests and by
 * backpressure.c only. */
#ifndef KVT_BACKPRESSURE_TEST_H
#define KVT_BACKPRESSURE_TEST_H

#include <stdbool.h>

#include "kvt/backpressure.h"

void kvt_bp_set_ema(struct kvt_bp *bp, double ema);
/* Only the policy's decision (ThrottledDropPolicy/DropStorePolicy.should_store),
 * without healthy bypass or cooldown; counts nothing. For tests of the policy alone. */
bool kvt_bp_policy_allows(struct kvt_bp *bp);

/* The detector's private fields, for the vLLM tests that set them directly
 * (bp._completions = ..., bp._under_pressure = True, ...). Times are kvt_now_s()
 * seconds, 0 = never. set replaces every field listed here (the warmup samples
 * and the policy's counters are not among them). */
struct kvt_bp_state {
    double ema;
    bool under_pressure;
    unsigned completions;
    double last_update_s;
    unsigned healthy_streak;
    double pressure_cleared_at_s;
    unsigned cooldown_count;
};
void kvt__bp_get_state(const struct kvt_bp *bp, struct kvt_bp_state *st_p);
void kvt__bp_set_state(struct kvt_bp *bp, const struct kvt_bp_state *st);

#endif

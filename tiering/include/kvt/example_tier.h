/* SPDX-License-Identifier: Apache-2.0 */
/* The in-memory example tier: the template for real tiers and the
 * workhorse of the tests. With no options it behaves exactly like vLLM's
 * ExampleSecondaryTierManager (synchronous, every job finished at once). Options
 * add what tests need: held or delayed completions, random failures, a first
 * RETRY for every key, request-level policy, a call log, and real byte copies so
 * that loaded rows can be verified. */
#ifndef KVT_EXAMPLE_TIER_H
#define KVT_EXAMPLE_TIER_H

#include <stddef.h>
#include <stdbool.h>

#include "kvt/tier.h"

enum kvt_example_call {
    KVT_EX_LOOKUP,
    KVT_EX_SUBMIT_STORE,
    KVT_EX_SUBMIT_LOAD,
    KVT_EX_TOUCH,
    KVT_EX_ON_NEW_REQUEST,
    KVT_EX_ON_REQUEST_FINISHED,
    KVT_EX_TAKE_EVENTS,
    KVT_EX_SERVE,
    KVT_EX_ON_SCHEDULE_END,
    KVT_EX_DRAIN,
    KVT_EX_SHUTDOWN,
};

/* Called for every op; job is set for submits, ctx where the op has one. */
typedef void (*kvt_example_call_cb)(void *arg, struct kvt_tier *t, enum kvt_example_call call,
                                    const struct kvt_job *job, struct kvt_req_ctx *ctx,
                                    const struct kvt_key *keys, size_t n);

struct kvt_example_tier_config {
    const char *type;        /* default "example" */
    int medium, locality;    /* a zeroed config: CPU, LOCAL; NULL config: CPU, any */
    bool hold_jobs;          /* keep results until kvt_example_tier_release() */
    unsigned delay_polls;    /* report a job after this many get_finished_jobs calls */
    double fail_rate;        /* probability that a job (or a promoted key) fails */
    unsigned seed;           /* for fail_rate */
    bool retry_first_lookup; /* answer RETRY the first time each key is looked up */
    bool request_level;      /* on_new_request returns REQUEST_LEVEL */
    bool copy_bytes;         /* keep a copy of every stored row; loads copy it back */
    bool emit_events;        /* a stored event (medium of the tier) per successful store */
    int shutdown_error;      /* shutdown returns this (tests of failed shutdown) */
    kvt_example_call_cb on_call;
    void *cb_arg;
};

int kvt_example_tier_create(const struct kvt_example_tier_config *cfg, struct kvt_tier **tier_p);

/* Test helpers. */
bool kvt_example_tier_has(struct kvt_tier *t, const struct kvt_key *key);
int kvt_example_tier_insert(struct kvt_tier *t, const struct kvt_key *key, const void *row);
int kvt_example_tier_remove(struct kvt_tier *t, const struct kvt_key *key);
size_t kvt_example_tier_num_keys(struct kvt_tier *t);
/* Jobs submitted and not yet reported. */
size_t kvt_example_tier_num_unreported(struct kvt_tier *t);
/* Makes held results reportable (hold_jobs). */
void kvt_example_tier_release(struct kvt_tier *t);
/* Sets or clears hold_jobs at run time. */
void kvt_example_tier_set_hold(struct kvt_tier *t, bool hold);
/* Changes fail_rate at run time. */
void kvt_example_tier_set_fail_rate(struct kvt_tier *t, double fail_rate);
/* Counters of calls by kind. */
unsigned kvt_example_tier_calls(struct kvt_tier *t, enum kvt_example_call call);
/* Sets the tier's back-pressure detector (owned by the tier afterwards). */
void kvt_example_tier_set_bp(struct kvt_tier *t, struct kvt_bp *bp);

#endif

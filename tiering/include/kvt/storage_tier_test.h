/* SPDX-License-Identifier: Apache-2.0 */
/* Test hooks of the storage tier (kvt/storage_tier.h): disk faults on demand and a
 * pause of the I/O threads, so a test can order what the threads would race.
 * Included by the tests and by storage_tier.c only. */
#ifndef KVT_STORAGE_TIER_TEST_H
#define KVT_STORAGE_TIER_TEST_H

#include <stdbool.h>

#include "kvt/storage_tier.h"

/* Fault injection: the next n chunk writes (KVT_STORAGE_FAULT_WRITE) or reads
 * (_READ) fail with err (a positive errno) before touching the disk; with fsync on,
 * the next n syncs of a chunk's folder after its rename (_SYNC) fail with err. */
enum kvt_storage_fault {
    KVT_STORAGE_FAULT_WRITE = 0,
    KVT_STORAGE_FAULT_READ = 1,
    KVT_STORAGE_FAULT_SYNC = 2,
};
void kvt_storage_tier_inject_fault(struct kvt_tier *t, enum kvt_storage_fault op, int err,
                                   unsigned n);
/* The next n chunk files the warm-restart scan of any tier opens fail with err. */
void kvt_storage_scan_inject_fault(int err, unsigned n);
/* While paused, I/O threads take no new task (running ones finish). */
void kvt_storage_tier_pause(struct kvt_tier *t, bool paused);

#endif

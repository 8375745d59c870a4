/* SPDX-License-Identifier: Apache-2.0 */
/* Test hooks of the async lookup (kvt/async_lookup.h): a test drives the worker's
 * timing itself. Included by the tests and by async_lookup.c only. */
#ifndef KVT_ASYNC_LOOKUP_TEST_H
#define KVT_ASYNC_LOOKUP_TEST_H

#include <stdbool.h>

#include "kvt/async_lookup.h"

/* Blocks until the worker has posted results for every item handed to it. */
void kvt_async_lookup_wait_idle(struct kvt_async_lookup *al);
/* Posts a result as if the worker had produced it. 0 or -ENOMEM. */
int kvt__async_lookup_inject_result(struct kvt_async_lookup *al, const struct kvt_key *key,
                                    unsigned long generation, bool found);

#endif

/* SPDX-License-Identifier: Apache-2.0 */
/* CHECK(cond) for the fuzz targets: a property of the code under test beyond the
 * sanitizers' own checks. A failure says which, and aborts (libFuzzer keeps the input
 * as a finding; fuzz_main.c's run of the seeds fails). */
#ifndef KVT_FUZZ_CHECK_H
#define KVT_FUZZ_CHECK_H

#include <stdio.h>
#include <stdlib.h>

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s: check failed: %s (line %d)\n", __FILE__, #cond, __LINE__);        \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

#endif

/* SPDX-License-Identifier: Apache-2.0 */
/* Shared test helpers over the tiering vocabulary: keys like vLLM's fixtures and
 * request contexts. Apart from test_util.c so that tests of common/ link without
 * the tiering library. */
#include <stdio.h>

#include "test_util.h"

struct kvt_key kt_key(int i)
{
    char buf[32];
    struct kvt_key k;
    int n = snprintf(buf, sizeof(buf), "%d", i);
    int rc = kvt_key_make(&k, buf, (size_t)n, 0);
    assert_int_equal(rc, 0);
    return k;
}

void kt_keys(struct kvt_key *out, int first, size_t n)
{
    for (size_t i = 0; i < n; i++)
        out[i] = kt_key(first + (int)i);
}

struct kvt_req_ctx *kt_ctx(const char *req_id)
{
    struct kvt_req_ctx *ctx = NULL;
    assert_int_equal(kvt_req_ctx_create(req_id, NULL, &ctx), 0);
    return ctx;
}

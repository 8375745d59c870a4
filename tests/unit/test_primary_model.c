/* SPDX-License-Identifier: Apache-2.0 */
/* The primary tier's store path against a model, under what one store call cannot
 * show alone: several requests' accesses alive at once and interleaved, stores that
 * fail (complete_store false: their slots leave the index between calls), keys
 * pinned by loads while others store and evict, reset_cache with accesses alive,
 * and accesses of thousands of records (beyond what a finished one leaves to the
 * next). After every call each key's lookup and the entry count must match. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

#include "kvt/primary.h"

enum { N_ACC = 3 };

struct model {
    struct kvt_primary *p;
    struct kvt_store_output out;
    int8_t *st; /* 0 absent, 1 pending, 2 ready */
    int *pins;
    int keys;
};

static int key_index(const struct model *m, const struct kvt_key *k)
{
    int i;

    assert_true(k->len == sizeof(i));
    memcpy(&i, k->bytes, sizeof(i));
    assert_true(i >= 0 && i < m->keys);
    return i;
}

static struct kvt_key mkey(int i)
{
    struct kvt_key k;

    kvt_key_set(&k, &i, sizeof(i));
    return k;
}

static void check(struct model *m)
{
    size_t present = 0;

    for (int j = 0; j < m->keys; j++) {
        struct kvt_key k = mkey(j);
        enum kvt_lookup_result want = m->st[j] == 0   ? KVT_MISS
                                      : m->st[j] == 1 ? KVT_HIT_PENDING
                                                      : KVT_HIT;

        present += m->st[j] != 0;
        if (kvt_primary_lookup(m->p, &k) != want)
            fail_msg("key %d: lookup %d, model %d", j, (int)kvt_primary_lookup(m->p, &k),
                     (int)m->st[j]);
    }
    assert_int_equal(kvt_primary_num_entries(m->p), present);
}

static void run(size_t chunks, const char *policy, int keys, size_t maxn, int calls, unsigned seed)
{
    struct kvt_key *k = calloc(maxn, sizeof(*k));

    struct kvt_primary_config pc = {.num_chunks = chunks, .policy = policy};
    struct kvt_primary_access *acc[N_ACC] = {NULL};
    struct model m = {.keys = keys};

    m.st = calloc((size_t)keys, sizeof(*m.st));
    m.pins = calloc((size_t)keys, sizeof(*m.pins));
    assert_non_null(k);
    assert_non_null(m.st);
    assert_non_null(m.pins);
    assert_int_equal(kvt_primary_create(&pc, NULL, &m.p), 0);
    kvt_store_output_init(&m.out);

    for (int call = 0; call < calls; call++) {
        unsigned op = (unsigned)rand_r(&seed) % 100;
        int a = rand_r(&seed) % (N_ACC + 1); /* N_ACC: no access */
        struct kvt_primary_access *x = a < N_ACC ? acc[a] : NULL;

        if (op < 50) { /* a store, some of its keys pinned by a load first */
            struct kvt_key pinned[8];
            size_t n = 1 + (size_t)rand_r(&seed) % maxn, n_pin = 0;
            int64_t slots[8];
            int rc;

            for (int t = 0; t < 8 && rand_r(&seed) % 3 == 0; t++) {
                int j = rand_r(&seed) % keys;

                if (m.st[j] == 2 && m.pins[j] == 0) {
                    pinned[n_pin] = mkey(j);
                    assert_int_equal(
                        kvt_primary_prepare_load_req(m.p, &pinned[n_pin], 1, x, &slots[n_pin]), 0);
                    m.pins[j]++;
                    n_pin++;
                }
            }
            for (size_t i = 0; i < n; i++)
                k[i] = mkey(rand_r(&seed) % keys);
            rc = kvt_primary_prepare_store_req(m.p, k, n, x, &m.out);
            if (rc != -ENOSPC) {
                assert_int_equal(rc, 0);
                for (size_t e = 0; e < m.out.n_evicted; e++) {
                    int j = key_index(&m, &m.out.evicted[e]);

                    assert_int_equal(m.st[j], 2);
                    assert_int_equal(m.pins[j], 0);
                    m.st[j] = 0;
                }
                for (size_t i = 0; i < m.out.n_store; i++) {
                    int j = key_index(&m, &m.out.keys_to_store[i]);

                    assert_int_equal(m.st[j], 0);
                    m.st[j] = 1;
                }
            }
            check(&m);
            for (size_t i = 0; i < n_pin; i++) {
                assert_int_equal(kvt_primary_complete_load(m.p, &pinned[i], 1), 0);
                m.pins[key_index(&m, &pinned[i])]--;
            }
        } else if (op < 80) { /* pending keys complete, some fail (leave the index) */
            for (int j = 0; j < keys; j++) {
                struct kvt_key kj = mkey(j);
                bool ok;

                if (m.st[j] != 1 || rand_r(&seed) % 2 != 0)
                    continue;
                ok = rand_r(&seed) % 5 != 0;
                assert_int_equal(kvt_primary_complete_store(m.p, &kj, 1, ok), 0);
                m.st[j] = ok ? 2 : 0;
            }
        } else if (op < 98) { /* a request finishes; another may take its place */
            if (acc[op % N_ACC] != NULL) {
                kvt_primary_request_finished(m.p, acc[op % N_ACC]);
                kvt_primary_access_destroy(acc[op % N_ACC]);
                acc[op % N_ACC] = NULL;
            }
            if (rand_r(&seed) % 4 != 0)
                assert_int_equal(kvt_primary_access_create(&acc[op % N_ACC]), 0);
        } else if (op == 98 && rand_r(&seed) % 8 == 0) {
            kvt_primary_reset_cache(m.p);
            memset(m.st, 0, (size_t)keys * sizeof(*m.st));
        }
        check(&m);
    }
    for (int i = 0; i < N_ACC; i++) {
        if (acc[i] != NULL) {
            kvt_primary_request_finished(m.p, acc[i]);
            kvt_primary_access_destroy(acc[i]);
        }
    }
    kvt_primary_destroy(m.p);
    kvt_store_output_cleanup(&m.out);
    free(m.st);
    free(m.pins);
    free(k);
}

static void test_interleaved_requests_against_a_model(void **state)
{
    (void)state;
    run(37, "lru", 300, 64, 4000, 11);
    run(37, "arc", 300, 64, 4000, 12);
    run(64, "arc", 120, 64, 4000, 13);
    run(300, "lru", 900, 200, 3000, 14);
}

/* Accesses of thousands of records: larger than a finished access may leave. */
static void test_large_accesses_against_a_model(void **state)
{
    (void)state;
    run(2000, "arc", 6000, 2500, 600, 21);
    run(2000, "lru", 6000, 2500, 600, 22);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_interleaved_requests_against_a_model),
        cmocka_unit_test(test_large_accesses_against_a_model),
    };

    return cmocka_run_group_tests(tests, NULL, NULL);
}

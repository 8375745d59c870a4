/* SPDX-License-Identifier: Apache-2.0 */
/* Placement (rendezvous hashing) and the location directory of the cluster. */
#include <errno.h>
#include <stdint.h>
#include <string.h>

#include "test_util.h"
#include "kvt/directory.h"
#include "kvt/placement.h"

#define MS 1000000ull

/* Every node computes the same home whatever the order of its member list. */
static void test_hrw_home_independent_of_member_order(void **state)
{
    uint64_t a[] = {11, 22, 33, 44}, b[] = {44, 22, 11, 33};

    for (int i = 0; i < 2000; i++) {
        struct kvt_key k = kt_key(i);
        long ha = kvt_hrw_home(&k, a, 4), hb = kvt_hrw_home(&k, b, 4);

        assert_true(ha >= 0 && hb >= 0);
        assert_int_equal(a[ha], b[hb]);
    }
    struct kvt_key k = kt_key(1);

    assert_int_equal(kvt_hrw_home(&k, a, 0), -1);
}

/* Removing a member moves only the keys it was home of; adding one moves only keys
 * to it; and the spread over 4 members is even within 10%. */
static void test_hrw_minimal_movement_and_spread(void **state)
{
    uint64_t four[] = {1, 2, 3, 4}, three[] = {1, 2, 4}, five[] = {1, 2, 3, 4, 5};
    unsigned count[4] = {0}, moved_to_5 = 0;
    const int n = 20000;

    for (int i = 0; i < n; i++) {
        struct kvt_key k = kt_key(i);
        uint64_t h4 = four[kvt_hrw_home(&k, four, 4)];
        uint64_t h3 = three[kvt_hrw_home(&k, three, 3)];
        uint64_t h5 = five[kvt_hrw_home(&k, five, 5)];

        count[h4 - 1]++;
        if (h4 != 3)
            assert_int_equal(h3, h4);
        if (h5 != h4) {
            assert_int_equal(h5, 5);
            moved_to_5++;
        }
    }
    for (int i = 0; i < 4; i++)
        assert_true(count[i] > n / 4 * 9 / 10 && count[i] < n / 4 * 11 / 10);
    assert_true(moved_to_5 > n / 5 * 9 / 10 && moved_to_5 < n / 5 * 11 / 10);
}

static void test_directory_publish_locate_unpublish(void **state)
{
    struct kvt_directory *d;
    struct kvt_key k[3];
    struct kvt_dir_holder h[4];

    kt_keys(k, 0, 3);
    assert_int_equal(kvt_directory_create(1000 * MS, 4, &d), 0);
    assert_int_equal(kvt_directory_publish(d, 7, 1, k, 3, 0), 0);
    assert_int_equal(kvt_directory_publish(d, 8, 5, k, 1, 10 * MS), 0);
    assert_int_equal(kvt_directory_num_keys(d), 3);
    assert_int_equal(kvt_directory_num_records(d), 4);
    assert_int_equal(kvt_directory_locate(d, &k[0], 20 * MS, h, 4), 2);
    assert_int_equal(h[0].node_id, 8); /* most recent first */
    assert_int_equal(h[0].incarnation, 5);
    assert_int_equal(h[1].node_id, 7);
    assert_int_equal(h[1].expires_ns, 1000 * MS);
    /* Unpublish by a stale incarnation does nothing; by the current one removes. */
    kvt_directory_unpublish(d, 8, 4, k, 1);
    assert_int_equal(kvt_directory_locate(d, &k[0], 20 * MS, h, 4), 2);
    kvt_directory_unpublish(d, 8, 5, k, 1);
    assert_int_equal(kvt_directory_locate(d, &k[0], 20 * MS, h, 4), 1);
    kvt_directory_unpublish(d, 7, 1, k, 3);
    assert_int_equal(kvt_directory_num_keys(d), 0);
    assert_int_equal(kvt_directory_num_records(d), 0);
    kvt_directory_destroy(d);
}

/* Places (direct reads): a publish with rows keeps each key's, a later publish
 * without one forgets it; another holder's place is its own. */
static void test_directory_rows(void **state)
{
    struct kvt_directory *d;
    struct kvt_key k[2];
    struct kvt_dir_holder h[4];
    struct kvt_dir_row rows[2] = {{.row = 17, .gen = 4, .known = true}, {.known = false}};

    (void)state;
    kt_keys(k, 0, 2);
    assert_int_equal(kvt_directory_create(1000 * MS, 4, &d), 0);
    assert_int_equal(kvt_directory_publish_rows(d, 7, 1, k, rows, 2, 0), 0);
    assert_int_equal(kvt_directory_publish(d, 8, 1, k, 1, 0), 0);
    assert_int_equal(kvt_directory_locate(d, &k[0], 0, h, 4), 2);
    assert_int_equal(h[0].node_id, 8);
    assert_false(h[0].has_row);
    assert_int_equal(h[1].node_id, 7);
    assert_true(h[1].has_row);
    assert_int_equal(h[1].row, 17);
    assert_int_equal(h[1].gen, 4);
    assert_int_equal(kvt_directory_locate(d, &k[1], 0, h, 4), 1);
    assert_false(h[0].has_row);
    assert_int_equal(kvt_directory_publish(d, 7, 1, k, 1, 0), 0); /* no place now */
    assert_int_equal(kvt_directory_locate(d, &k[0], 0, h, 4), 2);
    assert_int_equal(h[0].node_id, 7);
    assert_false(h[0].has_row);
    kvt_directory_destroy(d);
}

static void test_directory_incarnations(void **state)
{
    struct kvt_directory *d;
    struct kvt_key k = kt_key(1);
    struct kvt_dir_holder h[4];

    assert_int_equal(kvt_directory_create(1000 * MS, 4, &d), 0);
    assert_int_equal(kvt_directory_publish(d, 7, 2, &k, 1, 0), 0);
    /* A late publish of a previous life is ignored. */
    assert_int_equal(kvt_directory_publish(d, 7, 1, &k, 1, 0), 0);
    assert_int_equal(kvt_directory_locate(d, &k, 0, h, 4), 1);
    assert_int_equal(h[0].incarnation, 2);
    /* A new life replaces the old record. */
    assert_int_equal(kvt_directory_publish(d, 7, 3, &k, 1, 0), 0);
    assert_int_equal(kvt_directory_locate(d, &k, 0, h, 4), 1);
    assert_int_equal(h[0].incarnation, 3);
    assert_int_equal(kvt_directory_num_records(d), 1);
    /* Dropping lives below 3 keeps the record; dropping all removes it. */
    assert_int_equal(kvt_directory_drop_node(d, 7, 3), 0);
    assert_int_equal(kvt_directory_drop_node(d, 7, UINT64_MAX), 1);
    assert_int_equal(kvt_directory_num_keys(d), 0);
    kvt_directory_destroy(d);
}

static void test_directory_ttl_expiry_and_refresh(void **state)
{
    struct kvt_directory *d;
    struct kvt_key k[2];
    struct kvt_dir_holder h[2];

    kt_keys(k, 0, 2);
    assert_int_equal(kvt_directory_create(100 * MS, 2, &d), 0);
    assert_int_equal(kvt_directory_publish(d, 1, 1, k, 2, 0), 0);
    assert_int_equal(kvt_directory_publish(d, 1, 1, &k[1], 1, 80 * MS), 0); /* refresh */
    assert_int_equal(kvt_directory_locate(d, &k[0], 100 * MS, h, 2), 0);    /* expired */
    assert_int_equal(kvt_directory_locate(d, &k[1], 100 * MS, h, 2), 1);
    assert_int_equal(kvt_directory_num_keys(d), 1);
    assert_int_equal(kvt_directory_expire(d, 180 * MS), 1);
    assert_int_equal(kvt_directory_num_keys(d), 0);
    kvt_directory_destroy(d);
}

static void test_directory_max_holders_keeps_most_recent(void **state)
{
    struct kvt_directory *d;
    struct kvt_key k = kt_key(9);
    struct kvt_dir_holder h[3];

    assert_int_equal(kvt_directory_create(100 * MS, 2, &d), 0);
    for (uint64_t n = 1; n <= 5; n++)
        assert_int_equal(kvt_directory_publish(d, n, 1, &k, 1, 0), 0);
    assert_int_equal(kvt_directory_locate(d, &k, 0, h, 3), 2);
    assert_int_equal(h[0].node_id, 5);
    assert_int_equal(h[1].node_id, 4);
    assert_int_equal(kvt_directory_num_records(d), 2);
    /* Republishing an existing holder moves it to the front without growing. */
    assert_int_equal(kvt_directory_publish(d, 4, 1, &k, 1, 0), 0);
    assert_int_equal(kvt_directory_locate(d, &k, 0, h, 3), 2);
    assert_int_equal(h[0].node_id, 4);
    kvt_directory_destroy(d);
}

static bool keep_even(void *arg, const struct kvt_key *key)
{
    return key->bytes[key->len - 5] % 2 == 0; /* last digit of str(i) */
}

/* A node publishing without end (a hostile or broken peer) holds at most its limit
 * of records; the keys past it are refused (-ENOSPC), refreshes of its records and
 * other nodes' publications go through, and every way a record goes (unpublish,
 * expiry, a newer holder pushing it out, its node dropped, its key re-homed) gives
 * the node its room back. */
static void test_directory_node_limit(void **state)
{
    enum { LIMIT = 10, N = 1000 };
    static struct kvt_key k[N];
    struct kvt_directory *d;
    struct kvt_dir_holder h[2];

    kt_keys(k, 0, N);
    assert_int_equal(kvt_directory_create(100 * MS, 2, &d), 0);
    kvt_directory_set_node_limit(d, LIMIT, 7);
    assert_int_equal(kvt_directory_publish(d, 1, 1, k, N, 0), -ENOSPC);
    assert_int_equal(kvt_directory_num_records(d), LIMIT);
    assert_int_equal(kvt_directory_num_keys(d), LIMIT);
    assert_int_equal(kvt_directory_locate(d, &k[LIMIT], 0, h, 2), 0);
    /* Refreshes, and another node's keys. */
    assert_int_equal(kvt_directory_publish(d, 1, 1, k, LIMIT, 0), 0);
    assert_int_equal(kvt_directory_publish(d, 2, 1, &k[N - LIMIT], LIMIT, 0), 0);
    assert_int_equal(kvt_directory_num_records(d), 2 * LIMIT);
    /* Unpublished: room for one more. */
    kvt_directory_unpublish(d, 1, 1, &k[0], 1);
    assert_int_equal(kvt_directory_publish(d, 1, 1, &k[LIMIT], 2, 0), -ENOSPC);
    assert_int_equal(kvt_directory_locate(d, &k[LIMIT], 0, h, 2), 1);
    /* Pushed out of a full record (max_holders 2) by two newer holders. */
    assert_int_equal(kvt_directory_publish(d, 3, 1, &k[LIMIT], 1, 0), 0);
    assert_int_equal(kvt_directory_publish(d, 4, 1, &k[LIMIT], 1, 0), 0);
    assert_int_equal(kvt_directory_publish(d, 1, 1, &k[LIMIT + 1], 1, 0), 0);
    assert_int_equal(kvt_directory_publish(d, 1, 1, &k[LIMIT + 2], 1, 0), -ENOSPC);
    /* Dropped: node 2's room whole again. */
    assert_int_equal(kvt_directory_drop_node(d, 2, UINT64_MAX), LIMIT);
    assert_int_equal(kvt_directory_publish(d, 2, 1, k + 100, LIMIT, 0), 0);
    /* Re-homed keys (all of them), then expired ones. */
    assert_true(kvt_directory_retain(d, keep_even, NULL) > 0);
    assert_true(kvt_directory_expire(d, 200 * MS) > 0);
    assert_int_equal(kvt_directory_num_records(d), 0);
    assert_int_equal(kvt_directory_publish(d, 1, 1, k + 500, LIMIT, 300 * MS), 0);
    assert_int_equal(kvt_directory_publish(d, 2, 1, k + 600, LIMIT, 300 * MS), 0);
    assert_int_equal(kvt_directory_num_records(d), 2 * LIMIT);
    /* The home's own records (node 7 here) have no limit. */
    assert_int_equal(kvt_directory_publish(d, 7, 1, k, N, 300 * MS), 0);
    assert_int_equal(kvt_directory_num_records(d), 2 * LIMIT + N);
    kvt_directory_destroy(d);
}

static void test_directory_retain_drops_rehomed_keys(void **state)
{
    struct kvt_directory *d;
    struct kvt_key k[10];

    kt_keys(k, 0, 10);
    assert_int_equal(kvt_directory_create(100 * MS, 2, &d), 0);
    assert_int_equal(kvt_directory_publish(d, 1, 1, k, 10, 0), 0);
    assert_int_equal(kvt_directory_publish(d, 2, 1, k, 10, 0), 0);
    assert_int_equal(kvt_directory_retain(d, keep_even, NULL), 5);
    assert_int_equal(kvt_directory_num_keys(d), 5);
    assert_int_equal(kvt_directory_num_records(d), 10);
    kvt_directory_destroy(d);
}

static void test_directory_refuses_bad_config(void **state)
{
    struct kvt_directory *d = NULL;

    assert_int_equal(kvt_directory_create(0, 2, &d), -EINVAL);
    assert_int_equal(kvt_directory_create(1, 0, &d), -EINVAL);
    assert_null(d);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hrw_home_independent_of_member_order),
        cmocka_unit_test(test_hrw_minimal_movement_and_spread),
        cmocka_unit_test(test_directory_publish_locate_unpublish),
        cmocka_unit_test(test_directory_incarnations),
        cmocka_unit_test(test_directory_ttl_expiry_and_refresh),
        cmocka_unit_test(test_directory_max_holders_keeps_most_recent),
        cmocka_unit_test(test_directory_retain_drops_rehomed_keys),
        cmocka_unit_test(test_directory_refuses_bad_config),
        cmocka_unit_test(test_directory_rows),
        cmocka_unit_test(test_directory_node_limit),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

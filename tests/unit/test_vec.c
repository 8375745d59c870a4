/* SPDX-License-Identifier: Apache-2.0 */
/* kvt_vec_reserve (common/vec.c): first capacity, doubling, room for a large want
 * in one step, and nothing changed when memory runs out or the size overflows. */
#include <errno.h>
#include <stdint.h>
#include <string.h>

#include "test_util.h"
#include "kvt/alloc.h"
#include "kvt/alloc_test.h"
#include "kvt/vec.h"

struct pair {
    uint64_t a, b;
};

static void test_vec_growth(void **state)
{
    struct pair *v = NULL;
    size_t n = 0, cap = 0;

    assert_int_equal(kvt_vec_reserve(v, cap, 0, 4), 0); /* no room asked: nothing */
    assert_null(v);
    assert_int_equal(cap, 0);
    for (uint64_t i = 0; i < 100; i++) {
        assert_int_equal(kvt_vec_reserve(v, cap, n + 1, 4), 0);
        v[n++] = (struct pair){i, ~i};
        assert_true(cap >= n);
        if (n == 1)
            assert_int_equal(cap, 4); /* the first allocation holds `first` */
        if (n == 5)
            assert_int_equal(cap, 8); /* then it doubles */
    }
    assert_int_equal(cap, 128);
    for (uint64_t i = 0; i < 100; i++)
        assert_true(v[i].a == i && v[i].b == ~i);
    assert_int_equal(kvt_vec_reserve(v, cap, 1000, 4), 0); /* doubles until want fits */
    assert_int_equal(cap, 1024);
    assert_true(v[99].a == 99);
    kvt_free(v);
}

static void test_vec_failure_keeps_array(void **state)
{
    uint8_t *v = NULL;
    size_t cap = 0;

    assert_int_equal(kvt_vec_reserve(v, cap, 10, 16), 0);
    memset(v, 0xab, cap);
    uint8_t *before = v;

    kvt_alloc_fail_after(0);
    assert_int_equal(kvt_vec_reserve(v, cap, 17, 16), -ENOMEM);
    kvt_alloc_fail_after(-1);
    assert_ptr_equal(v, before);
    assert_int_equal(cap, 16);
    assert_int_equal(v[15], 0xab);
    assert_int_equal(kvt_vec_reserve(v, cap, SIZE_MAX, 16), -ENOMEM); /* overflow */
    assert_ptr_equal(v, before);
    assert_int_equal(cap, 16);

    struct pair *p = NULL;
    size_t pcap = 0;

    assert_int_equal(kvt_vec_reserve(p, pcap, SIZE_MAX / 8, 1), -ENOMEM); /* n * each */
    assert_null(p);
    assert_int_equal(pcap, 0);
    kvt_free(v);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_vec_growth),
        cmocka_unit_test(test_vec_failure_keeps_array),
    };

    return cmocka_run_group_tests_name("vec", tests, NULL, NULL);
}

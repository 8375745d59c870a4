/* SPDX-License-Identifier: Apache-2.0 */
/* The shared bounded msgpack reader (common/mpcheck.c): headers of every format,
 * the whole-body walk (one object, payloads present, counts within the bytes left,
 * depth and object limits) and skip. Bytes are written by hand, so that these tests
 * do not depend on the encoder they protect. */
#include <errno.h>
#include <stdint.h>
#include <string.h>

#include "test_util.h"
#include "kvt/mpcheck.h"

#define CHECK(buf, depth, objs) kvt_mp_check((buf), sizeof(buf), (depth), (objs))

static void test_head_formats(void **state)
{
    struct kvt_mp_obj o;
    static const uint8_t pfix[] = {0x7f}, nfix[] = {0xe0}, u16[] = {0xcd, 0x12, 0x34},
                         i8[] = {0xd0, 0x80}, i32[] = {0xd2, 0xff, 0xff, 0xff, 0xfe},
                         u64[] = {0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff},
                         f32[] = {0xca, 0x3f, 0xc0, 0x00, 0x00}, t[] = {0xc3},
                         str[] = {0xa3, 'a', 'b', 'c'}, bin8[] = {0xc4, 0x02, 1, 2},
                         fixext4[] = {0xd6, 0x01, 1, 2, 3, 4}, arr16[] = {0xdc, 0x00, 0x03},
                         map[] = {0x82};

    assert_int_equal(kvt_mp_head(pfix, pfix + 1, &o), 0);
    assert_int_equal(o.kind, KVT_MP_INT);
    assert_false(o.neg);
    assert_int_equal(o.u, 127);
    assert_int_equal(kvt_mp_head(nfix, nfix + 1, &o), 0);
    assert_true(o.neg);
    assert_int_equal(o.i, -32);
    assert_int_equal(kvt_mp_head(u16, u16 + 3, &o), 0);
    assert_int_equal(o.u, 0x1234);
    assert_int_equal(o.size, 3);
    assert_int_equal(kvt_mp_head(i8, i8 + 2, &o), 0);
    assert_true(o.neg);
    assert_int_equal(o.i, -128);
    assert_int_equal(kvt_mp_head(i32, i32 + 5, &o), 0);
    assert_int_equal(o.i, -2);
    assert_int_equal(kvt_mp_head(u64, u64 + 9, &o), 0);
    assert_false(o.neg);
    assert_true(o.u == UINT64_MAX);
    assert_int_equal(kvt_mp_head(f32, f32 + 5, &o), 0);
    assert_int_equal(o.kind, KVT_MP_FLOAT);
    assert_true(o.f == 1.5);
    assert_int_equal(kvt_mp_head(t, t + 1, &o), 0);
    assert_int_equal(o.kind, KVT_MP_BOOL);
    assert_int_equal(o.u, 1);
    assert_int_equal(kvt_mp_head(str, str + 4, &o), 0);
    assert_int_equal(o.kind, KVT_MP_STR);
    assert_int_equal(o.n, 3);
    assert_memory_equal(o.data, "abc", 3);
    assert_int_equal(o.size, 4);
    assert_int_equal(kvt_mp_head(bin8, bin8 + 4, &o), 0);
    assert_int_equal(o.kind, KVT_MP_BIN);
    assert_int_equal(o.n, 2);
    assert_int_equal(kvt_mp_head(fixext4, fixext4 + 6, &o), 0);
    assert_int_equal(o.kind, KVT_MP_EXT);
    assert_int_equal(o.size, 6);
    assert_int_equal(kvt_mp_head(arr16, arr16 + 3, &o), 0);
    assert_int_equal(o.kind, KVT_MP_ARRAY);
    assert_int_equal(o.n, 3);
    assert_int_equal(o.size, 3); /* elements not counted */
    assert_int_equal(kvt_mp_head(map, map + 1, &o), 0);
    assert_int_equal(o.kind, KVT_MP_MAP);
    assert_int_equal(o.n, 2);
}

static void test_head_truncated(void **state)
{
    struct kvt_mp_obj o;
    static const uint8_t c1[] = {0xc1}, u32[] = {0xce, 0, 0}, str8[] = {0xd9, 5, 'a', 'b'},
                         bin32[] = {0xc6, 0xff, 0xff, 0xff, 0xff, 0};

    assert_int_equal(kvt_mp_head(c1, c1, &o), -EBADMSG); /* nothing */
    assert_int_equal(kvt_mp_head(c1, c1 + 1, &o), -EBADMSG);
    assert_int_equal(kvt_mp_head(u32, u32 + 3, &o), -EBADMSG);
    assert_int_equal(kvt_mp_head(str8, str8 + 4, &o), -EBADMSG);
    /* a 6-byte input declaring 4 GiB of payload */
    assert_int_equal(kvt_mp_head(bin32, bin32 + 6, &o), -EBADMSG);
}

static void test_check_bodies(void **state)
{
    /* {1: [1, "x"], 2: {}} */
    static const uint8_t ok[] = {0x82, 0x01, 0x92, 0x01, 0xa1, 'x', 0x02, 0x80};
    static const uint8_t trailing[] = {0x01, 0x02};
    static const uint8_t short_arr[] = {0x93, 0x01, 0x02};
    /* 5 bytes declaring 2^32-1 elements: refused before anything is read past them */
    static const uint8_t huge_arr[] = {0xdd, 0xff, 0xff, 0xff, 0xff};
    static const uint8_t huge_map[] = {0xdf, 0x80, 0x00, 0x00, 0x00, 0x01, 0x02};
    static const uint8_t bad_inner[] = {0x92, 0x01, 0xc1};

    assert_int_equal(CHECK(ok, 8, 100), 0);
    assert_int_equal(kvt_mp_check(ok, 0, 8, 100), -EBADMSG);
    assert_int_equal(CHECK(trailing, 8, 100), -EBADMSG);
    assert_int_equal(CHECK(short_arr, 8, 100), -EBADMSG);
    assert_int_equal(CHECK(huge_arr, 8, 100), -EBADMSG);
    assert_int_equal(CHECK(huge_map, 8, 100), -EBADMSG);
    assert_int_equal(CHECK(bad_inner, 8, 100), -EBADMSG);
}

static void test_check_limits(void **state)
{
    uint8_t nest[80];
    static const uint8_t six[] = {0x95, 1, 2, 3, 4, 5}; /* 6 objects */

    /* [[[...[1]...]]] nested d deep: allowed at max_depth d, refused at d - 1 */
    for (int d = 1; d <= 70; d++) {
        memset(nest, 0x91, (size_t)d);
        nest[d] = 0x01;
        if (d <= KVT_MP_DEPTH_CAP)
            assert_int_equal(kvt_mp_check(nest, (size_t)d + 1, (unsigned)d, 1000), 0);
        assert_int_equal(kvt_mp_check(nest, (size_t)d + 1, (unsigned)d - 1, 1000), -EMSGSIZE);
    }
    /* the depth cap applies whatever is asked */
    memset(nest, 0x91, 70);
    nest[70] = 0x01;
    assert_int_equal(kvt_mp_check(nest, 71, 1000, 1000), -EMSGSIZE);
    assert_int_equal(CHECK(six, 8, 6), 0);
    assert_int_equal(CHECK(six, 8, 5), -EMSGSIZE);
}

static void test_skip(void **state)
{
    static const uint8_t two[] = {0x82, 0x01, 0x92, 0x01, 0xa1, 'x', 0x02, 0x80, 0x07};
    static const uint8_t cut[] = {0x92, 0x01};
    struct kvt_mp_cur c = {.p = two, .end = two + sizeof(two)};

    assert_int_equal(kvt_mp_skip(&c), 0);
    assert_ptr_equal(c.p, two + 8);
    assert_int_equal(kvt_mp_skip(&c), 0);
    assert_ptr_equal(c.p, two + 9);
    assert_int_equal(kvt_mp_skip(&c), -EBADMSG); /* nothing left */
    c = (struct kvt_mp_cur){.p = cut, .end = cut + sizeof(cut)};
    assert_int_equal(kvt_mp_skip(&c), -EBADMSG);
    assert_ptr_equal(c.p, cut); /* unmoved on failure */
}

/* The cursor: each read checks kind and bounds and moves only when it succeeds. */
static void test_cursor_reads(void **state)
{
    static const uint8_t ints[] = {0x05, 0xff, 0xcf, 0x80, 0, 0, 0, 0, 0, 0, 0, 0xd0, 0x80};
    struct kvt_mp_cur c = {.p = ints, .end = ints + sizeof(ints)};
    uint64_t u;
    int64_t i;

    assert_int_equal(kvt_mp_u64(&c, &u), 0);
    assert_int_equal(u, 5);
    assert_int_equal(kvt_mp_u64(&c, &u), -EBADMSG); /* -1 is not a u64 */
    assert_ptr_equal(c.p, ints + 1);
    assert_int_equal(kvt_mp_i64(&c, &i), 0);
    assert_int_equal(i, -1);
    assert_int_equal(kvt_mp_i64(&c, &i), -EBADMSG); /* 2^63 is past INT64_MAX */
    assert_int_equal(kvt_mp_u64(&c, &u), 0);
    assert_true(u == 1ull << 63);
    assert_int_equal(kvt_mp_i64(&c, &i), 0);
    assert_int_equal(i, -128);
    assert_int_equal(kvt_mp_i64(&c, &i), -EBADMSG); /* nothing left */

    static const uint8_t strs[] = {0xa2, 'h', 'i', 0xa2, 'a', 0, 0xa3, 'a', 'b', 'c', 0x01};
    char out[3];

    c = (struct kvt_mp_cur){.p = strs, .end = strs + sizeof(strs)};
    memset(out, 'x', sizeof(out));
    assert_int_equal(kvt_mp_str(&c, 1, 2, out), 0);
    assert_memory_equal(out, "hi\0", 3);
    assert_int_equal(kvt_mp_str(&c, 0, 2, out), -EBADMSG); /* a NUL inside */
    c.p += 3;
    assert_int_equal(kvt_mp_str(&c, 0, 2, out), -EBADMSG); /* longer than max */
    assert_int_equal(kvt_mp_str(&c, 4, 8, out), -EBADMSG); /* shorter than min */
    c.p += 4;
    assert_int_equal(kvt_mp_str(&c, 0, 2, out), -EBADMSG); /* not a str */
    assert_ptr_equal(c.p, strs + 10);

    static const uint8_t bins[] = {0xc4, 0x02, 7, 8, 0xc4, 0x05, 1, 2};
    uint8_t b[4];
    size_t len;

    c = (struct kvt_mp_cur){.p = bins, .end = bins + sizeof(bins)};
    memset(b, 0xee, sizeof(b));
    assert_int_equal(kvt_mp_bin(&c, 1, 4, b, &len), 0);
    assert_int_equal(len, 2);
    assert_memory_equal(b, ((uint8_t[]){7, 8, 0, 0}), 4);
    assert_int_equal(kvt_mp_bin(&c, 1, 4, b, &len), -EBADMSG); /* payload cut short */
    assert_ptr_equal(c.p, bins + 4);
    assert_int_equal(kvt_mp_bin(&c, 3, 4, b, NULL), -EBADMSG);
}

static void test_cursor_containers(void **state)
{
    static const uint8_t body[] = {0x82, 0x01, 0x93, 0x01, 0x02, 0x03, 0x02, 0xc0};
    struct kvt_mp_cur c = {.p = body, .end = body + sizeof(body)};
    struct kvt_mp_obj o;
    uint64_t pairs, key;
    uint32_t n;

    assert_int_equal(kvt_mp_array(&c, 8, &n), -EBADMSG); /* a map, not an array */
    assert_int_equal(kvt_mp_map(&c, &pairs), 0);
    assert_int_equal(pairs, 2);
    assert_int_equal(kvt_mp_u64(&c, &key), 0);
    assert_int_equal(kvt_mp_array(&c, 2, &n), -EMSGSIZE); /* past the caller's max */
    assert_ptr_equal(c.p, body + 2);
    assert_int_equal(kvt_mp_array(&c, 3, &n), 0);
    assert_int_equal(n, 3);
    for (uint32_t k = 0; k < n; k++)
        assert_int_equal(kvt_mp_skip(&c), 0);
    assert_int_equal(kvt_mp_u64(&c, &key), 0);
    assert_int_equal(kvt_mp_expect(&c, KVT_MP_BOOL, &o), -EBADMSG);
    assert_int_equal(kvt_mp_next(&c, &o), 0);
    assert_int_equal(o.kind, KVT_MP_NIL);
    assert_ptr_equal(c.p, c.end);
    assert_int_equal(kvt_mp_next(&c, &o), -EBADMSG);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_head_formats),
        cmocka_unit_test(test_head_truncated),
        cmocka_unit_test(test_check_bodies),
        cmocka_unit_test(test_check_limits),
        cmocka_unit_test(test_skip),
        cmocka_unit_test(test_cursor_reads),
        cmocka_unit_test(test_cursor_containers),
    };

    return cmocka_run_group_tests_name("mpcheck", tests, NULL, NULL);
}

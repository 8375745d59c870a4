/* SPDX-License-Identifier: Apache-2.0 */
/* kvt_hash64 is XXH3-64, whichever implementation common/hash.c calls (the
 * library's CPU-dispatched one on x86-64): checksums travel between nodes and live
 * in storage files, so every node must compute the same value. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <xxhash.h>

#include "kvt/hash.h"

static void test_known_value(void **state)
{
    (void)state;
    /* XXH3_64bits of the empty input, from the xxHash specification's test vectors */
    assert_true(kvt_hash64("", 0) == 0x2D06800538D394C2ull);
    assert_true(kvt_hash64_seed("", 0, 0) == 0x2D06800538D394C2ull);
}

/* Every length up to 2 KiB (each of XXH3's size classes), the sizes of chunks, and
 * unaligned starts, with and without seeds: equal to the library's portable entry
 * points. */
static void test_same_as_reference(void **state)
{
    static const size_t big[] = {4095, 4096, 65536, 262144, 262144 + 7, 1u << 20};
    const size_t cap = (1u << 20) + 64;
    uint8_t *buf = malloc(cap);
    uint64_t x = 0x9E3779B97F4A7C15ull;

    (void)state;
    assert_non_null(buf);
    for (size_t i = 0; i < cap; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        buf[i] = (uint8_t)x;
    }
    for (size_t len = 0; len <= 2048; len++) {
        const uint8_t *p = buf + (len % 13);

        assert_true(kvt_hash64(p, len) == XXH3_64bits(p, len));
        assert_true(kvt_hash64_seed(p, len, len * 77 + 1) ==
                    XXH3_64bits_withSeed(p, len, len * 77 + 1));
    }
    for (size_t i = 0; i < sizeof(big) / sizeof(big[0]); i++) {
        for (size_t off = 0; off < 3; off++) {
            assert_true(kvt_hash64(buf + off, big[i]) == XXH3_64bits(buf + off, big[i]));
            assert_true(kvt_hash64_seed(buf + off, big[i], 0xfeedull + off) ==
                        XXH3_64bits_withSeed(buf + off, big[i], 0xfeedull + off));
        }
    }
    free(buf);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_known_value),
        cmocka_unit_test(test_same_as_reference),
    };

    return cmocka_run_group_tests(tests, NULL, NULL);
}

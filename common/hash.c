/* SPDX-License-Identifier: Apache-2.0 */
/* XXH3-64 wrappers, so only this file includes <xxhash.h>. Where the library has
 * them (KVT_XXH3_DISPATCH, found by common/CMakeLists.txt), its runtime-dispatched
 * entry points pick AVX2/AVX-512 when the CPU has them (the plain ones are SSE2:
 * 16.7 against 26.9 GB/s on 256 KiB rows here); the values are the same
 * (tests/unit/test_hash.c). Short inputs (a key's hash, on every lookup) run the
 * header's own code inlined here: no call into the library, no dispatch. */
#define XXH_INLINE_ALL
#include <xxhash.h>
#ifdef KVT_XXH3_DISPATCH
/* The library's dispatched entry points (xxh_x86dispatch.h's), declared here: with
 * the header inlined, that file's declarations would be taken as static ones. */
XXH64_hash_t XXH3_64bits_dispatch(const void *input, size_t len);
XXH64_hash_t XXH3_64bits_withSeed_dispatch(const void *input, size_t len, XXH64_hash_t seed);
#endif

#include "kvt/hash.h"

uint64_t kvt_hash64(const void *data, size_t len)
{
#ifdef KVT_XXH3_DISPATCH
    /* Up to 240 bytes every variant runs the same scalar code. */
    if (len <= 240)
        return XXH3_64bits(data, len);
    return XXH3_64bits_dispatch(data, len);
#else
    return XXH3_64bits(data, len);
#endif
}

uint64_t kvt_hash64_seed(const void *data, size_t len, uint64_t seed)
{
#ifdef KVT_XXH3_DISPATCH
    return XXH3_64bits_withSeed_dispatch(data, len, seed);
#else
    return XXH3_64bits_withSeed(data, len, seed);
#endif
}

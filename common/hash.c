/* XXH3-64 wrappers, so only this file includes <xxhash.h>. */
#include <xxhash.h>

#include "kvt/hash.h"

uint64_t kvt_hash64(const void *data, size_t len)
{
    return XXH3_64bits(data, len);
}

uint64_t kvt_hash64_seed(const void *data, size_t len, uint64_t seed)
{
    return XXH3_64bits_withSeed(data, len, seed);
}

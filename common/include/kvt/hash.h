/* SPDX-License-Identifier: Apache-2.0 */
/* Hashing: XXH3-64 for keys and chunk checksums (libxxhash). */
#ifndef KVT_HASH_H
#define KVT_HASH_H

#include <stddef.h>
#include <stdint.h>

uint64_t kvt_hash64(const void *data, size_t len);
uint64_t kvt_hash64_seed(const void *data, size_t len, uint64_t seed);

#endif

/* SPDX-License-Identifier: Apache-2.0 */
/* Small helpers every module uses: container_of, array sizes, likely/unlikely. */
#ifndef KVT_COMMON_H
#define KVT_COMMON_H

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>

#define KVT_ARRAY_SIZE(a)                   (sizeof(a) / sizeof((a)[0]))
#define KVT_CONTAINER_OF(ptr, type, member) ((type *)((char *)(ptr)-offsetof(type, member)))
#define KVT_LIKELY(x)                       __builtin_expect(!!(x), 1)
#define KVT_UNLIKELY(x)                     __builtin_expect(!!(x), 0)
#define KVT_MIN(a, b)                       ((a) < (b) ? (a) : (b))
#define KVT_MAX(a, b)                       ((a) > (b) ? (a) : (b))

#endif

/* SPDX-License-Identifier: Apache-2.0 */
/* Small helpers every module uses: container_of, array sizes, likely/unlikely, a full
 * memory barrier. */
#ifndef KVT_COMMON_H
#define KVT_COMMON_H

#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>

#define KVT_ARRAY_SIZE(a)                   (sizeof(a) / sizeof((a)[0]))
#define KVT_CONTAINER_OF(ptr, type, member) ((type *)((char *)(ptr)-offsetof(type, member)))
#define KVT_LIKELY(x)                       __builtin_expect(!!(x), 1)
#define KVT_UNLIKELY(x)                     __builtin_expect(!!(x), 0)
#define KVT_MIN(a, b)                       ((a) < (b) ? (a) : (b))
#define KVT_MAX(a, b)                       ((a) > (b) ? (a) : (b))

/* Whether a call's errno says the process or system ran out of descriptors or memory:
 * nothing about the file or peer it was about (a later try may work). */
static inline bool kvt_err_no_resources(int err)
{
    return err == EMFILE || err == ENFILE || err == ENOMEM || err == ENOBUFS;
}

/* A full memory barrier (store-load included: Dekker handshakes, seqlock writers).
 * ThreadSanitizer does not model fences and GCC refuses them under -fsanitize=thread:
 * there it is a sequentially consistent read-modify-write of a word of its own, a
 * full barrier on x86 (a locked instruction) and an atomic TSan understands. */
static inline void kvt_full_fence(void)
{
#if defined(__SANITIZE_THREAD__)
    static unsigned kvt__fence_word;

    (void)__atomic_fetch_add(&kvt__fence_word, 0, __ATOMIC_SEQ_CST);
#else
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
}

#endif

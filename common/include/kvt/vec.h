/* SPDX-License-Identifier: Apache-2.0 */
/* kvt_vec: the one way the project grows an array. The owner keeps its typed
 * pointer and its size_t capacity wherever they belong (a struct's `v`/`cap`, a
 * buffer's `data`/`cap`), with the count next to them; kvt_vec_reserve only makes
 * room, so no struct has to change shape to use it and no element is ever moved
 * but by realloc.
 *
 * Growth: the first allocation holds `first` elements, each later one doubles
 * (then doubles again until `want` fit), so n pushes cost O(log n) reallocations.
 * On failure nothing changes: the old array and capacity stay valid. */
#ifndef KVT_VEC_H
#define KVT_VEC_H

#include <stddef.h>

/* Room for at least want elements in the array *vp points to (a pointer to any
 * object type, passed as its address) of *cap_p elements of each bytes. 0, or
 * -ENOMEM (also when the size would overflow) with *vp and *cap_p unchanged. */
int kvt__vec_reserve(void *vp, size_t *cap_p, size_t want, size_t each, size_t first);

/* v: an lvalue pointer to the elements; cap: its size_t capacity (an lvalue). */
#define kvt_vec_reserve(v, cap, want, first)                                                       \
    kvt__vec_reserve(&(v), &(cap), (want), sizeof(*(v)), (first))

#endif

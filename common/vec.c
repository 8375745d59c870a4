/* SPDX-License-Identifier: Apache-2.0 */
/* Growing an array (kvt/vec.h). The array pointer is passed by address as void *
 * and moved in and out with memcpy, so one function serves every element type
 * without reading a struct foo * through a void ** (which the aliasing rules
 * forbid). All memory comes from kvt_reallocarray, so out-of-memory tests reach
 * every array that grows through here. */
#include <errno.h>
#include <stdint.h>
#include <string.h>

#include "kvt/alloc.h"
#include "kvt/vec.h"

int kvt__vec_reserve(void *vp, size_t *cap_p, size_t want, size_t each, size_t first)
{
    size_t cap = *cap_p;
    void *v;

    if (want <= cap)
        return 0;
    cap = cap != 0 ? cap : (first != 0 ? first : 1);
    if (cap == *cap_p) {
        if (cap > SIZE_MAX / 2)
            return -ENOMEM;
        cap *= 2;
    }
    while (cap < want) {
        if (cap > SIZE_MAX / 2)
            return -ENOMEM;
        cap *= 2;
    }
    memcpy(&v, vp, sizeof(v));
    v = kvt_reallocarray(v, cap, each);
    if (v == NULL)
        return -ENOMEM;
    memcpy(vp, &v, sizeof(v));
    *cap_p = cap;
    return 0;
}

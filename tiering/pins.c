/* SPDX-License-Identifier: Apache-2.0 */
/* A holder's count of its load pins (kvt/pins.h). */
#include <errno.h>

#include "kvt/pins.h"

uintptr_t kvt_pins_of(const struct kvt_map *pins, const struct kvt_key *k)
{
    return (uintptr_t)kvt_map_get(pins, k->bytes, k->len);
}

/* Sets key k's count to c (0: the key leaves; a removal never allocates). */
static int pins_set(struct kvt_map *pins, const struct kvt_key *k, uintptr_t c)
{
    if (c == 0) {
        kvt_map_remove(pins, k->bytes, k->len);
        return 0;
    }
    return kvt_map_put(pins, k->bytes, k->len, (void *)c);
}

int kvt_pins_add(struct kvt_map *pins, const struct kvt_key *keys, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (pins_set(pins, &keys[i], kvt_pins_of(pins, &keys[i]) + 1) != 0) {
            kvt_pins_drop(pins, keys, i); /* out of memory: what was added goes */
            return -ENOMEM;
        }
    }
    return 0;
}

void kvt_pins_drop(struct kvt_map *pins, const struct kvt_key *keys, size_t n)
{
    for (size_t i = 0; i < n; i++)
        (void)pins_set(pins, &keys[i], kvt_pins_of(pins, &keys[i]) - 1); /* never allocates */
}

int kvt_pins_cover(const struct kvt_map *pins, const struct kvt_key *keys, size_t n,
                   struct kvt_map *scratch)
{
    int rc = 1;
    size_t i;

    for (i = 0; i < n && rc == 1; i++) {
        const struct kvt_key *k = &keys[i];
        uintptr_t named = (uintptr_t)kvt_map_get(scratch, k->bytes, k->len) + 1;

        if (named > kvt_pins_of(pins, k))
            rc = 0;
        else if (kvt_map_put(scratch, k->bytes, k->len, (void *)named) != 0)
            rc = -ENOMEM;
    }
    while (i-- > 0) /* emptied key by key: clearing would cost the table's size */
        kvt_map_remove(scratch, keys[i].bytes, keys[i].len);
    return rc;
}

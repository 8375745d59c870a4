/* SPDX-License-Identifier: Apache-2.0 */
/* The load pins one holder took through the manager, counted by key in a kvt_map (key
 * bytes -> count as uintptr_t). The manager's pins are shared by every holder (vLLM's
 * reference counts): a holder that completed a load it did not prepare would release
 * another holder's pin (a cascade job's, whose chunk could then be evicted under its
 * copy). So a holder keeps its own count and completes only loads its count covers:
 * the engine API per engine, kvtier-replay per trace. */
#ifndef KVT_PINS_H
#define KVT_PINS_H

#include <stddef.h>
#include <stdint.h>

#include "kvt/map.h"
#include "kvt/types.h"

/* The pins held of key k. */
uintptr_t kvt_pins_of(const struct kvt_map *pins, const struct kvt_key *k);
/* One pin more of each key named (a key named twice, two); -ENOMEM with none added. */
int kvt_pins_add(struct kvt_map *pins, const struct kvt_key *keys, size_t n);
/* One pin less of each key named; the pins must cover them (kvt_pins_cover). Never
 * allocates. */
void kvt_pins_drop(struct kvt_map *pins, const struct kvt_key *keys, size_t n);
/* 1 when pins holds each key at least as often as keys names it, 0 when not, -ENOMEM.
 * O(n): the names are counted in scratch, an empty map left empty. */
int kvt_pins_cover(const struct kvt_map *pins, const struct kvt_key *keys, size_t n,
                   struct kvt_map *scratch);

#endif

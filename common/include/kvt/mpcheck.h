/* SPDX-License-Identifier: Apache-2.0 */
/* The one bounded msgpack reader: peer bytes are read here, before anything
 * allocates (msgpack-c's unpacker allocates what a header declares before it has
 * seen the bytes: msgpack-c issue #1013). Both decoders use it, the wire codec
 * (cluster/wire.c) and the engine API codec (node/client/engine_proto.c); no
 * msgpack-c here.
 *
 * kvt_mp_head() parses one object's header; kvt_mp_check() walks a whole body:
 * every str/bin/ext payload present, every array/map declaring no more elements than
 * bytes remain (each element takes at least one), a depth and an object-count limit,
 * exactly one object with nothing after it. After kvt_mp_check() a count read from
 * the body is at most the body's length. A decoder then reads the body's fields
 * with a struct kvt_mp_cur: every read checks the type and that the header and
 * payload lie before end, and leaves the cursor unmoved when it fails. */
#ifndef KVT_MPCHECK_H
#define KVT_MPCHECK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define KVT_MP_DEPTH_CAP 64 /* the largest max_depth kvt_mp_check accepts */

enum kvt_mp_kind {
    KVT_MP_NIL,
    KVT_MP_BOOL,
    KVT_MP_INT, /* neg says whether it is below zero */
    KVT_MP_FLOAT,
    KVT_MP_STR,
    KVT_MP_BIN,
    KVT_MP_EXT,
    KVT_MP_ARRAY,
    KVT_MP_MAP
};

/* One object's header. n: the payload length (str, bin, ext), the element count
 * (array) or the pair count (map). u: an integer's unsigned value (a negative one's
 * two's complement), i: the same as int64 (callers check the range they need),
 * u = 0/1 for a bool; f: a float (float32 widened). data: the payload (str, bin,
 * ext). size: bytes of header and payload, not counting an array's elements. */
struct kvt_mp_obj {
    enum kvt_mp_kind kind;
    bool neg;
    uint64_t n;
    uint64_t u;
    int64_t i;
    double f;
    const uint8_t *data;
    size_t size;
};

/* 0, or -EBADMSG when the header or payload runs past end or for the never-used
 * byte 0xc1. Element counts are not checked here (kvt_mp_check does). */
int kvt_mp_head(const uint8_t *p, const uint8_t *end, struct kvt_mp_obj *o);

/* 0 when [p, p + len) is exactly one well-formed object; -EBADMSG when malformed
 * or truncated, -EMSGSIZE past max_depth (clamped to KVT_MP_DEPTH_CAP) or
 * max_objects. */
int kvt_mp_check(const uint8_t *p, size_t len, unsigned max_depth, uint64_t max_objects);

/* ---- the cursor ----------------------------------------------------------------
 * Reads move p past what they read; every one returns 0, -EBADMSG (truncated, or
 * not the kind or range asked for) or -EMSGSIZE (a count past the caller's limit),
 * and moves nothing when it fails. */
struct kvt_mp_cur {
    const uint8_t *p;
    const uint8_t *end;
};

/* Any one header (an array's or map's elements follow it). */
int kvt_mp_next(struct kvt_mp_cur *c, struct kvt_mp_obj *o);
/* One header of the given kind. */
int kvt_mp_expect(struct kvt_mp_cur *c, enum kvt_mp_kind kind, struct kvt_mp_obj *o);
/* An integer of 0..UINT64_MAX. */
int kvt_mp_u64(struct kvt_mp_cur *c, uint64_t *v_p);
/* An integer of INT64_MIN..INT64_MAX. */
int kvt_mp_i64(struct kvt_mp_cur *c, int64_t *v_p);
/* A str of min..max bytes with no NUL inside, copied into out[max + 1], the rest
 * of which is zeroed (so out is always terminated). */
int kvt_mp_str(struct kvt_mp_cur *c, size_t min, size_t max, char *out);
/* A bin of min..max bytes copied into out[max], the rest zeroed; its length in
 * *len_p (may be NULL). */
int kvt_mp_bin(struct kvt_mp_cur *c, size_t min, size_t max, uint8_t *out, size_t *len_p);
/* An array header of at most max (and at most UINT32_MAX) elements. */
int kvt_mp_array(struct kvt_mp_cur *c, uint64_t max, uint32_t *n_p);
/* A map header; its pair count. */
int kvt_mp_map(struct kvt_mp_cur *c, uint64_t *pairs_p);
/* Moves past one object and everything inside it. */
int kvt_mp_skip(struct kvt_mp_cur *c);

#endif

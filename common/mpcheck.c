/* SPDX-License-Identifier: Apache-2.0 */
/* Bounded msgpack reading (kvt/mpcheck.h): a header parser, an iterative walker
 * over a whole body, so that a peer's declared lengths are checked against the bytes
 * present before any decoder allocates, and the cursor both decoders read fields
 * with (so a type or bound check is written once, here).
 *
 * The walker keeps, per depth, how many objects are still expected there; an array
 * or map pushes its element count (a map two per pair) after checking that count
 * against the bytes left, since every element takes at least one byte. No recursion:
 * the depth is bounded by max_depth and the stack is an array on ours. */
#include <errno.h>
#include <string.h>

#include "kvt/mpcheck.h"

static uint64_t mp_be(const uint8_t *p, unsigned n)
{
    uint64_t v = 0;

    for (unsigned k = 0; k < n; k++)
        v = v << 8 | p[k];
    return v;
}

/* The fixed-size value of an int or float header (body bytes after the type byte). */
static void mp_value(uint8_t b, const uint8_t *p, unsigned body, struct kvt_mp_obj *o)
{
    uint64_t raw = mp_be(p + 1, body);

    if (o->kind == KVT_MP_FLOAT) {
        if (body == 4) {
            uint32_t r32 = (uint32_t)raw;
            float f;

            memcpy(&f, &r32, sizeof(f));
            o->f = f;
        } else {
            memcpy(&o->f, &raw, sizeof(o->f));
        }
        return;
    }
    if (b >= 0xd0) { /* int8..int64: sign-extend from body * 8 bits */
        unsigned bits = body * 8;
        int64_t v = (int64_t)raw;

        if (bits < 64 && (raw >> (bits - 1)) & 1u)
            v = (int64_t)(raw | ~((1ull << bits) - 1));
        o->neg = v < 0;
        o->i = v;
        o->u = (uint64_t)v;
    } else {
        o->u = raw;
    }
}

int kvt_mp_head(const uint8_t *p, const uint8_t *end, struct kvt_mp_obj *o)
{
    size_t avail = (size_t)(end - p);
    unsigned body = 0; /* fixed-size value bytes */
    unsigned lenb = 0; /* length/count bytes */
    unsigned ext = 0;  /* the ext type byte */
    uint8_t b;

    if (p >= end)
        return -EBADMSG;
    b = p[0];
    memset(o, 0, sizeof(*o));
    if (b <= 0x7f) {
        o->kind = KVT_MP_INT;
        o->u = b;
    } else if (b <= 0x8f) {
        o->kind = KVT_MP_MAP;
        o->n = b & 0x0f;
    } else if (b <= 0x9f) {
        o->kind = KVT_MP_ARRAY;
        o->n = b & 0x0f;
    } else if (b <= 0xbf) {
        o->kind = KVT_MP_STR;
        o->n = b & 0x1f;
    } else if (b >= 0xe0) {
        o->kind = KVT_MP_INT;
        o->neg = true;
        o->i = (int8_t)b;
        o->u = (uint64_t)o->i;
    } else if (b == 0xc0) {
        o->kind = KVT_MP_NIL;
    } else if (b == 0xc2 || b == 0xc3) {
        o->kind = KVT_MP_BOOL;
        o->u = b & 1;
    } else if (b >= 0xc4 && b <= 0xc6) {
        o->kind = KVT_MP_BIN;
        lenb = 1u << (b - 0xc4);
    } else if (b >= 0xc7 && b <= 0xc9) {
        o->kind = KVT_MP_EXT;
        lenb = 1u << (b - 0xc7);
        ext = 1;
    } else if (b == 0xca || b == 0xcb) {
        o->kind = KVT_MP_FLOAT;
        body = b == 0xca ? 4 : 8;
    } else if (b >= 0xcc && b <= 0xd3) {
        o->kind = KVT_MP_INT;
        body = 1u << ((b - 0xcc) & 3);
    } else if (b >= 0xd4 && b <= 0xd8) {
        o->kind = KVT_MP_EXT;
        ext = 1;
        o->n = 1u << (b - 0xd4);
    } else if (b >= 0xd9 && b <= 0xdb) {
        o->kind = KVT_MP_STR;
        lenb = 1u << (b - 0xd9);
    } else if (b == 0xdc || b == 0xdd) {
        o->kind = KVT_MP_ARRAY;
        lenb = b == 0xdc ? 2 : 4;
    } else if (b == 0xde || b == 0xdf) {
        o->kind = KVT_MP_MAP;
        lenb = b == 0xde ? 2 : 4;
    } else {
        return -EBADMSG; /* 0xc1 */
    }

    size_t hdr = 1 + body + lenb + ext;

    if (avail < hdr)
        return -EBADMSG;
    if (lenb != 0)
        o->n = mp_be(p + 1, lenb);
    if (body != 0)
        mp_value(b, p, body, o);
    if (o->kind == KVT_MP_INT && !o->neg)
        o->i = (int64_t)o->u;

    size_t payload = 0;

    if (o->kind == KVT_MP_STR || o->kind == KVT_MP_BIN || o->kind == KVT_MP_EXT) {
        if (o->n > avail - hdr)
            return -EBADMSG;
        payload = (size_t)o->n;
        o->data = p + hdr;
    }
    o->size = hdr + payload;
    return 0;
}

/* Elements an array or map header announces (0 for anything else). */
static uint64_t mp_children(const struct kvt_mp_obj *o)
{
    if (o->kind == KVT_MP_MAP)
        return 2 * o->n;
    return o->kind == KVT_MP_ARRAY ? o->n : 0;
}

int kvt_mp_check(const uint8_t *p, size_t len, unsigned max_depth, uint64_t max_objects)
{
    const uint8_t *end = p + len;
    uint64_t left[KVT_MP_DEPTH_CAP + 1]; /* objects still expected at each depth */
    size_t depth = 0;
    uint64_t objects = 0;

    if (max_depth > KVT_MP_DEPTH_CAP)
        max_depth = KVT_MP_DEPTH_CAP;
    left[0] = 1;
    for (;;) {
        struct kvt_mp_obj o;
        int rc;

        while (left[depth] == 0) {
            if (depth == 0)
                return p == end ? 0 : -EBADMSG;
            depth--;
        }
        left[depth]--;
        if (++objects > max_objects)
            return -EMSGSIZE;
        rc = kvt_mp_head(p, end, &o);
        if (rc < 0)
            return rc;
        p += o.size;

        uint64_t children = mp_children(&o);

        if (children > (uint64_t)(end - p))
            return -EBADMSG; /* declares more elements than there are bytes */
        if (children == 0)
            continue;
        if (depth + 1 > max_depth)
            return -EMSGSIZE;
        left[++depth] = children;
    }
}

int kvt_mp_skip(struct kvt_mp_cur *c)
{
    const uint8_t *p = c->p;
    uint64_t left = 1;

    while (left > 0) {
        struct kvt_mp_obj o;
        int rc = kvt_mp_head(p, c->end, &o);

        if (rc < 0)
            return rc;
        p += o.size;
        left += mp_children(&o) - 1;
        if (left > (uint64_t)(c->end - p))
            return -EBADMSG;
    }
    c->p = p;
    return 0;
}

/* ---- the cursor ---------------------------------------------------------------- */

int kvt_mp_next(struct kvt_mp_cur *c, struct kvt_mp_obj *o)
{
    int rc = kvt_mp_head(c->p, c->end, o);

    if (rc == 0)
        c->p += o->size;
    return rc;
}

int kvt_mp_expect(struct kvt_mp_cur *c, enum kvt_mp_kind kind, struct kvt_mp_obj *o)
{
    int rc = kvt_mp_head(c->p, c->end, o);

    if (rc < 0)
        return rc;
    if (o->kind != kind)
        return -EBADMSG;
    c->p += o->size;
    return 0;
}

int kvt_mp_u64(struct kvt_mp_cur *c, uint64_t *v_p)
{
    struct kvt_mp_obj o;
    int rc = kvt_mp_head(c->p, c->end, &o);

    if (rc < 0)
        return rc;
    if (o.kind != KVT_MP_INT || o.neg)
        return -EBADMSG;
    c->p += o.size;
    *v_p = o.u;
    return 0;
}

int kvt_mp_i64(struct kvt_mp_cur *c, int64_t *v_p)
{
    struct kvt_mp_obj o;
    int rc = kvt_mp_head(c->p, c->end, &o);

    if (rc < 0)
        return rc;
    if (o.kind != KVT_MP_INT || (!o.neg && o.u > INT64_MAX))
        return -EBADMSG;
    c->p += o.size;
    *v_p = o.i;
    return 0;
}

int kvt_mp_str(struct kvt_mp_cur *c, size_t min, size_t max, char *out)
{
    struct kvt_mp_obj o;
    int rc = kvt_mp_head(c->p, c->end, &o);

    if (rc < 0)
        return rc;
    if (o.kind != KVT_MP_STR || o.n < min || o.n > max || memchr(o.data, 0, o.n) != NULL)
        return -EBADMSG;
    c->p += o.size;
    memcpy(out, o.data, o.n);
    memset(out + o.n, 0, max + 1 - o.n);
    return 0;
}

int kvt_mp_bin(struct kvt_mp_cur *c, size_t min, size_t max, uint8_t *out, size_t *len_p)
{
    struct kvt_mp_obj o;
    int rc = kvt_mp_head(c->p, c->end, &o);

    if (rc < 0)
        return rc;
    if (o.kind != KVT_MP_BIN || o.n < min || o.n > max)
        return -EBADMSG;
    c->p += o.size;
    memcpy(out, o.data, o.n);
    memset(out + o.n, 0, max - o.n);
    if (len_p != NULL)
        *len_p = (size_t)o.n;
    return 0;
}

int kvt_mp_array(struct kvt_mp_cur *c, uint64_t max, uint32_t *n_p)
{
    struct kvt_mp_obj o;
    int rc = kvt_mp_head(c->p, c->end, &o);

    if (rc < 0)
        return rc;
    if (o.kind != KVT_MP_ARRAY)
        return -EBADMSG;
    if (o.n > max || o.n > UINT32_MAX)
        return -EMSGSIZE;
    c->p += o.size;
    *n_p = (uint32_t)o.n;
    return 0;
}

int kvt_mp_map(struct kvt_mp_cur *c, uint64_t *pairs_p)
{
    struct kvt_mp_obj o;
    int rc = kvt_mp_expect(c, KVT_MP_MAP, &o);

    if (rc == 0)
        *pairs_p = o.n;
    return rc;
}

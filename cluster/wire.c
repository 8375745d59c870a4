/* SPDX-License-Identifier: Apache-2.0 */
/* The wire codec: message bodies to and from msgpack (layout and error codes in
 * kvt/wire.h; framing in wire_frame.c).
 *
 * Every message type is described by one table of fields {key, kind, required,
 * where in struct kvt_wire_msg}; the encoder and the decoder both walk that table,
 * so the two cannot disagree about a field.
 *
 * Encoding uses msgpack-c's packer, writing through a callback into a
 * struct kvt_wire_buf (so allocations go through kvt_alloc and can be failed).
 *
 * Decoding never hands peer bytes to msgpack-c (whose unpacker allocates what a
 * header declares before it has seen the bytes: msgpack-c issue #1013). It runs in
 * three steps over the body, all on the one bounded msgpack reader (kvt/mpcheck.h,
 * shared with the engine API codec):
 *   1. validate: kvt_mp_check, one iterative walk over the whole body checking that
 *      every str/bin/ext payload is present, that every array/map count is at most
 *      the bytes left (each element takes at least one byte), the depth and the
 *      total object count, and that the body is exactly one object with nothing
 *      after it;
 *   2. header: the map's keys 0, 1, 2 (version major, minor, type), wherever they
 *      are in the map, so that an incompatible peer gets -EPROTO whatever the rest;
 *   3. fields: each key of the type's table is decoded with the reader's cursor
 *      (kind and bounds checked on every read); lists are checked against the
 *      limits before their one allocation; other keys are skipped.
 * After step 1 a declared count can only be as large as the body, so no allocation
 * is larger than a small multiple of the body (at most 24 bytes per body byte). */
#include <assert.h>
#include <errno.h>
#include <stddef.h>
#include <string.h>

#include <msgpack.h>

#include "kvt/alloc.h"
#include "kvt/common.h"
#include "kvt/mpcheck.h"
#include "kvt/wire.h"
#include "kvt/vec.h"

/* ---- the message tables ----------------------------------------------------- */

#define K_VMAJOR 0
#define K_VMINOR 1
#define K_TYPE   2

enum kind {
    K_U64,
    K_U32,
    K_U16,
    K_BIN32,   /* uint8_t[32] */
    K_ADDR,    /* char[KVT_WIRE_ADDR_MAX] */
    K_HANDLE,  /* uint8_t *, uint32_t len at n_off */
    K_KEYS,    /* struct kvt_key *, n at n_off */
    K_INDEXES, /* uint32_t *, n at n_off */
    K_CHUNKS,  /* struct kvt_wire_chunk *, n at n_off */
    K_MEMBERS, /* struct kvt_wire_member *, n at n_off */
    K_HOLDERS, /* struct kvt_wire_holder_list *, n at n_off */
    K_ROWS,    /* struct kvt_wire_row *, n at n_off */
};

struct field {
    uint8_t id;
    uint8_t kind;
    bool required;
    uint16_t off;   /* offsetof(struct kvt_wire_msg, ...) of the value or pointer */
    uint16_t n_off; /* of the uint32_t count (lists, handle) */
};

#define OFF(m) offsetof(struct kvt_wire_msg, u.m)
#define REQ(id_, kind_, m)                                                                         \
    {                                                                                              \
        .id = KVT_WIRE_F_##id_, .kind = kind_, .required = true, .off = OFF(m)                     \
    }
#define OPT(id_, kind_, m)                                                                         \
    {                                                                                              \
        .id = KVT_WIRE_F_##id_, .kind = kind_, .required = false, .off = OFF(m)                    \
    }
#define OPTLIST(id_, kind_, m, n)                                                                  \
    {                                                                                              \
        .id = KVT_WIRE_F_##id_, .kind = kind_, .required = false, .off = OFF(m), .n_off = OFF(n)   \
    }
#define LIST(id_, kind_, m, n)                                                                     \
    {                                                                                              \
        .id = KVT_WIRE_F_##id_, .kind = kind_, .required = true, .off = OFF(m), .n_off = OFF(n)    \
    }

static const struct field hello_fields[] = {
    REQ(NODE_ID, K_U64, hello.node_id), REQ(INCARNATION, K_U64, hello.incarnation),
    REQ(NS, K_BIN32, hello.ns),         REQ(NONCE, K_BIN32, hello.nonce),
    OPT(PROOF, K_BIN32, hello.proof),   OPT(ADDR, K_ADDR, hello.addr),
    OPT(PORT, K_U16, hello.port),       OPT(DOWN_AFTER, K_U32, hello.down_after_ms),
};
static const struct field hello_ack_fields[] = {
    REQ(NODE_ID, K_U64, hello.node_id),
    REQ(INCARNATION, K_U64, hello.incarnation),
    REQ(NS, K_BIN32, hello.ns),
    REQ(NONCE, K_BIN32, hello.nonce),
    REQ(PROOF, K_BIN32, hello.proof),
    OPT(ADDR, K_ADDR, hello.addr),
    OPT(PORT, K_U16, hello.port),
    OPT(DOWN_AFTER, K_U32, hello.down_after_ms),
    OPT(DROPPED, K_U64, hello.dropped_inc),
    OPT(DROP_SEQ, K_U64, hello.drop_seq),
};
static const struct field auth_fields[] = {
    REQ(NODE_ID, K_U64, hello.node_id),   REQ(INCARNATION, K_U64, hello.incarnation),
    REQ(PROOF, K_BIN32, hello.proof),     OPT(DROPPED, K_U64, hello.dropped_inc),
    OPT(DROP_SEQ, K_U64, hello.drop_seq),
};
static const struct field refuse_fields[] = {
    REQ(REASON, K_U32, refuse.reason),
};
static const struct field heartbeat_fields[] = {
    REQ(NODE_ID, K_U64, heartbeat.node_id),
    REQ(INCARNATION, K_U64, heartbeat.incarnation),
    REQ(SEQ, K_U64, heartbeat.seq),
    OPT(DIGEST, K_U64, heartbeat.digest),
};
static const struct field members_fields[] = {
    LIST(MEMBERS, K_MEMBERS, members.v, members.n),
};
static const struct field publish_fields[] = {
    REQ(NODE_ID, K_U64, publish.node_id),
    REQ(INCARNATION, K_U64, publish.incarnation),
    LIST(KEYS, K_KEYS, publish.keys, publish.n_keys),
    OPTLIST(ROWS, K_ROWS, publish.rows, publish.n_rows),
};
static const struct field locate_fields[] = {
    REQ(REQ_ID, K_U64, locate.req_id),
    LIST(KEYS, K_KEYS, locate.keys, locate.n_keys),
};
static const struct field locate_reply_fields[] = {
    REQ(REQ_ID, K_U64, locate_reply.req_id),
    LIST(HOLDERS, K_HOLDERS, locate_reply.holders, locate_reply.n_keys),
};
static const struct field fetch_fields[] = {
    REQ(JOB_ID, K_U64, fetch.job_id),
    LIST(KEYS, K_KEYS, fetch.keys, fetch.n_keys),
    OPT(DIRECT, K_U32, fetch.direct),
};
static const struct field grant_fields[] = {
    REQ(JOB_ID, K_U64, grant.job_id),
    REQ(LEASE_ID, K_U64, grant.lease_id),
    REQ(LEASE_TTL, K_U32, grant.lease_ttl_ms),
    LIST(HANDLE, K_HANDLE, grant.handle, grant.handle_len),
    LIST(CHUNKS, K_CHUNKS, grant.chunks, grant.n_chunks),
    LIST(DENIED, K_INDEXES, grant.denied, grant.n_denied),
    OPTLIST(FENCE_HANDLE, K_HANDLE, grant.fence_handle, grant.fence_handle_len),
    OPTLIST(DIRECT_HANDLE, K_HANDLE, grant.direct_handle, grant.direct_handle_len),
    OPTLIST(DIRECT_FENCE_HANDLE, K_HANDLE, grant.direct_fence_handle,
            grant.direct_fence_handle_len),
};
static const struct field deny_fields[] = {
    REQ(JOB_ID, K_U64, deny.job_id),
    REQ(REASON, K_U32, deny.reason),
};
static const struct field release_fields[] = {
    REQ(JOB_ID, K_U64, release.job_id),
    REQ(LEASE_ID, K_U64, release.lease_id),
};

struct type_desc {
    const char *name;
    const struct field *f;
    size_t n;
};

#define TYPE(t, name_, fields)                                                                     \
    [KVT_WIRE_##t] = {.name = name_, .f = fields, .n = KVT_ARRAY_SIZE(fields)}

static const struct type_desc types[KVT_WIRE_TYPE_END] = {
    TYPE(HELLO, "HELLO", hello_fields),
    TYPE(HELLO_ACK, "HELLO_ACK", hello_ack_fields),
    TYPE(AUTH, "AUTH", auth_fields),
    [KVT_WIRE_AUTH_OK] = {.name = "AUTH_OK", .f = NULL, .n = 0},
    TYPE(REFUSE, "REFUSE", refuse_fields),
    TYPE(HEARTBEAT, "HEARTBEAT", heartbeat_fields),
    TYPE(MEMBERS, "MEMBERS", members_fields),
    TYPE(PUBLISH, "PUBLISH", publish_fields),
    TYPE(UNPUBLISH, "UNPUBLISH", publish_fields),
    TYPE(LOCATE, "LOCATE", locate_fields),
    TYPE(LOCATE_REPLY, "LOCATE_REPLY", locate_reply_fields),
    TYPE(FETCH, "FETCH", fetch_fields),
    TYPE(GRANT, "GRANT", grant_fields),
    TYPE(DENY, "DENY", deny_fields),
    TYPE(RELEASE, "RELEASE", release_fields),
};

static const struct type_desc *type_desc(uint64_t type)
{
    if (type == 0 || type >= KVT_WIRE_TYPE_END)
        return NULL;
    return &types[type];
}

const char *kvt_wire_type_name(int type)
{
    const struct type_desc *td = type < 0 ? NULL : type_desc((uint64_t)type);

    return td == NULL ? "?" : td->name;
}

/* Where a field lives in a message. */
#define AT(m, off, T)  ((T *)((char *)(m) + (off)))
#define CAT(m, off, T) ((const T *)((const char *)(m) + (off)))

void kvt_wire_limits_default(struct kvt_wire_limits *lim)
{
    if (lim->max_frame == 0)
        lim->max_frame = KVT_WIRE_DEFAULT_MAX_FRAME;
    if (lim->max_keys == 0)
        lim->max_keys = KVT_WIRE_DEFAULT_MAX_KEYS;
    if (lim->max_holders == 0)
        lim->max_holders = KVT_WIRE_DEFAULT_MAX_HOLDERS;
    if (lim->max_members == 0)
        lim->max_members = KVT_WIRE_DEFAULT_MAX_MEMBERS;
    if (lim->max_handle == 0)
        lim->max_handle = KVT_WIRE_DEFAULT_MAX_HANDLE;
    if (lim->max_depth == 0)
        lim->max_depth = KVT_WIRE_DEFAULT_MAX_DEPTH;
    if (lim->max_depth > KVT_WIRE_DEPTH_CAP)
        lim->max_depth = KVT_WIRE_DEPTH_CAP;
    if (lim->max_elements == 0)
        lim->max_elements = KVT_WIRE_DEFAULT_MAX_ELEMENTS;
}

void kvt_wire_msg_init(struct kvt_wire_msg *m, enum kvt_wire_type type)
{
    memset(m, 0, sizeof(*m));
    m->type = type;
}

void kvt_wire_msg_free(struct kvt_wire_msg *m)
{
    if (m == NULL)
        return;
    for (size_t i = 0; i < KVT_ARRAY_SIZE(m->own_); i++) {
        kvt_free(m->own_[i]);
        m->own_[i] = NULL;
    }
    if (m->heap_bytes == 0)
        return; /* a caller's message: its pointers are the caller's */
    m->heap_bytes = 0;
    const struct type_desc *td = type_desc(m->type);

    for (size_t i = 0; td != NULL && i < td->n; i++)
        if (td->f[i].n_off != 0) {
            *AT(m, td->f[i].off, void *) = NULL;
            *AT(m, td->f[i].n_off, uint32_t) = 0;
        }
}

/* ---- reading fields: the shared cursor (kvt/mpcheck.h) ------------------------- */

static int rd_uint(struct kvt_mp_cur *c, uint64_t max, uint64_t *v_p)
{
    uint64_t v;
    int rc = kvt_mp_u64(c, &v);

    if (rc < 0)
        return rc;
    if (v > max)
        return -EBADMSG;
    *v_p = v;
    return 0;
}

static int rd_u32(struct kvt_mp_cur *c, uint32_t *v_p)
{
    uint64_t v;
    int rc = rd_uint(c, UINT32_MAX, &v);

    if (rc == 0)
        *v_p = (uint32_t)v;
    return rc;
}

static int rd_u16(struct kvt_mp_cur *c, uint16_t *v_p)
{
    uint64_t v;
    int rc = rd_uint(c, UINT16_MAX, &v);

    if (rc == 0)
        *v_p = (uint16_t)v;
    return rc;
}

static int rd_key(struct kvt_mp_cur *c, struct kvt_key *key)
{
    size_t len;
    int rc = kvt_mp_bin(c, 1, KVT_KEY_MAX, key->bytes, &len);

    if (rc == 0)
        key->len = (uint8_t)len;
    return rc;
}

/* A record: an array of at least min positional fields; *extra_p of them follow
 * the ones we know and are skipped by end_record. */
static int rd_record(struct kvt_mp_cur *c, uint32_t min, uint32_t *extra_p)
{
    uint32_t n;
    int rc = kvt_mp_array(c, UINT32_MAX, &n);

    if (rc < 0)
        return rc;
    if (n < min)
        return -EBADMSG;
    *extra_p = n - min;
    return 0;
}

static int end_record(struct kvt_mp_cur *c, uint32_t extra)
{
    for (uint32_t i = 0; i < extra; i++) {
        int rc = kvt_mp_skip(c);

        if (rc < 0)
            return rc;
    }
    return 0;
}

/* ---- decoding fields --------------------------------------------------------- */

/* Allocates size zeroed bytes owned by m (n * each, n may be 0: NULL, no error). */
static int own_alloc(struct kvt_wire_msg *m, size_t n, size_t each, void **p_p)
{
    if (n == 0) {
        *p_p = NULL;
        return 0;
    }
    size_t i = 0;

    while (i < KVT_ARRAY_SIZE(m->own_) && m->own_[i] != NULL)
        i++;
    assert(i < KVT_ARRAY_SIZE(m->own_)); /* the tables own at most 6 blocks */
    void *p = kvt_calloc(n, each);

    if (p == NULL)
        return -ENOMEM;
    m->own_[i] = p;
    m->heap_bytes += n * each;
    *p_p = p;
    return 0;
}

static int dec_keys(struct kvt_mp_cur *c, const struct kvt_wire_limits *lim, struct kvt_wire_msg *m,
                    const struct field *f)
{
    uint32_t n;
    struct kvt_key *keys;
    int rc = kvt_mp_array(c, lim->max_keys, &n);

    if (rc == 0)
        rc = own_alloc(m, n, sizeof(*keys), (void **)&keys);
    for (uint32_t i = 0; rc == 0 && i < n; i++)
        rc = rd_key(c, &keys[i]);
    if (rc < 0)
        return rc;
    *AT(m, f->off, struct kvt_key *) = keys;
    *AT(m, f->n_off, uint32_t) = n;
    return 0;
}

static int dec_indexes(struct kvt_mp_cur *c, const struct kvt_wire_limits *lim,
                       struct kvt_wire_msg *m, const struct field *f)
{
    uint32_t n, *v;
    int rc = kvt_mp_array(c, lim->max_keys, &n);

    if (rc == 0)
        rc = own_alloc(m, n, sizeof(*v), (void **)&v);
    for (uint32_t i = 0; rc == 0 && i < n; i++)
        rc = rd_u32(c, &v[i]);
    if (rc < 0)
        return rc;
    *AT(m, f->off, uint32_t *) = v;
    *AT(m, f->n_off, uint32_t) = n;
    return 0;
}

static int dec_chunk(struct kvt_mp_cur *c, struct kvt_wire_chunk *ch)
{
    uint32_t extra;
    int rc = rd_record(c, 5, &extra);

    if (rc == 0)
        rc = rd_u32(c, &ch->key_index);
    if (rc == 0)
        rc = kvt_mp_u64(c, &ch->offset);
    if (rc == 0)
        rc = rd_u32(c, &ch->length);
    if (rc == 0)
        rc = rd_u32(c, &ch->generation);
    if (rc == 0)
        rc = kvt_mp_u64(c, &ch->checksum);
    return rc < 0 ? rc : end_record(c, extra);
}

static int dec_chunks(struct kvt_mp_cur *c, const struct kvt_wire_limits *lim,
                      struct kvt_wire_msg *m, const struct field *f)
{
    uint32_t n;
    struct kvt_wire_chunk *v;
    int rc = kvt_mp_array(c, lim->max_keys, &n);

    if (rc == 0)
        rc = own_alloc(m, n, sizeof(*v), (void **)&v);
    for (uint32_t i = 0; rc == 0 && i < n; i++)
        rc = dec_chunk(c, &v[i]);
    if (rc < 0)
        return rc;
    *AT(m, f->off, struct kvt_wire_chunk *) = v;
    *AT(m, f->n_off, uint32_t) = n;
    return 0;
}

static int dec_member(struct kvt_mp_cur *c, struct kvt_wire_member *mb)
{
    uint32_t extra;
    int rc = rd_record(c, 4, &extra);

    if (rc == 0)
        rc = kvt_mp_u64(c, &mb->node_id);
    if (rc == 0)
        rc = kvt_mp_u64(c, &mb->incarnation);
    if (rc == 0)
        rc = kvt_mp_str(c, 0, KVT_WIRE_ADDR_MAX - 1, mb->addr);
    if (rc == 0)
        rc = rd_u16(c, &mb->port);
    return rc < 0 ? rc : end_record(c, extra);
}

static int dec_members(struct kvt_mp_cur *c, const struct kvt_wire_limits *lim,
                       struct kvt_wire_msg *m, const struct field *f)
{
    uint32_t n;
    struct kvt_wire_member *v;
    int rc = kvt_mp_array(c, lim->max_members, &n);

    if (rc == 0)
        rc = own_alloc(m, n, sizeof(*v), (void **)&v);
    for (uint32_t i = 0; rc == 0 && i < n; i++)
        rc = dec_member(c, &v[i]);
    if (rc < 0)
        return rc;
    *AT(m, f->off, struct kvt_wire_member *) = v;
    *AT(m, f->n_off, uint32_t) = n;
    return 0;
}

static int dec_holder(struct kvt_mp_cur *c, struct kvt_wire_holder *h)
{
    uint32_t extra;
    int rc = rd_record(c, 2, &extra);

    if (rc == 0)
        rc = kvt_mp_u64(c, &h->node_id);
    if (rc == 0)
        rc = kvt_mp_u64(c, &h->incarnation);
    h->has_row = false;
    /* Since 1.2: [row, gen] may follow; an even gen only. */
    if (rc == 0 && extra >= 2) {
        rc = kvt_mp_u64(c, &h->row);
        if (rc == 0)
            rc = rd_u32(c, &h->gen);
        if (rc == 0 && (h->gen & 1))
            rc = -EBADMSG;
        h->has_row = rc == 0;
        extra -= 2;
    }
    return rc < 0 ? rc : end_record(c, extra);
}

/* [] (not known) or [row, gen, ...]; one element, or an odd gen, is malformed. */
static int dec_row(struct kvt_mp_cur *c, struct kvt_wire_row *r)
{
    uint32_t extra;
    int rc = rd_record(c, 0, &extra);

    r->known = false;
    if (rc < 0 || extra == 0)
        return rc;
    if (extra == 1)
        return -EBADMSG;
    rc = kvt_mp_u64(c, &r->row);
    if (rc == 0)
        rc = rd_u32(c, &r->gen);
    if (rc == 0 && (r->gen & 1))
        rc = -EBADMSG;
    r->known = rc == 0;
    return rc < 0 ? rc : end_record(c, extra - 2);
}

static int dec_rows(struct kvt_mp_cur *c, const struct kvt_wire_limits *lim, struct kvt_wire_msg *m,
                    const struct field *f)
{
    uint32_t n;
    struct kvt_wire_row *v;
    int rc = kvt_mp_array(c, lim->max_keys, &n);

    if (rc == 0)
        rc = own_alloc(m, n, sizeof(*v), (void **)&v);
    for (uint32_t i = 0; rc == 0 && i < n; i++)
        rc = dec_row(c, &v[i]);
    if (rc < 0)
        return rc;
    *AT(m, f->off, struct kvt_wire_row *) = v;
    *AT(m, f->n_off, uint32_t) = n;
    return 0;
}

/* A list per key of holder records: one pass to count (and bound) the holders, one
 * allocation for the lists and one for all holders, then a pass to fill them. */
static int dec_holders(struct kvt_mp_cur *c, const struct kvt_wire_limits *lim,
                       struct kvt_wire_msg *m, const struct field *f)
{
    uint32_t n, per;
    uint64_t total = 0;
    struct kvt_wire_holder_list *lists;
    struct kvt_wire_holder *h;
    int rc = kvt_mp_array(c, lim->max_keys, &n);

    if (rc < 0)
        return rc;
    struct kvt_mp_cur scan = *c;

    for (uint32_t i = 0; i < n; i++) {
        rc = kvt_mp_array(&scan, lim->max_holders, &per);
        for (uint32_t j = 0; rc == 0 && j < per; j++)
            rc = kvt_mp_skip(&scan);
        if (rc < 0)
            return rc;
        total += per;
    }
    rc = own_alloc(m, n, sizeof(*lists), (void **)&lists);
    if (rc == 0)
        rc = own_alloc(m, (size_t)total, sizeof(*h), (void **)&h);
    for (uint32_t i = 0; rc == 0 && i < n; i++) {
        rc = kvt_mp_array(c, lim->max_holders, &per);
        if (rc < 0)
            break;
        lists[i].n = per;
        lists[i].v = per == 0 ? NULL : h;
        for (uint32_t j = 0; rc == 0 && j < per; j++)
            rc = dec_holder(c, h++);
    }
    if (rc < 0)
        return rc;
    *AT(m, f->off, struct kvt_wire_holder_list *) = lists;
    *AT(m, f->n_off, uint32_t) = n;
    return 0;
}

static int dec_handle(struct kvt_mp_cur *c, const struct kvt_wire_limits *lim,
                      struct kvt_wire_msg *m, const struct field *f)
{
    struct kvt_mp_obj o;
    uint8_t *p;
    int rc = kvt_mp_expect(c, KVT_MP_BIN, &o);

    if (rc < 0)
        return rc;
    if (o.n > lim->max_handle)
        return -EMSGSIZE;
    rc = own_alloc(m, (size_t)o.n, 1, (void **)&p);
    if (rc < 0)
        return rc;
    if (o.n > 0)
        memcpy(p, o.data, (size_t)o.n);
    *AT(m, f->off, uint8_t *) = p;
    *AT(m, f->n_off, uint32_t) = (uint32_t)o.n;
    return 0;
}

static int dec_field(struct kvt_mp_cur *c, const struct kvt_wire_limits *lim,
                     struct kvt_wire_msg *m, const struct field *f)
{
    switch (f->kind) {
    case K_U64:
        return kvt_mp_u64(c, AT(m, f->off, uint64_t));
    case K_U32:
        return rd_u32(c, AT(m, f->off, uint32_t));
    case K_U16:
        return rd_u16(c, AT(m, f->off, uint16_t));
    case K_BIN32:
        return kvt_mp_bin(c, KVT_WIRE_BIN32, KVT_WIRE_BIN32, AT(m, f->off, uint8_t), NULL);
    case K_ADDR:
        return kvt_mp_str(c, 0, KVT_WIRE_ADDR_MAX - 1, AT(m, f->off, char));
    case K_HANDLE:
        return dec_handle(c, lim, m, f);
    case K_KEYS:
        return dec_keys(c, lim, m, f);
    case K_INDEXES:
        return dec_indexes(c, lim, m, f);
    case K_CHUNKS:
        return dec_chunks(c, lim, m, f);
    case K_MEMBERS:
        return dec_members(c, lim, m, f);
    case K_HOLDERS:
        return dec_holders(c, lim, m, f);
    case K_ROWS:
        return dec_rows(c, lim, m, f);
    }
    assert(!"unknown field kind");
    return -EINVAL;
}

static const struct field *find_field(const struct type_desc *td, uint64_t key)
{
    for (size_t i = 0; i < td->n; i++)
        if (td->f[i].id == key)
            return &td->f[i];
    return NULL;
}

/* Step 2: version and type, wherever they are in the map. */
static int dec_header(struct kvt_mp_cur c, uint64_t pairs, struct kvt_wire_msg *m)
{
    uint64_t v[3], seen = 0;

    for (uint64_t i = 0; i < pairs; i++) {
        uint64_t key;
        int rc = kvt_mp_u64(&c, &key);

        if (rc < 0)
            return rc; /* keys are unsigned integers */
        if (key > K_TYPE) {
            rc = kvt_mp_skip(&c);
        } else if (seen & (1u << key)) {
            return -EBADMSG;
        } else {
            seen |= 1u << key;
            rc = kvt_mp_u64(&c, &v[key]);
        }
        if (rc < 0)
            return rc;
    }
    if (seen != 7)
        return -EBADMSG;
    if (v[K_VMAJOR] != KVT_WIRE_VERSION_MAJOR || v[K_VMINOR] > UINT32_MAX)
        return -EPROTO;
    if (type_desc(v[K_TYPE]) == NULL)
        return -EPROTO;
    m->ver_major = (uint32_t)v[K_VMAJOR];
    m->ver_minor = (uint32_t)v[K_VMINOR];
    m->type = (enum kvt_wire_type)v[K_TYPE];
    return 0;
}

/* What no single field says: counts and pairs that must agree (since 1.2). */
static int check_fields(const struct kvt_wire_msg *m)
{
    uint64_t dh = KVT_WIRE_HAS(KVT_WIRE_F_DIRECT_HANDLE),
             dfh = KVT_WIRE_HAS(KVT_WIRE_F_DIRECT_FENCE_HANDLE);

    switch (m->type) {
    case KVT_WIRE_PUBLISH:
    case KVT_WIRE_UNPUBLISH:
        if ((m->has & KVT_WIRE_HAS(KVT_WIRE_F_ROWS)) && m->u.publish.n_rows != m->u.publish.n_keys)
            return -EBADMSG;
        return 0;
    case KVT_WIRE_FETCH:
        return m->u.fetch.direct > 1 ? -EBADMSG : 0;
    case KVT_WIRE_GRANT:
        return ((m->has & dh) != 0) != ((m->has & dfh) != 0) ? -EBADMSG : 0;
    default:
        return 0;
    }
}

/* Step 3: the type's fields; everything else is skipped. */
static int dec_fields(struct kvt_mp_cur c, uint64_t pairs, const struct kvt_wire_limits *lim,
                      struct kvt_wire_msg *m)
{
    const struct type_desc *td = type_desc(m->type);
    uint64_t seen = 0;

    for (uint64_t i = 0; i < pairs; i++) {
        uint64_t key;
        int rc = kvt_mp_u64(&c, &key);
        const struct field *f = rc < 0 || key <= K_TYPE ? NULL : find_field(td, key);

        if (rc < 0)
            return rc;
        if (f == NULL) {
            rc = kvt_mp_skip(&c);
        } else if (seen & KVT_WIRE_HAS(f->id)) {
            return -EBADMSG; /* a field twice */
        } else {
            seen |= KVT_WIRE_HAS(f->id);
            rc = dec_field(&c, lim, m, f);
        }
        if (rc < 0)
            return rc;
    }
    for (size_t i = 0; i < td->n; i++)
        if (td->f[i].required && !(seen & KVT_WIRE_HAS(td->f[i].id)))
            return -EBADMSG;
    m->has = seen;
    return check_fields(m);
}

int kvt_wire_decode(const uint8_t *body, size_t len, const struct kvt_wire_limits *lim_in,
                    struct kvt_wire_msg *out)
{
    struct kvt_wire_limits lim = {0};
    struct kvt_wire_msg m;
    uint64_t pairs;
    int rc;

    if ((body == NULL && len > 0) || out == NULL)
        return -EINVAL;
    if (lim_in != NULL)
        lim = *lim_in;
    kvt_wire_limits_default(&lim);
    if (len > lim.max_frame)
        return -EMSGSIZE;
    rc = kvt_mp_check(body, len, lim.max_depth, lim.max_elements);
    if (rc < 0)
        return rc;

    struct kvt_mp_cur c = {.p = body, .end = body + len};

    rc = kvt_mp_map(&c, &pairs);
    if (rc < 0)
        return rc;
    memset(&m, 0, sizeof(m));
    rc = dec_header(c, pairs, &m);
    if (rc < 0)
        return rc;
    rc = dec_fields(c, pairs, &lim, &m);
    if (rc < 0)
        goto free_msg;
    *out = m;
    return 0;

free_msg:
    kvt_wire_msg_free(&m);
    return rc;
}

/* ---- encoding ---------------------------------------------------------------- */

static bool addr_ok(const char *addr)
{
    return memchr(addr, 0, KVT_WIRE_ADDR_MAX) != NULL;
}

/* What the decoder would refuse, a caller must not send: -EINVAL. */
static int check_field(const struct kvt_wire_msg *m, const struct field *f)
{
    const void *ptr = f->n_off != 0 ? *CAT(m, f->off, void *) : NULL;
    uint32_t n = f->n_off != 0 ? *CAT(m, f->n_off, uint32_t) : 0;

    if (n > 0 && ptr == NULL)
        return -EINVAL;
    switch (f->kind) {
    case K_ADDR:
        return addr_ok(CAT(m, f->off, char)) ? 0 : -EINVAL;
    case K_KEYS:
        for (uint32_t i = 0; i < n; i++) {
            const struct kvt_key *k = (const struct kvt_key *)ptr + i;

            if (k->len < 1 || k->len > KVT_KEY_MAX)
                return -EINVAL;
        }
        return 0;
    case K_MEMBERS:
        for (uint32_t i = 0; i < n; i++)
            if (!addr_ok(((const struct kvt_wire_member *)ptr)[i].addr))
                return -EINVAL;
        return 0;
    case K_HOLDERS:
        for (uint32_t i = 0; i < n; i++) {
            const struct kvt_wire_holder_list *l = (const struct kvt_wire_holder_list *)ptr + i;

            if (l->n > 0 && l->v == NULL)
                return -EINVAL;
            for (uint32_t j = 0; j < l->n; j++)
                if (l->v[j].has_row && (l->v[j].gen & 1))
                    return -EINVAL;
        }
        return 0;
    case K_ROWS:
        for (uint32_t i = 0; i < n; i++) {
            const struct kvt_wire_row *r = (const struct kvt_wire_row *)ptr + i;

            if (r->known && (r->gen & 1))
                return -EINVAL;
        }
        return m->u.publish.n_rows == m->u.publish.n_keys ? 0 : -EINVAL;
    default:
        return 0;
    }
}

static bool sends(const struct kvt_wire_msg *m, const struct field *f)
{
    return f->required || (m->has & KVT_WIRE_HAS(f->id));
}

/* The packer's sink: appends to a kvt_wire_buf, remembers the first failure. */
struct sink {
    struct kvt_wire_buf *b;
    int err;
};

static int sink_write(void *data, const char *buf, size_t len)
{
    struct sink *s = data;
    struct kvt_wire_buf *b = s->b;

    if (s->err != 0)
        return -1;
    if (len > SIZE_MAX / 2 - b->len) {
        s->err = -EMSGSIZE;
        return -1;
    }
    if (kvt_vec_reserve(b->data, b->cap, b->len + len, 256) < 0) {
        s->err = -ENOMEM;
        return -1;
    }
    memcpy(b->data + b->len, buf, len);
    b->len += len;
    return 0;
}

static void pack_bin(msgpack_packer *pk, const void *p, size_t len)
{
    msgpack_pack_bin(pk, len);
    if (len > 0) /* an empty one may have no bytes at all (NULL) */
        msgpack_pack_bin_body(pk, p, len);
}

static void pack_addr(msgpack_packer *pk, const char *addr)
{
    size_t len = strlen(addr);

    msgpack_pack_str(pk, len);
    msgpack_pack_str_body(pk, addr, len);
}

static void enc_field(msgpack_packer *pk, const struct kvt_wire_msg *m, const struct field *f)
{
    const void *ptr = f->n_off != 0 ? *CAT(m, f->off, void *) : NULL;
    uint32_t n = f->n_off != 0 ? *CAT(m, f->n_off, uint32_t) : 0;

    msgpack_pack_uint64(pk, f->id);
    switch (f->kind) {
    case K_U64:
        msgpack_pack_uint64(pk, *CAT(m, f->off, uint64_t));
        break;
    case K_U32:
        msgpack_pack_uint64(pk, *CAT(m, f->off, uint32_t));
        break;
    case K_U16:
        msgpack_pack_uint64(pk, *CAT(m, f->off, uint16_t));
        break;
    case K_BIN32:
        pack_bin(pk, CAT(m, f->off, uint8_t), KVT_WIRE_BIN32);
        break;
    case K_ADDR:
        pack_addr(pk, CAT(m, f->off, char));
        break;
    case K_HANDLE:
        pack_bin(pk, ptr, n);
        break;
    case K_KEYS:
        msgpack_pack_array(pk, n);
        for (uint32_t i = 0; i < n; i++) {
            const struct kvt_key *k = (const struct kvt_key *)ptr + i;

            pack_bin(pk, k->bytes, k->len);
        }
        break;
    case K_INDEXES:
        msgpack_pack_array(pk, n);
        for (uint32_t i = 0; i < n; i++)
            msgpack_pack_uint64(pk, ((const uint32_t *)ptr)[i]);
        break;
    case K_CHUNKS:
        msgpack_pack_array(pk, n);
        for (uint32_t i = 0; i < n; i++) {
            const struct kvt_wire_chunk *ch = (const struct kvt_wire_chunk *)ptr + i;

            msgpack_pack_array(pk, 5);
            msgpack_pack_uint64(pk, ch->key_index);
            msgpack_pack_uint64(pk, ch->offset);
            msgpack_pack_uint64(pk, ch->length);
            msgpack_pack_uint64(pk, ch->generation);
            msgpack_pack_uint64(pk, ch->checksum);
        }
        break;
    case K_MEMBERS:
        msgpack_pack_array(pk, n);
        for (uint32_t i = 0; i < n; i++) {
            const struct kvt_wire_member *mb = (const struct kvt_wire_member *)ptr + i;

            msgpack_pack_array(pk, 4);
            msgpack_pack_uint64(pk, mb->node_id);
            msgpack_pack_uint64(pk, mb->incarnation);
            pack_addr(pk, mb->addr);
            msgpack_pack_uint64(pk, mb->port);
        }
        break;
    case K_HOLDERS:
        msgpack_pack_array(pk, n);
        for (uint32_t i = 0; i < n; i++) {
            const struct kvt_wire_holder_list *l = (const struct kvt_wire_holder_list *)ptr + i;

            msgpack_pack_array(pk, l->n);
            for (uint32_t j = 0; j < l->n; j++) {
                msgpack_pack_array(pk, l->v[j].has_row ? 4 : 2);
                msgpack_pack_uint64(pk, l->v[j].node_id);
                msgpack_pack_uint64(pk, l->v[j].incarnation);
                if (l->v[j].has_row) {
                    msgpack_pack_uint64(pk, l->v[j].row);
                    msgpack_pack_uint64(pk, l->v[j].gen);
                }
            }
        }
        break;
    case K_ROWS:
        msgpack_pack_array(pk, n);
        for (uint32_t i = 0; i < n; i++) {
            const struct kvt_wire_row *r = (const struct kvt_wire_row *)ptr + i;

            msgpack_pack_array(pk, r->known ? 2 : 0);
            if (r->known) {
                msgpack_pack_uint64(pk, r->row);
                msgpack_pack_uint64(pk, r->gen);
            }
        }
        break;
    }
}

int kvt_wire_encode(const struct kvt_wire_msg *m, struct kvt_wire_buf *buf)
{
    static const uint8_t zero_hdr[KVT_WIRE_FRAME_HDR];
    const struct type_desc *td;
    struct sink s = {.b = buf, .err = 0};
    msgpack_packer pk;
    size_t start, pairs = 3;

    if (m == NULL || buf == NULL || (td = type_desc(m->type)) == NULL)
        return -EINVAL;
    for (size_t i = 0; i < td->n; i++) {
        if (!sends(m, &td->f[i]))
            continue;
        int rc = check_field(m, &td->f[i]);

        if (rc < 0)
            return rc;
        pairs++;
    }

    start = buf->len;
    msgpack_packer_init(&pk, &s, sink_write);
    sink_write(&s, (const char *)zero_hdr, sizeof(zero_hdr));
    msgpack_pack_map(&pk, pairs);
    msgpack_pack_uint64(&pk, K_VMAJOR);
    msgpack_pack_uint64(&pk, KVT_WIRE_VERSION_MAJOR);
    msgpack_pack_uint64(&pk, K_VMINOR);
    msgpack_pack_uint64(&pk, KVT_WIRE_VERSION_MINOR);
    msgpack_pack_uint64(&pk, K_TYPE);
    msgpack_pack_uint64(&pk, m->type);
    for (size_t i = 0; i < td->n; i++)
        if (sends(m, &td->f[i]))
            enc_field(&pk, m, &td->f[i]);
    if (s.err != 0)
        goto fail;

    size_t body = buf->len - start - KVT_WIRE_FRAME_HDR;

    if (body > UINT32_MAX) {
        s.err = -EMSGSIZE;
        goto fail;
    }
    for (int i = 0; i < KVT_WIRE_FRAME_HDR; i++)
        buf->data[start + i] = (uint8_t)(body >> (8 * (KVT_WIRE_FRAME_HDR - 1 - i)));
    return 0;

fail:
    buf->len = start;
    return s.err;
}

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
 * three steps over the body, all on the shared parser of msgpack headers
 * (kvt/mpcheck.h, also used by the engine API codec):
 *   1. validate: kvt_mp_check, one iterative walk over the whole body checking that every
 *      str/bin/ext payload is present, that every array/map count is at most the
 *      bytes left (each element takes at least one byte), the depth and the total
 *      object count, and that the body is exactly one object with nothing after it;
 *   2. header: the map's keys 0, 1, 2 (version major, minor, type), wherever they
 *      are in the map, so that an incompatible peer gets -EPROTO whatever the rest;
 *   3. fields: each key of the type's table is decoded; lists are checked against
 *      the limits before their one allocation; other keys are skipped.
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
#define LIST(id_, kind_, m, n)                                                                     \
    {                                                                                              \
        .id = KVT_WIRE_F_##id_, .kind = kind_, .required = true, .off = OFF(m), .n_off = OFF(n)    \
    }

static const struct field hello_fields[] = {
    REQ(NODE_ID, K_U64, hello.node_id), REQ(INCARNATION, K_U64, hello.incarnation),
    REQ(NS, K_BIN32, hello.ns),         REQ(NONCE, K_BIN32, hello.nonce),
    OPT(PROOF, K_BIN32, hello.proof),   OPT(ADDR, K_ADDR, hello.addr),
    OPT(PORT, K_U16, hello.port),
};
static const struct field hello_ack_fields[] = {
    REQ(NODE_ID, K_U64, hello.node_id), REQ(INCARNATION, K_U64, hello.incarnation),
    REQ(NS, K_BIN32, hello.ns),         REQ(NONCE, K_BIN32, hello.nonce),
    REQ(PROOF, K_BIN32, hello.proof),   OPT(ADDR, K_ADDR, hello.addr),
    OPT(PORT, K_U16, hello.port),
};
static const struct field auth_fields[] = {
    REQ(NODE_ID, K_U64, hello.node_id),
    REQ(INCARNATION, K_U64, hello.incarnation),
    REQ(PROOF, K_BIN32, hello.proof),
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
};
static const struct field grant_fields[] = {
    REQ(JOB_ID, K_U64, grant.job_id),
    REQ(LEASE_ID, K_U64, grant.lease_id),
    REQ(LEASE_TTL, K_U32, grant.lease_ttl_ms),
    LIST(HANDLE, K_HANDLE, grant.handle, grant.handle_len),
    LIST(CHUNKS, K_CHUNKS, grant.chunks, grant.n_chunks),
    LIST(DENIED, K_INDEXES, grant.denied, grant.n_denied),
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

/* ---- msgpack headers ------------------------------------------------------- */

enum mp_kind {
    MP_NIL,
    MP_BOOL,
    MP_UINT,
    MP_NINT,
    MP_FLOAT,
    MP_STR,
    MP_BIN,
    MP_EXT,
    MP_ARRAY,
    MP_MAP
};

/* One msgpack object's header. v: the value (UINT), the payload length (STR, BIN,
 * EXT) or the element count (ARRAY; MAP counts pairs). size: bytes of header and
 * payload, not counting an array's or map's elements. */
struct mp_obj {
    enum mp_kind kind;
    uint64_t v;
    const uint8_t *data;
    size_t size;
};

/* Our view of a shared header (kvt/mpcheck.h): unsigned and negative integers apart,
 * v the value or the length/count. */
static int mp_parse(const uint8_t *p, const uint8_t *end, struct mp_obj *o)
{
    static const enum mp_kind kinds[] = {
        [KVT_MP_NIL] = MP_NIL,     [KVT_MP_BOOL] = MP_BOOL,   [KVT_MP_INT] = MP_UINT,
        [KVT_MP_FLOAT] = MP_FLOAT, [KVT_MP_STR] = MP_STR,     [KVT_MP_BIN] = MP_BIN,
        [KVT_MP_EXT] = MP_EXT,     [KVT_MP_ARRAY] = MP_ARRAY, [KVT_MP_MAP] = MP_MAP,
    };
    struct kvt_mp_obj h;
    int rc = kvt_mp_head(p, end, &h);

    if (rc < 0)
        return rc;
    o->kind = h.kind == KVT_MP_INT && h.neg ? MP_NINT : kinds[h.kind];
    o->v = h.kind == KVT_MP_INT || h.kind == KVT_MP_BOOL ? h.u : h.n;
    o->data = h.data;
    o->size = h.size;
    return 0;
}

/* Step 1: the whole body is one well-formed object within the limits. */
static int validate(const uint8_t *p, size_t len, const struct kvt_wire_limits *lim)
{
    return kvt_mp_check(p, len, lim->max_depth, lim->max_elements);
}

/* ---- reading validated bytes ------------------------------------------------- */

struct cur {
    const uint8_t *p;
    const uint8_t *end;
};

static int next(struct cur *c, struct mp_obj *o)
{
    int rc = mp_parse(c->p, c->end, o);

    if (rc == 0)
        c->p += o->size;
    return rc;
}

/* Skips one object and everything inside it. */
static int skip(struct cur *c)
{
    return kvt_mp_skip(&c->p, c->end);
}

static int rd_kind(struct cur *c, enum mp_kind kind, struct mp_obj *o)
{
    int rc = next(c, o);

    if (rc < 0)
        return rc;
    return o->kind == kind ? 0 : -EBADMSG;
}

static int rd_uint(struct cur *c, uint64_t max, uint64_t *v_p)
{
    struct mp_obj o;
    int rc = rd_kind(c, MP_UINT, &o);

    if (rc < 0)
        return rc;
    if (o.v > max)
        return -EBADMSG;
    *v_p = o.v;
    return 0;
}

static int rd_u64(struct cur *c, uint64_t *v_p)
{
    return rd_uint(c, UINT64_MAX, v_p);
}

static int rd_u32(struct cur *c, uint32_t *v_p)
{
    uint64_t v;
    int rc = rd_uint(c, UINT32_MAX, &v);

    if (rc == 0)
        *v_p = (uint32_t)v;
    return rc;
}

static int rd_u16(struct cur *c, uint16_t *v_p)
{
    uint64_t v;
    int rc = rd_uint(c, UINT16_MAX, &v);

    if (rc == 0)
        *v_p = (uint16_t)v;
    return rc;
}

static int rd_bin32(struct cur *c, uint8_t *out)
{
    struct mp_obj o;
    int rc = rd_kind(c, MP_BIN, &o);

    if (rc < 0)
        return rc;
    if (o.v != KVT_WIRE_BIN32)
        return -EBADMSG;
    memcpy(out, o.data, KVT_WIRE_BIN32);
    return 0;
}

/* A str of at most KVT_WIRE_ADDR_MAX - 1 bytes with no NUL inside. */
static int rd_addr(struct cur *c, char *out)
{
    struct mp_obj o;
    int rc = rd_kind(c, MP_STR, &o);

    if (rc < 0)
        return rc;
    if (o.v >= KVT_WIRE_ADDR_MAX || memchr(o.data, 0, o.v) != NULL)
        return -EBADMSG;
    memcpy(out, o.data, o.v);
    memset(out + o.v, 0, KVT_WIRE_ADDR_MAX - o.v);
    return 0;
}

static int rd_key(struct cur *c, struct kvt_key *key)
{
    struct mp_obj o;
    int rc = rd_kind(c, MP_BIN, &o);

    if (rc < 0)
        return rc;
    if (o.v < 1 || o.v > KVT_KEY_MAX)
        return -EBADMSG;
    key->len = (uint8_t)o.v;
    memcpy(key->bytes, o.data, o.v);
    return 0;
}

/* An array of at most max elements: -EMSGSIZE beyond. */
static int rd_list(struct cur *c, uint32_t max, uint32_t *n_p)
{
    struct mp_obj o;
    int rc = rd_kind(c, MP_ARRAY, &o);

    if (rc < 0)
        return rc;
    if (o.v > max)
        return -EMSGSIZE;
    *n_p = (uint32_t)o.v;
    return 0;
}

/* A record: an array of at least min positional fields; *extra_p of them follow
 * the ones we know and are skipped by end_record. */
static int rd_record(struct cur *c, uint32_t min, uint64_t *extra_p)
{
    struct mp_obj o;
    int rc = rd_kind(c, MP_ARRAY, &o);

    if (rc < 0)
        return rc;
    if (o.v < min)
        return -EBADMSG;
    *extra_p = o.v - min;
    return 0;
}

static int end_record(struct cur *c, uint64_t extra)
{
    for (uint64_t i = 0; i < extra; i++) {
        int rc = skip(c);

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
    assert(i < KVT_ARRAY_SIZE(m->own_)); /* the tables own at most 3 blocks */
    void *p = kvt_calloc(n, each);

    if (p == NULL)
        return -ENOMEM;
    m->own_[i] = p;
    m->heap_bytes += n * each;
    *p_p = p;
    return 0;
}

static int dec_keys(struct cur *c, const struct kvt_wire_limits *lim, struct kvt_wire_msg *m,
                    const struct field *f)
{
    uint32_t n;
    struct kvt_key *keys;
    int rc = rd_list(c, lim->max_keys, &n);

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

static int dec_indexes(struct cur *c, const struct kvt_wire_limits *lim, struct kvt_wire_msg *m,
                       const struct field *f)
{
    uint32_t n, *v;
    int rc = rd_list(c, lim->max_keys, &n);

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

static int dec_chunk(struct cur *c, struct kvt_wire_chunk *ch)
{
    uint64_t extra;
    int rc = rd_record(c, 5, &extra);

    if (rc == 0)
        rc = rd_u32(c, &ch->key_index);
    if (rc == 0)
        rc = rd_u64(c, &ch->offset);
    if (rc == 0)
        rc = rd_u32(c, &ch->length);
    if (rc == 0)
        rc = rd_u32(c, &ch->generation);
    if (rc == 0)
        rc = rd_u64(c, &ch->checksum);
    return rc < 0 ? rc : end_record(c, extra);
}

static int dec_chunks(struct cur *c, const struct kvt_wire_limits *lim, struct kvt_wire_msg *m,
                      const struct field *f)
{
    uint32_t n;
    struct kvt_wire_chunk *v;
    int rc = rd_list(c, lim->max_keys, &n);

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

static int dec_member(struct cur *c, struct kvt_wire_member *mb)
{
    uint64_t extra;
    int rc = rd_record(c, 4, &extra);

    if (rc == 0)
        rc = rd_u64(c, &mb->node_id);
    if (rc == 0)
        rc = rd_u64(c, &mb->incarnation);
    if (rc == 0)
        rc = rd_addr(c, mb->addr);
    if (rc == 0)
        rc = rd_u16(c, &mb->port);
    return rc < 0 ? rc : end_record(c, extra);
}

static int dec_members(struct cur *c, const struct kvt_wire_limits *lim, struct kvt_wire_msg *m,
                       const struct field *f)
{
    uint32_t n;
    struct kvt_wire_member *v;
    int rc = rd_list(c, lim->max_members, &n);

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

static int dec_holder(struct cur *c, struct kvt_wire_holder *h)
{
    uint64_t extra;
    int rc = rd_record(c, 2, &extra);

    if (rc == 0)
        rc = rd_u64(c, &h->node_id);
    if (rc == 0)
        rc = rd_u64(c, &h->incarnation);
    return rc < 0 ? rc : end_record(c, extra);
}

/* A list per key of holder records: one pass to count (and bound) the holders, one
 * allocation for the lists and one for all holders, then a pass to fill them. */
static int dec_holders(struct cur *c, const struct kvt_wire_limits *lim, struct kvt_wire_msg *m,
                       const struct field *f)
{
    uint32_t n, per;
    uint64_t total = 0;
    struct kvt_wire_holder_list *lists;
    struct kvt_wire_holder *h;
    int rc = rd_list(c, lim->max_keys, &n);

    if (rc < 0)
        return rc;
    struct cur scan = *c;

    for (uint32_t i = 0; i < n; i++) {
        rc = rd_list(&scan, lim->max_holders, &per);
        for (uint32_t j = 0; rc == 0 && j < per; j++)
            rc = skip(&scan);
        if (rc < 0)
            return rc;
        total += per;
    }
    rc = own_alloc(m, n, sizeof(*lists), (void **)&lists);
    if (rc == 0)
        rc = own_alloc(m, (size_t)total, sizeof(*h), (void **)&h);
    for (uint32_t i = 0; rc == 0 && i < n; i++) {
        rc = rd_list(c, lim->max_holders, &per);
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

static int dec_handle(struct cur *c, const struct kvt_wire_limits *lim, struct kvt_wire_msg *m,
                      const struct field *f)
{
    struct mp_obj o;
    uint8_t *p;
    int rc = rd_kind(c, MP_BIN, &o);

    if (rc < 0)
        return rc;
    if (o.v > lim->max_handle)
        return -EMSGSIZE;
    rc = own_alloc(m, (size_t)o.v, 1, (void **)&p);
    if (rc < 0)
        return rc;
    if (o.v > 0)
        memcpy(p, o.data, (size_t)o.v);
    *AT(m, f->off, uint8_t *) = p;
    *AT(m, f->n_off, uint32_t) = (uint32_t)o.v;
    return 0;
}

static int dec_field(struct cur *c, const struct kvt_wire_limits *lim, struct kvt_wire_msg *m,
                     const struct field *f)
{
    switch (f->kind) {
    case K_U64:
        return rd_u64(c, AT(m, f->off, uint64_t));
    case K_U32:
        return rd_u32(c, AT(m, f->off, uint32_t));
    case K_U16:
        return rd_u16(c, AT(m, f->off, uint16_t));
    case K_BIN32:
        return rd_bin32(c, AT(m, f->off, uint8_t));
    case K_ADDR:
        return rd_addr(c, AT(m, f->off, char));
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
static int dec_header(struct cur c, uint64_t pairs, struct kvt_wire_msg *m)
{
    uint64_t v[3], seen = 0;

    for (uint64_t i = 0; i < pairs; i++) {
        uint64_t key;
        int rc = rd_u64(&c, &key);

        if (rc < 0)
            return rc; /* keys are unsigned integers */
        if (key > K_TYPE) {
            rc = skip(&c);
        } else if (seen & (1u << key)) {
            return -EBADMSG;
        } else {
            seen |= 1u << key;
            rc = rd_u64(&c, &v[key]);
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

/* Step 3: the type's fields; everything else is skipped. */
static int dec_fields(struct cur c, uint64_t pairs, const struct kvt_wire_limits *lim,
                      struct kvt_wire_msg *m)
{
    const struct type_desc *td = type_desc(m->type);
    uint64_t seen = 0;

    for (uint64_t i = 0; i < pairs; i++) {
        uint64_t key;
        int rc = rd_u64(&c, &key);
        const struct field *f = rc < 0 || key <= K_TYPE ? NULL : find_field(td, key);

        if (rc < 0)
            return rc;
        if (f == NULL) {
            rc = skip(&c);
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
    return 0;
}

int kvt_wire_decode(const uint8_t *body, size_t len, const struct kvt_wire_limits *lim_in,
                    struct kvt_wire_msg *out)
{
    struct kvt_wire_limits lim = {0};
    struct kvt_wire_msg m;
    struct mp_obj o;
    int rc;

    if ((body == NULL && len > 0) || out == NULL)
        return -EINVAL;
    if (lim_in != NULL)
        lim = *lim_in;
    kvt_wire_limits_default(&lim);
    if (len > lim.max_frame)
        return -EMSGSIZE;
    rc = validate(body, len, &lim);
    if (rc < 0)
        return rc;

    struct cur c = {.p = body, .end = body + len};

    rc = rd_kind(&c, MP_MAP, &o);
    if (rc < 0)
        return rc;
    memset(&m, 0, sizeof(m));
    rc = dec_header(c, o.v, &m);
    if (rc < 0)
        return rc;
    rc = dec_fields(c, o.v, &lim, &m);
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
        }
        return 0;
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
    if (len > b->cap - b->len) {
        size_t cap = KVT_MAX(b->cap * 2, (size_t)256);

        if (len > SIZE_MAX / 2 - b->len) {
            s->err = -EMSGSIZE;
            return -1;
        }
        cap = KVT_MAX(cap, b->len + len);
        uint8_t *p = kvt_realloc(b->data, cap);

        if (p == NULL) {
            s->err = -ENOMEM;
            return -1;
        }
        b->data = p;
        b->cap = cap;
    }
    memcpy(b->data + b->len, buf, len);
    b->len += len;
    return 0;
}

static void pack_bin(msgpack_packer *pk, const void *p, size_t len)
{
    msgpack_pack_bin(pk, len);
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
                msgpack_pack_array(pk, 2);
                msgpack_pack_uint64(pk, l->v[j].node_id);
                msgpack_pack_uint64(pk, l->v[j].incarnation);
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

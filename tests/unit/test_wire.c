/* SPDX-License-Identifier: Apache-2.0 */
/* The wire codec (transport/wire.c, wire_frame.c): round trips of every message
 * type, refusal of everything a hostile or newer peer can send, bounded decoding
 * (msgpack-c issue #1013), the stream reader; and the fuzz seed corpus, written to
 * $KVT_WIRE_CORPUS_DIR when set (tests/fuzz/corpus/wire is generated that way). */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"
#include "kvt/alloc.h"
#include "kvt/alloc_test.h"
#include "kvt/wire.h"

/* ---- sample messages: one per type, with values that need every int width ---- */

struct sample {
    struct kvt_wire_msg m;
    struct kvt_key keys[4];
    struct kvt_wire_member members[3];
    struct kvt_wire_holder holders[5];
    struct kvt_wire_holder_list lists[4];
    struct kvt_wire_chunk chunks[3];
    uint32_t denied[2];
    uint8_t handle[300];
    struct kvt_wire_row rows[4];
};

static void fill_bytes(uint8_t *p, size_t n, uint8_t seed)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)(seed + 37 * i);
}

static void sample_keys(struct sample *s)
{
    uint8_t one = 0xab, big[KVT_KEY_MAX];

    fill_bytes(big, sizeof(big), 9);
    s->keys[0] = kt_key(0);
    s->keys[1] = kt_key(12345);
    assert_int_equal(kvt_key_set(&s->keys[2], &one, 1), 0);
    assert_int_equal(kvt_key_set(&s->keys[3], big, sizeof(big)), 0);
}

static void sample_msg(struct sample *s, enum kvt_wire_type t)
{
    struct kvt_wire_msg *m = &s->m;

    memset(s, 0, sizeof(*s));
    kvt_wire_msg_init(m, t);
    sample_keys(s);
    switch (t) {
    case KVT_WIRE_HELLO:
    case KVT_WIRE_HELLO_ACK:
    case KVT_WIRE_AUTH:
        m->u.hello.node_id = 0x1122334455667788ull;
        m->u.hello.incarnation = 0xfedcba9876543210ull;
        fill_bytes(m->u.hello.ns, KVT_WIRE_BIN32, 1);
        fill_bytes(m->u.hello.nonce, KVT_WIRE_BIN32, 2);
        fill_bytes(m->u.hello.proof, KVT_WIRE_BIN32, 3);
        strcpy(m->u.hello.addr, "192.168.17.203");
        m->u.hello.port = 65535;
        m->u.hello.down_after_ms = 4000000000u;
        m->u.hello.dropped_inc = t == KVT_WIRE_HELLO ? 0 : 0x8070605040302010ull;
        m->u.hello.drop_seq = t == KVT_WIRE_HELLO ? 0 : 0x0102030405060708ull;
        if (t == KVT_WIRE_HELLO)
            m->has = KVT_WIRE_HAS(KVT_WIRE_F_PROOF) | KVT_WIRE_HAS(KVT_WIRE_F_ADDR) |
                     KVT_WIRE_HAS(KVT_WIRE_F_PORT) | KVT_WIRE_HAS(KVT_WIRE_F_DOWN_AFTER);
        else if (t == KVT_WIRE_HELLO_ACK)
            m->has = KVT_WIRE_HAS(KVT_WIRE_F_ADDR) | KVT_WIRE_HAS(KVT_WIRE_F_PORT) |
                     KVT_WIRE_HAS(KVT_WIRE_F_DOWN_AFTER) | KVT_WIRE_HAS(KVT_WIRE_F_DROPPED) |
                     KVT_WIRE_HAS(KVT_WIRE_F_DROP_SEQ);
        else
            m->has = KVT_WIRE_HAS(KVT_WIRE_F_DROPPED) | KVT_WIRE_HAS(KVT_WIRE_F_DROP_SEQ);
        break;
    case KVT_WIRE_AUTH_OK:
        break;
    case KVT_WIRE_REFUSE:
        m->u.refuse.reason = KVT_WIRE_R_NAMESPACE;
        break;
    case KVT_WIRE_HEARTBEAT:
        m->u.heartbeat.node_id = 7;
        m->u.heartbeat.incarnation = 1ull << 40;
        m->u.heartbeat.seq = 300;
        m->u.heartbeat.digest = 0x8000000000000001ull;
        m->has = KVT_WIRE_HAS(KVT_WIRE_F_DIGEST);
        break;
    case KVT_WIRE_MEMBERS:
        for (int i = 0; i < 3; i++) {
            s->members[i].node_id = 100 + i;
            s->members[i].incarnation = 0xffffffffull + i;
            snprintf(s->members[i].addr, KVT_WIRE_ADDR_MAX, "10.0.0.%d", i + 1);
            s->members[i].port = (uint16_t)(7000 + i);
        }
        strcpy(s->members[2].addr, ""); /* an empty address is valid */
        m->u.members.n = 3;
        m->u.members.v = s->members;
        break;
    case KVT_WIRE_PUBLISH:
    case KVT_WIRE_UNPUBLISH:
        m->u.publish.node_id = 42;
        m->u.publish.incarnation = 99999;
        m->u.publish.n_keys = 4;
        m->u.publish.keys = s->keys;
        if (t == KVT_WIRE_PUBLISH) { /* since 1.2: where each key sits, one unknown */
            s->rows[0] = (struct kvt_wire_row){.row = 0, .gen = 2, .known = true};
            s->rows[2] =
                (struct kvt_wire_row){.row = 1ull << 40, .gen = 0xfffffffeu, .known = true};
            s->rows[3] = (struct kvt_wire_row){.row = 127, .gen = 0, .known = true};
            m->u.publish.n_rows = 4;
            m->u.publish.rows = s->rows;
            m->has |= KVT_WIRE_HAS(KVT_WIRE_F_ROWS);
        }
        break;
    case KVT_WIRE_LOCATE:
        m->u.locate.req_id = 0x0102030405ull;
        m->u.locate.n_keys = 4;
        m->u.locate.keys = s->keys;
        break;
    case KVT_WIRE_LOCATE_REPLY:
        for (int i = 0; i < 5; i++) {
            s->holders[i].node_id = 1000 + i;
            s->holders[i].incarnation = 1ull << (60 - i);
        }
        /* since 1.2: two of them with their row and generation */
        s->holders[0].has_row = s->holders[3].has_row = true;
        s->holders[0].row = 5;
        s->holders[0].gen = 0x10;
        s->holders[3].row = UINT64_MAX;
        s->holders[3].gen = 0xfffffffeu;
        /* holders per key: 2, 0, 1, 2 */
        s->lists[0] = (struct kvt_wire_holder_list){.n = 2, .v = &s->holders[0]};
        s->lists[1] = (struct kvt_wire_holder_list){.n = 0, .v = NULL};
        s->lists[2] = (struct kvt_wire_holder_list){.n = 1, .v = &s->holders[2]};
        s->lists[3] = (struct kvt_wire_holder_list){.n = 2, .v = &s->holders[3]};
        m->u.locate_reply.req_id = 77;
        m->u.locate_reply.n_keys = 4;
        m->u.locate_reply.holders = s->lists;
        break;
    case KVT_WIRE_FETCH:
        m->u.fetch.job_id = 0xdeadbeefcafeull;
        m->u.fetch.n_keys = 4;
        m->u.fetch.keys = s->keys;
        m->u.fetch.direct = 1;
        m->has |= KVT_WIRE_HAS(KVT_WIRE_F_DIRECT);
        break;
    case KVT_WIRE_GRANT:
        fill_bytes(s->handle, sizeof(s->handle), 5);
        for (int i = 0; i < 3; i++) {
            s->chunks[i].key_index = (uint32_t)i * 2;
            s->chunks[i].offset = (3ull << 31) + (uint64_t)i * 262144;
            s->chunks[i].length = 262144;
            s->chunks[i].generation = 0xfffffff0u + (uint32_t)i;
            s->chunks[i].checksum = 0x9e3779b97f4a7c15ull * (uint64_t)(i + 1);
        }
        s->denied[0] = 1;
        s->denied[1] = 70000;
        m->u.grant.job_id = 5;
        m->u.grant.lease_id = 6;
        m->u.grant.lease_ttl_ms = 30000;
        m->u.grant.handle_len = sizeof(s->handle);
        m->u.grant.handle = s->handle;
        m->u.grant.n_chunks = 3;
        m->u.grant.chunks = s->chunks;
        m->u.grant.n_denied = 2;
        m->u.grant.denied = s->denied;
        m->u.grant.fence_handle_len = sizeof(s->handle) - 3; /* other bytes than handle */
        m->u.grant.fence_handle = s->handle + 3;
        m->has |= KVT_WIRE_HAS(KVT_WIRE_F_FENCE_HANDLE);
        m->u.grant.direct_handle_len = 40;
        m->u.grant.direct_handle = s->handle + 7;
        m->u.grant.direct_fence_handle_len = 0; /* empty: still present */
        m->u.grant.direct_fence_handle = NULL;
        m->has |=
            KVT_WIRE_HAS(KVT_WIRE_F_DIRECT_HANDLE) | KVT_WIRE_HAS(KVT_WIRE_F_DIRECT_FENCE_HANDLE);
        break;
    case KVT_WIRE_DENY:
        m->u.deny.job_id = 8;
        m->u.deny.reason = KVT_WIRE_R_BUSY;
        break;
    case KVT_WIRE_RELEASE:
        m->u.release.job_id = 9;
        m->u.release.lease_id = UINT64_MAX;
        break;
    default:
        fail_msg("no sample for type %d", t);
    }
}

static void assert_keys_equal(const struct kvt_key *a, const struct kvt_key *b, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++) {
        assert_int_equal(a[i].len, b[i].len);
        assert_memory_equal(a[i].bytes, b[i].bytes, a[i].len);
    }
}

/* Every field of the type, exactly. got is decoded; want is what was encoded. */
static void assert_msg_equal(const struct kvt_wire_msg *want, const struct kvt_wire_msg *got)
{
    assert_int_equal(got->type, want->type);
    switch (want->type) {
    case KVT_WIRE_HELLO:
    case KVT_WIRE_HELLO_ACK:
    case KVT_WIRE_AUTH: {
        const struct kvt_wire_hello *a = &want->u.hello, *b = &got->u.hello;

        assert_int_equal(b->node_id, a->node_id);
        assert_int_equal(b->incarnation, a->incarnation);
        if (want->type != KVT_WIRE_AUTH) {
            assert_memory_equal(b->ns, a->ns, KVT_WIRE_BIN32);
            assert_memory_equal(b->nonce, a->nonce, KVT_WIRE_BIN32);
            assert_string_equal(b->addr, a->addr);
            assert_int_equal(b->port, a->port);
            assert_int_equal(b->down_after_ms, a->down_after_ms);
        }
        assert_int_equal(b->dropped_inc, a->dropped_inc);
        assert_int_equal(b->drop_seq, a->drop_seq);
        assert_memory_equal(b->proof, a->proof, KVT_WIRE_BIN32);
        break;
    }
    case KVT_WIRE_AUTH_OK:
        break;
    case KVT_WIRE_REFUSE:
        assert_int_equal(got->u.refuse.reason, want->u.refuse.reason);
        break;
    case KVT_WIRE_HEARTBEAT:
        assert_int_equal(got->u.heartbeat.node_id, want->u.heartbeat.node_id);
        assert_int_equal(got->u.heartbeat.incarnation, want->u.heartbeat.incarnation);
        assert_int_equal(got->u.heartbeat.seq, want->u.heartbeat.seq);
        assert_int_equal(got->u.heartbeat.digest, want->u.heartbeat.digest);
        break;
    case KVT_WIRE_MEMBERS:
        assert_int_equal(got->u.members.n, want->u.members.n);
        for (uint32_t i = 0; i < want->u.members.n; i++) {
            const struct kvt_wire_member *a = &want->u.members.v[i], *b = &got->u.members.v[i];

            assert_int_equal(b->node_id, a->node_id);
            assert_int_equal(b->incarnation, a->incarnation);
            assert_string_equal(b->addr, a->addr);
            assert_int_equal(b->port, a->port);
        }
        break;
    case KVT_WIRE_PUBLISH:
    case KVT_WIRE_UNPUBLISH:
        assert_int_equal(got->u.publish.node_id, want->u.publish.node_id);
        assert_int_equal(got->u.publish.incarnation, want->u.publish.incarnation);
        assert_int_equal(got->u.publish.n_keys, want->u.publish.n_keys);
        assert_keys_equal(want->u.publish.keys, got->u.publish.keys, want->u.publish.n_keys);
        assert_int_equal(got->u.publish.n_rows, want->u.publish.n_rows);
        for (uint32_t i = 0; i < want->u.publish.n_rows; i++) {
            const struct kvt_wire_row *a = &want->u.publish.rows[i], *b = &got->u.publish.rows[i];

            assert_int_equal(b->known, a->known);
            if (a->known) {
                assert_int_equal(b->row, a->row);
                assert_int_equal(b->gen, a->gen);
            }
        }
        break;
    case KVT_WIRE_LOCATE:
        assert_int_equal(got->u.locate.req_id, want->u.locate.req_id);
        assert_int_equal(got->u.locate.n_keys, want->u.locate.n_keys);
        assert_keys_equal(want->u.locate.keys, got->u.locate.keys, want->u.locate.n_keys);
        break;
    case KVT_WIRE_LOCATE_REPLY:
        assert_int_equal(got->u.locate_reply.req_id, want->u.locate_reply.req_id);
        assert_int_equal(got->u.locate_reply.n_keys, want->u.locate_reply.n_keys);
        for (uint32_t i = 0; i < want->u.locate_reply.n_keys; i++) {
            const struct kvt_wire_holder_list *a = &want->u.locate_reply.holders[i];
            const struct kvt_wire_holder_list *b = &got->u.locate_reply.holders[i];

            assert_int_equal(b->n, a->n);
            for (uint32_t j = 0; j < a->n; j++) {
                assert_int_equal(b->v[j].node_id, a->v[j].node_id);
                assert_int_equal(b->v[j].incarnation, a->v[j].incarnation);
                assert_int_equal(b->v[j].has_row, a->v[j].has_row);
                if (a->v[j].has_row) {
                    assert_int_equal(b->v[j].row, a->v[j].row);
                    assert_int_equal(b->v[j].gen, a->v[j].gen);
                }
            }
        }
        break;
    case KVT_WIRE_FETCH:
        assert_int_equal(got->u.fetch.job_id, want->u.fetch.job_id);
        assert_int_equal(got->u.fetch.n_keys, want->u.fetch.n_keys);
        assert_keys_equal(want->u.fetch.keys, got->u.fetch.keys, want->u.fetch.n_keys);
        assert_int_equal(got->u.fetch.direct, want->u.fetch.direct);
        break;
    case KVT_WIRE_GRANT: {
        const struct kvt_wire_grant *a = &want->u.grant, *b = &got->u.grant;

        assert_int_equal(b->job_id, a->job_id);
        assert_int_equal(b->lease_id, a->lease_id);
        assert_int_equal(b->lease_ttl_ms, a->lease_ttl_ms);
        assert_int_equal(b->handle_len, a->handle_len);
        assert_memory_equal(b->handle, a->handle, a->handle_len);
        assert_int_equal(b->n_chunks, a->n_chunks);
        for (uint32_t i = 0; i < a->n_chunks; i++) {
            assert_int_equal(b->chunks[i].key_index, a->chunks[i].key_index);
            assert_int_equal(b->chunks[i].offset, a->chunks[i].offset);
            assert_int_equal(b->chunks[i].length, a->chunks[i].length);
            assert_int_equal(b->chunks[i].generation, a->chunks[i].generation);
            assert_int_equal(b->chunks[i].checksum, a->chunks[i].checksum);
        }
        assert_int_equal(b->n_denied, a->n_denied);
        for (uint32_t i = 0; i < a->n_denied; i++)
            assert_int_equal(b->denied[i], a->denied[i]);
        assert_int_equal(got->has & KVT_WIRE_HAS(KVT_WIRE_F_FENCE_HANDLE),
                         want->has & KVT_WIRE_HAS(KVT_WIRE_F_FENCE_HANDLE));
        assert_int_equal(b->fence_handle_len, a->fence_handle_len);
        assert_memory_equal(b->fence_handle, a->fence_handle, a->fence_handle_len);
        assert_int_equal(b->direct_handle_len, a->direct_handle_len);
        assert_memory_equal(b->direct_handle, a->direct_handle, a->direct_handle_len);
        assert_int_equal(b->direct_fence_handle_len, a->direct_fence_handle_len);
        break;
    }
    case KVT_WIRE_DENY:
        assert_int_equal(got->u.deny.job_id, want->u.deny.job_id);
        assert_int_equal(got->u.deny.reason, want->u.deny.reason);
        break;
    case KVT_WIRE_RELEASE:
        assert_int_equal(got->u.release.job_id, want->u.release.job_id);
        assert_int_equal(got->u.release.lease_id, want->u.release.lease_id);
        break;
    default:
        fail();
    }
}

/* The fields a decoded message of this type reports present: its required ones
 * and the optional ones the sample sends. */
static uint64_t expected_has(const struct kvt_wire_msg *m)
{
    static const uint64_t req[KVT_WIRE_TYPE_END] = {
        [KVT_WIRE_HELLO] = KVT_WIRE_HAS(KVT_WIRE_F_NODE_ID) | KVT_WIRE_HAS(KVT_WIRE_F_INCARNATION) |
                           KVT_WIRE_HAS(KVT_WIRE_F_NS) | KVT_WIRE_HAS(KVT_WIRE_F_NONCE),
        [KVT_WIRE_HELLO_ACK] = KVT_WIRE_HAS(KVT_WIRE_F_NODE_ID) |
                               KVT_WIRE_HAS(KVT_WIRE_F_INCARNATION) | KVT_WIRE_HAS(KVT_WIRE_F_NS) |
                               KVT_WIRE_HAS(KVT_WIRE_F_NONCE) | KVT_WIRE_HAS(KVT_WIRE_F_PROOF),
        [KVT_WIRE_AUTH] = KVT_WIRE_HAS(KVT_WIRE_F_NODE_ID) | KVT_WIRE_HAS(KVT_WIRE_F_INCARNATION) |
                          KVT_WIRE_HAS(KVT_WIRE_F_PROOF),
        [KVT_WIRE_REFUSE] = KVT_WIRE_HAS(KVT_WIRE_F_REASON),
        [KVT_WIRE_HEARTBEAT] = KVT_WIRE_HAS(KVT_WIRE_F_NODE_ID) |
                               KVT_WIRE_HAS(KVT_WIRE_F_INCARNATION) | KVT_WIRE_HAS(KVT_WIRE_F_SEQ),
        [KVT_WIRE_MEMBERS] = KVT_WIRE_HAS(KVT_WIRE_F_MEMBERS),
        [KVT_WIRE_PUBLISH] = KVT_WIRE_HAS(KVT_WIRE_F_NODE_ID) |
                             KVT_WIRE_HAS(KVT_WIRE_F_INCARNATION) | KVT_WIRE_HAS(KVT_WIRE_F_KEYS),
        [KVT_WIRE_UNPUBLISH] = KVT_WIRE_HAS(KVT_WIRE_F_NODE_ID) |
                               KVT_WIRE_HAS(KVT_WIRE_F_INCARNATION) | KVT_WIRE_HAS(KVT_WIRE_F_KEYS),
        [KVT_WIRE_LOCATE] = KVT_WIRE_HAS(KVT_WIRE_F_REQ_ID) | KVT_WIRE_HAS(KVT_WIRE_F_KEYS),
        [KVT_WIRE_LOCATE_REPLY] =
            KVT_WIRE_HAS(KVT_WIRE_F_REQ_ID) | KVT_WIRE_HAS(KVT_WIRE_F_HOLDERS),
        [KVT_WIRE_FETCH] = KVT_WIRE_HAS(KVT_WIRE_F_JOB_ID) | KVT_WIRE_HAS(KVT_WIRE_F_KEYS),
        [KVT_WIRE_GRANT] = KVT_WIRE_HAS(KVT_WIRE_F_JOB_ID) | KVT_WIRE_HAS(KVT_WIRE_F_LEASE_ID) |
                           KVT_WIRE_HAS(KVT_WIRE_F_LEASE_TTL) | KVT_WIRE_HAS(KVT_WIRE_F_HANDLE) |
                           KVT_WIRE_HAS(KVT_WIRE_F_CHUNKS) | KVT_WIRE_HAS(KVT_WIRE_F_DENIED),
        [KVT_WIRE_DENY] = KVT_WIRE_HAS(KVT_WIRE_F_JOB_ID) | KVT_WIRE_HAS(KVT_WIRE_F_REASON),
        [KVT_WIRE_RELEASE] = KVT_WIRE_HAS(KVT_WIRE_F_JOB_ID) | KVT_WIRE_HAS(KVT_WIRE_F_LEASE_ID),
    };
    uint64_t opt = m->type == KVT_WIRE_HELLO
                       ? KVT_WIRE_HAS(KVT_WIRE_F_PROOF) | KVT_WIRE_HAS(KVT_WIRE_F_ADDR) |
                             KVT_WIRE_HAS(KVT_WIRE_F_PORT) | KVT_WIRE_HAS(KVT_WIRE_F_DOWN_AFTER)
                   : m->type == KVT_WIRE_HELLO_ACK
                       ? KVT_WIRE_HAS(KVT_WIRE_F_ADDR) | KVT_WIRE_HAS(KVT_WIRE_F_PORT) |
                             KVT_WIRE_HAS(KVT_WIRE_F_DOWN_AFTER) |
                             KVT_WIRE_HAS(KVT_WIRE_F_DROPPED) | KVT_WIRE_HAS(KVT_WIRE_F_DROP_SEQ)
                   : m->type == KVT_WIRE_AUTH
                       ? KVT_WIRE_HAS(KVT_WIRE_F_DROPPED) | KVT_WIRE_HAS(KVT_WIRE_F_DROP_SEQ)
                   : m->type == KVT_WIRE_HEARTBEAT ? KVT_WIRE_HAS(KVT_WIRE_F_DIGEST)
                   : m->type == KVT_WIRE_GRANT     ? KVT_WIRE_HAS(KVT_WIRE_F_FENCE_HANDLE) |
                                                     KVT_WIRE_HAS(KVT_WIRE_F_DIRECT_HANDLE) |
                                                     KVT_WIRE_HAS(KVT_WIRE_F_DIRECT_FENCE_HANDLE)
                   : m->type == KVT_WIRE_PUBLISH ? KVT_WIRE_HAS(KVT_WIRE_F_ROWS)
                   : m->type == KVT_WIRE_FETCH   ? KVT_WIRE_HAS(KVT_WIRE_F_DIRECT)
                                                 : 0;

    return req[m->type] | (m->has & opt);
}

/* Encodes m into b (reset first) and returns the body within it. */
static const uint8_t *encode(const struct kvt_wire_msg *m, struct kvt_wire_buf *b, size_t *len_p)
{
    const uint8_t *body;

    kvt_wire_buf_reset(b);
    assert_int_equal(kvt_wire_encode(m, b), 0);
    assert_int_equal(kvt_wire_unframe(b->data, b->len, NULL, &body, len_p), 0);
    return body;
}

/* ---- a hand-written msgpack builder, to craft what our encoder never sends ---- */

struct tb {
    uint8_t b[1 << 16];
    size_t n;
};

static void tb_byte(struct tb *t, uint8_t v)
{
    assert_true(t->n < sizeof(t->b));
    t->b[t->n++] = v;
}

static void tb_be(struct tb *t, uint64_t v, unsigned bytes)
{
    for (unsigned i = bytes; i-- > 0;)
        tb_byte(t, (uint8_t)(v >> (8 * i)));
}

static void tb_raw(struct tb *t, const void *p, size_t n)
{
    assert_true(t->n + n <= sizeof(t->b));
    memcpy(t->b + t->n, p, n);
    t->n += n;
}

static void tb_u(struct tb *t, uint64_t v)
{
    if (v < 128) {
        tb_byte(t, (uint8_t)v);
    } else if (v <= 0xff) {
        tb_byte(t, 0xcc);
        tb_be(t, v, 1);
    } else if (v <= 0xffff) {
        tb_byte(t, 0xcd);
        tb_be(t, v, 2);
    } else if (v <= 0xffffffffull) {
        tb_byte(t, 0xce);
        tb_be(t, v, 4);
    } else {
        tb_byte(t, 0xcf);
        tb_be(t, v, 8);
    }
}

static void tb_map(struct tb *t, uint32_t n)
{
    if (n < 16) {
        tb_byte(t, (uint8_t)(0x80 | n));
    } else {
        tb_byte(t, 0xdf);
        tb_be(t, n, 4);
    }
}

static void tb_arr(struct tb *t, uint32_t n)
{
    if (n < 16) {
        tb_byte(t, (uint8_t)(0x90 | n));
    } else {
        tb_byte(t, 0xdd);
        tb_be(t, n, 4);
    }
}

static void tb_bin(struct tb *t, const void *p, uint32_t n)
{
    tb_byte(t, 0xc6);
    tb_be(t, n, 4);
    tb_raw(t, p, n);
}

static void tb_str(struct tb *t, const char *s, size_t n)
{
    tb_byte(t, 0xdb);
    tb_be(t, n, 4);
    tb_raw(t, s, n);
}

/* The three header pairs. */
static void tb_hdr(struct tb *t, uint64_t major, uint64_t minor, uint64_t type)
{
    tb_u(t, 0);
    tb_u(t, major);
    tb_u(t, 1);
    tb_u(t, minor);
    tb_u(t, 2);
    tb_u(t, type);
}

static int tb_decode(const struct tb *t, const struct kvt_wire_limits *lim, struct kvt_wire_msg *m)
{
    return kvt_wire_decode(t->b, t->n, lim, m);
}

static const enum kvt_wire_type all_types[] = {
    KVT_WIRE_HELLO,     KVT_WIRE_HELLO_ACK, KVT_WIRE_AUTH,         KVT_WIRE_AUTH_OK,
    KVT_WIRE_REFUSE,    KVT_WIRE_HEARTBEAT, KVT_WIRE_MEMBERS,      KVT_WIRE_PUBLISH,
    KVT_WIRE_UNPUBLISH, KVT_WIRE_LOCATE,    KVT_WIRE_LOCATE_REPLY, KVT_WIRE_FETCH,
    KVT_WIRE_GRANT,     KVT_WIRE_DENY,      KVT_WIRE_RELEASE,
};
#define N_TYPES (sizeof(all_types) / sizeof(all_types[0]))

/* ---- tests ------------------------------------------------------------------- */

/* Every type survives encode -> frame -> decode with every field exact, reports
 * our version and the fields present, and allocates at most 24 bytes per body
 * byte. */
static void test_wire_round_trip_every_type(void **state)
{
    struct kvt_wire_buf b;
    struct sample *s = malloc(sizeof(*s));

    assert_int_equal(N_TYPES, KVT_WIRE_TYPE_END - 1);
    kvt_wire_buf_init(&b);
    for (size_t i = 0; i < N_TYPES; i++) {
        struct kvt_wire_msg got;
        size_t len;
        const uint8_t *body;

        sample_msg(s, all_types[i]);
        body = encode(&s->m, &b, &len);
        assert_int_equal(b.len, len + KVT_WIRE_FRAME_HDR);
        assert_int_equal(kvt_wire_decode(body, len, NULL, &got), 0);
        assert_msg_equal(&s->m, &got);
        assert_int_equal(got.ver_major, KVT_WIRE_VERSION_MAJOR);
        assert_int_equal(got.ver_minor, KVT_WIRE_VERSION_MINOR);
        assert_int_equal(got.has, expected_has(&s->m));
        assert_true(got.heap_bytes <= 24 * len);
        assert_string_equal(kvt_wire_type_name(got.type), kvt_wire_type_name((int)all_types[i]));
        kvt_wire_msg_free(&got);
        assert_int_equal(got.heap_bytes, 0);
    }
    assert_string_equal(kvt_wire_type_name(KVT_WIRE_GRANT), "GRANT");
    assert_string_equal(kvt_wire_type_name(0), "?");
    assert_string_equal(kvt_wire_type_name(KVT_WIRE_TYPE_END), "?");
    kvt_wire_buf_cleanup(&b);
    free(s);
}

/* Optional fields not sent are reported absent (and zero); a required one missing
 * from a crafted message is -EBADMSG. */
static void test_wire_optional_and_required_fields(void **state)
{
    struct kvt_wire_buf b;
    struct kvt_wire_msg got;
    struct sample *s = malloc(sizeof(*s));
    size_t len;
    const uint8_t *body;

    kvt_wire_buf_init(&b);
    sample_msg(s, KVT_WIRE_HELLO);
    s->m.has = 0;
    body = encode(&s->m, &b, &len);
    assert_int_equal(kvt_wire_decode(body, len, NULL, &got), 0);
    assert_int_equal(got.has, expected_has(&s->m));
    assert_false(got.has & KVT_WIRE_HAS(KVT_WIRE_F_PROOF));
    assert_string_equal(got.u.hello.addr, "");
    assert_int_equal(got.u.hello.port, 0);
    uint8_t zero[KVT_WIRE_BIN32] = {0};

    assert_memory_equal(got.u.hello.proof, zero, KVT_WIRE_BIN32);
    kvt_wire_msg_free(&got);

    sample_msg(s, KVT_WIRE_HEARTBEAT);
    s->m.has = 0;
    body = encode(&s->m, &b, &len);
    assert_int_equal(kvt_wire_decode(body, len, NULL, &got), 0);
    assert_int_equal(got.u.heartbeat.digest, 0);
    assert_false(got.has & KVT_WIRE_HAS(KVT_WIRE_F_DIGEST));
    kvt_wire_msg_free(&got);

    /* HELLO_ACK without its proof; HEARTBEAT without seq. */
    struct tb *t = calloc(1, sizeof(*t));

    tb_map(t, 7);
    tb_hdr(t, 1, 0, KVT_WIRE_HELLO_ACK);
    tb_u(t, KVT_WIRE_F_NODE_ID);
    tb_u(t, 1);
    tb_u(t, KVT_WIRE_F_INCARNATION);
    tb_u(t, 2);
    tb_u(t, KVT_WIRE_F_NS);
    tb_bin(t, zero, 32);
    tb_u(t, KVT_WIRE_F_NONCE);
    tb_bin(t, zero, 32);
    assert_int_equal(tb_decode(t, NULL, &got), -EBADMSG);
    t->n = 0;
    tb_map(t, 5);
    tb_hdr(t, 1, 0, KVT_WIRE_HEARTBEAT);
    tb_u(t, KVT_WIRE_F_NODE_ID);
    tb_u(t, 1);
    tb_u(t, KVT_WIRE_F_INCARNATION);
    tb_u(t, 2);
    assert_int_equal(tb_decode(t, NULL, &got), -EBADMSG);
    free(t);
    kvt_wire_buf_cleanup(&b);
    free(s);
}

/* Every proper prefix of every encoded body is refused, and so is every prefix of
 * its frame, by unframe and by the stream reader (which yields nothing). */
static void test_wire_every_truncation_refused(void **state)
{
    struct kvt_wire_buf b;
    struct sample *s = malloc(sizeof(*s));
    struct kvt_wire_reader r;

    kvt_wire_buf_init(&b);
    for (size_t i = 0; i < N_TYPES; i++) {
        size_t len;
        const uint8_t *body, *bp;
        size_t bl, used;

        sample_msg(s, all_types[i]);
        body = encode(&s->m, &b, &len);
        for (size_t k = 0; k < len; k++) {
            struct kvt_wire_msg got;
            uint8_t *copy = malloc(k + 1); /* exact size: ASan sees any overread */

            memcpy(copy, body, k);
            assert_int_equal(kvt_wire_decode(copy, k, NULL, &got), -EBADMSG);
            free(copy);
        }
        for (size_t k = 0; k < b.len; k++) {
            assert_int_equal(kvt_wire_unframe(b.data, k, NULL, &bp, &bl), -EBADMSG);
            assert_int_equal(kvt_wire_reader_init(&r, NULL), 0);
            assert_int_equal(kvt_wire_reader_push(&r, b.data, k, &used), 0);
            assert_int_equal(used, k);
            kvt_wire_reader_cleanup(&r);
        }
    }
    kvt_wire_buf_cleanup(&b);
    free(s);
}

/* An AUTH from a wire 1.4 node carries holds_inc (the life it holds live), a field
 * 1.5 retired: it decodes, the field is skipped and says nothing of a drop. */
static void test_wire_auth_of_1_4_skips_holds(void **state)
{
    struct tb *t = calloc(1, sizeof(*t));
    struct kvt_wire_msg got;
    uint8_t proof[KVT_WIRE_BIN32];

    (void)state;
    fill_bytes(proof, sizeof(proof), 7);
    tb_map(t, 7);
    tb_hdr(t, KVT_WIRE_VERSION_MAJOR, 4, KVT_WIRE_AUTH);
    tb_u(t, KVT_WIRE_F_NODE_ID);
    tb_u(t, 5);
    tb_u(t, KVT_WIRE_F_INCARNATION);
    tb_u(t, 6);
    tb_u(t, KVT_WIRE_F_PROOF);
    tb_bin(t, proof, sizeof(proof));
    tb_u(t, KVT_WIRE_F_HOLDS);
    tb_u(t, 0x1234);
    assert_int_equal(tb_decode(t, NULL, &got), 0);
    assert_int_equal(got.type, KVT_WIRE_AUTH);
    assert_int_equal(got.u.hello.node_id, 5);
    assert_false(got.has & KVT_WIRE_HAS(KVT_WIRE_F_HOLDS));
    assert_false(got.has & KVT_WIRE_HAS(KVT_WIRE_F_DROPPED));
    assert_int_equal(got.u.hello.dropped_inc, 0);
    kvt_wire_msg_free(&got);
    free(t);
}

/* A newer minor version: header pairs anywhere in the map, fields of every msgpack
 * kind under unknown keys (and known keys of other types), extra elements in
 * records. All skipped; the known fields decode exactly. */
static void test_wire_unknown_fields_skipped(void **state)
{
    struct tb *t = calloc(1, sizeof(*t));
    struct kvt_wire_msg got;
    static const uint8_t ext[] = {0xd4, 0x05, 0x01};
    static const uint8_t misc[] = {0xc0, 0xc3, 0xff, 0xd3, 0x80, 0, 0, 0, 0, 0, 0,
                                   0,    0xcb, 0,    0,    0,    0, 0, 0, 0, 0};
    uint8_t bytes[200];

    fill_bytes(bytes, sizeof(bytes), 4);
    tb_map(t, 11);
    tb_u(t, 63); /* unknown small key: a nested map and array */
    tb_map(t, 2);
    tb_u(t, 1);
    tb_arr(t, 3);
    tb_u(t, 1);
    tb_str(t, "x", 1);
    tb_raw(t, ext, sizeof(ext));
    tb_u(t, 2);
    tb_map(t, 0);
    tb_u(t, 1); /* minor, before major */
    tb_u(t, 9);
    tb_u(t, KVT_WIRE_F_SEQ);
    tb_u(t, 1ull << 33);
    tb_u(t, KVT_WIRE_F_KEYS); /* known key, another type's field */
    tb_arr(t, 5);             /* misc holds 5 objects */
    tb_raw(t, misc, sizeof(misc));
    tb_u(t, 0);
    tb_u(t, KVT_WIRE_VERSION_MAJOR);
    tb_u(t, 100000); /* large unknown key: a big bin */
    tb_bin(t, bytes, sizeof(bytes));
    tb_u(t, 2);
    tb_u(t, KVT_WIRE_HEARTBEAT);
    tb_u(t, KVT_WIRE_F_NODE_ID);
    tb_u(t, 3);
    tb_u(t, 40); /* misc scalars */
    tb_arr(t, 3);
    tb_raw(t, misc, 3);
    tb_u(t, KVT_WIRE_F_INCARNATION);
    tb_u(t, 4);
    tb_u(t, UINT64_MAX);
    tb_str(t, "", 0);
    assert_int_equal(tb_decode(t, NULL, &got), 0);
    assert_int_equal(got.type, KVT_WIRE_HEARTBEAT);
    assert_int_equal(got.ver_minor, 9);
    assert_int_equal(got.u.heartbeat.node_id, 3);
    assert_int_equal(got.u.heartbeat.incarnation, 4);
    assert_int_equal(got.u.heartbeat.seq, 1ull << 33);
    assert_false(got.has & KVT_WIRE_HAS(KVT_WIRE_F_DIGEST));
    kvt_wire_msg_free(&got);

    /* Records with appended elements; ints in non-canonical widths. */
    t->n = 0;
    tb_map(t, 5);
    tb_hdr(t, 1, 3, KVT_WIRE_GRANT);
    tb_u(t, KVT_WIRE_F_JOB_ID);
    tb_byte(t, 0xd3); /* int64 5 */
    tb_be(t, 5, 8);
    tb_u(t, KVT_WIRE_F_CHUNKS);
    tb_arr(t, 1);
    tb_arr(t, 7);
    tb_u(t, 2);
    tb_u(t, 4096);
    tb_byte(t, 0xce); /* u32 in a u32 field */
    tb_be(t, 8192, 4);
    tb_u(t, 11);
    tb_u(t, 0x123456789ull);
    tb_str(t, "future", 6);
    tb_arr(t, 0);
    assert_int_equal(tb_decode(t, NULL, &got), -EBADMSG); /* GRANT lacks fields */
    t->n = 0;
    tb_map(t, 9);
    tb_hdr(t, 1, 3, KVT_WIRE_GRANT);
    tb_u(t, KVT_WIRE_F_JOB_ID);
    tb_byte(t, 0xd3);
    tb_be(t, 5, 8);
    tb_u(t, KVT_WIRE_F_LEASE_ID);
    tb_u(t, 6);
    tb_u(t, KVT_WIRE_F_LEASE_TTL);
    tb_u(t, 1000);
    tb_u(t, KVT_WIRE_F_HANDLE);
    tb_bin(t, bytes, 0);
    tb_u(t, KVT_WIRE_F_DENIED);
    tb_arr(t, 0);
    tb_u(t, KVT_WIRE_F_CHUNKS);
    tb_arr(t, 1);
    tb_arr(t, 7);
    tb_u(t, 2);
    tb_u(t, 4096);
    tb_byte(t, 0xce);
    tb_be(t, 8192, 4);
    tb_u(t, 11);
    tb_u(t, 0x123456789ull);
    tb_str(t, "future", 6);
    tb_arr(t, 0);
    assert_int_equal(tb_decode(t, NULL, &got), 0);
    assert_int_equal(got.u.grant.job_id, 5);
    assert_int_equal(got.u.grant.handle_len, 0);
    assert_null(got.u.grant.handle);
    assert_int_equal(got.u.grant.n_chunks, 1);
    assert_int_equal(got.u.grant.chunks[0].key_index, 2);
    assert_int_equal(got.u.grant.chunks[0].offset, 4096);
    assert_int_equal(got.u.grant.chunks[0].length, 8192);
    assert_int_equal(got.u.grant.chunks[0].generation, 11);
    assert_int_equal(got.u.grant.chunks[0].checksum, 0x123456789ull);
    assert_int_equal(got.u.grant.n_denied, 0);
    /* A holder before 1.1 sends no fence words: the field is absent, not empty. */
    assert_false(got.has & KVT_WIRE_HAS(KVT_WIRE_F_FENCE_HANDLE));
    assert_null(got.u.grant.fence_handle);
    kvt_wire_msg_free(&got);

    /* MEMBERS entry with a fifth element; LOCATE_REPLY holder with a third. */
    t->n = 0;
    tb_map(t, 4);
    tb_hdr(t, 1, 0, KVT_WIRE_MEMBERS);
    tb_u(t, KVT_WIRE_F_MEMBERS);
    tb_arr(t, 1);
    tb_arr(t, 5);
    tb_u(t, 10);
    tb_u(t, 11);
    tb_str(t, "h1", 2);
    tb_u(t, 80);
    tb_map(t, 1);
    tb_u(t, 1);
    tb_u(t, 2);
    assert_int_equal(tb_decode(t, NULL, &got), 0);
    assert_int_equal(got.u.members.n, 1);
    assert_int_equal(got.u.members.v[0].node_id, 10);
    assert_int_equal(got.u.members.v[0].incarnation, 11);
    assert_string_equal(got.u.members.v[0].addr, "h1");
    assert_int_equal(got.u.members.v[0].port, 80);
    kvt_wire_msg_free(&got);
    t->n = 0;
    tb_map(t, 5);
    tb_hdr(t, 1, 0, KVT_WIRE_LOCATE_REPLY);
    tb_u(t, KVT_WIRE_F_REQ_ID);
    tb_u(t, 1);
    tb_u(t, KVT_WIRE_F_HOLDERS);
    tb_arr(t, 2);
    tb_arr(t, 1);
    tb_arr(t, 3);
    tb_u(t, 5);
    tb_u(t, 6);
    tb_u(t, 7);
    tb_arr(t, 0);
    assert_int_equal(tb_decode(t, NULL, &got), 0);
    assert_int_equal(got.u.locate_reply.n_keys, 2);
    assert_int_equal(got.u.locate_reply.holders[0].n, 1);
    assert_int_equal(got.u.locate_reply.holders[0].v[0].node_id, 5);
    assert_int_equal(got.u.locate_reply.holders[0].v[0].incarnation, 6);
    assert_int_equal(got.u.locate_reply.holders[1].n, 0);
    kvt_wire_msg_free(&got);
    free(t);
}

/* Unknown types and another major version are -EPROTO, whatever the fields (a
 * major-2 body may lay them out differently). */
static void test_wire_unknown_type_and_bad_major_refused(void **state)
{
    struct tb *t = calloc(1, sizeof(*t));
    struct kvt_wire_msg got;
    static const uint64_t bad[][2] = {
        {1, 0},
        {1, KVT_WIRE_TYPE_END},
        {1, 99},
        {1, UINT64_MAX},
        {2, KVT_WIRE_HEARTBEAT},
        {0, KVT_WIRE_HEARTBEAT},
        {UINT64_MAX, KVT_WIRE_HEARTBEAT},
    };

    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        t->n = 0;
        tb_map(t, 4);
        tb_hdr(t, bad[i][0], 0, bad[i][1]);
        tb_u(t, KVT_WIRE_F_NODE_ID);
        tb_str(t, "not an int", 10);
        assert_int_equal(tb_decode(t, NULL, &got), -EPROTO);
    }
    /* Control: major 1, type HEARTBEAT, same bad field: malformed. */
    t->n = 0;
    tb_map(t, 4);
    tb_hdr(t, 1, 0, KVT_WIRE_HEARTBEAT);
    tb_u(t, KVT_WIRE_F_NODE_ID);
    tb_str(t, "not an int", 10);
    assert_int_equal(tb_decode(t, NULL, &got), -EBADMSG);
    free(t);
}

/* Everything malformed in a message of a known type is -EBADMSG. */
static void test_wire_malformed_fields_refused(void **state)
{
    struct tb *t = calloc(1, sizeof(*t));
    struct kvt_wire_msg got;
    uint8_t big[KVT_KEY_MAX + 1] = {0};

    /* A PUBLISH with one key field whose content varies. */
#define PUBLISH_WITH(keys_stmt)                                                                    \
    do {                                                                                           \
        t->n = 0;                                                                                  \
        tb_map(t, 6);                                                                              \
        tb_hdr(t, 1, 0, KVT_WIRE_PUBLISH);                                                         \
        tb_u(t, KVT_WIRE_F_NODE_ID);                                                               \
        tb_u(t, 1);                                                                                \
        tb_u(t, KVT_WIRE_F_INCARNATION);                                                           \
        tb_u(t, 1);                                                                                \
        tb_u(t, KVT_WIRE_F_KEYS);                                                                  \
        keys_stmt;                                                                                 \
    } while (0)

    PUBLISH_WITH((tb_arr(t, 1), tb_bin(t, big, 1)));
    assert_int_equal(tb_decode(t, NULL, &got), 0);
    kvt_wire_msg_free(&got);
    PUBLISH_WITH((tb_arr(t, 1), tb_bin(t, big, 0))); /* empty key */
    assert_int_equal(tb_decode(t, NULL, &got), -EBADMSG);
    PUBLISH_WITH((tb_arr(t, 1), tb_bin(t, big, KVT_KEY_MAX + 1))); /* 65-byte key */
    assert_int_equal(tb_decode(t, NULL, &got), -EBADMSG);
    PUBLISH_WITH((tb_arr(t, 1), tb_str(t, "k", 1))); /* str, not bin */
    assert_int_equal(tb_decode(t, NULL, &got), -EBADMSG);
    PUBLISH_WITH(tb_bin(t, big, 1)); /* not a list */
    assert_int_equal(tb_decode(t, NULL, &got), -EBADMSG);
    PUBLISH_WITH((tb_arr(t, 2), tb_bin(t, big, 1), tb_u(t, 1))); /* second key an int */
    assert_int_equal(tb_decode(t, NULL, &got), -EBADMSG);
    PUBLISH_WITH((tb_arr(t, 1), tb_bin(t, big, 1), tb_u(t, 0))); /* trailing byte */
    assert_int_equal(tb_decode(t, NULL, &got), -EBADMSG);

    /* Scalars: out of range, negative, wrong kinds; duplicates; bad keys. */
    static const struct {
        uint8_t field;
        uint8_t bytes[12];
        size_t n;
    } bad_scalar[] = {
        {KVT_WIRE_F_REASON, {0xcf, 0, 0, 0, 1, 0, 0, 0, 0}, 9}, /* 2^32 in a u32 */
        {KVT_WIRE_F_REASON, {0xff}, 1},                         /* -1 */
        {KVT_WIRE_F_REASON, {0xd0, 0x80}, 2},                   /* int8 -128 */
        {KVT_WIRE_F_REASON, {0xc0}, 1},                         /* nil */
        {KVT_WIRE_F_REASON, {0xc3}, 1},                         /* true */
        {KVT_WIRE_F_REASON, {0xca, 0x3f, 0x80, 0, 0}, 5},       /* 1.0f */
        {KVT_WIRE_F_REASON, {0x90}, 1},                         /* [] */
        {KVT_WIRE_F_REASON, {0xc1}, 1},                         /* never used byte */
    };
    for (size_t i = 0; i < sizeof(bad_scalar) / sizeof(bad_scalar[0]); i++) {
        t->n = 0;
        tb_map(t, 4);
        tb_hdr(t, 1, 0, KVT_WIRE_REFUSE);
        tb_u(t, bad_scalar[i].field);
        tb_raw(t, bad_scalar[i].bytes, bad_scalar[i].n);
        assert_int_equal(tb_decode(t, NULL, &got), -EBADMSG);
    }
    t->n = 0; /* a field twice */
    tb_map(t, 5);
    tb_hdr(t, 1, 0, KVT_WIRE_REFUSE);
    tb_u(t, KVT_WIRE_F_REASON);
    tb_u(t, 1);
    tb_u(t, KVT_WIRE_F_REASON);
    tb_u(t, 1);
    assert_int_equal(tb_decode(t, NULL, &got), -EBADMSG);
    t->n = 0; /* the type twice */
    tb_map(t, 5);
    tb_hdr(t, 1, 0, KVT_WIRE_REFUSE);
    tb_u(t, 2);
    tb_u(t, KVT_WIRE_REFUSE);
    tb_u(t, KVT_WIRE_F_REASON);
    tb_u(t, 1);
    assert_int_equal(tb_decode(t, NULL, &got), -EBADMSG);
    t->n = 0; /* a string key */
    tb_map(t, 5);
    tb_hdr(t, 1, 0, KVT_WIRE_REFUSE);
    tb_str(t, "reason", 6);
    tb_u(t, 1);
    tb_u(t, KVT_WIRE_F_REASON);
    tb_u(t, 1);
    assert_int_equal(tb_decode(t, NULL, &got), -EBADMSG);
    t->n = 0; /* no version */
    tb_map(t, 2);
    tb_u(t, 2);
    tb_u(t, KVT_WIRE_AUTH_OK);
    tb_u(t, 1);
    tb_u(t, 0);
    assert_int_equal(tb_decode(t, NULL, &got), -EBADMSG);
    t->n = 0; /* the body is not a map */
    tb_arr(t, 6);
    tb_hdr(t, 1, 0, KVT_WIRE_AUTH_OK);
    assert_int_equal(tb_decode(t, NULL, &got), -EBADMSG);
    t->n = 0; /* type as a string */
    tb_map(t, 3);
    tb_u(t, 0);
    tb_u(t, 1);
    tb_u(t, 1);
    tb_u(t, 0);
    tb_u(t, 2);
    tb_str(t, "\x04", 1);
    assert_int_equal(tb_decode(t, NULL, &got), -EBADMSG);
    t->n = 0; /* AUTH_OK has no fields: the minimal message */
    tb_map(t, 3);
    tb_hdr(t, 1, 0, KVT_WIRE_AUTH_OK);
    assert_int_equal(tb_decode(t, NULL, &got), 0);
    assert_int_equal(got.type, KVT_WIRE_AUTH_OK);
    assert_int_equal(got.has, 0);
    kvt_wire_msg_free(&got);

    /* Fixed-size and string fields. */
    static const size_t bin_sizes[] = {0, 31, 33};

    for (size_t i = 0; i < 3; i++) {
        t->n = 0;
        tb_map(t, 6);
        tb_hdr(t, 1, 0, KVT_WIRE_AUTH);
        tb_u(t, KVT_WIRE_F_NODE_ID);
        tb_u(t, 1);
        tb_u(t, KVT_WIRE_F_INCARNATION);
        tb_u(t, 1);
        tb_u(t, KVT_WIRE_F_PROOF);
        tb_bin(t, big, (uint32_t)bin_sizes[i]);
        assert_int_equal(tb_decode(t, NULL, &got), -EBADMSG);
    }
    static const char *const bad_addr[] = {"a\0b", "0123456789012345678901234567890123456789"
                                                   "012345678901234567890123"};
    static const size_t bad_addr_len[] = {3, 64};

    for (size_t i = 0; i < 2; i++) {
        t->n = 0;
        tb_map(t, 4);
        tb_hdr(t, 1, 0, KVT_WIRE_MEMBERS);
        tb_u(t, KVT_WIRE_F_MEMBERS);
        tb_arr(t, 1);
        tb_arr(t, 4);
        tb_u(t, 1);
        tb_u(t, 1);
        tb_str(t, bad_addr[i], bad_addr_len[i]);
        tb_u(t, 1);
        assert_int_equal(tb_decode(t, NULL, &got), -EBADMSG);
    }
    t->n = 0; /* a member record one element short */
    tb_map(t, 4);
    tb_hdr(t, 1, 0, KVT_WIRE_MEMBERS);
    tb_u(t, KVT_WIRE_F_MEMBERS);
    tb_arr(t, 1);
    tb_arr(t, 3);
    tb_u(t, 1);
    tb_u(t, 1);
    tb_str(t, "a", 1);
    assert_int_equal(tb_decode(t, NULL, &got), -EBADMSG);
    t->n = 0; /* a port over 65535 */
    tb_map(t, 4);
    tb_hdr(t, 1, 0, KVT_WIRE_MEMBERS);
    tb_u(t, KVT_WIRE_F_MEMBERS);
    tb_arr(t, 1);
    tb_arr(t, 4);
    tb_u(t, 1);
    tb_u(t, 1);
    tb_str(t, "a", 1);
    tb_u(t, 65536);
    assert_int_equal(tb_decode(t, NULL, &got), -EBADMSG);

    /* Bad arguments. */
    assert_int_equal(kvt_wire_decode(NULL, 1, NULL, &got), -EINVAL);
    assert_int_equal(kvt_wire_decode(t->b, t->n, NULL, NULL), -EINVAL);
    assert_int_equal(kvt_wire_decode(NULL, 0, NULL, &got), -EBADMSG);
    free(t);
#undef PUBLISH_WITH
}

/* msgpack-c issue #1013: a 5-byte body declaring a 4 GiB array (or map, bin, str)
 * must be refused without allocating: with every allocation failing, the answer is
 * still -EBADMSG (not -ENOMEM). Same inside a valid header, in a frame, and through
 * the stream reader. */
static void test_wire_issue_1013_huge_declared_length(void **state)
{
    static const uint8_t bombs[][5] = {
        {0xdd, 0xff, 0xff, 0xff, 0xff}, /* array32 */
        {0xdf, 0xff, 0xff, 0xff, 0xff}, /* map32 */
        {0xc6, 0xff, 0xff, 0xff, 0xff}, /* bin32 */
        {0xdb, 0xff, 0xff, 0xff, 0xff}, /* str32 */
        {0xc9, 0xff, 0xff, 0xff, 0xff}, /* ext32 */
    };
    struct kvt_wire_msg got;
    struct tb *t = calloc(1, sizeof(*t));

    kvt_alloc_fail_after(0);
    for (size_t i = 0; i < sizeof(bombs) / sizeof(bombs[0]); i++) {
        uint8_t frame[9] = {0, 0, 0, 5};
        const uint8_t *body;
        size_t len, used;
        struct kvt_wire_reader r;

        assert_int_equal(kvt_wire_decode(bombs[i], 5, NULL, &got), -EBADMSG);
        memcpy(frame + 4, bombs[i], 5);
        assert_int_equal(kvt_wire_unframe(frame, sizeof(frame), NULL, &body, &len), 0);
        assert_int_equal(kvt_wire_decode(body, len, NULL, &got), -EBADMSG);

        /* The stream reader needs a buffer for the body: allow exactly that. */
        kvt_alloc_fail_after(-1);
        assert_int_equal(kvt_wire_reader_init(&r, NULL), 0);
        assert_int_equal(kvt_wire_reader_push(&r, frame, sizeof(frame), &used), 1);
        kvt_wire_reader_frame(&r, &body, &len);
        assert_int_equal(len, 5);
        kvt_alloc_fail_after(0);
        assert_int_equal(kvt_wire_decode(body, len, NULL, &got), -EBADMSG);
        kvt_wire_reader_cleanup(&r);

        /* As the keys of a FETCH that is otherwise fine. */
        t->n = 0;
        tb_map(t, 5);
        tb_hdr(t, 1, 0, KVT_WIRE_FETCH);
        tb_u(t, KVT_WIRE_F_JOB_ID);
        tb_u(t, 1);
        tb_u(t, KVT_WIRE_F_KEYS);
        tb_raw(t, bombs[i], 5);
        assert_int_equal(tb_decode(t, NULL, &got), -EBADMSG);
    }
    /* Declared 4096 keys (within max_keys) with one present: still refused before
     * the 4096-key allocation. */
    uint8_t k = 1;

    t->n = 0;
    tb_map(t, 5);
    tb_hdr(t, 1, 0, KVT_WIRE_FETCH);
    tb_u(t, KVT_WIRE_F_JOB_ID);
    tb_u(t, 1);
    tb_u(t, KVT_WIRE_F_KEYS);
    tb_arr(t, 4096);
    tb_bin(t, &k, 1);
    assert_int_equal(tb_decode(t, NULL, &got), -EBADMSG);
    kvt_alloc_fail_after(-1);
    free(t);
}

/* Nesting deeper than max_depth is refused, at the top and under an unknown key;
 * so is a body with more objects than max_elements. */
static void test_wire_depth_and_element_bombs_refused(void **state)
{
    struct tb *t = calloc(1, sizeof(*t));
    struct kvt_wire_msg got;
    struct kvt_wire_limits lim = {.max_elements = 1000};

    kvt_alloc_fail_after(0); /* refused before any allocation */
    for (int i = 0; i < 60000; i++)
        tb_byte(t, 0x91);
    tb_u(t, 0);
    assert_int_equal(tb_decode(t, NULL, &got), -EMSGSIZE);
    t->n = 0;
    for (int i = 0; i < 60000; i++)
        tb_byte(t, 0x81); /* {1: {1: ...}}: map in key position, at depth 9 */
    assert_int_equal(tb_decode(t, NULL, &got), -EMSGSIZE);

    /* Depth 8 allowed (the default), 9 not: an unknown field of AUTH_OK. */
    for (int depth = 8; depth <= 9; depth++) {
        t->n = 0;
        tb_map(t, 4);
        tb_hdr(t, 1, 0, KVT_WIRE_AUTH_OK);
        tb_u(t, 50);
        for (int i = 1; i < depth; i++)
            tb_arr(t, 1);
        tb_u(t, 0);
        kvt_alloc_fail_after(-1);
        int rc = tb_decode(t, NULL, &got);

        assert_int_equal(rc, depth == 8 ? 0 : -EMSGSIZE);
        if (rc == 0)
            kvt_wire_msg_free(&got);
        kvt_alloc_fail_after(0);
    }

    /* 2000 nils under an unknown key: too many objects for max_elements 1000. */
    t->n = 0;
    tb_map(t, 4);
    tb_hdr(t, 1, 0, KVT_WIRE_AUTH_OK);
    tb_u(t, 50);
    tb_arr(t, 2000);
    for (int i = 0; i < 2000; i++)
        tb_byte(t, 0xc0);
    assert_int_equal(tb_decode(t, &lim, &got), -EMSGSIZE);
    kvt_alloc_fail_after(-1);
    assert_int_equal(tb_decode(t, NULL, &got), 0);
    kvt_wire_msg_free(&got);
    free(t);
}

/* Lists longer than the configured limits are -EMSGSIZE, at the limit they pass. */
static void test_wire_list_limits(void **state)
{
    struct kvt_wire_buf b;
    struct sample *s = malloc(sizeof(*s));
    struct kvt_wire_msg got;
    size_t len;
    const uint8_t *body;
    static const struct {
        enum kvt_wire_type type;
        struct kvt_wire_limits at, below;
    } cases[] = {
        {KVT_WIRE_PUBLISH, {.max_keys = 4}, {.max_keys = 3}},
        {KVT_WIRE_FETCH, {.max_keys = 4}, {.max_keys = 3}},
        {KVT_WIRE_LOCATE_REPLY, {.max_holders = 2}, {.max_holders = 1}},
        {KVT_WIRE_LOCATE_REPLY, {.max_keys = 4}, {.max_keys = 3}},
        {KVT_WIRE_MEMBERS, {.max_members = 3}, {.max_members = 2}},
        {KVT_WIRE_GRANT, {.max_handle = 300}, {.max_handle = 299}},
        {KVT_WIRE_GRANT, {.max_keys = 3}, {.max_keys = 2}},
        {KVT_WIRE_GRANT, {.max_depth = 3}, {.max_depth = 2}},
    };

    kvt_wire_buf_init(&b);
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        sample_msg(s, cases[i].type);
        body = encode(&s->m, &b, &len);
        assert_int_equal(kvt_wire_decode(body, len, &cases[i].at, &got), 0);
        kvt_wire_msg_free(&got);
        assert_int_equal(kvt_wire_decode(body, len, &cases[i].below, &got), -EMSGSIZE);
    }
    /* max_frame applies to decode too. */
    sample_msg(s, KVT_WIRE_RELEASE);
    body = encode(&s->m, &b, &len);
    struct kvt_wire_limits lim = {.max_frame = len - 1};

    assert_int_equal(kvt_wire_decode(body, len, &lim, &got), -EMSGSIZE);
    kvt_wire_buf_cleanup(&b);
    free(s);
}

/* The reader refuses a header declaring more than max_frame as soon as the 4 bytes
 * are in, without allocating, and stays refused. Exactly max_frame is accepted. */
static void test_wire_reader_oversize_frame_refused(void **state)
{
    struct kvt_wire_limits lim = {.max_frame = 1024};
    struct kvt_wire_reader r;
    size_t used;
    uint8_t hdr[4] = {0, 0, 0x04, 0x01}, huge[4] = {0xff, 0xff, 0xff, 0xff};
    uint8_t *frame = calloc(1, 1028);
    const uint8_t *body;
    size_t len;

    assert_int_equal(kvt_wire_reader_init(&r, &lim), 0);
    kvt_alloc_fail_after(0);
    assert_int_equal(kvt_wire_reader_push(&r, hdr, 3, &used), 0);
    assert_int_equal(used, 3);
    assert_int_equal(kvt_wire_reader_push(&r, hdr + 3, 1, &used), -EMSGSIZE);
    assert_int_equal(kvt_wire_reader_push(&r, frame, 10, &used), -EMSGSIZE);
    assert_null(r.buf);
    kvt_alloc_fail_after(-1);
    kvt_wire_reader_cleanup(&r);

    assert_int_equal(kvt_wire_reader_init(&r, NULL), 0); /* default 1 MiB */
    kvt_alloc_fail_after(0);
    assert_int_equal(kvt_wire_reader_push(&r, huge, 4, &used), -EMSGSIZE);
    kvt_alloc_fail_after(-1);
    kvt_wire_reader_cleanup(&r);
    assert_int_equal(kvt_wire_unframe(huge, 4, NULL, &body, &len), -EMSGSIZE);

    frame[2] = 0x04; /* 1024 */
    assert_int_equal(kvt_wire_reader_init(&r, &lim), 0);
    assert_int_equal(kvt_wire_reader_push(&r, frame, 1028, &used), 1);
    assert_int_equal(used, 1028);
    kvt_wire_reader_frame(&r, &body, &len);
    assert_int_equal(len, 1024);
    kvt_wire_reader_cleanup(&r);
    assert_int_equal(kvt_wire_unframe(frame, 1028, &lim, &body, &len), 0);
    assert_int_equal(len, 1024);
    assert_int_equal(kvt_wire_unframe(frame, 1029, &lim, &body, &len), -EBADMSG);

    /* The reader's own allocation failing is sticky -ENOMEM. */
    assert_int_equal(kvt_wire_reader_init(&r, &lim), 0);
    kvt_alloc_fail_after(0);
    assert_int_equal(kvt_wire_reader_push(&r, frame, 1028, &used), -ENOMEM);
    kvt_alloc_fail_after(-1);
    assert_int_equal(kvt_wire_reader_push(&r, frame, 1028, &used), -ENOMEM);
    kvt_wire_reader_cleanup(&r);
    free(frame);
}

static uint64_t rng_state;

static uint32_t rng(void)
{
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(rng_state >> 33);
}

/* A stream of every type's frame three times, with an empty frame in the middle,
 * cut at random points: the reader yields each frame whole, in order, and each
 * decodes exactly (the empty one is -EBADMSG). */
static void test_wire_reader_random_split_points(void **state)
{
    struct kvt_wire_buf b;
    struct sample *s = malloc(sizeof(*s));
    enum { NF = 3 * N_TYPES + 1, EMPTY_AT = N_TYPES + 4 };
    size_t starts[NF + 1], total = 0;
    uint8_t *stream = malloc(1 << 16);

    kvt_wire_buf_init(&b);
    for (size_t f = 0; f < NF; f++) {
        starts[f] = total;
        if (f == EMPTY_AT) {
            memset(stream + total, 0, KVT_WIRE_FRAME_HDR);
            total += KVT_WIRE_FRAME_HDR;
            continue;
        }
        size_t len;

        sample_msg(s, all_types[(f - (f > EMPTY_AT)) % N_TYPES]);
        encode(&s->m, &b, &len);
        assert_true(total + b.len <= (1 << 16));
        memcpy(stream + total, b.data, b.len);
        total += b.len;
    }
    starts[NF] = total;

    rng_state = 12345;
    for (int iter = 0; iter < 300; iter++) {
        struct kvt_wire_reader r;
        size_t pos = 0, nframes = 0;
        uint32_t max_piece = 1 + rng() % (iter < 100 ? 8 : 600);

        assert_int_equal(kvt_wire_reader_init(&r, NULL), 0);
        while (pos < total) {
            size_t piece = 1 + rng() % max_piece, used;

            if (piece > total - pos)
                piece = total - pos;
            while (piece > 0) {
                int rc = kvt_wire_reader_push(&r, stream + pos, piece, &used);

                assert_true(rc == 0 || rc == 1);
                assert_true(used <= piece);
                pos += used;
                piece -= used;
                if (rc == 0) {
                    assert_int_equal(piece, 0);
                    continue;
                }
                /* A whole frame: it ends exactly where we are. */
                const uint8_t *body;
                size_t len;
                struct kvt_wire_msg got;

                assert_true(nframes < NF);
                assert_int_equal(pos, starts[nframes + 1]);
                kvt_wire_reader_frame(&r, &body, &len);
                assert_int_equal(len, starts[nframes + 1] - starts[nframes] - 4);
                assert_memory_equal(body, stream + starts[nframes] + 4, len);
                if (nframes == EMPTY_AT) {
                    assert_int_equal(kvt_wire_decode(body, len, NULL, &got), -EBADMSG);
                } else {
                    sample_msg(s, all_types[(nframes - (nframes > EMPTY_AT)) % N_TYPES]);
                    assert_int_equal(kvt_wire_decode(body, len, NULL, &got), 0);
                    assert_msg_equal(&s->m, &got);
                    kvt_wire_msg_free(&got);
                }
                nframes++;
            }
        }
        assert_int_equal(nframes, NF);
        kvt_wire_reader_cleanup(&r);
    }
    kvt_wire_buf_cleanup(&b);
    free(stream);
    free(s);
}

/* Every allocation of decode, and of encode, failing in turn: -ENOMEM, nothing
 * leaked (LeakSanitizer), the output untouched; then success. */
static void test_wire_allocation_failures_unwind(void **state)
{
    struct kvt_wire_buf b, b2;
    struct sample *s = malloc(sizeof(*s));

    kvt_wire_buf_init(&b);
    for (size_t i = 0; i < N_TYPES; i++) {
        size_t len;
        const uint8_t *body;
        int rc;

        sample_msg(s, all_types[i]);
        body = encode(&s->m, &b, &len);
        for (long n = 0;; n++) {
            struct kvt_wire_msg got;

            memset(&got, 0x5a, sizeof(got));
            kvt_alloc_fail_after(n);
            rc = kvt_wire_decode(body, len, NULL, &got);
            kvt_alloc_fail_after(-1);
            if (rc == 0) {
                assert_msg_equal(&s->m, &got);
                kvt_wire_msg_free(&got);
                break;
            }
            assert_int_equal(rc, -ENOMEM);
            assert_int_equal(got.type, 0x5a5a5a5a); /* untouched */
            assert_true(n < 6); /* the tables own at most 6 blocks (GRANT since 1.2) */
        }
        for (long n = 0;; n++) {
            kvt_wire_buf_init(&b2);
            kvt_alloc_fail_after(n);
            rc = kvt_wire_encode(&s->m, &b2);
            kvt_alloc_fail_after(-1);
            if (rc == 0) {
                assert_int_equal(b2.len, b.len);
                assert_memory_equal(b2.data, b.data, b.len);
                kvt_wire_buf_cleanup(&b2);
                break;
            }
            assert_int_equal(rc, -ENOMEM);
            assert_int_equal(b2.len, 0);
            kvt_wire_buf_cleanup(&b2);
        }
    }
    kvt_wire_buf_cleanup(&b);
    free(s);
}

/* The encoder refuses what the decoder would refuse (-EINVAL) and leaves the
 * buffer as it was. */
static void test_wire_encode_refuses_invalid(void **state)
{
    struct kvt_wire_buf b;
    struct sample *s = malloc(sizeof(*s));
    struct kvt_wire_msg m;

    kvt_wire_buf_init(&b);
    sample_msg(s, KVT_WIRE_RELEASE);
    assert_int_equal(kvt_wire_encode(&s->m, &b), 0);
    size_t len0 = b.len;

#define REFUSED(msg)                                                                               \
    do {                                                                                           \
        assert_int_equal(kvt_wire_encode((msg), &b), -EINVAL);                                     \
        assert_int_equal(b.len, len0);                                                             \
    } while (0)

    kvt_wire_msg_init(&m, 0);
    REFUSED(&m);
    kvt_wire_msg_init(&m, KVT_WIRE_TYPE_END);
    REFUSED(&m);
    sample_msg(s, KVT_WIRE_FETCH);
    s->keys[2].len = 0;
    REFUSED(&s->m);
    s->keys[2].len = KVT_KEY_MAX + 1;
    REFUSED(&s->m);
    sample_msg(s, KVT_WIRE_FETCH);
    s->m.u.fetch.keys = NULL;
    REFUSED(&s->m);
    s->m.u.fetch.n_keys = 0; /* an empty list may be NULL */
    assert_int_equal(kvt_wire_encode(&s->m, &b), 0);
    len0 = b.len;
    sample_msg(s, KVT_WIRE_MEMBERS);
    memset(s->members[1].addr, 'a', KVT_WIRE_ADDR_MAX); /* no NUL */
    REFUSED(&s->m);
    sample_msg(s, KVT_WIRE_HELLO);
    memset(s->m.u.hello.addr, 'a', KVT_WIRE_ADDR_MAX);
    REFUSED(&s->m);
    s->m.has &= ~KVT_WIRE_HAS(KVT_WIRE_F_ADDR); /* not sent: not checked */
    assert_int_equal(kvt_wire_encode(&s->m, &b), 0);
    len0 = b.len;
    sample_msg(s, KVT_WIRE_LOCATE_REPLY);
    s->lists[2].v = NULL;
    REFUSED(&s->m);
    sample_msg(s, KVT_WIRE_GRANT);
    s->m.u.grant.handle = NULL;
    REFUSED(&s->m);
    assert_int_equal(kvt_wire_encode(NULL, &b), -EINVAL);
    assert_int_equal(kvt_wire_encode(&s->m, NULL), -EINVAL);
#undef REFUSED
    kvt_wire_buf_cleanup(&b);
    free(s);
}

/* ---- the fuzz seed corpus ---------------------------------------------------- *
 * Input format of tests/fuzz/fuzz_wire.c: byte 0 is the mode; odd: the rest is one
 * body for kvt_wire_decode; even: the rest is a byte stream for the frame reader,
 * pushed in pieces of (mode >> 1) + 1 bytes. */

static void write_seed(const char *dir, const char *name, uint8_t mode, const uint8_t *p, size_t n)
{
    char path[512];
    FILE *f;

    snprintf(path, sizeof(path), "%s/%s", dir, name);
    f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(&mode, 1, 1, f), 1);
    assert_int_equal(fwrite(p, 1, n, f), n);
    assert_int_equal(fclose(f), 0);
}

static void lower(char *dst, const char *src)
{
    for (; *src; src++)
        *dst++ = (char)(*src >= 'A' && *src <= 'Z' ? *src - 'A' + 'a' : *src);
    *dst = 0;
}

/* Writes the seeds into $KVT_WIRE_CORPUS_DIR if set (how the committed corpus is
 * made), else into a scratch directory; either way each body seed must decode. */
static void test_wire_seed_corpus(void **state)
{
    const char *env = getenv("KVT_WIRE_CORPUS_DIR");
    char *dir = env != NULL ? NULL : kt_tmpdir("wire-corpus");
    const char *out = env != NULL ? env : dir;
    struct kvt_wire_buf b, all;
    struct sample *s = malloc(sizeof(*s));
    struct tb *t = calloc(1, sizeof(*t));
    char name[96], lname[32];

    kvt_wire_buf_init(&b);
    kvt_wire_buf_init(&all);
    for (size_t i = 0; i < N_TYPES; i++) {
        size_t len;
        const uint8_t *body;
        struct kvt_wire_msg got;

        sample_msg(s, all_types[i]);
        body = encode(&s->m, &b, &len);
        assert_int_equal(kvt_wire_decode(body, len, NULL, &got), 0);
        kvt_wire_msg_free(&got);
        lower(lname, kvt_wire_type_name((int)all_types[i]));
        snprintf(name, sizeof(name), "body-%02zu-%s", i + 1, lname);
        write_seed(out, name, 1, body, len);
        snprintf(name, sizeof(name), "frame-%02zu-%s", i + 1, lname);
        write_seed(out, name, 0, b.data, b.len);
        assert_int_equal(kvt_wire_encode(&s->m, &all), 0);
    }
    write_seed(out, "stream-all-bytewise", 0, all.data, all.len);
    write_seed(out, "stream-all-7", 12, all.data, all.len);
    write_seed(out, "stream-all-whole", 254, all.data, all.len);

    /* Crafted: newer minor with unknown fields; the 1013 bomb; a depth bomb;
     * an oversized frame header; a bad major. */
    tb_map(t, 7);
    tb_hdr(t, 1, 5, KVT_WIRE_HEARTBEAT);
    tb_u(t, KVT_WIRE_F_NODE_ID);
    tb_u(t, 1);
    tb_u(t, KVT_WIRE_F_INCARNATION);
    tb_u(t, 2);
    tb_u(t, KVT_WIRE_F_SEQ);
    tb_u(t, 3);
    tb_u(t, 60);
    tb_map(t, 1);
    tb_u(t, 1);
    tb_arr(t, 2);
    tb_str(t, "x", 1);
    tb_byte(t, 0xc0);
    write_seed(out, "body-newer-minor", 1, t->b, t->n);
    static const uint8_t bomb[] = {0xdd, 0xff, 0xff, 0xff, 0xff};
    static const uint8_t bomb_frame[] = {0, 0, 0, 5, 0xdd, 0xff, 0xff, 0xff, 0xff};
    static const uint8_t huge_hdr[] = {0xff, 0xff, 0xff, 0xff, 0x80};

    write_seed(out, "body-issue-1013", 1, bomb, sizeof(bomb));
    write_seed(out, "frame-issue-1013", 0, bomb_frame, sizeof(bomb_frame));
    write_seed(out, "frame-oversize", 0, huge_hdr, sizeof(huge_hdr));
    t->n = 0;
    for (int i = 0; i < 40; i++)
        tb_byte(t, 0x91);
    tb_byte(t, 0);
    write_seed(out, "body-depth-bomb", 1, t->b, t->n);
    t->n = 0;
    tb_map(t, 3);
    tb_hdr(t, 2, 0, KVT_WIRE_HELLO);
    write_seed(out, "body-major-2", 1, t->b, t->n);

    if (dir != NULL)
        free(dir);
    kvt_wire_buf_cleanup(&b);
    kvt_wire_buf_cleanup(&all);
    free(t);
    free(s);
}

/* The fields of direct reads (since 1.2): a holder record of 1.0 decodes without a
 * row; an odd generation, a row record of one element, rows that do not match the
 * keys, a direct flag other than 0/1 and one direct handle without the other are
 * refused; the encoder refuses what the decoder would. */
static void test_wire_direct_fields(void **state)
{
    struct tb *t = calloc(1, sizeof(*t));
    struct kvt_wire_msg got;
    struct kvt_wire_buf b;
    struct sample *s = malloc(sizeof(*s));
    uint8_t k = 1;

    (void)state;
    /* LOCATE_REPLY, one key, one holder record built by rec_stmt. */
#define REPLY_WITH(rec_stmt)                                                                       \
    do {                                                                                           \
        t->n = 0;                                                                                  \
        tb_map(t, 5);                                                                              \
        tb_hdr(t, 1, 2, KVT_WIRE_LOCATE_REPLY);                                                    \
        tb_u(t, KVT_WIRE_F_REQ_ID);                                                                \
        tb_u(t, 1);                                                                                \
        tb_u(t, KVT_WIRE_F_HOLDERS);                                                               \
        tb_arr(t, 1);                                                                              \
        tb_arr(t, 1);                                                                              \
        rec_stmt;                                                                                  \
    } while (0)
    REPLY_WITH((tb_arr(t, 2), tb_u(t, 7), tb_u(t, 8)));
    assert_int_equal(tb_decode(t, NULL, &got), 0);
    assert_false(got.u.locate_reply.holders[0].v[0].has_row);
    kvt_wire_msg_free(&got);
    REPLY_WITH((tb_arr(t, 5), tb_u(t, 7), tb_u(t, 8), tb_u(t, 9), tb_u(t, 4), tb_u(t, 0)));
    assert_int_equal(tb_decode(t, NULL, &got), 0); /* a newer element after them: skipped */
    assert_true(got.u.locate_reply.holders[0].v[0].has_row);
    assert_int_equal(got.u.locate_reply.holders[0].v[0].row, 9);
    assert_int_equal(got.u.locate_reply.holders[0].v[0].gen, 4);
    kvt_wire_msg_free(&got);
    REPLY_WITH((tb_arr(t, 4), tb_u(t, 7), tb_u(t, 8), tb_u(t, 9), tb_u(t, 5))); /* odd gen */
    assert_int_equal(tb_decode(t, NULL, &got), -EBADMSG);
    REPLY_WITH((tb_arr(t, 4), tb_u(t, 7), tb_u(t, 8), tb_str(t, "r", 1), tb_u(t, 4)));
    assert_int_equal(tb_decode(t, NULL, &got), -EBADMSG);
    REPLY_WITH((tb_arr(t, 4), tb_u(t, 7), tb_u(t, 8), tb_u(t, 9), tb_u(t, 1ull << 32)));
    assert_int_equal(tb_decode(t, NULL, &got), -EBADMSG);

    /* PUBLISH of one key with rows built by rows_stmt. */
#define PUBLISH_ROWS(rows_stmt)                                                                    \
    do {                                                                                           \
        t->n = 0;                                                                                  \
        tb_map(t, 7);                                                                              \
        tb_hdr(t, 1, 2, KVT_WIRE_PUBLISH);                                                         \
        tb_u(t, KVT_WIRE_F_NODE_ID);                                                               \
        tb_u(t, 1);                                                                                \
        tb_u(t, KVT_WIRE_F_INCARNATION);                                                           \
        tb_u(t, 1);                                                                                \
        tb_u(t, KVT_WIRE_F_KEYS);                                                                  \
        tb_arr(t, 1);                                                                              \
        tb_bin(t, &k, 1);                                                                          \
        tb_u(t, KVT_WIRE_F_ROWS);                                                                  \
        rows_stmt;                                                                                 \
    } while (0)
    PUBLISH_ROWS((tb_arr(t, 1), tb_arr(t, 2), tb_u(t, 3), tb_u(t, 6)));
    assert_int_equal(tb_decode(t, NULL, &got), 0);
    assert_true(got.u.publish.rows[0].known);
    assert_int_equal(got.u.publish.rows[0].row, 3);
    kvt_wire_msg_free(&got);
    PUBLISH_ROWS((tb_arr(t, 1), tb_arr(t, 0)));
    assert_int_equal(tb_decode(t, NULL, &got), 0);
    assert_false(got.u.publish.rows[0].known);
    kvt_wire_msg_free(&got);
    PUBLISH_ROWS((tb_arr(t, 1), tb_arr(t, 1), tb_u(t, 3))); /* one element */
    assert_int_equal(tb_decode(t, NULL, &got), -EBADMSG);
    PUBLISH_ROWS((tb_arr(t, 1), tb_arr(t, 2), tb_u(t, 3), tb_u(t, 7))); /* odd gen */
    assert_int_equal(tb_decode(t, NULL, &got), -EBADMSG);
    PUBLISH_ROWS((tb_arr(t, 0))); /* fewer rows than keys */
    assert_int_equal(tb_decode(t, NULL, &got), -EBADMSG);
    PUBLISH_ROWS((tb_arr(t, 2), tb_arr(t, 0), tb_arr(t, 0))); /* more */
    assert_int_equal(tb_decode(t, NULL, &got), -EBADMSG);
    PUBLISH_ROWS((tb_u(t, 3))); /* not a list */
    assert_int_equal(tb_decode(t, NULL, &got), -EBADMSG);

    /* FETCH direct 2; GRANT with one direct handle only. */
    t->n = 0;
    tb_map(t, 6);
    tb_hdr(t, 1, 2, KVT_WIRE_FETCH);
    tb_u(t, KVT_WIRE_F_JOB_ID);
    tb_u(t, 1);
    tb_u(t, KVT_WIRE_F_KEYS);
    tb_arr(t, 1);
    tb_bin(t, &k, 1);
    tb_u(t, KVT_WIRE_F_DIRECT);
    tb_u(t, 2);
    assert_int_equal(tb_decode(t, NULL, &got), -EBADMSG);
    kvt_wire_buf_init(&b);
    sample_msg(s, KVT_WIRE_GRANT);
    s->m.has &= ~KVT_WIRE_HAS(KVT_WIRE_F_DIRECT_FENCE_HANDLE);
    assert_int_equal(kvt_wire_encode(&s->m, &b), 0); /* the encoder does not pair them */
    assert_int_equal(
        kvt_wire_decode(b.data + KVT_WIRE_FRAME_HDR, b.len - KVT_WIRE_FRAME_HDR, NULL, &got),
        -EBADMSG);
    /* The encoder refuses odd generations and rows that do not match the keys. */
    kvt_wire_buf_reset(&b);
    sample_msg(s, KVT_WIRE_LOCATE_REPLY);
    s->holders[0].gen = 3;
    assert_int_equal(kvt_wire_encode(&s->m, &b), -EINVAL);
    sample_msg(s, KVT_WIRE_PUBLISH);
    s->rows[0].gen = 3;
    assert_int_equal(kvt_wire_encode(&s->m, &b), -EINVAL);
    sample_msg(s, KVT_WIRE_PUBLISH);
    s->m.u.publish.n_rows = 3;
    assert_int_equal(kvt_wire_encode(&s->m, &b), -EINVAL);
    assert_int_equal(b.len, 0);
#undef REPLY_WITH
#undef PUBLISH_ROWS
    kvt_wire_buf_cleanup(&b);
    free(s);
    free(t);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_wire_round_trip_every_type),
        cmocka_unit_test(test_wire_optional_and_required_fields),
        cmocka_unit_test(test_wire_every_truncation_refused),
        cmocka_unit_test(test_wire_unknown_fields_skipped),
        cmocka_unit_test(test_wire_auth_of_1_4_skips_holds),
        cmocka_unit_test(test_wire_unknown_type_and_bad_major_refused),
        cmocka_unit_test(test_wire_malformed_fields_refused),
        cmocka_unit_test(test_wire_issue_1013_huge_declared_length),
        cmocka_unit_test(test_wire_depth_and_element_bombs_refused),
        cmocka_unit_test(test_wire_list_limits),
        cmocka_unit_test(test_wire_reader_oversize_frame_refused),
        cmocka_unit_test(test_wire_reader_random_split_points),
        cmocka_unit_test(test_wire_allocation_failures_unwind),
        cmocka_unit_test(test_wire_encode_refuses_invalid),
        cmocka_unit_test(test_wire_direct_fields),
        cmocka_unit_test(test_wire_seed_corpus),
    };

    return cmocka_run_group_tests(tests, NULL, NULL);
}

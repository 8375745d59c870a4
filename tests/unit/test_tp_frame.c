/* The frame reader of a transport connection (transport/tp_frame.c, kvt/tp_frame.h):
 * the first code to see every byte an unauthenticated peer sends to the peer port.
 * Good streams in both roles, whole and a byte at a time; each hostile input of
 * issue #21 (64 zero bytes, 16 bytes of 0xff, a little-endian length 4 and 16 bytes)
 * refused by its first header; every bound (type, flags, length per type, the count
 * of messages, HELLO only first, nothing after ADDR); dead after an error. Also
 * writes the seed corpus of tests/fuzz/fuzz_preauth (KVT_PREAUTH_CORPUS_DIR). */
#include <endian.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "test_util.h"

#include "kvt/auth.h"
#include "kvt/tp_frame.h"
#include "kvt/wire.h"

struct stream {
    uint8_t b[64 << 10];
    size_t n;
};

static void put_frame(struct stream *s, uint8_t type, const void *p, size_t len)
{
    assert_true(s->n + KVT_TP_FRAME_HDR + len <= sizeof(s->b));
    kvt_tp_frame_hdr(s->b + s->n, type, (uint32_t)len);
    s->n += KVT_TP_FRAME_HDR;
    if (len > 0)
        memcpy(s->b + s->n, p, len);
    s->n += len;
}

static void put_msg(struct stream *s, const struct kvt_wire_msg *m)
{
    struct kvt_wire_buf b;

    kvt_wire_buf_init(&b);
    assert_int_equal(kvt_wire_encode(m, &b), 0);
    put_frame(s, KVT_TP_FRAME_DATA, b.data, b.len);
    kvt_wire_buf_cleanup(&b);
}

static void put_hello(struct stream *s)
{
    uint32_t v = htole32(2);

    put_frame(s, KVT_TP_FRAME_HELLO, &v, sizeof(v));
}

static void put_addr(struct stream *s, size_t waddr_len)
{
    uint8_t p[KVT_TP_FRAME_ADDR_MAX];

    for (size_t i = 0; i < sizeof(p); i++)
        p[i] = (uint8_t)(i * 13);
    put_frame(s, KVT_TP_FRAME_ADDR, p, KVT_TP_FRAME_TOKEN_BYTES + waddr_len);
}

static void hs_msg(struct kvt_wire_msg *m, enum kvt_wire_type t)
{
    kvt_wire_msg_init(m, t);
    m->u.hello.node_id = 0x42;
    m->u.hello.incarnation = 7;
    kvt_auth_namespace("test-ns", m->u.hello.ns);
    memset(m->u.hello.nonce, 0x11, sizeof(m->u.hello.nonce));
    memset(m->u.hello.proof, 0x22, sizeof(m->u.hello.proof));
}

/* The server's view of a client: HELLO, AUTH, a READ request, ADDR. */
static void client_stream(struct stream *s)
{
    struct kvt_wire_msg m;
    uint64_t rd[3] = {htole64(0x1000), htole64(4096), htole64(1)};

    s->n = 0;
    hs_msg(&m, KVT_WIRE_HELLO);
    put_msg(s, &m);
    hs_msg(&m, KVT_WIRE_AUTH);
    put_msg(s, &m);
    put_frame(s, KVT_TP_FRAME_RDREQ, rd, sizeof(rd));
    put_addr(s, 215);
}

/* The client's view of a server: our HELLO, HELLO_ACK, AUTH_OK, ADDR. */
static void server_stream(struct stream *s)
{
    struct kvt_wire_msg m;

    s->n = 0;
    put_hello(s);
    hs_msg(&m, KVT_WIRE_HELLO_ACK);
    put_msg(s, &m);
    kvt_wire_msg_init(&m, KVT_WIRE_AUTH_OK);
    put_msg(s, &m);
    put_addr(s, 50);
}

static bool g_decode; /* feed: DATA frames must be handshake messages */

/* Feeds s in pieces; the frame types seen into types (0-terminated); the push result
 * that ended it (0: all taken, or -EPROTO). */
static int feed(bool active, const uint8_t *p, size_t n, size_t piece, uint8_t *types, size_t cap)
{
    static struct kvt_tp_frame_reader r;
    size_t k = 0;

    kvt_tp_frame_reader_init(&r, active);
    for (size_t at = 0; at < n;) {
        size_t len = n - at < piece ? n - at : piece, off = 0;

        while (off < len) {
            struct kvt_tp_frame f;
            size_t used;
            int rc = kvt_tp_frame_push(&r, p + at + off, len - off, &used, &f);

            assert_true(used <= len - off);
            if (rc < 0) {
                types[k] = 0;
                assert_int_equal(rc, -EPROTO);
                assert_int_equal(kvt_tp_frame_push(&r, p, 1, &used, &f), -EPROTO); /* dead */
                return rc;
            }
            off += used;
            if (rc == 0) {
                assert_int_equal(off, len);
                break;
            }
            assert_true(k + 1 < cap);
            types[k++] = f.type;
            if (g_decode && f.type == KVT_TP_FRAME_DATA) { /* the handshake decoder's */
                const uint8_t *body;
                size_t blen;
                struct kvt_wire_msg m;

                assert_int_equal(kvt_wire_unframe(f.payload, f.len, NULL, &body, &blen), 0);
                assert_int_equal(kvt_wire_decode(body, blen, NULL, &m), 0);
                kvt_wire_msg_free(&m);
            }
        }
        at += len;
    }
    types[k] = 0;
    return 0;
}

static void test_good_streams(void **state)
{
    static struct stream s;
    static const uint8_t want_c[] = {KVT_TP_FRAME_DATA, KVT_TP_FRAME_DATA, KVT_TP_FRAME_RDREQ,
                                     KVT_TP_FRAME_ADDR, 0};
    static const uint8_t want_s[] = {KVT_TP_FRAME_HELLO, KVT_TP_FRAME_DATA, KVT_TP_FRAME_DATA,
                                     KVT_TP_FRAME_ADDR, 0};
    const size_t pieces[] = {1, 3, 8, 9, 100, 1 << 20};
    uint8_t types[16];

    (void)state;
    g_decode = true;
    for (size_t i = 0; i < sizeof(pieces) / sizeof(pieces[0]); i++) {
        client_stream(&s);
        assert_int_equal(feed(false, s.b, s.n, pieces[i], types, sizeof(types)), 0);
        assert_memory_equal(types, want_c, sizeof(want_c));
        server_stream(&s);
        assert_int_equal(feed(true, s.b, s.n, pieces[i], types, sizeof(types)), 0);
        assert_memory_equal(types, want_s, sizeof(want_s));
    }
    /* A DATA frame of no bytes is a frame. */
    g_decode = false;
    s.n = 0;
    put_frame(&s, KVT_TP_FRAME_DATA, NULL, 0);
    assert_int_equal(feed(false, s.b, s.n, 1, types, sizeof(types)), 0);
    assert_int_equal(types[0], KVT_TP_FRAME_DATA);
    assert_int_equal(types[1], 0);
}

/* Issue #21's inputs, which aborted a node through UCX's sockcm listener, and the
 * same against the active side: refused by the first header, nothing taken past it. */
static void test_hostile_inputs(void **state)
{
    uint8_t zeros[64] = {0}, ff[16], len4[20] = {4, 0, 0, 0};
    uint8_t types[4];

    (void)state;
    memset(ff, 0xff, sizeof(ff));
    memset(len4 + 4, 0x41, 16);
    for (int active = 0; active < 2; active++) {
        assert_int_equal(feed(active, zeros, sizeof(zeros), 64, types, 4), -EPROTO);
        assert_int_equal(feed(active, ff, sizeof(ff), 16, types, 4), -EPROTO);
        assert_int_equal(feed(active, len4, sizeof(len4), 20, types, 4), -EPROTO);
        assert_int_equal(feed(active, zeros, sizeof(zeros), 1, types, 4), -EPROTO);
        assert_int_equal(types[0], 0);
    }
    /* 7 bytes: not judged yet, all taken. */
    assert_int_equal(feed(false, ff, 7, 7, types, 4), 0);
}

static void test_bounds(void **state)
{
    static struct stream s;
    uint8_t big[KVT_TP_PREAUTH_MSG_BYTES + 1] = {0}, types[16];
    uint64_t rd[3] = {0};

    (void)state;
    /* DATA: at most KVT_TP_PREAUTH_MSG_BYTES, judged by the header alone. */
    s.n = 0;
    put_frame(&s, KVT_TP_FRAME_DATA, big, sizeof(big));
    assert_int_equal(feed(false, s.b, KVT_TP_FRAME_HDR, 8, types, 16), -EPROTO);
    /* Messages (DATA and RDREQ): KVT_TP_PREAUTH_MSGS, not one more. */
    s.n = 0;
    for (int i = 0; i < KVT_TP_PREAUTH_MSGS; i++)
        put_frame(&s, i % 2 ? KVT_TP_FRAME_RDREQ : KVT_TP_FRAME_DATA, rd, sizeof(rd));
    assert_int_equal(feed(false, s.b, s.n, 5, types, 16), 0);
    put_frame(&s, KVT_TP_FRAME_DATA, NULL, 0);
    assert_int_equal(feed(false, s.b, s.n, 5, types, 16), -EPROTO);
    /* RDREQ: exactly 24 bytes. */
    s.n = 0;
    put_frame(&s, KVT_TP_FRAME_RDREQ, rd, 16);
    assert_int_equal(feed(false, s.b, s.n, 64, types, 16), -EPROTO);
    /* HELLO: first, only on the active side, only once, 4 bytes. */
    s.n = 0;
    put_hello(&s);
    assert_int_equal(feed(false, s.b, s.n, 64, types, 16), -EPROTO);
    put_hello(&s);
    assert_int_equal(feed(true, s.b, s.n, 64, types, 16), -EPROTO);
    assert_int_equal(types[0], KVT_TP_FRAME_HELLO);
    s.n = 0;
    put_frame(&s, KVT_TP_FRAME_HELLO, rd, 8);
    assert_int_equal(feed(true, s.b, s.n, 64, types, 16), -EPROTO);
    s.n = 0;
    put_frame(&s, KVT_TP_FRAME_DATA, NULL, 0);
    assert_int_equal(feed(true, s.b, s.n, 64, types, 16), -EPROTO); /* not HELLO first */
    /* ADDR: a token and at least a byte, at most KVT_TP_FRAME_ADDR_MAX; then nothing. */
    s.n = 0;
    put_frame(&s, KVT_TP_FRAME_ADDR, big, KVT_TP_FRAME_TOKEN_BYTES);
    assert_int_equal(feed(false, s.b, s.n, 64, types, 16), -EPROTO);
    s.n = 0;
    kvt_tp_frame_hdr(s.b, KVT_TP_FRAME_ADDR, KVT_TP_FRAME_ADDR_MAX + 1);
    assert_int_equal(feed(false, s.b, KVT_TP_FRAME_HDR, 64, types, 16), -EPROTO);
    s.n = 0;
    put_addr(&s, KVT_TP_FRAME_WADDR_MAX);
    assert_int_equal(feed(false, s.b, s.n, 4096, types, 16), 0);
    put_frame(&s, KVT_TP_FRAME_DATA, NULL, 0);
    assert_int_equal(feed(false, s.b, s.n, 4096, types, 16), -EPROTO);
    /* Unknown type, flags not 0, another magic. */
    s.n = 0;
    put_frame(&s, 9, NULL, 0);
    assert_int_equal(feed(false, s.b, s.n, 64, types, 16), -EPROTO);
    s.n = 0;
    put_frame(&s, KVT_TP_FRAME_DATA, NULL, 0);
    s.b[3] = 1;
    assert_int_equal(feed(false, s.b, s.n, 64, types, 16), -EPROTO);
    s.b[3] = 0;
    s.b[0] ^= 1;
    assert_int_equal(feed(false, s.b, s.n, 64, types, 16), -EPROTO);
}

static const char *g_written[16];
static size_t g_n_written;

static void write_seed(const char *dir, const char *name, uint8_t mode, const uint8_t *p, size_t n)
{
    char path[512];
    FILE *f;

    assert_true(g_n_written < 16);
    g_written[g_n_written++] = name;
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(&mode, 1, 1, f), 1);
    assert_int_equal(fwrite(p, 1, n, f), n);
    assert_int_equal(fclose(f), 0);
}

/* Seeds of fuzz_preauth (byte 0: bit 0 the role, the rest the piece size - 1). */
static void test_tp_frame_seed_corpus(void **state)
{
    static struct stream s;
    const char *env = getenv("KVT_PREAUTH_CORPUS_DIR");
    char *dir = env != NULL ? NULL : kt_tmpdir("preauth-corpus");
    const char *out = env != NULL ? env : dir;
    uint8_t zeros[64] = {0}, ff[16], len4[20] = {4, 0, 0, 0};

    (void)state;
    client_stream(&s);
    write_seed(out, "client-whole", 0xfe, s.b, s.n);
    write_seed(out, "client-bytewise", 0, s.b, s.n);
    write_seed(out, "client-7", 12, s.b, s.n);
    server_stream(&s);
    write_seed(out, "server-whole", 0xff, s.b, s.n);
    write_seed(out, "server-bytewise", 1, s.b, s.n);
    memset(ff, 0xff, sizeof(ff));
    memset(len4 + 4, 0x41, 16);
    write_seed(out, "hostile-64-zeros", 0xfe, zeros, sizeof(zeros));
    write_seed(out, "hostile-16-ff", 0xfe, ff, sizeof(ff));
    write_seed(out, "hostile-len4", 0xfe, len4, sizeof(len4));
    if (dir != NULL) { /* a run of the test, not a corpus refresh: leave nothing */
        char path[512];

        for (size_t i = 0; i < g_n_written; i++) {
            snprintf(path, sizeof(path), "%s/%s", dir, g_written[i]);
            assert_int_equal(unlink(path), 0);
        }
        assert_int_equal(rmdir(dir), 0);
        free(dir);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_good_streams),
        cmocka_unit_test(test_hostile_inputs),
        cmocka_unit_test(test_bounds),
        cmocka_unit_test(test_tp_frame_seed_corpus),
    };

    return cmocka_run_group_tests(tests, NULL, NULL);
}

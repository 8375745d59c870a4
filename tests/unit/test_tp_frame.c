/* The frame reader of a transport connection (transport/tp_frame.c, kvt/tp_frame.h):
 * the first code to see every byte an unauthenticated peer sends to the peer port.
 * Good streams in both roles, whole and a byte at a time; each hostile input of
 * issue #21 (64 zero bytes, 16 bytes of 0xff, a little-endian length 4 and 16 bytes)
 * refused by its first header; every bound (type, flags, length per type, the count
 * of messages, HELLO only first, nothing after ADDR but one MODE); dead after an
 * error. Socket mode: nothing of it before the owner opens the reader; then MSG
 * (bounded by msg_max) and RDREP payloads into the caller's sink, pushed or read
 * straight in, RDREP's fixed part checked. Also writes the seed corpus of
 * tests/fuzz/fuzz_preauth (KVT_PREAUTH_CORPUS_DIR). */
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
    uint32_t v = htole32(3);

    put_frame(s, KVT_TP_FRAME_HELLO, &v, sizeof(v));
}

static void put_addr(struct stream *s, size_t waddr_len)
{
    uint8_t p[KVT_TP_FRAME_ADDR_MAX];

    for (size_t i = 0; i < sizeof(p); i++)
        p[i] = (uint8_t)(i * 13);
    memset(p + KVT_TP_FRAME_TOKEN_BYTES, 0, KVT_TP_FRAME_CAPS_BYTES);
    put_frame(s, KVT_TP_FRAME_ADDR, p,
              KVT_TP_FRAME_TOKEN_BYTES + KVT_TP_FRAME_CAPS_BYTES + waddr_len);
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

/* A server in socket mode, as a client sees it: the server stream, MODE=SOCKET,
 * a message, a READ request, a reply with bytes, a refusal. */
static void socket_stream(struct stream *s)
{
    uint32_t mode = htole32(KVT_TP_MODE_SOCKET);
    uint64_t rd[3] = {htole64(0x1000), htole64(4096), htole64(9)};
    uint8_t rep[KVT_TP_FRAME_RDREP_BYTES] = {0};
    uint64_t tag = htole64(1), len = htole64(300);
    uint32_t err = htole32(EACCES);

    server_stream(s);
    put_frame(s, KVT_TP_FRAME_MODE, &mode, sizeof(mode));
    put_frame(s, KVT_TP_FRAME_MSG, "message", 7);
    put_frame(s, KVT_TP_FRAME_RDREQ, rd, sizeof(rd));
    memcpy(rep, &tag, 8);
    memcpy(rep + 8, &len, 8);
    put_frame(s, KVT_TP_FRAME_RDREP, rep, sizeof(rep));
    for (int i = 0; i < 300; i++)
        s->b[s->n++] = (uint8_t)i;
    memset(rep + 8, 0, 8);
    memcpy(rep + 16, &err, 4);
    put_frame(s, KVT_TP_FRAME_RDREP, rep, sizeof(rep));
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
    /* ADDR: a token, the caps and at least a byte, at most KVT_TP_FRAME_ADDR_MAX; then
     * nothing but one MODE. */
    s.n = 0;
    put_frame(&s, KVT_TP_FRAME_ADDR, big, KVT_TP_FRAME_TOKEN_BYTES);
    assert_int_equal(feed(false, s.b, s.n, 64, types, 16), -EPROTO);
    s.n = 0;
    put_frame(&s, KVT_TP_FRAME_ADDR, big, KVT_TP_FRAME_ADDR_MIN - 1);
    assert_int_equal(feed(false, s.b, s.n, 64, types, 16), -EPROTO);
    s.n = 0;
    put_frame(&s, KVT_TP_FRAME_ADDR, big, KVT_TP_FRAME_ADDR_MIN);
    assert_int_equal(feed(false, s.b, s.n, 64, types, 16), 0);
    s.n = 0;
    kvt_tp_frame_hdr(s.b, KVT_TP_FRAME_ADDR, KVT_TP_FRAME_ADDR_MAX + 1);
    assert_int_equal(feed(false, s.b, KVT_TP_FRAME_HDR, 64, types, 16), -EPROTO);
    s.n = 0;
    put_addr(&s, KVT_TP_FRAME_WADDR_MAX);
    assert_int_equal(feed(false, s.b, s.n, 4096, types, 16), 0);
    put_frame(&s, KVT_TP_FRAME_DATA, NULL, 0);
    assert_int_equal(feed(false, s.b, s.n, 4096, types, 16), -EPROTO);
    /* The frames of socket mode are nothing before ADDR, nor after it unopened. */
    for (uint8_t t = KVT_TP_FRAME_MODE; t <= KVT_TP_FRAME_RDREP; t++) {
        s.n = 0;
        put_frame(&s, t, rd, t == KVT_TP_FRAME_MODE ? 4 : sizeof(rd));
        assert_int_equal(feed(false, s.b, s.n, 64, types, 16), -EPROTO);
        s.n = 0;
        put_addr(&s, 20);
        put_frame(&s, t, rd, t == KVT_TP_FRAME_MODE ? 4 : sizeof(rd));
        assert_int_equal(feed(false, s.b, s.n, 64, types, 16),
                         t == KVT_TP_FRAME_MODE ? 0 : -EPROTO);
    }
    /* One MODE of 4 bytes, then nothing. */
    s.n = 0;
    put_addr(&s, 20);
    put_frame(&s, KVT_TP_FRAME_MODE, rd, 8);
    assert_int_equal(feed(false, s.b, s.n, 64, types, 16), -EPROTO);
    s.n = 0;
    put_addr(&s, 20);
    put_frame(&s, KVT_TP_FRAME_MODE, rd, 4);
    put_frame(&s, KVT_TP_FRAME_MODE, rd, 4);
    assert_int_equal(feed(false, s.b, s.n, 64, types, 16), -EPROTO);
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

/* A reader past ADDR, opened for socket mode with msg_max 100. */
static void open_reader(struct kvt_tp_frame_reader *r)
{
    static struct stream s;
    struct kvt_tp_frame f;
    size_t used;

    kvt_tp_frame_reader_init(r, false);
    assert_int_equal(kvt_tp_frame_reader_open(r, 100), -EPROTO); /* not before ADDR */
    s.n = 0;
    put_addr(&s, 20);
    assert_int_equal(kvt_tp_frame_push(r, s.b, s.n, &used, &f), 1);
    assert_int_equal(f.type, KVT_TP_FRAME_ADDR);
    assert_int_equal(kvt_tp_frame_reader_open(r, 100), 0);
}

static void put_rdrep(struct stream *s, uint64_t tag, uint64_t len, uint32_t err, uint32_t zero)
{
    uint8_t p[KVT_TP_FRAME_RDREP_BYTES];

    tag = htole64(tag);
    len = htole64(len);
    err = htole32(err);
    memcpy(p, &tag, 8);
    memcpy(p + 8, &len, 8);
    memcpy(p + 16, &err, 4);
    memcpy(p + 20, &zero, 4);
    put_frame(s, KVT_TP_FRAME_RDREP, p, sizeof(p));
}

static void test_socket_mode(void **state)
{
    static struct kvt_tp_frame_reader r;
    static struct stream s;
    static uint8_t sink[200000];
    uint8_t msg[100], rd[24] = {0};
    struct kvt_tp_frame f;
    size_t used, off;
    uint8_t *dst;

    (void)state;
    /* MSG (sink), RDREQ (inline), RDREP (fixed part inline, bytes to the sink), a
     * refusal (no bytes), MSG of 0 bytes: pushed whole. */
    open_reader(&r);
    memset(msg, 0x42, sizeof(msg));
    s.n = 0;
    put_frame(&s, KVT_TP_FRAME_MSG, msg, sizeof(msg));
    put_frame(&s, KVT_TP_FRAME_RDREQ, rd, sizeof(rd));
    put_rdrep(&s, 7, 5000, 0, 0);
    for (int i = 0; i < 5000; i++)
        s.b[s.n++] = (uint8_t)i;
    put_rdrep(&s, 8, 0, EACCES, 0);
    put_frame(&s, KVT_TP_FRAME_MSG, NULL, 0);
    off = 0;
    assert_int_equal(kvt_tp_frame_push(&r, s.b, s.n, &used, &f), 1);
    assert_int_equal(f.type, KVT_TP_FRAME_MSG);
    assert_int_equal(f.sink_len, 100);
    assert_null(f.payload);
    off += used;
    /* A sink is due: pushing before giving one is the caller's bug, nothing taken. */
    assert_int_equal(kvt_tp_frame_push(&r, s.b + off, s.n - off, &used, &f), -EINVAL);
    assert_int_equal(used, 0);
    kvt_tp_frame_sink(&r, sink);
    assert_int_equal(kvt_tp_frame_push(&r, s.b + off, s.n - off, &used, &f), 2);
    off += used;
    assert_int_equal(f.type, KVT_TP_FRAME_MSG);
    assert_memory_equal(sink, msg, sizeof(msg));
    assert_int_equal(kvt_tp_frame_push(&r, s.b + off, s.n - off, &used, &f), 1);
    off += used;
    assert_int_equal(f.type, KVT_TP_FRAME_RDREQ);
    assert_int_equal(f.sink_len, 0);
    assert_int_equal(kvt_tp_frame_push(&r, s.b + off, s.n - off, &used, &f), 1);
    off += used;
    assert_int_equal(f.type, KVT_TP_FRAME_RDREP);
    assert_int_equal(f.sink_len, 5000);
    kvt_tp_frame_sink(&r, sink);
    /* Read straight in: the first 3000 bytes as if by readv into the sink. */
    assert_int_equal(kvt_tp_frame_sink_want(&r, &dst), 5000);
    assert_ptr_equal(dst, sink);
    memcpy(dst, s.b + off, 3000);
    assert_false(kvt_tp_frame_sink_got(&r, 3000));
    off += 3000;
    assert_int_equal(kvt_tp_frame_sink_want(&r, &dst), 2000);
    assert_ptr_equal(dst, sink + 3000);
    assert_int_equal(kvt_tp_frame_push(&r, s.b + off, 10, &used, &f), 0); /* part */
    off += used;
    assert_int_equal(kvt_tp_frame_push(&r, s.b + off, s.n - off, &used, &f), 2);
    off += used;
    for (int i = 0; i < 5000; i++)
        assert_int_equal(sink[i], (uint8_t)i);
    assert_int_equal(kvt_tp_frame_sink_want(&r, &dst), 0);
    assert_int_equal(kvt_tp_frame_push(&r, s.b + off, s.n - off, &used, &f), 1);
    off += used;
    assert_int_equal(f.type, KVT_TP_FRAME_RDREP);
    assert_int_equal(f.sink_len, 0); /* a refusal: the frame is whole */
    assert_int_equal(kvt_tp_frame_push(&r, s.b + off, s.n - off, &used, &f), 1);
    off += used;
    assert_int_equal(f.type, KVT_TP_FRAME_MSG);
    assert_int_equal(f.sink_len, 0);
    assert_int_equal(off, s.n);

    /* Bounds once open: MSG over msg_max; RDREQ and RDREP of another length; an error
     * reply with bytes; RDREP's fourth word not 0; pre-auth frames and MODE. */
    const struct {
        uint8_t type;
        uint32_t len;
    } bad[] = {{KVT_TP_FRAME_MSG, 101},  {KVT_TP_FRAME_RDREQ, 16},
               {KVT_TP_FRAME_RDREP, 16}, {KVT_TP_FRAME_DATA, 0},
               {KVT_TP_FRAME_HELLO, 4},  {KVT_TP_FRAME_ADDR, 100},
               {KVT_TP_FRAME_MODE, 4},   {9, 0}};

    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        open_reader(&r);
        s.n = 0;
        kvt_tp_frame_hdr(s.b, bad[i].type, bad[i].len);
        assert_int_equal(kvt_tp_frame_push(&r, s.b, KVT_TP_FRAME_HDR, &used, &f), -EPROTO);
        assert_int_equal(kvt_tp_frame_push(&r, s.b, 1, &used, &f), -EPROTO); /* dead */
    }
    open_reader(&r);
    s.n = 0;
    put_rdrep(&s, 1, 10, EACCES, 0);
    assert_int_equal(kvt_tp_frame_push(&r, s.b, s.n, &used, &f), -EPROTO);
    open_reader(&r);
    s.n = 0;
    put_rdrep(&s, 1, 10, 0, 1);
    assert_int_equal(kvt_tp_frame_push(&r, s.b, s.n, &used, &f), -EPROTO);
    /* A reply larger than any frame length (64-bit): the caller's sink decides. */
    open_reader(&r);
    s.n = 0;
    put_rdrep(&s, 1, 5ull << 32, 0, 0);
    assert_int_equal(kvt_tp_frame_push(&r, s.b, s.n, &used, &f), 1);
    assert_true(f.sink_len == (5ull << 32));
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
    socket_stream(&s);
    write_seed(out, "socket-whole", 0xff, s.b, s.n);
    write_seed(out, "socket-9", 17, s.b, s.n);
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
        cmocka_unit_test(test_socket_mode),
        cmocka_unit_test(test_tp_frame_seed_corpus),
    };

    return cmocka_run_group_tests(tests, NULL, NULL);
}

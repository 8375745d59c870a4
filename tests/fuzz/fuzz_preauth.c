/* libFuzzer target for what an unauthenticated peer can send to the peer port: the
 * frame reader of a transport connection (kvt/tp_frame.h) and the handshake decoder
 * its DATA frames feed (kvt_wire_unframe + kvt_wire_decode, as cluster/peers.c's
 * tp_on_msg calls them, with the same default limits).
 *
 * Input: byte 0 is the mode. Bit 0: the role (1: we dialled, so the stream must
 * start with HELLO; 0: we accepted). The rest of it: the stream is pushed through
 * the reader in pieces of (mode >> 1) + 1 bytes. The seeds in corpus/preauth are
 * written by test_tp_frame's test_tp_frame_seed_corpus.
 *
 * Checked on every input, beyond the sanitizers' own checks:
 * - push returns 1, 0 or -EPROTO only, takes at most what it was given and all of it
 *   when it returns 0, and fails forever after its first error;
 * - every frame is of a known type within its type's length bound, HELLO (only) first
 *   and only when we dialled, at most KVT_TP_PREAUTH_MSGS DATA and RDREQ frames,
 *   nothing after ADDR;
 * - decoding a DATA frame fails only with -EBADMSG, -EPROTO or -EMSGSIZE, and a
 *   decoded message holds at most 24 heap bytes per body byte. */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvt/tp_frame.h"
#include "kvt/wire.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "fuzz_preauth: check failed: %s (line %d)\n", #cond, __LINE__);        \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

static void check_handshake(const uint8_t *p, size_t len)
{
    struct kvt_wire_limits lim = {0};
    struct kvt_wire_msg m;
    const uint8_t *body;
    size_t blen;
    int rc;

    kvt_wire_limits_default(&lim);
    rc = kvt_wire_unframe(p, len, &lim, &body, &blen);
    if (rc == 0)
        rc = kvt_wire_decode(body, blen, &lim, &m);
    if (rc != 0) {
        CHECK(rc == -EBADMSG || rc == -EPROTO || rc == -EMSGSIZE);
        return;
    }
    CHECK(m.heap_bytes <= 24 * blen);
    kvt_wire_msg_free(&m);
}

static void check_frame(const struct kvt_tp_frame *f, bool active, unsigned *n_frames,
                        unsigned *n_msgs, bool *done)
{
    CHECK(!*done);
    CHECK((f->type == KVT_TP_FRAME_HELLO) == (active && *n_frames == 0));
    switch (f->type) {
    case KVT_TP_FRAME_HELLO:
        CHECK(f->len == KVT_TP_FRAME_HELLO_BYTES);
        break;
    case KVT_TP_FRAME_DATA:
        CHECK(f->len <= KVT_TP_PREAUTH_MSG_BYTES);
        (*n_msgs)++;
        check_handshake(f->payload, f->len);
        break;
    case KVT_TP_FRAME_RDREQ:
        CHECK(f->len == KVT_TP_FRAME_RDREQ_BYTES);
        (*n_msgs)++;
        break;
    case KVT_TP_FRAME_ADDR:
        CHECK(f->len > KVT_TP_FRAME_TOKEN_BYTES && f->len <= KVT_TP_FRAME_ADDR_MAX);
        *done = true;
        break;
    default:
        CHECK(0);
    }
    CHECK(*n_msgs <= KVT_TP_PREAUTH_MSGS);
    (*n_frames)++;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static struct kvt_tp_frame_reader r; /* 8 KiB: not on the stack */
    unsigned n_frames = 0, n_msgs = 0;
    bool done = false, dead = false;
    size_t piece;
    bool active;

    if (size < 1)
        return 0;
    active = data[0] & 1;
    piece = (size_t)(data[0] >> 1) + 1;
    data++;
    size--;
    kvt_tp_frame_reader_init(&r, active);
    while (size > 0) {
        size_t n = size < piece ? size : piece, off = 0;

        while (off < n) {
            struct kvt_tp_frame f;
            size_t used;
            int rc = kvt_tp_frame_push(&r, data + off, n - off, &used, &f);

            CHECK(used <= n - off);
            if (rc < 0) {
                CHECK(rc == -EPROTO);
                dead = true;
                break;
            }
            CHECK(rc == 0 || rc == 1);
            off += used;
            if (rc == 0) {
                CHECK(off == n);
                break;
            }
            check_frame(&f, active, &n_frames, &n_msgs, &done);
        }
        if (dead)
            break;
        data += n;
        size -= n;
    }
    if (dead) { /* and stays so */
        struct kvt_tp_frame f;
        size_t used;
        uint8_t zero[KVT_TP_FRAME_HDR] = {0};

        CHECK(kvt_tp_frame_push(&r, zero, sizeof(zero), &used, &f) == -EPROTO);
    }
    return 0;
}

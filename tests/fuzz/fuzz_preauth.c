/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer target for what a peer can send to the peer port: the frame reader of a
 * transport connection (kvt/tp_frame.h), before authorization and in socket mode,
 * and the handshake decoder its DATA frames feed (kvt_wire_unframe +
 * kvt_wire_decode, as cluster/peers.c's tp_on_msg calls them, with the same default
 * limits).
 *
 * Input: byte 0 is the mode. Bit 0: the role (1: we dialled, so the stream must
 * start with HELLO; 0: we accepted). The rest of it: the stream is pushed through
 * the reader in pieces of (mode >> 1) + 1 bytes. A MODE frame saying socket mode
 * opens the reader (msg_max 4096), as the UCX backend does; the bytes of a MSG or
 * RDREP go to a sink of ours (RDREP: up to 64 KiB; a longer one ends the input, as
 * the backend fails a reply of another length than asked), taken by push or, every
 * other frame, "read straight in" (sink_want / sink_got). The seeds in
 * corpus/preauth are written by test_tp_frame's test_tp_frame_seed_corpus.
 *
 * Checked on every input, beyond the sanitizers' own checks:
 * - push returns 2, 1, 0 or -EPROTO only, takes at most what it was given and all of
 *   it when it returns 0, and fails forever after its first error; 2 only when a
 *   sink was being filled, and then it is full;
 * - every frame is of a known type within its type's length bound, HELLO (only) first
 *   and only when we dialled, at most KVT_TP_PREAUTH_MSGS DATA and RDREQ frames
 *   before ADDR, after ADDR one MODE and, only once opened, MSG (<= msg_max), RDREQ
 *   and RDREP (24 bytes; an error reply carries no bytes);
 * - decoding a DATA frame fails only with -EBADMSG, -EPROTO or -EMSGSIZE, and a
 *   decoded message holds at most 24 heap bytes per body byte. */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvt/tp_frame.h"
#include "kvt/wire.h"
#include "fuzz_check.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

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

#define MSG_MAX  4096u
#define SINK_MAX (64u << 10)

struct state {
    unsigned n_frames, n_msgs;
    bool addr, mode, open;
};

/* Checks a frame; false when the input ends here (a sink longer than ours). */
static bool check_frame(struct kvt_tp_frame_reader *r, const struct kvt_tp_frame *f, bool active,
                        struct state *st)
{
    static uint8_t sink[SINK_MAX];
    uint32_t mode;

    CHECK((f->type == KVT_TP_FRAME_HELLO) == (active && st->n_frames == 0));
    st->n_frames++;
    if (st->open) {
        switch (f->type) {
        case KVT_TP_FRAME_MSG:
            CHECK(f->len <= MSG_MAX && f->sink_len == f->len && f->payload == NULL);
            break;
        case KVT_TP_FRAME_RDREQ:
            CHECK(f->len == KVT_TP_FRAME_RDREQ_BYTES && f->sink_len == 0);
            break;
        case KVT_TP_FRAME_RDREP: {
            uint32_t err;

            CHECK(f->len == KVT_TP_FRAME_RDREP_BYTES);
            memcpy(&err, f->payload + 16, 4);
            CHECK(err == 0 || f->sink_len == 0);
            break;
        }
        default:
            CHECK(0);
        }
        if (f->sink_len > SINK_MAX)
            return false;
        if (f->sink_len > 0)
            kvt_tp_frame_sink(r, sink);
        return true;
    }
    if (st->addr) {
        CHECK(f->type == KVT_TP_FRAME_MODE && f->len == KVT_TP_FRAME_MODE_BYTES && !st->mode);
        st->mode = true;
        memcpy(&mode, f->payload, 4);
        if (mode == KVT_TP_MODE_SOCKET) {
            CHECK(kvt_tp_frame_reader_open(r, MSG_MAX) == 0);
            st->open = true;
        }
        return true;
    }
    switch (f->type) {
    case KVT_TP_FRAME_HELLO:
        CHECK(f->len == KVT_TP_FRAME_HELLO_BYTES);
        break;
    case KVT_TP_FRAME_DATA:
        CHECK(f->len <= KVT_TP_PREAUTH_MSG_BYTES);
        st->n_msgs++;
        check_handshake(f->payload, f->len);
        break;
    case KVT_TP_FRAME_RDREQ:
        CHECK(f->len == KVT_TP_FRAME_RDREQ_BYTES);
        st->n_msgs++;
        break;
    case KVT_TP_FRAME_ADDR:
        CHECK(f->len >= KVT_TP_FRAME_ADDR_MIN && f->len <= KVT_TP_FRAME_ADDR_MAX);
        st->addr = true;
        break;
    default:
        CHECK(0);
    }
    CHECK(st->n_msgs <= KVT_TP_PREAUTH_MSGS);
    return true;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static struct kvt_tp_frame_reader r; /* 8 KiB: not on the stack */
    struct state st = {0};
    bool dead = false, end = false, direct = false;
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
            uint8_t *dst;
            uint64_t want = kvt_tp_frame_sink_want(&r, &dst);
            int rc;

            if (want > 0 && direct) { /* as readv straight into the sink */
                size_t k = want < n - off ? (size_t)want : n - off;

                memcpy(dst, data + off, k);
                off += k;
                if (kvt_tp_frame_sink_got(&r, k))
                    direct = !direct;
                continue;
            }
            rc = kvt_tp_frame_push(&r, data + off, n - off, &used, &f);
            CHECK(used <= n - off);
            if (rc < 0) {
                CHECK(rc == -EPROTO);
                dead = true;
                break;
            }
            CHECK(rc == 0 || rc == 1 || rc == 2);
            off += used;
            if (rc == 0) {
                CHECK(off == n);
                break;
            }
            if (rc == 2) {
                CHECK(want > 0 && kvt_tp_frame_sink_want(&r, &dst) == 0);
                direct = !direct;
                continue;
            }
            if (!check_frame(&r, &f, active, &st)) {
                end = true;
                break;
            }
        }
        if (dead || end)
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

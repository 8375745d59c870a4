/* The frame reader of a transport's own TCP connection (kvt/tp_frame.h).
 *
 * A two-state machine per frame: collecting the 8 header bytes, then the payload.
 * The header is judged whole before any payload byte is taken (magic, flags, type,
 * the type's length bound, and where the type may come in the stream), so a peer
 * that is not speaking our protocol is found by its first 8 bytes and the largest
 * thing it can make us hold is one bounded payload in the reader's own buffer. This
 * code knows nothing of UCX: it is fuzzed on its own (tests/fuzz/fuzz_preauth.c). */
#include <endian.h>
#include <errno.h>
#include <string.h>

#include "kvt/tp_frame.h"

void kvt_tp_frame_reader_init(struct kvt_tp_frame_reader *r, bool active)
{
    r->active = active;
    r->dead = r->done = false;
    r->hdr_got = 0;
    r->type = 0;
    r->len = 0;
    r->got = 0;
    r->n_frames = r->n_msgs = 0;
}

void kvt_tp_frame_hdr(uint8_t out[KVT_TP_FRAME_HDR], uint8_t type, uint32_t len)
{
    uint16_t magic = htole16(KVT_TP_FRAME_MAGIC);
    uint32_t l = htole32(len);

    memcpy(out, &magic, 2);
    out[2] = type;
    out[3] = 0;
    memcpy(out + 4, &l, 4);
}

/* Whether a frame of this type and length may come next. */
static bool frame_allowed(const struct kvt_tp_frame_reader *r, uint8_t type, uint32_t len)
{
    bool first = r->n_frames == 0;

    if (r->done) /* nothing after ADDR */
        return false;
    if (r->active && first)
        return type == KVT_TP_FRAME_HELLO && len == KVT_TP_FRAME_HELLO_BYTES;
    switch (type) {
    case KVT_TP_FRAME_DATA:
        return len <= KVT_TP_PREAUTH_MSG_BYTES && r->n_msgs < KVT_TP_PREAUTH_MSGS;
    case KVT_TP_FRAME_RDREQ:
        return len == KVT_TP_FRAME_RDREQ_BYTES && r->n_msgs < KVT_TP_PREAUTH_MSGS;
    case KVT_TP_FRAME_ADDR:
        return len > KVT_TP_FRAME_TOKEN_BYTES && len <= KVT_TP_FRAME_ADDR_MAX;
    default: /* HELLO only first, on the active side */
        return false;
    }
}

static int reader_fail(struct kvt_tp_frame_reader *r)
{
    r->dead = true;
    return -EPROTO;
}

int kvt_tp_frame_push(struct kvt_tp_frame_reader *r, const uint8_t *data, size_t len,
                      size_t *used_p, struct kvt_tp_frame *f)
{
    size_t used = 0;

    *used_p = 0;
    if (r->dead)
        return -EPROTO;
    while (used < len) {
        if (r->hdr_got < KVT_TP_FRAME_HDR) {
            size_t n = KVT_TP_FRAME_HDR - r->hdr_got;

            if (n > len - used)
                n = len - used;
            memcpy(r->hdr + r->hdr_got, data + used, n);
            r->hdr_got += n;
            used += n;
            if (r->hdr_got < KVT_TP_FRAME_HDR)
                break;

            uint16_t magic;
            uint32_t flen;

            memcpy(&magic, r->hdr, 2);
            memcpy(&flen, r->hdr + 4, 4);
            r->type = r->hdr[2];
            r->len = le32toh(flen);
            r->got = 0;
            if (le16toh(magic) != KVT_TP_FRAME_MAGIC || r->hdr[3] != 0 ||
                !frame_allowed(r, r->type, r->len)) {
                *used_p = used;
                return reader_fail(r);
            }
        }
        size_t n = r->len - r->got;

        if (n > len - used)
            n = len - used;
        memcpy(r->buf + r->got, data + used, n);
        r->got += n;
        used += n;
        if (r->got < r->len)
            break;
        /* A whole frame. */
        r->hdr_got = 0;
        r->n_frames++;
        if (r->type == KVT_TP_FRAME_DATA || r->type == KVT_TP_FRAME_RDREQ)
            r->n_msgs++;
        if (r->type == KVT_TP_FRAME_ADDR)
            r->done = true;
        f->type = r->type;
        f->len = r->len;
        f->payload = r->buf;
        *used_p = used;
        return 1;
    }
    *used_p = used;
    return 0;
}

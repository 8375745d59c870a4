/* The frame reader of a transport's own TCP connection (kvt/tp_frame.h).
 *
 * A three-state machine per frame: collecting the 8 header bytes, then the payload
 * into the reader's own buffer, or, for the two frames that carry bulk bytes (MSG
 * and a READ reply's RDREP), into a buffer of the caller's (the sink). The header is
 * judged whole before any payload byte is taken (magic, flags, type, the type's
 * length bound, and where the type may come in the stream), so a peer that is not
 * speaking our protocol is found by its first 8 bytes and the largest thing it can
 * make us hold is one bounded payload in the reader's own buffer. A sink is sized by
 * the caller, who checks the announced length against what it expects before it
 * gives one (an RDREP's length must be the length it asked for), so no length from
 * the peer sizes anything here.
 *
 * Phases of a stream: before ADDR (HELLO, at most KVT_TP_PREAUTH_MSGS DATA and RDREQ,
 * ADDR); after ADDR only one MODE, unless the owner opened the reader for socket mode
 * (MSG, RDREQ, RDREP). This code knows nothing of UCX: it is fuzzed on its own
 * (tests/fuzz/fuzz_preauth.c). */
#include <endian.h>
#include <errno.h>
#include <string.h>

#include "kvt/tp_frame.h"

void kvt_tp_frame_reader_init(struct kvt_tp_frame_reader *r, bool active)
{
    r->active = active;
    r->dead = r->addr_seen = r->mode_seen = r->open = false;
    r->msg_max = 0;
    r->hdr_got = 0;
    r->type = 0;
    r->len = 0;
    r->got = 0;
    r->n_frames = r->n_msgs = 0;
    r->sink_type = 0;
    r->sink_due = false;
    r->sink = NULL;
    r->sink_left = r->sink_len = 0;
}

int kvt_tp_frame_reader_open(struct kvt_tp_frame_reader *r, uint32_t msg_max)
{
    if (r->dead || !r->addr_seen)
        return -EPROTO;
    r->open = true;
    r->msg_max = msg_max;
    return 0;
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

    if (r->open) {
        switch (type) {
        case KVT_TP_FRAME_MSG:
            return len <= r->msg_max;
        case KVT_TP_FRAME_RDREQ:
            return len == KVT_TP_FRAME_RDREQ_BYTES;
        case KVT_TP_FRAME_RDREP:
            return len == KVT_TP_FRAME_RDREP_BYTES;
        default:
            return false;
        }
    }
    if (r->addr_seen) /* one MODE, then nothing unless opened */
        return type == KVT_TP_FRAME_MODE && len == KVT_TP_FRAME_MODE_BYTES && !r->mode_seen;
    if (r->active && first)
        return type == KVT_TP_FRAME_HELLO && len == KVT_TP_FRAME_HELLO_BYTES;
    switch (type) {
    case KVT_TP_FRAME_DATA:
        return len <= KVT_TP_PREAUTH_MSG_BYTES && r->n_msgs < KVT_TP_PREAUTH_MSGS;
    case KVT_TP_FRAME_RDREQ:
        return len == KVT_TP_FRAME_RDREQ_BYTES && r->n_msgs < KVT_TP_PREAUTH_MSGS;
    case KVT_TP_FRAME_ADDR:
        return len >= KVT_TP_FRAME_ADDR_MIN && len <= KVT_TP_FRAME_ADDR_MAX;
    default: /* HELLO only first, on the active side; the rest only after ADDR */
        return false;
    }
}

static int reader_fail(struct kvt_tp_frame_reader *r)
{
    r->dead = true;
    return -EPROTO;
}

/* A frame whose payload (or what follows its fixed part) goes to a sink. */
static void sink_due(struct kvt_tp_frame_reader *r, uint64_t len, struct kvt_tp_frame *f)
{
    r->sink_type = r->type;
    r->sink_due = len > 0;
    r->sink_len = len;
    f->sink_len = len;
}

int kvt_tp_frame_push(struct kvt_tp_frame_reader *r, const uint8_t *data, size_t len,
                      size_t *used_p, struct kvt_tp_frame *f)
{
    size_t used = 0;

    *used_p = 0;
    if (r->dead)
        return -EPROTO;
    if (r->sink_due)
        return -EINVAL;
    while (used < len) {
        if (r->sink_left > 0) {
            size_t n = r->sink_left < len - used ? (size_t)r->sink_left : len - used;

            memcpy(r->sink, data + used, n);
            r->sink += n;
            r->sink_left -= n;
            used += n;
            if (r->sink_left > 0)
                break;
            r->sink = NULL;
            f->type = r->sink_type;
            f->len =
                r->sink_type == KVT_TP_FRAME_MSG ? (uint32_t)r->sink_len : KVT_TP_FRAME_RDREP_BYTES;
            f->payload = NULL;
            f->sink_len = r->sink_len;
            *used_p = used;
            return 2;
        }
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
            if (r->type == KVT_TP_FRAME_MSG) { /* the whole payload goes to a sink */
                r->hdr_got = 0;
                r->n_frames++;
                f->type = r->type;
                f->len = r->len;
                f->payload = NULL;
                sink_due(r, r->len, f);
                *used_p = used;
                return 1;
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
        f->type = r->type;
        f->len = r->len;
        f->payload = r->buf;
        f->sink_len = 0;
        switch (r->type) {
        case KVT_TP_FRAME_DATA:
        case KVT_TP_FRAME_RDREQ:
            if (!r->addr_seen)
                r->n_msgs++;
            break;
        case KVT_TP_FRAME_ADDR:
            r->addr_seen = true;
            break;
        case KVT_TP_FRAME_MODE:
            r->mode_seen = true;
            break;
        case KVT_TP_FRAME_RDREP: {
            uint64_t blen;
            uint32_t err, zero;

            memcpy(&blen, r->buf + 8, 8);
            memcpy(&err, r->buf + 16, 4);
            memcpy(&zero, r->buf + 20, 4);
            blen = le64toh(blen);
            if (zero != 0 || (err != 0 && blen != 0)) {
                *used_p = used;
                return reader_fail(r);
            }
            sink_due(r, blen, f);
            break;
        }
        default:
            break;
        }
        *used_p = used;
        return 1;
    }
    *used_p = used;
    return 0;
}

void kvt_tp_frame_sink(struct kvt_tp_frame_reader *r, void *dst)
{
    if (!r->sink_due)
        return;
    r->sink_due = false;
    r->sink = dst;
    r->sink_left = r->sink_len;
}

uint64_t kvt_tp_frame_sink_want(const struct kvt_tp_frame_reader *r, uint8_t **dst_p)
{
    *dst_p = r->sink;
    return r->sink_left;
}

bool kvt_tp_frame_sink_got(struct kvt_tp_frame_reader *r, uint64_t n)
{
    if (n > r->sink_left) /* the caller read more than it was told: its bug */
        n = r->sink_left;
    r->sink += n;
    r->sink_left -= n;
    if (r->sink_left > 0)
        return false;
    r->sink = NULL;
    return true;
}

/* Framing of wire messages: [u32 big-endian body length][body] (kvt/wire.h).
 *
 * The stream reader is a two-state machine per frame: HEADER (collecting the 4
 * length bytes in hdr[]) then BODY (collecting need bytes in buf). The length is
 * checked against max_frame the moment the header is complete, before a byte of
 * the body is buffered or any memory is sized from it; so a peer can make a
 * reader hold at most max_frame bytes. push stops at the end of each frame so the
 * caller decodes it in place, with no copy and no queue of frames. After a frame
 * larger than KEEP_BYTES the buffer is released, so an idle connection does not
 * keep one peak's worth of memory. */
#include <assert.h>
#include <errno.h>
#include <string.h>

#include "kvt/alloc.h"
#include "kvt/common.h"
#include "kvt/wire.h"

#define KEEP_BYTES (64u << 10)

static size_t frame_len(const uint8_t *hdr)
{
    return (size_t)hdr[0] << 24 | (size_t)hdr[1] << 16 | (size_t)hdr[2] << 8 | hdr[3];
}

void kvt_wire_buf_init(struct kvt_wire_buf *b)
{
    memset(b, 0, sizeof(*b));
}

void kvt_wire_buf_cleanup(struct kvt_wire_buf *b)
{
    if (b == NULL)
        return;
    kvt_free(b->data);
    memset(b, 0, sizeof(*b));
}

int kvt_wire_unframe(const void *buf, size_t len, const struct kvt_wire_limits *lim_in,
                     const uint8_t **body_p, size_t *body_len_p)
{
    struct kvt_wire_limits lim = {0};
    const uint8_t *p = buf;

    if ((buf == NULL && len > 0) || body_p == NULL || body_len_p == NULL)
        return -EINVAL;
    if (lim_in != NULL)
        lim = *lim_in;
    kvt_wire_limits_default(&lim);
    if (len < KVT_WIRE_FRAME_HDR)
        return -EBADMSG;

    size_t n = frame_len(p);

    if (n > lim.max_frame)
        return -EMSGSIZE;
    if (n != len - KVT_WIRE_FRAME_HDR)
        return -EBADMSG;
    *body_p = p + KVT_WIRE_FRAME_HDR;
    *body_len_p = n;
    return 0;
}

int kvt_wire_reader_init(struct kvt_wire_reader *r, const struct kvt_wire_limits *lim_in)
{
    struct kvt_wire_limits lim = {0};

    if (r == NULL)
        return -EINVAL;
    if (lim_in != NULL)
        lim = *lim_in;
    kvt_wire_limits_default(&lim);
    memset(r, 0, sizeof(*r));
    r->max_frame = lim.max_frame;
    return 0;
}

void kvt_wire_reader_cleanup(struct kvt_wire_reader *r)
{
    if (r == NULL)
        return;
    kvt_free(r->buf);
    memset(r, 0, sizeof(*r));
}

/* The header is complete: check the length, then make room for the body. */
static int start_body(struct kvt_wire_reader *r)
{
    size_t n = frame_len(r->hdr);

    if (n > r->max_frame)
        return -EMSGSIZE;
    if (n > r->cap) {
        size_t cap = KVT_MIN(KVT_MAX(n, r->cap * 2), r->max_frame);
        uint8_t *p = kvt_realloc(r->buf, cap);

        if (p == NULL)
            return -ENOMEM;
        r->buf = p;
        r->cap = cap;
    }
    r->need = n;
    r->have = 0;
    return 0;
}

int kvt_wire_reader_push(struct kvt_wire_reader *r, const void *data, size_t len, size_t *used_p)
{
    const uint8_t *in = data;
    size_t used = 0, k;

    if (r == NULL || (data == NULL && len > 0) || used_p == NULL)
        return -EINVAL;
    if (r->err != 0)
        return r->err;
    if (r->ready) {
        r->ready = false;
        r->hdr_have = 0;
        r->need = r->have = 0;
        if (r->cap > KEEP_BYTES) {
            kvt_free(r->buf);
            r->buf = NULL;
            r->cap = 0;
        }
    }
    if (len == 0) {
        *used_p = 0;
        return 0;
    }
    if (r->hdr_have < KVT_WIRE_FRAME_HDR) {
        k = KVT_MIN(KVT_WIRE_FRAME_HDR - r->hdr_have, len);
        memcpy(r->hdr + r->hdr_have, in, k);
        r->hdr_have += k;
        used = k;
        if (r->hdr_have < KVT_WIRE_FRAME_HDR) {
            *used_p = used;
            return 0;
        }
        int rc = start_body(r);

        if (rc < 0) {
            r->err = rc;
            return rc;
        }
    }
    k = KVT_MIN(r->need - r->have, len - used);
    if (k > 0) {
        memcpy(r->buf + r->have, in + used, k);
        r->have += k;
        used += k;
    }
    *used_p = used;
    if (r->have < r->need)
        return 0;
    r->ready = true;
    return 1;
}

void kvt_wire_reader_frame(const struct kvt_wire_reader *r, const uint8_t **body_p, size_t *len_p)
{
    assert(r->ready);
    *body_p = r->buf != NULL ? r->buf : r->hdr;
    *len_p = r->need;
}

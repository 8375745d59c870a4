/* The frames of a transport's own TCP connection (the UCX backend's peer port), and
 * the reader that is the first code to see every byte an unauthenticated peer sends.
 *
 * A connection carries, in each direction, frames of an 8-byte header
 * {magic "kv", type, flags 0, payload length} (little-endian) and a payload:
 *   HELLO  passive -> active, first and once: {u32 version}
 *   DATA   a control message sent before its sender authorized the endpoint
 *          (at most KVT_TP_PREAUTH_MSG_BYTES)
 *   RDREQ  a READ request sent before its sender authorized: {u64 addr, len, tag}
 *   ADDR   the last frame, sent when its sender authorizes the endpoint:
 *          {token[16], the sender's UCX worker address}
 * DATA and RDREQ together are at most KVT_TP_PREAUTH_MSGS per direction; nothing
 * follows ADDR but the end of the stream. So a connection never carries more than
 * 8 + KVT_TP_PREAUTH_MSGS * (8 + 4096) + 8 + KVT_TP_FRAME_ADDR_MAX bytes.
 *
 * The reader checks each header before it takes a byte of payload (magic, type,
 * flags, length bound of the type, the order above) and keeps at most one payload,
 * in its own buffer: no allocation, nothing sized by the peer. */
#ifndef KVT_TP_FRAME_H
#define KVT_TP_FRAME_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvt/transport.h"

#define KVT_TP_FRAME_HDR         8
#define KVT_TP_FRAME_MAGIC       0x766bu /* "kv" */
#define KVT_TP_FRAME_TOKEN_BYTES 16
#define KVT_TP_FRAME_HELLO_BYTES 4
#define KVT_TP_FRAME_RDREQ_BYTES 24
#define KVT_TP_FRAME_WADDR_MAX   8192 /* a UCX worker address: ~50-250 bytes seen */
#define KVT_TP_FRAME_ADDR_MAX    (KVT_TP_FRAME_TOKEN_BYTES + KVT_TP_FRAME_WADDR_MAX)

enum kvt_tp_frame_type {
    KVT_TP_FRAME_HELLO = 1,
    KVT_TP_FRAME_DATA = 2,
    KVT_TP_FRAME_RDREQ = 3,
    KVT_TP_FRAME_ADDR = 4,
};

struct kvt_tp_frame {
    uint8_t type;
    uint32_t len;
    const uint8_t *payload; /* valid until the next push */
};

/* One per connection (caller's storage, ~8 KiB). */
struct kvt_tp_frame_reader {
    bool active; /* we dialled: the first frame must be HELLO */
    bool dead;   /* an error was returned: every later push fails */
    bool done;   /* ADDR was read: only the end of the stream may follow */
    uint8_t hdr[KVT_TP_FRAME_HDR];
    size_t hdr_got;
    uint8_t type;
    uint32_t len;
    size_t got;
    unsigned n_frames, n_msgs; /* frames read; DATA + RDREQ read */
    uint8_t buf[KVT_TP_FRAME_ADDR_MAX];
};

void kvt_tp_frame_reader_init(struct kvt_tp_frame_reader *r, bool active);
/* Consumes bytes of the stream. 1: a whole frame is in *f (*used_p bytes taken; call
 * again with the rest); 0: every byte taken, the frame is not complete; -EPROTO: the
 * bytes are not our protocol or break its order (the reader is dead after it). */
int kvt_tp_frame_push(struct kvt_tp_frame_reader *r, const uint8_t *data, size_t len,
                      size_t *used_p, struct kvt_tp_frame *f);
/* Writes a frame header. */
void kvt_tp_frame_hdr(uint8_t out[KVT_TP_FRAME_HDR], uint8_t type, uint32_t len);

#endif

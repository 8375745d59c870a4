/* The frames of a transport's own TCP connection (the UCX backend's peer port), and
 * the reader that is the first code to see every byte a peer sends on it.
 *
 * A connection carries, in each direction, frames of an 8-byte header
 * {magic "kv", type, flags 0, payload length} (little-endian) and a payload.
 * Before authorization:
 *   HELLO  passive -> active, first and once: {u32 version}
 *   DATA   a control message sent before its sender authorized the endpoint
 *          (at most KVT_TP_PREAUTH_MSG_BYTES)
 *   RDREQ  a READ request: {u64 addr, u64 len, u64 tag}
 *   ADDR   sent when its sender authorizes the endpoint: {token[16], u32 flags,
 *          u32 0, host[16], the sender's UCX worker address} (flags KVT_TP_ADDR_*;
 *          host: the sender's boot id, zeros when unknown)
 * DATA and RDREQ together are at most KVT_TP_PREAUTH_MSGS per direction before ADDR.
 * After ADDR the side that decides how the connection's data moves (the UCX
 * backend: the one whose worker address sorts first) sends
 *   MODE   {u32 KVT_TP_MODE_UCX or KVT_TP_MODE_SOCKET}, once;
 * with UCX, nothing follows on the connection in either direction but its end (the
 * connection stays open as the liveness signal). In socket mode the owner opens the
 * reader (kvt_tp_frame_reader_open) and the connection carries, both ways:
 *   MSG    a control message (at most the msg_max given to open); its payload goes
 *          to a buffer of the caller's (a sink)
 *   RDREQ  as above
 *   RDREP  a READ reply: {u64 tag, u64 len, u32 err, u32 0}, then len bytes (no
 *          frame length of their own: len is 64 bits) into a sink; err != 0 only
 *          with len 0
 * So before authorization a connection never carries more than 8 + KVT_TP_PREAUTH_MSGS
 * * (8 + 4096) + 8 + KVT_TP_FRAME_ADDR_MAX bytes, and nothing it carries after is
 * accepted unless its owner opened the reader.
 *
 * The reader checks each header before it takes a byte of payload (magic, type,
 * flags, length bound of the type, the order above) and keeps at most one bounded
 * payload, in its own buffer: no allocation, nothing sized by the peer. The payloads
 * of MSG and RDREP go to the caller's buffer instead (kvt_tp_frame_sink), which the
 * caller sizes and checks first (a READ reply must be exactly the length asked). */
#ifndef KVT_TP_FRAME_H
#define KVT_TP_FRAME_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvt/transport.h"

#define KVT_TP_FRAME_HDR         8
#define KVT_TP_FRAME_MAGIC       0x766bu /* "kv" */
#define KVT_TP_FRAME_TOKEN_BYTES 16
#define KVT_TP_FRAME_CAPS_BYTES  24 /* ADDR: flags, 0, host */
#define KVT_TP_FRAME_HELLO_BYTES 4
#define KVT_TP_FRAME_RDREQ_BYTES 24
#define KVT_TP_FRAME_RDREP_BYTES 24
#define KVT_TP_FRAME_MODE_BYTES  4
#define KVT_TP_FRAME_WADDR_MAX   8192 /* a UCX worker address: ~50-250 bytes seen */
#define KVT_TP_FRAME_ADDR_MIN    (KVT_TP_FRAME_TOKEN_BYTES + KVT_TP_FRAME_CAPS_BYTES + 1)
#define KVT_TP_FRAME_ADDR_MAX                                                                      \
    (KVT_TP_FRAME_TOKEN_BYTES + KVT_TP_FRAME_CAPS_BYTES + KVT_TP_FRAME_WADDR_MAX)

/* ADDR flags: what the sender wants and has. */
#define KVT_TP_ADDR_SOCKET 1u /* socket mode, whatever UCX could do (a test switch) */
#define KVT_TP_ADDR_TCP_OK 2u /* UCX may carry our data over tcp (a bench switch) */
#define KVT_TP_ADDR_NET    4u /* its UCX has a network transport other than tcp (RDMA) */
#define KVT_TP_ADDR_FLAGS  7u

#define KVT_TP_MODE_UCX    1u
#define KVT_TP_MODE_SOCKET 2u

enum kvt_tp_frame_type {
    KVT_TP_FRAME_HELLO = 1,
    KVT_TP_FRAME_DATA = 2,
    KVT_TP_FRAME_RDREQ = 3,
    KVT_TP_FRAME_ADDR = 4,
    KVT_TP_FRAME_MODE = 5,
    KVT_TP_FRAME_MSG = 6,
    KVT_TP_FRAME_RDREP = 7,
};

struct kvt_tp_frame {
    uint8_t type;
    uint32_t len;           /* of payload (MSG: of what goes to the sink) */
    const uint8_t *payload; /* valid until the next push; NULL for MSG */
    uint64_t sink_len;      /* bytes that follow into a sink of the caller's, or 0 */
};

/* One per connection (caller's storage, ~8 KiB). */
struct kvt_tp_frame_reader {
    bool active;    /* we dialled: the first frame must be HELLO */
    bool dead;      /* an error was returned: every later push fails */
    bool addr_seen; /* ADDR was read: MODE (once), or what open allows, may follow */
    bool mode_seen;
    bool open;        /* socket mode: MSG, RDREQ and RDREP, unbounded in number */
    uint32_t msg_max; /* MSG payload bound once open */
    uint8_t hdr[KVT_TP_FRAME_HDR];
    size_t hdr_got;
    uint8_t type;
    uint32_t len;
    size_t got;
    unsigned n_frames, n_msgs; /* frames read; DATA + RDREQ read before ADDR */
    /* The payload of the last frame returned, going to the caller's buffer. */
    uint8_t sink_type;
    bool sink_due;      /* returned; kvt_tp_frame_sink not called yet */
    uint8_t *sink;      /* where the rest goes */
    uint64_t sink_left; /* bytes still to come */
    uint64_t sink_len;
    uint8_t buf[KVT_TP_FRAME_ADDR_MAX];
};

void kvt_tp_frame_reader_init(struct kvt_tp_frame_reader *r, bool active);
/* Socket mode, after ADDR: MSG (payload at most msg_max), RDREQ and RDREP from now on.
 * -EPROTO before the peer's ADDR was read (or after an error). */
int kvt_tp_frame_reader_open(struct kvt_tp_frame_reader *r, uint32_t msg_max);
/* Consumes bytes of the stream. 1: a whole frame is in *f, or, when f->sink_len > 0,
 * its header (and RDREP's fixed part): the caller must give the sink before pushing
 * again. 2: the sink of frame type f->type is full. (*used_p bytes taken in both;
 * call again with the rest.) 0: every byte taken, nothing complete. -EPROTO: the bytes
 * are not our protocol or break its order (the reader is dead after it). -EINVAL: a
 * sink is due and was not given (a bug of the caller's; nothing taken). */
int kvt_tp_frame_push(struct kvt_tp_frame_reader *r, const uint8_t *data, size_t len,
                      size_t *used_p, struct kvt_tp_frame *f);
/* The f->sink_len bytes of the frame just returned go to dst. */
void kvt_tp_frame_sink(struct kvt_tp_frame_reader *r, void *dst);
/* Bytes still due into the sink (0: none), and where, to read them straight in... */
uint64_t kvt_tp_frame_sink_want(const struct kvt_tp_frame_reader *r, uint8_t **dst_p);
/* ...then this with how many came: true when the sink is full. */
bool kvt_tp_frame_sink_got(struct kvt_tp_frame_reader *r, uint64_t n);
/* Writes a frame header. */
void kvt_tp_frame_hdr(uint8_t out[KVT_TP_FRAME_HDR], uint8_t type, uint32_t len);

#endif

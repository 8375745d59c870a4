/* SPDX-License-Identifier: Apache-2.0 */
/* The wire codec: every control message kvtier nodes exchange,
 * framed for byte streams and decoded with bounds a peer cannot get around.
 *
 * Frame: [u32 big-endian body length][body]; the body is one msgpack map keyed by
 * small unsigned integers:
 *   0: version major, 1: version minor, 2: message type, 8..63: the fields
 *   (enum kvt_wire_field) of that type.
 * Records inside lists (members, holders, chunks) are msgpack arrays of positional
 * fields; a newer minor version may append elements, which are skipped.
 *
 * Compatibility: a major version other than KVT_WIRE_VERSION_MAJOR is refused; any
 * minor is accepted. Fields a type does not know (any key other than its own) are
 * skipped whatever their value, so a newer minor version can add fields.
 *
 * Decoding is bounded before anything is allocated: the body is first walked by a
 * validator that checks every declared str/bin/ext length and every array/map
 * count against the bytes actually present, the nesting depth and the total number
 * of objects; then lists are checked against the per-message limits; only then is
 * memory allocated, at most a small multiple of the body's size (heap_bytes).
 * msgpack-c is used only to encode (its packer); it never decodes peer bytes.
 *
 * Errors (negative errno):
 *   -EBADMSG   malformed: truncated, trailing bytes, wrong msgpack type or range,
 *              missing required field, duplicate field, key not 1..64 bytes ...
 *   -EPROTO    well formed but incompatible: another major version, unknown type
 *   -EMSGSIZE  over a configured limit: frame size, list length, handle size,
 *              nesting depth, object count
 *   -ENOMEM    allocation failed
 *   -EINVAL    the caller's mistake (encoding an invalid message, bad arguments)
 *
 * Ownership: a message filled by kvt_wire_decode owns its lists and handle (freed
 * with kvt_wire_msg_free). A message a caller builds to encode points at the
 * caller's memory and owns nothing; kvt_wire_msg_free on it does nothing. */
#ifndef KVT_WIRE_H
#define KVT_WIRE_H

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>

#include "kvt/types.h"

#define KVT_WIRE_VERSION_MAJOR 1
#define KVT_WIRE_VERSION_MINOR 6

#define KVT_WIRE_FRAME_HDR 4  /* u32 big-endian body length */
#define KVT_WIRE_BIN32     32 /* namespace fingerprint, nonce, HMAC-SHA256 proof */
#define KVT_WIRE_ADDR_MAX  64 /* address string incl. NUL */
#define KVT_WIRE_DEPTH_CAP 64 /* max_depth is clamped to this */

/* Defaults of struct kvt_wire_limits. */
#define KVT_WIRE_DEFAULT_MAX_FRAME    (1u << 20)
#define KVT_WIRE_DEFAULT_MAX_KEYS     4096
#define KVT_WIRE_DEFAULT_MAX_HOLDERS  64
#define KVT_WIRE_DEFAULT_MAX_MEMBERS  1024
#define KVT_WIRE_DEFAULT_MAX_HANDLE   4096
#define KVT_WIRE_DEFAULT_MAX_DEPTH    8
#define KVT_WIRE_DEFAULT_MAX_ELEMENTS (1u << 20)

/* What a decoder accepts. A zero field means its default; NULL limits mean all
 * defaults. */
struct kvt_wire_limits {
    size_t max_frame;      /* body bytes of one frame */
    uint32_t max_keys;     /* keys, chunks, denied indexes, holder lists per message */
    uint32_t max_holders;  /* holders per key in LOCATE_REPLY */
    uint32_t max_members;  /* entries of MEMBERS */
    uint32_t max_handle;   /* bytes of a GRANT's region handle */
    uint32_t max_depth;    /* container nesting; the body's map is depth 1 */
    uint32_t max_elements; /* msgpack objects in one body, at every depth */
};

/* Fills every zero field of lim with its default and clamps max_depth. */
void kvt_wire_limits_default(struct kvt_wire_limits *lim);

enum kvt_wire_type {
    KVT_WIRE_HELLO = 1,    /* hello: client -> server, first message */
    KVT_WIRE_HELLO_ACK,    /* hello: server -> client, with the server's proof */
    KVT_WIRE_AUTH,         /* hello: client -> server, the client's proof */
    KVT_WIRE_AUTH_OK,      /* no fields */
    KVT_WIRE_REFUSE,       /* reason */
    KVT_WIRE_HEARTBEAT,    /* heartbeat */
    KVT_WIRE_MEMBERS,      /* members */
    KVT_WIRE_PUBLISH,      /* publish */
    KVT_WIRE_UNPUBLISH,    /* publish */
    KVT_WIRE_LOCATE,       /* locate */
    KVT_WIRE_LOCATE_REPLY, /* locate_reply */
    KVT_WIRE_FETCH,        /* fetch */
    KVT_WIRE_GRANT,        /* grant */
    KVT_WIRE_DENY,         /* deny */
    KVT_WIRE_RELEASE,      /* release */
    KVT_WIRE_TYPE_END
};

/* "HELLO", ...; "?" for anything else. */
const char *kvt_wire_type_name(int type);

/* Field keys of the body map. Each type uses a subset; which are required and
 * which optional is listed at the struct of that type. */
enum kvt_wire_field {
    KVT_WIRE_F_NODE_ID = 8,
    KVT_WIRE_F_INCARNATION,
    KVT_WIRE_F_NS,
    KVT_WIRE_F_NONCE,
    KVT_WIRE_F_PROOF,
    KVT_WIRE_F_ADDR,
    KVT_WIRE_F_PORT,
    KVT_WIRE_F_REASON,
    KVT_WIRE_F_SEQ,
    KVT_WIRE_F_DIGEST,
    KVT_WIRE_F_MEMBERS,
    KVT_WIRE_F_KEYS,
    KVT_WIRE_F_REQ_ID,
    KVT_WIRE_F_HOLDERS,
    KVT_WIRE_F_JOB_ID,
    KVT_WIRE_F_LEASE_ID,
    KVT_WIRE_F_LEASE_TTL,
    KVT_WIRE_F_HANDLE,
    KVT_WIRE_F_CHUNKS,
    KVT_WIRE_F_DENIED,
    KVT_WIRE_F_FENCE_HANDLE,        /* since 1.1 */
    KVT_WIRE_F_ROWS,                /* since 1.2 */
    KVT_WIRE_F_DIRECT,              /* since 1.2 */
    KVT_WIRE_F_DIRECT_HANDLE,       /* since 1.2 */
    KVT_WIRE_F_DIRECT_FENCE_HANDLE, /* since 1.2 */
    KVT_WIRE_F_DOWN_AFTER,          /* since 1.3 */
    KVT_WIRE_F_HOLDS,               /* 1.4 only, retired: skipped (see dropped_inc) */
    KVT_WIRE_F_DROPPED,             /* since 1.5 */
    KVT_WIRE_F_DROP_SEQ,            /* since 1.6 */
};
/* Bit of a field in kvt_wire_msg.has. */
#define KVT_WIRE_HAS(field) (UINT64_C(1) << (field))

/* Reasons of REFUSE and DENY. A decoder passes any u32 through (a newer peer may
 * send reasons this one does not know). */
enum kvt_wire_reason {
    KVT_WIRE_R_UNSPEC = 0,
    KVT_WIRE_R_VERSION,   /* incompatible protocol version */
    KVT_WIRE_R_NAMESPACE, /* another namespace fingerprint */
    KVT_WIRE_R_AUTH,      /* proof did not verify */
    KVT_WIRE_R_PROTOCOL,  /* malformed or unexpected message */
    KVT_WIRE_R_BUSY,      /* no capacity now; try later */
    KVT_WIRE_R_SHUTDOWN,  /* the node is stopping */
    KVT_WIRE_R_NOT_FOUND, /* none of the keys is held here */
};

/* HELLO, HELLO_ACK, AUTH.
 *   HELLO:     node_id, incarnation, ns, nonce required; proof, addr, port,
 *              down_after optional
 *   HELLO_ACK: node_id, incarnation, ns, nonce, proof required; addr, port,
 *              down_after, dropped, drop_seq optional
 *   AUTH:      node_id, incarnation, proof required; dropped, drop_seq optional
 * addr/port: where the sender listens (its connection's source port is not).
 * down_after_ms (since 1.3): how long the sender lets a member stay silent before it
 * calls it down (its heartbeat interval times the misses it allows).
 * dropped_inc (since 1.5): the receiver's incarnation that the sender called down and
 * has not held live since (it dropped every record that life published to it), or 0.
 * Sent once the sender knows who the receiver is. (1.4 sent holds_inc instead, the
 * incarnation it held live: a link that raced the first one up said 0 for a member
 * that had dropped nothing. Retired; its field is skipped.)
 * drop_seq (since 1.6, with dropped_inc): which time the sender called that life down
 * (1 for the first). Every link that comes up while the member is down names the same
 * drop; the receiver acts on each drop once. Without it (1.5), every such link counts. */
struct kvt_wire_hello {
    uint64_t node_id;
    uint64_t incarnation;
    uint8_t ns[KVT_WIRE_BIN32];
    uint8_t nonce[KVT_WIRE_BIN32];
    uint8_t proof[KVT_WIRE_BIN32];
    char addr[KVT_WIRE_ADDR_MAX]; /* NUL-terminated, no NUL inside */
    uint16_t port;
    uint32_t down_after_ms;
    uint64_t dropped_inc;
    uint64_t drop_seq;
};

/* REFUSE: reason required. */
struct kvt_wire_refuse {
    uint32_t reason;
};

/* HEARTBEAT: node_id, incarnation, seq required; digest (of the sender's member
 * list) optional. */
struct kvt_wire_heartbeat {
    uint64_t node_id;
    uint64_t incarnation;
    uint64_t seq;
    uint64_t digest;
};

/* One entry of MEMBERS; on the wire [node_id, incarnation, addr, port]. */
struct kvt_wire_member {
    uint64_t node_id;
    uint64_t incarnation;
    char addr[KVT_WIRE_ADDR_MAX];
    uint16_t port;
};

/* MEMBERS: members required (may be empty). */
struct kvt_wire_members {
    uint32_t n;
    struct kvt_wire_member *v;
};

/* Where a published key's bytes sit in its holder's primary; on the wire [row, gen]
 * when known, [] when not (a record of one element is refused). row: the slot (the
 * row's bytes at row * row_bytes of the primary registration, its fence word at
 * row * 4 of the fence words); gen: the slot's fence word once the row's bytes were
 * complete, even (an odd one is refused). */
struct kvt_wire_row {
    uint64_t row;
    uint32_t gen;
    bool known;
};

/* PUBLISH, UNPUBLISH: node_id (the holder), incarnation, keys required.
 * rows (optional, since 1.2, PUBLISH): rows[i] is where keys[i] sits in the
 * holder's primary; exactly n_keys of them (another count is refused). A holder
 * sends it only in network.fetch direct mode. */
struct kvt_wire_publish {
    uint64_t node_id;
    uint64_t incarnation;
    uint32_t n_keys;
    struct kvt_key *keys;
    uint32_t n_rows;
    struct kvt_wire_row *rows;
};

/* LOCATE: req_id, keys required. */
struct kvt_wire_locate {
    uint64_t req_id;
    uint32_t n_keys;
    struct kvt_key *keys;
};

/* A holder of a key; on the wire [node_id, incarnation], or since 1.2 [node_id,
 * incarnation, row, gen] when the home knows where the key sits in the holder's
 * primary (has_row; gen even, an odd one is refused). A decoder before 1.2 skips the
 * two appended elements. */
struct kvt_wire_holder {
    uint64_t node_id;
    uint64_t incarnation;
    uint64_t row;
    uint32_t gen;
    bool has_row;
};
struct kvt_wire_holder_list {
    uint32_t n;
    struct kvt_wire_holder *v;
};

/* LOCATE_REPLY: req_id, holders required; holders[i] answers keys[i] of the
 * LOCATE with that req_id (n_keys equal; checked by the caller, not the codec). */
struct kvt_wire_locate_reply {
    uint64_t req_id;
    uint32_t n_keys;
    struct kvt_wire_holder_list *holders;
};

/* FETCH: job_id, keys required. direct (optional, since 1.2; 0 or 1, anything else
 * is refused): 1 asks the holder for the handles of direct reads in its GRANT. */
struct kvt_wire_fetch {
    uint64_t job_id;
    uint32_t n_keys;
    struct kvt_key *keys;
    uint32_t direct;
};

/* One granted chunk; on the wire [key_index, offset, length, generation, checksum].
 * key_index is into the FETCH's keys; offset from the start of the registration.
 * generation: the row's fence word as the holder completed its bytes (even); the
 * word of the row at offset sits at (offset / length) * 4 in the fence registration
 * (the GRANT's fence_handle). */
struct kvt_wire_chunk {
    uint32_t key_index;
    uint32_t length;
    uint32_t generation;
    uint64_t offset;
    uint64_t checksum;
};

/* GRANT: job_id, lease_id, lease_ttl_ms, handle, chunks, denied all required
 * (lists may be empty). handle: the packed region handle (kvt_tp_pack).
 * fence_handle (optional, since 1.1; KVT_WIRE_HAS(KVT_WIRE_F_FENCE_HANDLE)): the
 * packed handle of the holder's fence words, one u32 per row, little-endian.
 * direct_handle, direct_fence_handle (optional, since 1.2, both or neither): the
 * handles of the holder's whole primary and fence words, exposed to the requester's
 * endpoint for direct reads (network.fetch direct) until that link closes; sent
 * only in answer to a FETCH with direct 1. */
struct kvt_wire_grant {
    uint64_t job_id;
    uint64_t lease_id;
    uint32_t lease_ttl_ms;
    uint32_t handle_len;
    uint8_t *handle;
    uint32_t n_chunks;
    struct kvt_wire_chunk *chunks;
    uint32_t n_denied;
    uint32_t *denied; /* key indexes not granted */
    uint32_t fence_handle_len;
    uint8_t *fence_handle;
    uint32_t direct_handle_len;
    uint8_t *direct_handle;
    uint32_t direct_fence_handle_len;
    uint8_t *direct_fence_handle;
};

/* DENY: job_id, reason required. */
struct kvt_wire_deny {
    uint64_t job_id;
    uint32_t reason;
};

/* RELEASE: job_id, lease_id required. */
struct kvt_wire_release {
    uint64_t job_id;
    uint64_t lease_id;
};

/* One message. type selects the member of u (see enum kvt_wire_type).
 * has: on decode, a bit (KVT_WIRE_HAS) for every field that was present; on encode,
 *      which optional fields to send (required ones are always sent).
 * ver_major/ver_minor: on decode, the sender's; ignored on encode (we send ours).
 * own_/heap_bytes: what a decoded message allocated; zero in a caller's message. */
struct kvt_wire_msg {
    enum kvt_wire_type type;
    uint32_t ver_major;
    uint32_t ver_minor;
    uint64_t has;
    union {
        struct kvt_wire_hello hello;
        struct kvt_wire_refuse refuse;
        struct kvt_wire_heartbeat heartbeat;
        struct kvt_wire_members members;
        struct kvt_wire_publish publish;
        struct kvt_wire_locate locate;
        struct kvt_wire_locate_reply locate_reply;
        struct kvt_wire_fetch fetch;
        struct kvt_wire_grant grant;
        struct kvt_wire_deny deny;
        struct kvt_wire_release release;
    } u;
    void *own_[6];
    size_t heap_bytes;
};

/* Zeroes m and sets its type. */
void kvt_wire_msg_init(struct kvt_wire_msg *m, enum kvt_wire_type type);
/* Frees what a decoded message owns and zeroes its pointers; no-op for NULL or a
 * caller-built message. */
void kvt_wire_msg_free(struct kvt_wire_msg *m);

/* A growable byte buffer for encoded frames (caller's storage). */
struct kvt_wire_buf {
    uint8_t *data;
    size_t len;
    size_t cap;
};
void kvt_wire_buf_init(struct kvt_wire_buf *b);
void kvt_wire_buf_cleanup(struct kvt_wire_buf *b);
static inline void kvt_wire_buf_reset(struct kvt_wire_buf *b)
{
    b->len = 0;
}

/* Appends one frame (header + body) encoding m to buf. 0; -EINVAL for an invalid
 * message (unknown type, key not 1..64 bytes, NULL list with n > 0, address too
 * long); -EMSGSIZE for a body over 4 GiB; -ENOMEM. On error buf is unchanged
 * (apart from capacity). The receiver's limits are the caller's business: check
 * the frame's length before sending. */
int kvt_wire_encode(const struct kvt_wire_msg *m, struct kvt_wire_buf *buf);

/* Decodes one body (without its frame header). 0 and *out filled (release with
 * kvt_wire_msg_free); or a negative errno listed at the top and *out untouched. */
int kvt_wire_decode(const uint8_t *body, size_t len, const struct kvt_wire_limits *lim,
                    struct kvt_wire_msg *out);

/* For transports that deliver whole messages: checks that buf is exactly one frame
 * and returns its body. -EBADMSG for a short buffer or a length that does not match
 * len, -EMSGSIZE for a body over lim->max_frame. */
int kvt_wire_unframe(const void *buf, size_t len, const struct kvt_wire_limits *lim,
                     const uint8_t **body_p, size_t *body_len_p);

/* Incremental frame extraction from a byte stream (caller's storage).
 *
 *   while (len > 0) {
 *       rc = kvt_wire_reader_push(&r, data, len, &used);
 *       if (rc < 0) -> drop the connection
 *       data += used; len -= used;
 *       if (rc == 1) { kvt_wire_reader_frame(&r, &body, &blen); decode body; }
 *   }
 *
 * A frame header declaring more than max_frame is refused (-EMSGSIZE) as soon as
 * its 4 bytes are in, before any of the body is buffered. The buffer holds at most
 * one frame. Errors are sticky: a byte stream cannot resynchronise. */
struct kvt_wire_reader {
    size_t max_frame;
    uint8_t hdr[KVT_WIRE_FRAME_HDR];
    size_t hdr_have; /* header bytes of the current frame received */
    size_t need;     /* body bytes of the current frame (valid once hdr_have == 4) */
    size_t have;     /* body bytes received */
    uint8_t *buf;    /* owned; cap bytes */
    size_t cap;
    bool ready; /* a complete frame is in buf until the next push */
    int err;    /* sticky error, 0 if none */
};

/* 0 or -EINVAL. lim NULL: defaults. */
int kvt_wire_reader_init(struct kvt_wire_reader *r, const struct kvt_wire_limits *lim);
void kvt_wire_reader_cleanup(struct kvt_wire_reader *r);
/* Consumes bytes of data up to the end of the next frame: returns 1 when a frame is
 * complete, 0 when all len bytes were consumed without completing one (*used_p is
 * the count consumed in both cases), -EMSGSIZE / -ENOMEM (sticky, *used_p unset).
 * A frame returned by the previous push is discarded first. */
int kvt_wire_reader_push(struct kvt_wire_reader *r, const void *data, size_t len, size_t *used_p);
/* The complete frame's body; valid until the next push or cleanup. */
void kvt_wire_reader_frame(const struct kvt_wire_reader *r, const uint8_t **body_p, size_t *len_p);

#endif

/* The engine API's shared-memory ring (node/engine_ring.c on kvtierd's side,
 * node/client/ring.c in libkvtier-client). Internal: not installed.
 *
 * Why: a call over the engine socket costs two system calls and, above all, the
 * wake-up of a process on the other core (30-50 us on a shared host); the manager
 * call itself takes well under a microsecond. Over the ring an engine writes its
 * request into memory both processes map and waits on the reply in that memory;
 * the node, while busy, polls the rings in its loop, so a call costs two cache-line
 * transfers each way plus the manager's work.
 *
 * Set-up: an engine asks for a ring in HELLO (KVT_HELLO_RING in the flags); the
 * node creates a memfd of its own (sealed: it can neither grow nor shrink, so the
 * engine cannot make the node fault on it) and an eventfd, and passes both after
 * the region's fd with the HELLO reply. The reply's flags say whether it did. The
 * socket stays: it carries HELLO, fd passing, the ERROR frame that closes a
 * connection, and every message that does not fit the ring.
 *
 * Layout of the memfd:
 *
 *     [0, KVT_ERING_CTL_BYTES)   struct kvt_ering_ctl (three cache lines used)
 *     [req_off, +req_cap)        requests, engine -> node
 *     [rep_off, +rep_cap)        replies, node -> engine
 *
 * Each direction is a single-producer single-consumer byte ring with free-running
 * 64-bit head (bytes published) and tail (bytes consumed) counters. A record is an
 * 8-byte header (struct kvt_ering_rec) and its body, padded to 8 bytes; a record
 * never wraps: when it does not fit before the end, a PAD record fills the rest and
 * the record starts at offset 0. A record takes at most half the ring (so it always
 * fits once the ring has drained); a larger request goes over the socket, and a
 * larger reply is replaced by a REDIRECT record: its frame follows on the socket.
 * The bodies are the socket's frame bodies (kvtier/engine_proto.h), unchanged.
 *
 * Who writes what: the engine writes requests, req_head, rep_tail and
 * client_waiting; the node writes replies, req_tail, rep_head, rep_seq,
 * node_sleeping and closed. The node keeps its own copies of every counter and
 * size and never trusts one it reads: a head or tail that does not add up, a
 * record header out of bounds or a sequence number out of order closes that
 * engine's connection (counted), and a request body is copied out of the ring
 * before it is decoded.
 *
 * Waking: while the node is polling it clears node_sleeping; before it sleeps it
 * sets it and looks at every ring once more. An engine that publishes a request
 * and then sees node_sleeping writes the eventfd (the node's loop waits on it).
 * The engine spins on rep_head for a while, then sets client_waiting and
 * futex-waits on rep_seq, which the node bumps (and wakes, when client_waiting is
 * set) with every reply. Both sides put a full fence between their store and
 * their look at the other's flag, so no wake-up is lost. When the node closes the
 * connection it sets closed and wakes the engine, which then reads the socket. */
#ifndef KVTIER_ENGINE_RING_H
#define KVTIER_ENGINE_RING_H

#include <stdint.h>

#define KVT_ERING_MAGIC     0x31304752544b564bull /* "KVKTRG01" little-endian */
#define KVT_ERING_VERSION   1u
#define KVT_ERING_CTL_BYTES 4096u
#define KVT_ERING_REC_BYTES 8u
#define KVT_ERING_PAD       0xffffffffu /* record: skip to the ring's start */
#define KVT_ERING_REDIRECT  0xfffffffeu /* reply record: the reply is on the socket */
/* The most a record's len may say: beyond this only the two markers above. */
#define KVT_ERING_LEN_MAX 0x7fffffffu

/* HELLO flags (KVT_EF_FLAGS): in the request, "I want a ring"; in the reply, "the
 * ring's memfd and eventfd follow the region's fd". */
#define KVT_HELLO_RING 1u

struct kvt_ering_ctl {
    /* Written by the node before the memfd is passed; constant after. */
    uint64_t magic;
    uint32_t version;
    uint32_t ctl_bytes;
    uint64_t req_off, req_cap;
    uint64_t rep_off, rep_cap;
    uint8_t pad0[64 - 40];
    /* Written by the engine. */
    _Alignas(64) uint64_t req_head; /* request bytes published */
    uint64_t rep_tail;              /* reply bytes consumed */
    uint32_t client_waiting;        /* 1: futex-waiting on rep_seq */
    uint8_t pad1[64 - 20];
    /* Written by the node. */
    _Alignas(64) uint64_t req_tail; /* request bytes consumed */
    uint64_t rep_head;              /* reply bytes published */
    uint32_t rep_seq;               /* futex word: bumped with every reply */
    uint32_t node_sleeping;         /* 1: write the eventfd after publishing */
    uint32_t closed;                /* 1: the connection is closing: read the socket */
};

_Static_assert(sizeof(struct kvt_ering_ctl) <= KVT_ERING_CTL_BYTES, "ring control too large");

/* A record header: the body's bytes (or PAD / REDIRECT) and the sequence number of
 * the request (requests: 1, 2, 3, ...; a reply carries its request's). */
struct kvt_ering_rec {
    uint32_t len;
    uint32_t seq;
};

/* Bytes a record of body len takes in the ring. */
static inline uint64_t kvt_ering_rec_bytes(uint64_t len)
{
    return KVT_ERING_REC_BYTES + ((len + 7) & ~(uint64_t)7);
}

#endif

/* SPDX-License-Identifier: Apache-2.0 */
/* The engine API's shared-memory ring (node/engine_ring.c on kvtierd's side,
 * node/client/ring.c in libkvtier-client). Internal: not installed.
 *
 * Why: a call over the engine socket costs two system calls and, above all, the
 * wake-up of a process on the other core (30-50 us on a shared host); the manager
 * call itself takes well under a microsecond. Over the ring an engine writes its
 * request into memory both processes map and waits on the reply in that memory;
 * the node, while busy, polls the rings in its loop, so a call costs the transfer
 * of its records' cache lines (a 1-key lookup: two lines there, one back) plus the
 * manager's work.
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
 *     [0, KVT_ERING_CTL_BYTES)   struct kvt_ering_ctl
 *     [req_off, +req_cap)        requests, engine -> node
 *     [rep_off, +rep_cap)        replies, node -> engine
 *
 * Each direction is a single-producer single-consumer byte ring. A record is a
 * 16-byte header (struct kvt_ering_rec) and its body, padded to a cache line (64
 * bytes): every record starts on a line of its own, so a small reply (a 1-key
 * lookup's) is one line and a small request two, and the next record's slot never
 * shares a line with the record before it. A record never wraps: when it does
 * not fit before the end, the record is written at offset 0 and then a PAD header
 * where it would have started (PAD, REDIRECT and CLOSED records take one line). A record takes at
 * most half the ring (so it always fits once the ring has drained); a larger
 * request goes over the socket, and a larger reply is replaced by a REDIRECT
 * record: its frame follows on the socket. The bodies are the socket's frame
 * bodies (kvtier/engine_proto.h), unchanged.
 *
 * Publication is the header: the producer writes the body and the header's ack,
 * then stores len and seq (release); the consumer polls the seq word of the slot
 * where the next record is due, and a record is there when that word holds the
 * sequence number it expects (requests 1, 2, 3, ...; a reply carries its
 * request's). So a call moves the cache lines of one record each way and nothing
 * else: no shared counter bounces between the cores (the control page's tails are
 * stored by their owner on lines of their own and read by the other side only
 * when the acks say a ring is full). ack tells the other side how
 * far the producer has consumed the other ring (a request's ack: reply bytes the
 * engine has read; a reply's: request bytes the node has taken), which is all
 * either needs to know how much room it has. rep_tail and req_tail in the control
 * page say the same and are read only when the acks say a ring is full. The two
 * channels are not in step (a request posted ahead of its replies carries an
 * older ack than rep_tail may already hold): each only ever goes forward, and the
 * further of the two counts.
 *
 * A consumer scrubs the body of every record it consumed before it acks it
 * (kvt_ering_scrub below: the first word of each of its lines after the first), so
 * that the slot where the next record is due never holds an old body's bytes that
 * read as the sequence number awaited.
 *
 * Who writes what: the engine writes requests, client_waiting and rep_tail (and
 * scrubs the replies it consumed); the node writes replies, node_sleeping, closed
 * and req_tail (and scrubs the requests it took). The node keeps its own
 * copies of every counter and size and never trusts one it reads: an ack that goes
 * backwards on its channel or beyond what was published, a record out of bounds or
 * over the limits closes that engine's connection (counted), and a request body is
 * copied out of the ring before it is decoded.
 *
 * Waking: while the node is polling it clears node_sleeping; before it sleeps it
 * sets it and looks at every ring once more. An engine that publishes a request
 * and then sees node_sleeping writes the eventfd (the node's loop waits on it).
 * The engine spins on its reply slot for a while, then sets client_waiting and
 * futex-waits on the slot's seq word; the node, after publishing a reply, wakes
 * that word when client_waiting is set. Both sides put a full fence between their
 * store and their look at the other's flag, so no wake-up is lost. When the node
 * closes the connection it sets closed, writes a CLOSED record into the reply slot
 * and wakes it; the engine then reads the socket (its ERROR frame, or EOF). */
#ifndef KVTIER_ENGINE_RING_H
#define KVTIER_ENGINE_RING_H

#include <stddef.h>
#include <stdint.h>

#define KVT_ERING_MAGIC 0x33304752544b564bull /* "KVKTRG03" little-endian */
/* 3: records aligned to 64 bytes (2: to 16). A client and a node of different
 * versions do not share a ring: the client's open refuses the control page and the
 * engine stays on the socket. */
#define KVT_ERING_VERSION   3u
#define KVT_ERING_CTL_BYTES 4096u
#define KVT_ERING_REC_BYTES 16u
#define KVT_ERING_ALIGN     64u         /* a record's start and size: one cache line */
#define KVT_ERING_PAD       0xffffffffu /* record: the next one is at the ring's start */
#define KVT_ERING_REDIRECT  0xfffffffeu /* reply record: the reply is on the socket */
#define KVT_ERING_CLOSED    0xfffffffdu /* reply record: the node closed the connection */
/* The most a record's len may say: beyond this only the markers above. */
#define KVT_ERING_LEN_MAX 0x7fffffffu

/* HELLO flags (KVT_EF_FLAGS): in the request, "I want a ring"; in the reply, "the
 * ring's memfd and eventfd follow the region's fd". */
#define KVT_HELLO_RING 1u

/* Each group of fields on a cache line of its own: a side writes its lines only
 * rarely (waits, sleeps, closing) or only for the other side's rare reads. */
struct kvt_ering_ctl {
    /* Written by the node before the memfd is passed; constant after. */
    uint64_t magic;
    uint32_t version;
    uint32_t ctl_bytes;
    uint64_t req_off, req_cap;
    uint64_t rep_off, rep_cap;
    /* Written by the engine around a futex wait. */
    _Alignas(64) uint32_t client_waiting;
    /* Written by the node when it starts or stops polling, and when it closes. */
    _Alignas(64) uint32_t node_sleeping;
    uint32_t closed;
    /* Written by the engine as it consumes replies (the node reads it only when
     * the acks say the reply ring is full). */
    _Alignas(64) uint64_t rep_tail;
    /* Written by the node as it takes requests (read by the engine likewise). */
    _Alignas(64) uint64_t req_tail;
};

_Static_assert(sizeof(struct kvt_ering_ctl) <= KVT_ERING_CTL_BYTES, "ring control too large");

/* A record header. len: the body's bytes, or PAD / REDIRECT / CLOSED. seq: the
 * request's sequence number (a reply carries its request's). ack: bytes of the
 * other ring its producer has consumed. len and seq are one 8-byte word, stored
 * last (release); the consumer loads it first (acquire). */
struct kvt_ering_rec {
    uint32_t len;
    uint32_t seq;
    uint64_t ack;
};

_Static_assert(sizeof(struct kvt_ering_rec) == KVT_ERING_REC_BYTES, "ring record header");

/* Bytes a record of body len takes in the ring: its header and body rounded up to
 * whole lines (a marker record, len 0: one line). */
static inline uint64_t kvt_ering_rec_bytes(uint64_t len)
{
    return (KVT_ERING_REC_BYTES + len + KVT_ERING_ALIGN - 1) & ~(uint64_t)(KVT_ERING_ALIGN - 1);
}

/* memcpy for the small copies of a call's path (a record's body into or out of the
 * ring, a reply's pieces): inline 16-byte moves up to 256 bytes, libc beyond. Why:
 * on this project's test machine (a KVM guest on a Xeon with AVX-512) a call of
 * glibc's memcpy for 24 bytes on the node's reply path cost about 0.1 us of the
 * ring's 1-key round trip, measured by swapping it for this copy. */
static inline void kvt_ering_copy(void *dst, const void *src, size_t n)
{
    uint8_t *d = (uint8_t *)dst;
    const uint8_t *s = (const uint8_t *)src;

    if (n > 256) {
        __builtin_memcpy(d, s, n);
        return;
    }
    for (; n >= 16; n -= 16, d += 16, s += 16)
        __builtin_memcpy(d, s, 16);
    if (n >= 8) {
        __builtin_memcpy(d, s, 8);
        d += 8, s += 8, n -= 8;
    }
    if (n >= 4) {
        __builtin_memcpy(d, s, 4);
        d += 4, s += 4, n -= 4;
    }
    if (n >= 2) {
        __builtin_memcpy(d, s, 2);
        d += 2, s += 2, n -= 2;
    }
    if (n > 0)
        *d = *s;
}

/* What a consumer does to a record it has copied out, before it acks its bytes:
 * the first 8 bytes of every line of the record after its first become a header
 * {len 0, seq: the record's own}. A consumer polls the slot where the next record
 * is due before the producer has written there, and in the ring's second lap that
 * slot may lie inside an old record's body: body bytes that happened to read as
 * the awaited sequence number (a key ending in two random bytes and its group's
 * zeros does, about once in 65536 with seq below 65536) would be taken for a
 * record. Slots are line starts, so after the scrub every word a slot can hold is
 * a header the producer wrote or a scrubbed one, and their sequence numbers are
 * all behind the one awaited. A one-line record (a small reply) needs no store at
 * all. The stores are ordered before the ack by its release. */
static inline void kvt_ering_scrub(uint8_t *rec, uint32_t len, uint32_t seq)
{
    struct kvt_ering_rec h = {.len = 0, .seq = seq};
    uint64_t v, end = kvt_ering_rec_bytes(len);

    __builtin_memcpy(&v, &h, sizeof(v));
    for (uint64_t o = KVT_ERING_ALIGN; o < end; o += KVT_ERING_ALIGN)
        __atomic_store_n((uint64_t *)(void *)(rec + o), v, __ATOMIC_RELAXED);
}

#endif

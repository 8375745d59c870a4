/* SPDX-License-Identifier: Apache-2.0 */
/* The engine API's wire protocol, shared by kvtierd's server (node/engine_api.c)
 * and libkvtier-client (node/client/client.c). Internal: not installed.
 *
 * A stream socket carries frames: a big-endian u32 body length, then the body, one
 * msgpack map from small integer field ids (KVT_EF_*) to values. Every request has
 * an op and a seq; its reply has op | KVT_EOP_REPLY, the same seq and an rc (0 or
 * -errno). The first request on a connection is HELLO; its reply carries the region
 * geometry, and the region's fd travels with it as SCM_RIGHTS ancillary data.
 * Unknown fields are skipped (a newer minor may add some); an unknown op is refused.
 *
 * Minor 1 adds: HELLO's FINGERPRINT (the engine's model fingerprint in the request,
 * the node's in the reply), ERROR's MESSAGE (why the connection is closed), and the
 * ops RESET, PENDING and PEERS. A client sends them only to a node whose HELLO reply
 * said minor >= 1 (a minor-0 node would close the connection on an unknown op).
 *
 * Decoding is bounded before allocation: the body is first walked as raw msgpack
 * headers (every payload present, every count no larger than the bytes left, depth
 * and object count capped), then each list is checked against the limits before
 * its one allocation. msgpack-c's unpacker never sees peer bytes; its packer
 * encodes. */
#ifndef KVTIER_ENGINE_PROTO_H
#define KVTIER_ENGINE_PROTO_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvtier/client.h"

#define KVT_EPROTO_HDR      4
#define KVT_EPROTO_ID_MAX   KVTIER_REQ_ID_MAX
#define KVT_EPROTO_GEOM_MAX 8
#define KVT_EPROTO_MSG_MAX  1023 /* bytes of an ERROR frame's message */
#define KVT_EPROTO_PEER_MIN 8    /* fields of a peer a reply carries at least */

enum kvt_eproto_op {
    KVT_EOP_HELLO = 1,
    KVT_EOP_NEW_REQUEST = 2,
    KVT_EOP_LOOKUP = 3,
    KVT_EOP_PREPARE_STORE = 4,
    KVT_EOP_COMPLETE_STORE = 5,
    KVT_EOP_PREPARE_LOAD = 6,
    KVT_EOP_COMPLETE_LOAD = 7,
    KVT_EOP_TOUCH = 8,
    KVT_EOP_REQUEST_FINISHED = 9,
    KVT_EOP_SCHEDULE_END = 10,
    KVT_EOP_TAKE_EVENTS = 11,
    KVT_EOP_GET_STATS = 12,
    KVT_EOP_ATTACH = 13,  /* an engine's own region: GEOM (KVT_EA_*), its fd as SCM_RIGHTS */
    KVT_EOP_JOBS = 14,    /* a step's lookups (KEYS) and jobs; reply: verdicts, finished jobs */
    KVT_EOP_RESET = 15,   /* minor 1: the node forgets every chunk (rc only; -EBUSY) */
    KVT_EOP_PENDING = 16, /* minor 1: has_pending_work; reply FLAGS (KVT_EPENDING_*) */
    KVT_EOP_PEERS = 17,   /* minor 1: reply PEERS */
    KVT_EOP_MAX_REQUEST = 17,
    KVT_EOP_ERROR = 0x7f, /* server -> client: the connection is being closed */
    KVT_EOP_REPLY = 0x80,
};

/* Field ids; bit i of struct kvt_emsg.has says field i is present. */
enum kvt_eproto_field {
    KVT_EF_OP = 0,
    KVT_EF_SEQ = 1,
    KVT_EF_RC = 2,
    KVT_EF_REQ_ID = 3,
    KVT_EF_NAME = 4,
    KVT_EF_MAJOR = 5,
    KVT_EF_MINOR = 6,
    KVT_EF_FLAGS = 7,    /* lookup flags, complete_store success, policy, n_done */
    KVT_EF_KEYS = 8,     /* array of bin 1..64 */
    KVT_EF_RESULTS = 9,  /* bin, one lookup result per byte */
    KVT_EF_IDS = 10,     /* array of int: chunk ids (loads, stores) */
    KVT_EF_INDEX = 11,   /* array of uint: prepare_store's store_index */
    KVT_EF_EVICTED = 12, /* array of bin */
    KVT_EF_PARAMS = 13,  /* str: kv_transfer_params JSON */
    KVT_EF_FILTER = 14,  /* array of [medium, locality]; absent = every tier */
    KVT_EF_NEW = 15,     /* array of str */
    KVT_EF_PREEMPTED = 16,
    KVT_EF_EVENTS = 17,      /* array of [keys, medium, locality, removed] */
    KVT_EF_STATS = 18,       /* array of [name, label, kind, value, count, sum, buckets] */
    KVT_EF_GEOM = 19,        /* array of uint, KVT_EG_* */
    KVT_EF_BOUNDS = 20,      /* array of 16 floats */
    KVT_EF_JOB_KEYS = 21,    /* array of bin: every job's keys, job after job */
    KVT_EF_JOBS = 22,        /* array of uint: [job id, kind or status, n keys] per job */
    KVT_EF_OK = 23,          /* bin: one byte per key of the finished jobs, 1 = loaded/stored */
    KVT_EF_FINGERPRINT = 24, /* str 0..KVTIER_FINGERPRINT_MAX: HELLO (engine's; node's) */
    KVT_EF_MESSAGE = 25,     /* str 0..KVT_EPROTO_MSG_MAX: ERROR's reason */
    KVT_EF_PEERS = 26,       /* array of [id, incarnation, addr, port, state, last heard ms,
                                pulled bytes, served bytes, ...more in a newer minor] */
    /* array parallel to KVT_EF_STATS (and after it): each stat's finite bucket upper
     * bounds, ascending (empty for a counter or gauge); without it a histogram's
     * bounds are KVT_EF_BOUNDS, the last of which stands for +Inf */
    KVT_EF_STAT_BOUNDS = 27,
    KVT_EF_COUNT = 28,
};

/* PENDING reply flags (KVT_EF_FLAGS). */
#define KVT_EPENDING_NODE   1u /* the node's manager has work in flight */
#define KVT_EPENDING_CLIENT 2u /* this client's jobs are not all reported */

/* ATTACH geometry, KVT_EF_GEOM[i] of the request: the engine's region as the node is
 * to map it from the passed fd. The reply's GEOM is the node's rows (KVT_EG_*). */
enum kvt_eproto_attach {
    KVT_EA_ROWS = 0,   /* rows of the engine's region */
    KVT_EA_STRIDE = 1, /* bytes from one row to the next (and bytes of a row) */
    KVT_EA_SIZE = 2,   /* rows * stride */
    KVT_EA_OFFSET = 3, /* where row 0 starts in the fd (page aligned) */
    KVT_EA_COUNT = 4,
};

/* JOBS: a job's kind in the request, its status in the reply. Rows of the engine's
 * region go in KVT_EF_IDS, one per job key. */
enum kvt_eproto_job {
    KVT_EJ_STORE = 0,  /* copy the rows into the node (kvtier keeps the chunks) */
    KVT_EJ_LOAD = 1,   /* fill the rows from the node's chunks */
    KVT_EJ_OK = 0,     /* reply: every key done */
    KVT_EJ_FAILED = 1, /* reply: some keys failed; KVT_EF_OK says which succeeded */
};

/* GET_STATS request flags (KVT_EF_FLAGS). */
#define KVT_ESTATS_TOTALS 1u /* the node's totals, not this client's deltas */

/* HELLO reply geometry, KVT_EF_GEOM[i]. */
enum kvt_eproto_geom {
    KVT_EG_CLIENT_ID = 0,
    KVT_EG_NUM_CHUNKS = 1,
    KVT_EG_ROW_BYTES = 2,
    KVT_EG_PAGE_BYTES = 3,
    KVT_EG_NUM_WORKERS = 4,
    KVT_EG_SIZE = 5,
    KVT_EG_MAX_KEYS = 6,
    KVT_EG_COUNT = 7,
};

struct kvt_eproto_limits {
    uint32_t max_body;   /* bytes of one body */
    uint32_t max_keys;   /* per key list, id list, result bin, request-id list */
    uint32_t max_params; /* bytes of params JSON */
    uint32_t max_events; /* events in one reply (keys of all events: max_body bound) */
    uint32_t max_stats;
    uint32_t max_peers; /* peers in one reply */
};
/* 1 MiB bodies, 4096 keys, 64 KiB params, 65536 events/stats, 4096 peers. */
void kvt__eproto_limits_default(struct kvt_eproto_limits *lim);

typedef char kvt_eproto_id_t[KVT_EPROTO_ID_MAX + 1];

/* One decoded (or to-be-encoded) message. Pointers are owned by the message when
 * decoded (kvt__emsg_free); when encoding they are the caller's. */
struct kvt_emsg {
    uint32_t has; /* 1u << KVT_EF_* */
    uint32_t op;
    uint64_t seq;
    int64_t rc;
    kvt_eproto_id_t req_id;
    char name[KVTIER_NAME_MAX + 1];
    uint64_t major, minor;
    uint64_t flags;
    struct kvtier_key *keys;
    uint32_t n_keys;
    uint8_t *results;
    uint32_t n_results;
    int64_t *ids;
    uint32_t n_ids;
    uint32_t *index;
    uint32_t n_index;
    struct kvtier_key *evicted;
    uint32_t n_evicted;
    char *params; /* NUL-terminated */
    uint32_t params_len;
    struct kvtier_tier_matcher filter[KVTIER_FILTER_MAX];
    uint32_t n_filter;
    kvt_eproto_id_t *new_ids;
    uint32_t n_new;
    kvt_eproto_id_t *preempted;
    uint32_t n_preempted;
    struct kvtier_event *events; /* decoded: every event's keys in one array */
    uint32_t n_events;
    struct kvtier_stat *stats;
    uint32_t n_stats;
    struct kvtier_hist_bounds *stat_bounds; /* KVT_EF_STAT_BOUNDS: n_stats of them */
    uint64_t geom[KVT_EPROTO_GEOM_MAX];
    uint32_t n_geom;
    double bounds[KVTIER_HIST_BUCKETS];
    uint32_t n_bounds;
    struct kvtier_key *job_keys;
    uint32_t n_job_keys;
    uint64_t *jobs; /* triples */
    uint32_t n_jobs;
    uint8_t *ok;
    uint32_t n_ok;
    char fingerprint[KVTIER_FINGERPRINT_MAX + 1];
    char message[KVT_EPROTO_MSG_MAX + 1];
    struct kvtier_peer *peers;
    uint32_t n_peers;
    /* decoded only */
    void *heap; /* the events' key array */
    size_t heap_bytes;
};

static inline bool kvt__emsg_has(const struct kvt_emsg *m, enum kvt_eproto_field f)
{
    return (m->has >> f) & 1u;
}

/* Zeroes m. */
void kvt__emsg_init(struct kvt_emsg *m);
/* Frees what a decode allocated and zeroes m. */
void kvt__emsg_free(struct kvt_emsg *m);

/* Decodes one body. 0, or -EBADMSG (not well-formed msgpack, wrong types, bad key
 * or string lengths), -EMSGSIZE (over a limit), -EPROTO (no op), -ENOMEM. On error m
 * holds nothing. */
int kvt__emsg_decode(const uint8_t *body, size_t len, const struct kvt_eproto_limits *lim,
                     struct kvt_emsg *m);

/* A growable byte buffer. */
struct kvt_ebuf {
    uint8_t *data;
    size_t len, cap;
};
void kvt__ebuf_init(struct kvt_ebuf *b);
void kvt__ebuf_cleanup(struct kvt_ebuf *b);
/* Appends p[0..len). -ENOMEM (b unchanged). */
int kvt__ebuf_append(struct kvt_ebuf *b, const void *p, size_t len);
/* Appends one frame (header + body) of every field in m->has. -ENOMEM. */
int kvt__emsg_encode(const struct kvt_emsg *m, struct kvt_ebuf *b);

/* ---- binary messages (the ring's hot calls) ---------------------------------------
 *
 * A fixed-layout body for the calls an engine makes per block (lookup, touch,
 * prepare_load, complete_load, complete_store): no map to walk, no allocation, a
 * header and two packed arrays. It starts with KVT_EBIN_MAGIC, a byte msgpack never
 * uses, so a receiver tells the two kinds apart by the first byte. Only over the
 * ring (both ends share the host, so integers are in its byte order), and only to
 * a node whose HELLO reply has KVT_HELLO_BIN: an older node never sees one, and an
 * older engine never sends one. The node checks every length against the body's
 * (kvt__ebin_req_parse) before it reads anything; one that does not add up is
 * refused like a malformed frame. The reply of a binary request is binary; it
 * comes over the ring, or on the socket behind a REDIRECT like any reply. */
#define KVT_EBIN_MAGIC 0xc1u /* "never used" in msgpack */
#define KVT_EBIN_HDR   24u
#define KVT_HELLO_BIN  2u /* HELLO reply flag: the node takes binary requests on the ring */

/* Request: the header, id_len bytes of request id (no NUL; 0 bytes: no request
 * named, as a frame without REQ_ID), n * key_len bytes of keys. flags: lookup's
 * KVTIER_LOOKUP_*, complete_store's success (0 or 1), else 0. */
struct kvt_ebin_req {
    uint8_t magic;
    uint8_t op;      /* KVT_EOP_LOOKUP, _TOUCH, _PREPARE_LOAD, _COMPLETE_LOAD, _COMPLETE_STORE */
    uint8_t key_len; /* 1..KVTIER_KEY_MAX */
    uint8_t id_len;  /* 0..KVT_EPROTO_ID_MAX */
    uint32_t n;      /* keys, at most the limit's max_keys */
    uint32_t flags;
    uint32_t zero; /* 0 (room for a newer minor) */
    uint64_t seq;
};

/* Reply: the header, then lookup's n result bytes or prepare_load's n int64 chunk
 * ids (n = 0 when rc < 0). */
struct kvt_ebin_rep {
    uint8_t magic;
    uint8_t op; /* the request's | KVT_EOP_REPLY */
    uint16_t zero;
    int32_t rc;
    uint32_t n;
    uint32_t zero2;
    uint64_t seq;
};

_Static_assert(sizeof(struct kvt_ebin_req) == KVT_EBIN_HDR, "binary request header");
_Static_assert(sizeof(struct kvt_ebin_rep) == KVT_EBIN_HDR, "binary reply header");

/* Whether op has a binary form. */
static inline bool kvt__ebin_op(unsigned op)
{
    return op == KVT_EOP_LOOKUP || op == KVT_EOP_TOUCH || op == KVT_EOP_PREPARE_LOAD ||
           op == KVT_EOP_COMPLETE_LOAD || op == KVT_EOP_COMPLETE_STORE;
}

/* Bytes of a reply's payload entry for op (lookup: a result byte, prepare_load: a
 * chunk id), 0 for the ops whose reply is only an rc. */
static inline size_t kvt__ebin_rep_elem(unsigned op)
{
    return op == KVT_EOP_LOOKUP ? 1 : op == KVT_EOP_PREPARE_LOAD ? 8 : 0;
}

/* A binary request checked against its body and lim: 0 with *hdr_p (a copy) and
 * the id and keys pointing into body, or -EBADMSG (a length that does not add
 * up, an unknown op, a bad key length, an id with a NUL, flags an op does not
 * take, a reserved field not zero) or -EMSGSIZE (more keys than lim allows). */
int kvt__ebin_req_parse(const uint8_t *body, size_t len, const struct kvt_eproto_limits *lim,
                        struct kvt_ebin_req *hdr_p, const char **id_p, const uint8_t **keys_p);
/* A binary reply to request req checked against its body: 0 with *hdr_p and the
 * payload pointing into body, or -EPROTO (not the reply to req, more entries than
 * req had keys, a length that does not add up). */
int kvt__ebin_rep_parse(const uint8_t *body, size_t len, const struct kvt_ebin_req *req,
                        struct kvt_ebin_rep *hdr_p, const uint8_t **payload_p);

/* The body length a frame header announces. */
static inline uint32_t kvt__eproto_frame_len(const uint8_t *hdr)
{
    return (uint32_t)hdr[0] << 24 | (uint32_t)hdr[1] << 16 | (uint32_t)hdr[2] << 8 | hdr[3];
}

#endif

/* SPDX-License-Identifier: Apache-2.0 */
/* The engine API codec (layout in kvtier/engine_proto.h), compiled into both the
 * daemon (kvt_node) and libkvtier-client.
 *
 * Decoding runs on the one bounded msgpack reader (kvt/mpcheck.h, shared with the
 * wire codec), in two passes:
 *   1. validate: kvt_mp_check, an iterative walk over the whole body: every
 *      str/bin/ext payload is present, every array/map declares no more elements
 *      than bytes remain (each element takes at least one), depth and object count
 *      are capped, and the body is exactly one object;
 *   2. fields: the top map's pairs are read by field id with the reader's cursor
 *      (kind and bounds checked on every read); each list's count is checked
 *      against the limits before its one allocation; unknown ids skipped.
 * After pass 1 a count can be at most the body's length, so what a decode
 * allocates is a small multiple of the body plus the limits (heap_bytes says how
 * much). Encoding goes through msgpack-c's packer into a struct kvt_ebuf. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <msgpack.h>

#include "kvt/alloc.h"
#include "kvt/common.h"
#include "kvt/mpcheck.h"
#include "kvt/vec.h"
#include "kvtier/engine_proto.h"

#define MAX_DEPTH   8
#define MAX_OBJECTS (1u << 22)

void kvt__eproto_limits_default(struct kvt_eproto_limits *lim)
{
    *lim = (struct kvt_eproto_limits){.max_body = 1u << 20,
                                      .max_keys = 4096,
                                      .max_params = 64u << 10,
                                      .max_events = 65536,
                                      .max_stats = 65536,
                                      .max_peers = 4096};
}

void kvt__emsg_init(struct kvt_emsg *m)
{
    memset(m, 0, sizeof(*m));
}

void kvt__emsg_free(struct kvt_emsg *m)
{
    kvt_free(m->keys);
    kvt_free(m->results);
    kvt_free(m->ids);
    kvt_free(m->index);
    kvt_free(m->evicted);
    kvt_free(m->params);
    kvt_free(m->new_ids);
    kvt_free(m->preempted);
    kvt_free(m->events);
    kvt_free(m->stats);
    kvt_free(m->stat_bounds);
    kvt_free(m->job_keys);
    kvt_free(m->jobs);
    kvt_free(m->ok);
    kvt_free(m->peers);
    kvt_free(m->heap);
    kvt__emsg_init(m);
}

/* ---- reading fields: the shared cursor (kvt/mpcheck.h) --------------------------- */

static int rd_int_range(struct kvt_mp_cur *c, int64_t lo, int64_t hi, int *v)
{
    int64_t x;
    int rc = kvt_mp_i64(c, &x);

    if (rc < 0)
        return rc;
    if (x < lo || x > hi)
        return -EBADMSG;
    *v = (int)x;
    return 0;
}

static int rd_f64(struct kvt_mp_cur *c, double *v)
{
    struct kvt_mp_obj o;
    int rc = kvt_mp_next(c, &o);

    if (rc < 0)
        return rc;
    if (o.kind == KVT_MP_FLOAT)
        *v = o.f;
    else if (o.kind == KVT_MP_INT)
        *v = o.neg ? (double)o.i : (double)o.u;
    else
        return -EBADMSG;
    return 0;
}

static int rd_key(struct kvt_mp_cur *c, struct kvtier_key *k)
{
    size_t len;
    int rc = kvt_mp_bin(c, 1, KVTIER_KEY_MAX, k->bytes, &len);

    if (rc == 0)
        k->len = (uint8_t)len;
    return rc;
}

/* One allocation of n * each (n already bounded); counts into heap_bytes. */
static int alloc_n(struct kvt_emsg *m, void **p, size_t n, size_t each)
{
    if (*p != NULL)
        return -EBADMSG; /* a field given twice */
    *p = kvt_calloc(n ? n : 1, each);
    if (*p == NULL)
        return -ENOMEM;
    m->heap_bytes += (n ? n : 1) * each;
    return 0;
}

static int dec_keys(struct kvt_mp_cur *c, struct kvt_emsg *m, uint32_t max,
                    struct kvtier_key **keys, uint32_t *n_p)
{
    uint32_t n;
    int rc = kvt_mp_array(c, max, &n);

    if (rc < 0)
        return rc;
    rc = alloc_n(m, (void **)keys, n, sizeof(**keys));
    for (uint32_t i = 0; rc == 0 && i < n; i++)
        rc = rd_key(c, &(*keys)[i]);
    if (rc == 0)
        *n_p = n;
    return rc;
}

static int dec_id_list(struct kvt_mp_cur *c, struct kvt_emsg *m, uint32_t max,
                       kvt_eproto_id_t **ids, uint32_t *n_p)
{
    uint32_t n;
    int rc = kvt_mp_array(c, max, &n);

    if (rc < 0)
        return rc;
    rc = alloc_n(m, (void **)ids, n, sizeof(**ids));
    for (uint32_t i = 0; rc == 0 && i < n; i++)
        rc = kvt_mp_str(c, 1, KVT_EPROTO_ID_MAX, (*ids)[i]);
    if (rc == 0)
        *n_p = n;
    return rc;
}

/* Events: [keys, medium, locality, removed]; all keys in one array (m->heap). The
 * first pass counts the keys so that the one allocation is exact. */
static int dec_events(struct kvt_mp_cur *c, const struct kvt_eproto_limits *lim, struct kvt_emsg *m)
{
    uint32_t n;
    uint64_t total = 0;
    struct kvt_mp_cur save;
    int rc = kvt_mp_array(c, lim->max_events, &n);

    if (rc < 0)
        return rc;
    save = *c;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t fields, nk = 0;

        rc = kvt_mp_array(c, 16, &fields);
        if (rc == 0 && fields != 4)
            rc = -EBADMSG;
        if (rc == 0)
            rc = kvt_mp_array(c, UINT32_MAX, &nk);
        if (rc < 0)
            return rc;
        total += nk;
        for (uint32_t k = 0; k < nk + 3u; k++) {
            rc = kvt_mp_skip(c);
            if (rc < 0)
                return rc;
        }
    }
    /* every key is at least 2 bytes, so total is bounded by the body */
    *c = save;
    rc = alloc_n(m, (void **)&m->events, n, sizeof(*m->events));
    if (rc == 0)
        rc = alloc_n(m, &m->heap, total, sizeof(struct kvtier_key));
    struct kvtier_key *keys = m->heap;
    for (uint32_t i = 0; rc == 0 && i < n; i++) {
        struct kvtier_event *ev = &m->events[i];
        uint32_t fields, nk = 0;
        struct kvt_mp_obj o;

        rc = kvt_mp_array(c, 16, &fields);
        if (rc == 0)
            rc = kvt_mp_array(c, UINT32_MAX, &nk);
        if (rc < 0)
            break;
        ev->keys = keys;
        ev->n = nk;
        for (uint32_t k = 0; rc == 0 && k < nk; k++)
            rc = rd_key(c, keys++);
        if (rc == 0)
            rc = rd_int_range(c, 0, 1, &ev->medium);
        if (rc == 0)
            rc = rd_int_range(c, -1, 1, &ev->locality);
        if (rc == 0)
            rc = kvt_mp_expect(c, KVT_MP_BOOL, &o);
        if (rc == 0)
            ev->removed = o.u != 0;
    }
    if (rc == 0)
        m->n_events = n;
    return rc;
}

static int dec_stats(struct kvt_mp_cur *c, const struct kvt_eproto_limits *lim, struct kvt_emsg *m)
{
    uint32_t n;
    int rc = kvt_mp_array(c, lim->max_stats, &n);

    if (rc < 0)
        return rc;
    rc = alloc_n(m, (void **)&m->stats, n, sizeof(*m->stats));
    for (uint32_t i = 0; rc == 0 && i < n; i++) {
        struct kvtier_stat *s = &m->stats[i];
        uint32_t fields, nb;

        rc = kvt_mp_array(c, 16, &fields);
        if (rc == 0 && fields != 7)
            rc = -EBADMSG;
        if (rc == 0)
            rc = kvt_mp_str(c, 1, KVTIER_STAT_NAME_MAX - 1, s->name);
        if (rc == 0)
            rc = kvt_mp_str(c, 0, KVTIER_STAT_LABEL_MAX - 1, s->label);
        if (rc == 0)
            rc = rd_int_range(c, 0, 2, &s->kind);
        if (rc == 0)
            rc = rd_f64(c, &s->value);
        if (rc == 0)
            rc = kvt_mp_u64(c, &s->count);
        if (rc == 0)
            rc = rd_f64(c, &s->sum);
        if (rc == 0)
            rc = kvt_mp_array(c, KVTIER_HIST_BUCKETS, &nb);
        if (rc == 0 && nb != KVTIER_HIST_BUCKETS)
            rc = -EBADMSG;
        for (uint32_t b = 0; rc == 0 && b < nb; b++)
            rc = kvt_mp_u64(c, &s->buckets[b]);
    }
    if (rc == 0)
        m->n_stats = n;
    return rc;
}

/* Each stat's bucket bounds: after the stats they belong to (encoders write fields in
 * id order), one list per stat, each ascending and finite. */
static int dec_stat_bounds(struct kvt_mp_cur *c, struct kvt_emsg *m)
{
    uint32_t n;
    int rc;

    if (!kvt__emsg_has(m, KVT_EF_STATS))
        return -EBADMSG;
    rc = kvt_mp_array(c, m->n_stats, &n);
    if (rc == 0 && n != m->n_stats)
        rc = -EBADMSG;
    if (rc == 0)
        rc = alloc_n(m, (void **)&m->stat_bounds, n, sizeof(*m->stat_bounds));
    for (uint32_t i = 0; rc == 0 && i < n; i++) {
        struct kvtier_hist_bounds *hb = &m->stat_bounds[i];
        uint32_t nb;

        rc = kvt_mp_array(c, KVTIER_HIST_BUCKETS - 1, &nb);
        for (uint32_t b = 0; rc == 0 && b < nb; b++) {
            rc = rd_f64(c, &hb->bound[b]);
            if (rc == 0 && (!isfinite(hb->bound[b]) || (b > 0 && hb->bound[b] <= hb->bound[b - 1])))
                rc = -EBADMSG;
        }
        if (rc == 0)
            hb->n = nb;
    }
    return rc;
}

/* Peers: each an array of at least KVT_EPROTO_PEER_MIN fields (a newer minor's
 * extra fields are skipped). */
static int dec_peers(struct kvt_mp_cur *c, const struct kvt_eproto_limits *lim, struct kvt_emsg *m)
{
    uint32_t n;
    int rc = kvt_mp_array(c, lim->max_peers, &n);

    if (rc < 0)
        return rc;
    rc = alloc_n(m, (void **)&m->peers, n, sizeof(*m->peers));
    for (uint32_t i = 0; rc == 0 && i < n; i++) {
        struct kvtier_peer *p = &m->peers[i];
        uint32_t fields;
        uint64_t port;

        rc = kvt_mp_array(c, 64, &fields);
        if (rc == 0 && fields < KVT_EPROTO_PEER_MIN)
            rc = -EBADMSG;
        if (rc == 0)
            rc = kvt_mp_u64(c, &p->node_id);
        if (rc == 0)
            rc = kvt_mp_u64(c, &p->incarnation);
        if (rc == 0)
            rc = kvt_mp_str(c, 0, KVTIER_ADDR_MAX, p->addr);
        if (rc == 0)
            rc = kvt_mp_u64(c, &port);
        if (rc == 0 && port > UINT16_MAX)
            rc = -EBADMSG;
        p->port = (uint16_t)port;
        if (rc == 0)
            rc = rd_int_range(c, KVTIER_PEER_ALIVE, KVTIER_PEER_SELF, &p->state);
        if (rc == 0)
            rc = kvt_mp_u64(c, &p->last_heard_ms);
        if (rc == 0)
            rc = kvt_mp_u64(c, &p->pulled_bytes);
        if (rc == 0)
            rc = kvt_mp_u64(c, &p->served_bytes);
        for (uint32_t f = KVT_EPROTO_PEER_MIN; rc == 0 && f < fields; f++)
            rc = kvt_mp_skip(c);
    }
    if (rc == 0)
        m->n_peers = n;
    return rc;
}

static int dec_field(struct kvt_mp_cur *c, uint64_t id, const struct kvt_eproto_limits *lim,
                     struct kvt_emsg *m)
{
    struct kvt_mp_obj o;
    uint32_t n;
    int rc;

    if (id < 32 && ((m->has >> id) & 1u))
        return -EBADMSG; /* duplicate field */
    switch (id) {
    case KVT_EF_OP:
        rc = kvt_mp_u64(c, &m->seq); /* scratch */
        if (rc == 0 && m->seq > 0xff)
            rc = -EBADMSG;
        m->op = (uint32_t)m->seq;
        m->seq = 0;
        break;
    case KVT_EF_SEQ:
        rc = kvt_mp_u64(c, &m->seq);
        break;
    case KVT_EF_RC:
        rc = kvt_mp_i64(c, &m->rc);
        if (rc == 0 && (m->rc > 0 || m->rc < -4095))
            rc = -EBADMSG;
        break;
    case KVT_EF_REQ_ID:
        rc = kvt_mp_str(c, 1, KVT_EPROTO_ID_MAX, m->req_id);
        break;
    case KVT_EF_NAME:
        rc = kvt_mp_str(c, 0, KVTIER_NAME_MAX, m->name);
        break;
    case KVT_EF_MAJOR:
        rc = kvt_mp_u64(c, &m->major);
        break;
    case KVT_EF_MINOR:
        rc = kvt_mp_u64(c, &m->minor);
        break;
    case KVT_EF_FLAGS:
        rc = kvt_mp_u64(c, &m->flags);
        break;
    case KVT_EF_KEYS:
        rc = dec_keys(c, m, lim->max_keys, &m->keys, &m->n_keys);
        break;
    case KVT_EF_EVICTED:
        rc = dec_keys(c, m, lim->max_keys, &m->evicted, &m->n_evicted);
        break;
    case KVT_EF_RESULTS:
        rc = kvt_mp_expect(c, KVT_MP_BIN, &o);
        if (rc == 0 && o.n > lim->max_keys)
            rc = -EMSGSIZE;
        if (rc == 0)
            rc = alloc_n(m, (void **)&m->results, o.n, 1);
        if (rc == 0) {
            memcpy(m->results, o.data, o.n);
            m->n_results = (uint32_t)o.n;
            for (uint32_t i = 0; i < m->n_results; i++) {
                if (m->results[i] > KVTIER_RETRY)
                    rc = -EBADMSG;
            }
        }
        break;
    case KVT_EF_IDS:
        rc = kvt_mp_array(c, lim->max_keys, &n);
        if (rc == 0)
            rc = alloc_n(m, (void **)&m->ids, n, sizeof(*m->ids));
        for (uint32_t i = 0; rc == 0 && i < n; i++)
            rc = kvt_mp_i64(c, &m->ids[i]);
        if (rc == 0)
            m->n_ids = n;
        break;
    case KVT_EF_INDEX:
        rc = kvt_mp_array(c, lim->max_keys, &n);
        if (rc == 0)
            rc = alloc_n(m, (void **)&m->index, n, sizeof(*m->index));
        for (uint32_t i = 0; rc == 0 && i < n; i++) {
            uint64_t v;

            rc = kvt_mp_u64(c, &v);
            if (rc == 0 && v > UINT32_MAX)
                rc = -EBADMSG;
            m->index[i] = (uint32_t)v;
        }
        if (rc == 0)
            m->n_index = n;
        break;
    case KVT_EF_PARAMS:
        rc = kvt_mp_expect(c, KVT_MP_STR, &o);
        if (rc == 0 && o.n > lim->max_params)
            rc = -EMSGSIZE;
        if (rc == 0 && memchr(o.data, 0, o.n) != NULL)
            rc = -EBADMSG;
        if (rc == 0)
            rc = alloc_n(m, (void **)&m->params, o.n + 1, 1);
        if (rc == 0) {
            memcpy(m->params, o.data, o.n);
            m->params_len = (uint32_t)o.n;
        }
        break;
    case KVT_EF_FILTER:
        rc = kvt_mp_array(c, KVTIER_FILTER_MAX, &n);
        for (uint32_t i = 0; rc == 0 && i < n; i++) {
            uint32_t two;

            rc = kvt_mp_array(c, 2, &two);
            if (rc == 0 && two != 2)
                rc = -EBADMSG;
            if (rc == 0)
                rc = rd_int_range(c, -1, 1, &m->filter[i].medium);
            if (rc == 0)
                rc = rd_int_range(c, -1, 1, &m->filter[i].locality);
        }
        if (rc == 0)
            m->n_filter = n;
        break;
    case KVT_EF_NEW:
        rc = dec_id_list(c, m, lim->max_keys, &m->new_ids, &m->n_new);
        break;
    case KVT_EF_PREEMPTED:
        rc = dec_id_list(c, m, lim->max_keys, &m->preempted, &m->n_preempted);
        break;
    case KVT_EF_EVENTS:
        rc = dec_events(c, lim, m);
        break;
    case KVT_EF_STATS:
        rc = dec_stats(c, lim, m);
        break;
    case KVT_EF_GEOM:
        rc = kvt_mp_array(c, KVT_EPROTO_GEOM_MAX, &n);
        for (uint32_t i = 0; rc == 0 && i < n; i++)
            rc = kvt_mp_u64(c, &m->geom[i]);
        if (rc == 0)
            m->n_geom = n;
        break;
    case KVT_EF_BOUNDS:
        rc = kvt_mp_array(c, KVTIER_HIST_BUCKETS, &n);
        for (uint32_t i = 0; rc == 0 && i < n; i++)
            rc = rd_f64(c, &m->bounds[i]);
        if (rc == 0)
            m->n_bounds = n;
        break;
    case KVT_EF_STAT_BOUNDS:
        rc = dec_stat_bounds(c, m);
        break;
    case KVT_EF_JOB_KEYS:
        rc = dec_keys(c, m, lim->max_keys, &m->job_keys, &m->n_job_keys);
        break;
    case KVT_EF_JOBS:
        rc = kvt_mp_array(c, (uint64_t)lim->max_keys * 3, &n);
        if (rc == 0 && n % 3 != 0)
            rc = -EBADMSG;
        if (rc == 0)
            rc = alloc_n(m, (void **)&m->jobs, n, sizeof(*m->jobs));
        for (uint32_t i = 0; rc == 0 && i < n; i++)
            rc = kvt_mp_u64(c, &m->jobs[i]);
        if (rc == 0)
            m->n_jobs = n;
        break;
    case KVT_EF_OK:
        rc = kvt_mp_expect(c, KVT_MP_BIN, &o);
        if (rc == 0 && o.n > lim->max_keys)
            rc = -EMSGSIZE;
        if (rc == 0)
            rc = alloc_n(m, (void **)&m->ok, o.n, 1);
        if (rc == 0) {
            memcpy(m->ok, o.data, o.n);
            m->n_ok = (uint32_t)o.n;
        }
        break;
    case KVT_EF_FINGERPRINT:
        rc = kvt_mp_str(c, 0, KVTIER_FINGERPRINT_MAX, m->fingerprint);
        break;
    case KVT_EF_MESSAGE:
        rc = kvt_mp_str(c, 0, KVT_EPROTO_MSG_MAX, m->message);
        break;
    case KVT_EF_PEERS:
        rc = dec_peers(c, lim, m);
        break;
    default:
        return kvt_mp_skip(c); /* a newer minor's field */
    }
    if (rc == 0)
        m->has |= 1u << id;
    return rc;
}

int kvt__emsg_decode(const uint8_t *body, size_t len, const struct kvt_eproto_limits *lim,
                     struct kvt_emsg *m)
{
    struct kvt_mp_cur c = {.p = body, .end = body + len};
    uint64_t pairs;
    int rc;

    kvt__emsg_init(m);
    if (len > lim->max_body)
        return -EMSGSIZE;
    rc = kvt_mp_check(body, len, MAX_DEPTH, MAX_OBJECTS);
    if (rc < 0)
        return rc;
    rc = kvt_mp_map(&c, &pairs);
    for (uint64_t i = 0; rc == 0 && i < pairs; i++) {
        uint64_t id;

        rc = kvt_mp_u64(&c, &id);
        if (rc == 0)
            rc = dec_field(&c, id, lim, m);
    }
    if (rc == 0 && !kvt__emsg_has(m, KVT_EF_OP))
        rc = -EPROTO;
    if (rc < 0)
        kvt__emsg_free(m);
    return rc;
}

/* ---- encoding ------------------------------------------------------------------ */

void kvt__ebuf_init(struct kvt_ebuf *b)
{
    memset(b, 0, sizeof(*b));
}

void kvt__ebuf_cleanup(struct kvt_ebuf *b)
{
    kvt_free(b->data);
    kvt__ebuf_init(b);
}

int kvt__ebuf_append(struct kvt_ebuf *b, const void *p, size_t len)
{
    if (kvt_vec_reserve(b->data, b->cap, b->len + len, 256) < 0)
        return -ENOMEM;
    memcpy(b->data + b->len, p, len);
    b->len += len;
    return 0;
}

struct sink {
    struct kvt_ebuf *b;
    bool failed;
};

static int sink_write(void *data, const char *buf, size_t len)
{
    struct sink *s = data;
    struct kvt_ebuf *b = s->b;

    if (s->failed)
        return -1;
    if (kvt__ebuf_append(b, buf, len) != 0) {
        s->failed = true;
        return -1;
    }
    return 0;
}

static void pack_key(msgpack_packer *pk, const struct kvtier_key *k)
{
    msgpack_pack_bin(pk, k->len);
    msgpack_pack_bin_body(pk, k->bytes, k->len);
}

static void pack_str(msgpack_packer *pk, const char *s)
{
    size_t n = strlen(s);

    msgpack_pack_str(pk, n);
    msgpack_pack_str_body(pk, s, n);
}

static void pack_keys(msgpack_packer *pk, const struct kvtier_key *keys, size_t n)
{
    msgpack_pack_array(pk, n);
    for (size_t i = 0; i < n; i++)
        pack_key(pk, &keys[i]);
}

static void pack_ids(msgpack_packer *pk, const kvt_eproto_id_t *ids, size_t n)
{
    msgpack_pack_array(pk, n);
    for (size_t i = 0; i < n; i++)
        pack_str(pk, ids[i]);
}

static void enc_field(msgpack_packer *pk, const struct kvt_emsg *m, unsigned f)
{
    msgpack_pack_uint32(pk, f);
    switch (f) {
    case KVT_EF_OP:
        msgpack_pack_uint32(pk, m->op);
        break;
    case KVT_EF_SEQ:
        msgpack_pack_uint64(pk, m->seq);
        break;
    case KVT_EF_RC:
        msgpack_pack_int64(pk, m->rc);
        break;
    case KVT_EF_REQ_ID:
        pack_str(pk, m->req_id);
        break;
    case KVT_EF_NAME:
        pack_str(pk, m->name);
        break;
    case KVT_EF_MAJOR:
        msgpack_pack_uint64(pk, m->major);
        break;
    case KVT_EF_MINOR:
        msgpack_pack_uint64(pk, m->minor);
        break;
    case KVT_EF_FLAGS:
        msgpack_pack_uint64(pk, m->flags);
        break;
    case KVT_EF_KEYS:
        pack_keys(pk, m->keys, m->n_keys);
        break;
    case KVT_EF_EVICTED:
        pack_keys(pk, m->evicted, m->n_evicted);
        break;
    case KVT_EF_RESULTS:
        msgpack_pack_bin(pk, m->n_results);
        msgpack_pack_bin_body(pk, m->results, m->n_results);
        break;
    case KVT_EF_IDS:
        msgpack_pack_array(pk, m->n_ids);
        for (uint32_t i = 0; i < m->n_ids; i++)
            msgpack_pack_int64(pk, m->ids[i]);
        break;
    case KVT_EF_INDEX:
        msgpack_pack_array(pk, m->n_index);
        for (uint32_t i = 0; i < m->n_index; i++)
            msgpack_pack_uint32(pk, m->index[i]);
        break;
    case KVT_EF_PARAMS:
        msgpack_pack_str(pk, m->params_len);
        msgpack_pack_str_body(pk, m->params, m->params_len);
        break;
    case KVT_EF_FILTER:
        msgpack_pack_array(pk, m->n_filter);
        for (uint32_t i = 0; i < m->n_filter; i++) {
            msgpack_pack_array(pk, 2);
            msgpack_pack_int(pk, m->filter[i].medium);
            msgpack_pack_int(pk, m->filter[i].locality);
        }
        break;
    case KVT_EF_NEW:
        pack_ids(pk, m->new_ids, m->n_new);
        break;
    case KVT_EF_PREEMPTED:
        pack_ids(pk, m->preempted, m->n_preempted);
        break;
    case KVT_EF_EVENTS:
        msgpack_pack_array(pk, m->n_events);
        for (uint32_t i = 0; i < m->n_events; i++) {
            const struct kvtier_event *ev = &m->events[i];

            msgpack_pack_array(pk, 4);
            pack_keys(pk, ev->keys, ev->n);
            msgpack_pack_int(pk, ev->medium);
            msgpack_pack_int(pk, ev->locality);
            if (ev->removed)
                msgpack_pack_true(pk);
            else
                msgpack_pack_false(pk);
        }
        break;
    case KVT_EF_STATS:
        msgpack_pack_array(pk, m->n_stats);
        for (uint32_t i = 0; i < m->n_stats; i++) {
            const struct kvtier_stat *s = &m->stats[i];

            msgpack_pack_array(pk, 7);
            pack_str(pk, s->name);
            pack_str(pk, s->label);
            msgpack_pack_int(pk, s->kind);
            msgpack_pack_double(pk, s->value);
            msgpack_pack_uint64(pk, s->count);
            msgpack_pack_double(pk, s->sum);
            msgpack_pack_array(pk, KVTIER_HIST_BUCKETS);
            for (unsigned b = 0; b < KVTIER_HIST_BUCKETS; b++)
                msgpack_pack_uint64(pk, s->buckets[b]);
        }
        break;
    case KVT_EF_GEOM:
        msgpack_pack_array(pk, m->n_geom);
        for (uint32_t i = 0; i < m->n_geom; i++)
            msgpack_pack_uint64(pk, m->geom[i]);
        break;
    case KVT_EF_BOUNDS:
        msgpack_pack_array(pk, m->n_bounds);
        for (uint32_t i = 0; i < m->n_bounds; i++)
            msgpack_pack_double(pk, m->bounds[i]);
        break;
    case KVT_EF_STAT_BOUNDS:
        msgpack_pack_array(pk, m->n_stats);
        for (uint32_t i = 0; i < m->n_stats; i++) {
            const struct kvtier_hist_bounds *hb = &m->stat_bounds[i];
            uint32_t nb = KVT_MIN(hb->n, (uint32_t)KVTIER_HIST_BUCKETS - 1);

            msgpack_pack_array(pk, nb);
            for (uint32_t b = 0; b < nb; b++)
                msgpack_pack_double(pk, hb->bound[b]);
        }
        break;
    case KVT_EF_JOB_KEYS:
        pack_keys(pk, m->job_keys, m->n_job_keys);
        break;
    case KVT_EF_JOBS:
        msgpack_pack_array(pk, m->n_jobs);
        for (uint32_t i = 0; i < m->n_jobs; i++)
            msgpack_pack_uint64(pk, m->jobs[i]);
        break;
    case KVT_EF_OK:
        msgpack_pack_bin(pk, m->n_ok);
        msgpack_pack_bin_body(pk, m->ok, m->n_ok);
        break;
    case KVT_EF_FINGERPRINT:
        pack_str(pk, m->fingerprint);
        break;
    case KVT_EF_MESSAGE:
        pack_str(pk, m->message);
        break;
    case KVT_EF_PEERS:
        msgpack_pack_array(pk, m->n_peers);
        for (uint32_t i = 0; i < m->n_peers; i++) {
            const struct kvtier_peer *p = &m->peers[i];

            msgpack_pack_array(pk, KVT_EPROTO_PEER_MIN);
            msgpack_pack_uint64(pk, p->node_id);
            msgpack_pack_uint64(pk, p->incarnation);
            pack_str(pk, p->addr);
            msgpack_pack_uint64(pk, p->port);
            msgpack_pack_int(pk, p->state);
            msgpack_pack_uint64(pk, p->last_heard_ms);
            msgpack_pack_uint64(pk, p->pulled_bytes);
            msgpack_pack_uint64(pk, p->served_bytes);
        }
        break;
    default:
        msgpack_pack_nil(pk);
        break;
    }
}

int kvt__emsg_encode(const struct kvt_emsg *m, struct kvt_ebuf *b)
{
    struct sink s = {b, false};
    msgpack_packer pk;
    size_t start = b->len;
    uint8_t hdr[KVT_EPROTO_HDR] = {0};
    unsigned n = 0;

    for (unsigned f = 0; f < KVT_EF_COUNT; f++)
        n += (m->has >> f) & 1u;
    if (sink_write(&s, (const char *)hdr, sizeof(hdr)) != 0)
        return -ENOMEM;
    msgpack_packer_init(&pk, &s, sink_write);
    msgpack_pack_map(&pk, n);
    for (unsigned f = 0; f < KVT_EF_COUNT; f++) {
        if ((m->has >> f) & 1u)
            enc_field(&pk, m, f);
    }
    if (s.failed) {
        b->len = start;
        return -ENOMEM;
    }
    size_t body = b->len - start - KVT_EPROTO_HDR;

    if (body > UINT32_MAX) {
        b->len = start;
        return -EMSGSIZE;
    }
    b->data[start] = (uint8_t)(body >> 24);
    b->data[start + 1] = (uint8_t)(body >> 16);
    b->data[start + 2] = (uint8_t)(body >> 8);
    b->data[start + 3] = (uint8_t)body;
    return 0;
}

/* ---- binary messages ------------------------------------------------------------- */

int kvt__ebin_req_parse(const uint8_t *body, size_t len, const struct kvt_eproto_limits *lim,
                        struct kvt_ebin_req *hdr_p, const char **id_p, const uint8_t **keys_p)
{
    struct kvt_ebin_req h;
    uint64_t want;

    if (len < KVT_EBIN_HDR)
        return -EBADMSG;
    memcpy(&h, body, sizeof(h));
    if (h.magic != KVT_EBIN_MAGIC || !kvt__ebin_op(h.op) || h.key_len < 1 ||
        h.key_len > KVTIER_KEY_MAX || h.id_len > KVT_EPROTO_ID_MAX || h.zero != 0)
        return -EBADMSG;
    if ((h.op == KVT_EOP_LOOKUP && (h.flags & ~(uint32_t)KVTIER_LOOKUP_PREFIX) != 0) ||
        (h.op == KVT_EOP_COMPLETE_STORE && h.flags > 1) ||
        (h.op != KVT_EOP_LOOKUP && h.op != KVT_EOP_COMPLETE_STORE && h.flags != 0))
        return -EBADMSG;
    if (h.n > lim->max_keys)
        return -EMSGSIZE;
    want = (uint64_t)KVT_EBIN_HDR + h.id_len + (uint64_t)h.n * h.key_len;
    if (want != len)
        return -EBADMSG;
    /* (a loop, not memchr: see kvt_ering_copy on library calls in a ring call) */
    for (size_t i = 0; i < h.id_len; i++)
        if (body[KVT_EBIN_HDR + i] == 0)
            return -EBADMSG;
    *hdr_p = h;
    *id_p = (const char *)body + KVT_EBIN_HDR;
    *keys_p = body + KVT_EBIN_HDR + h.id_len;
    return 0;
}

int kvt__ebin_rep_parse(const uint8_t *body, size_t len, const struct kvt_ebin_req *req,
                        struct kvt_ebin_rep *hdr_p, const uint8_t **payload_p)
{
    struct kvt_ebin_rep h;
    size_t elem = kvt__ebin_rep_elem(req->op);

    if (len < KVT_EBIN_HDR)
        return -EPROTO;
    memcpy(&h, body, sizeof(h));
    if (h.magic != KVT_EBIN_MAGIC || h.op != (req->op | KVT_EOP_REPLY) || h.seq != req->seq ||
        h.zero != 0 || h.zero2 != 0 || h.rc > 0 || h.n > req->n || (h.rc < 0 && h.n != 0) ||
        (elem == 0 && h.n != 0) || len != KVT_EBIN_HDR + (size_t)h.n * elem)
        return -EPROTO;
    *hdr_p = h;
    *payload_p = body + KVT_EBIN_HDR;
    return 0;
}

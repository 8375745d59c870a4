/* SPDX-License-Identifier: Apache-2.0 */
/* Randomized manager test: long random sequences of engine calls (many requests,
 * three example tiers with delays, RETRYs, request-level policy and random
 * failures) with the invariants checked after every step:
 *   - ref counts are -1 or >= 0; counters equal a recount; slots add up;
 *   - nothing pinned or write-pending is ever evicted;
 *   - every loaded row holds exactly the bytes stored for its key;
 *   - every job is reported (the manager asserts on unknown or repeated reports)
 *     and at the end no job, pin or pending write is left;
 *   - every finished request is finalized exactly once in every tier;
 * and after every manager call, that the policy's state is what vLLM's CPU tier
 * rules make of the same calls: a model of those rules written here (below,
 * "the policy model") follows each call, predicts every eviction (which keys,
 * in which order) and must agree with the primary's LRU order, or ARC's T1, T2,
 * ghost lists and target.
 * Runs under ASan (leaks) and TSan. KVT_RANDOM_SEEDS / KVT_RANDOM_STEPS scale it. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

#include "kvt/example_tier.h"
#include "kvt/hash.h"
#include "kvt/manager.h"
#include "kvt/primary_test.h"

#define NUM_CHUNKS  24
#define ROW         64
#define KEYSPACE    80
#define MAX_REQS    6
#define N_TIERS     3
#define MAX_SERIALS 65536

/* ---- the policy model ----------------------------------------------------
 * vLLM 0.34's CPUOffloadingManager + LRUCachePolicy / ARCCachePolicy, written the
 * obvious way over key ids (every key here is kt_key(id), KV group 0, and no
 * request carries token positions):
 *   request access  the keys a request saw in first-seen order; inserted (it
 *                   allocated them), reused (it loaded them, or offered them for
 *                   store while ready, and had not inserted them), store-missed;
 *   LRU             a rank per entry: a new one at insert, and at its request's
 *                   finish each seen present key, tail first; evict the lowest
 *                   ranks among ref 0, unprotected entries;
 *   ARC             T1/T2/B1/B2 lists and target; finish: insertion-only keys
 *                   to the MRU end of their list, reused ones T1 -> T2 / T2 MRU;
 *                   store misses adapt to ghosts, tail first, before allocating;
 *                   evict by the simulated |T1| against int(target), ghosts cut
 *                   to capacity after;
 *   touch           a request of its own that reuses the ready keys and
 *                   finishes at once.
 * The model learns what it cannot know from the primary after each call: ref
 * counts (completions and pins happen inside tiers' jobs), keys that left
 * through a failed write, and which lookups asked the tiers for a key they hold
 * (a promotion, or an attempt that found no room: vLLM's prepare_write, which
 * records and adapts either way). Evictions it predicts itself. */
#define MK KEYSPACE

enum { MF_INSERTED = 1, MF_REUSED = 2, MF_MISS = 4 };

struct macc {
    int seen[MK]; /* first-seen order */
    int n;
    uint8_t flags[MK];
    bool has[MK];
    unsigned gen;
    bool finished;
};

struct model {
    bool arc;
    unsigned gen;
    bool present[MK];
    int ref[MK]; /* as observed: -1 writing, 0 ready, > 0 pinned */
    uint64_t rank[MK], next_rank;
    int l[4][2 * MK]; /* ARC: T1, T2, B1, B2, LRU end first */
    int n[4];
    double target;
};

struct rreq {
    struct kvt_req_ctx *ctx;
    struct macc acc;
    bool live, finished;
    /* a prepared store not yet completed */
    struct kvt_key store_keys[8];
    size_t n_store_keys;
    bool store_pending;
    /* loads held across steps */
    struct kvt_key load_keys[8];
    size_t n_load;
};

struct world {
    struct kvt_manager *m;
    struct kvt_primary *p;
    struct kvt_tier *tiers[N_TIERS];
    struct rreq reqs[MAX_REQS];
    unsigned next_req;
    uint64_t rng;
    struct kvt_store_output out;
    /* finalization counts per tier for each request id (by serial) */
    unsigned finishes[N_TIERS][MAX_SERIALS];
    unsigned finished_reqs[MAX_SERIALS];
    unsigned n_finished_reqs;
    unsigned long loads_verified, evictions, promotions_seen;
    struct model mdl;
    /* during a manager call: the tiers' HIT answers to lookups (promotion
     * attempts), in order, and what each retry_first tier has answered before */
    struct {
        int id;
        struct kvt_req_ctx *ctx;
    } attempt[64];
    int n_attempts;
    bool retried[N_TIERS][MK];
    unsigned long model_checks, model_evictions, model_attempts;
};

static struct world *W;

static uint64_t rnd(struct world *w)
{
    w->rng ^= w->rng << 13;
    w->rng ^= w->rng >> 7;
    w->rng ^= w->rng << 17;
    return w->rng;
}

static unsigned rnd_n(struct world *w, unsigned n)
{
    return (unsigned)(rnd(w) % n);
}

/* Zipf-ish popularity: small ids far more often. */
static struct kvt_key pick_key(struct world *w)
{
    unsigned a = rnd_n(w, KEYSPACE), b = rnd_n(w, KEYSPACE);
    return kt_key((int)(a < b ? a : b));
}

static void fill_row(uint8_t *row, const struct kvt_key *k)
{
    uint64_t h = kvt_key_hash(k);
    for (size_t i = 0; i < ROW; i += 8)
        memcpy(row + i, &h, 8);
}

static unsigned serial_of(const char *req_id)
{
    return (unsigned)atoi(req_id + 2);
}

static int id_of(const struct kvt_key *k)
{
    int id = 0;

    assert_true(k->len >= 5 && k->len <= 8);
    for (size_t i = 0; i + 4 < k->len; i++)
        id = id * 10 + (k->bytes[i] - '0');
    assert_true(id >= 0 && id < MK);
    return id;
}

static void on_call(void *arg, struct kvt_tier *t, enum kvt_example_call call,
                    const struct kvt_job *job, struct kvt_req_ctx *ctx, const struct kvt_key *keys,
                    size_t n)
{
    struct world *w = arg;
    if (call == KVT_EX_LOOKUP) {
        /* The tier's answer, as ex_lookup gives it: a HIT is a promotion attempt
         * by the manager right after. */
        int id = id_of(&keys[0]);
        bool retry = t->index == 1 && !w->retried[t->index][id];

        w->retried[t->index][id] |= t->index == 1;
        if (!retry && kvt_example_tier_has(t, &keys[0])) {
            assert_true(w->n_attempts < 64);
            w->attempt[w->n_attempts].id = id;
            w->attempt[w->n_attempts++].ctx = ctx;
        }
    }
    if (call == KVT_EX_ON_REQUEST_FINISHED)
        w->finishes[t->index][serial_of(ctx->req_id) % MAX_SERIALS]++;
    if (call == KVT_EX_SUBMIT_LOAD)
        w->promotions_seen++;
}

/* ---- the policy model: rules ---------------------------------------------- */

static int m_where(const struct model *m, int id)
{
    for (int l = 0; l < 4; l++)
        for (int i = 0; i < m->n[l]; i++)
            if (m->l[l][i] == id)
                return l;
    return -1;
}

static void m_unlink(struct model *m, int l, int id)
{
    for (int i = 0; i < m->n[l]; i++)
        if (m->l[l][i] == id) {
            memmove(&m->l[l][i], &m->l[l][i + 1], (size_t)(m->n[l] - i - 1) * sizeof(int));
            m->n[l]--;
            return;
        }
    fail_msg("model: key %d not in list %d", id, l);
}

static void m_append(struct model *m, int l, int id)
{
    m->l[l][m->n[l]++] = id;
}

static void m_insert(struct model *m, int id)
{
    m->present[id] = true;
    m->ref[id] = -1;
    if (!m->arc) {
        m->rank[id] = ++m->next_rank;
        return;
    }
    int l = m_where(m, id);

    if (l >= 2)
        m_unlink(m, l, id); /* the key leaves B1/B2 */
    m_append(m, 0, id);
}

/* A failed write leaves (policy.remove): no ghost. */
static void m_drop(struct model *m, int id)
{
    m->present[id] = false;
    if (m->arc)
        m_unlink(m, m_where(m, id), id);
}

static void m_reset(struct model *m)
{
    bool arc = m->arc;
    unsigned gen = m->gen;

    memset(m, 0, sizeof(*m));
    m->arc = arc;
    m->gen = gen + 1;
}

/* The access that records, after vLLM's cache-generation check; NULL if none. */
static struct macc *m_live(struct model *m, struct macc *a)
{
    if (a == NULL)
        return NULL;
    if (a->gen != m->gen) {
        memset(a, 0, sizeof(*a));
        a->gen = m->gen;
    }
    return a->finished ? NULL : a;
}

static void m_see(struct macc *a, int id)
{
    if (!a->has[id]) {
        a->has[id] = true;
        a->seen[a->n++] = id;
    }
}

static void m_reuse(struct macc *a, int id)
{
    m_see(a, id);
    if (!(a->flags[id] & MF_INSERTED))
        a->flags[id] |= MF_REUSED;
}

/* One request-scoped access: ids in prefix order, kinds MF_* flags. */
static void m_apply(struct model *m, const int *ids, const uint8_t *flags, int n)
{
    for (int i = n - 1; i >= 0; i--) {
        int id = ids[i], l;

        if (!m->present[id])
            continue;
        if (!m->arc) {
            m->rank[id] = ++m->next_rank;
            continue;
        }
        l = m_where(m, id);
        if (flags[i] & MF_REUSED) {
            m_unlink(m, l, id);
            m_append(m, 1, id); /* T1 -> T2, or T2's MRU end */
        } else if (flags[i] & MF_INSERTED) {
            m_unlink(m, l, id);
            m_append(m, l, id);
        }
    }
}

static void m_finish(struct model *m, struct macc *a)
{
    uint8_t flags[MK];

    if (a->gen != m->gen) { /* stale: a new state, finished at once */
        memset(a, 0, sizeof(*a));
        a->gen = m->gen;
    }
    if (a->finished)
        return;
    for (int i = 0; i < a->n; i++)
        flags[i] = a->flags[a->seen[i]];
    m_apply(m, a->seen, flags, a->n);
    memset(a, 0, sizeof(*a));
    a->gen = m->gen;
    a->finished = true;
}

static void m_touch(struct model *m, const int *ids, int n)
{
    int seen[MK], k = 0;
    uint8_t flags[MK];
    bool has[MK] = {false};

    for (int i = 0; i < n; i++) {
        if (!m->present[ids[i]] || m->ref[ids[i]] < 0 || has[ids[i]])
            continue;
        has[ids[i]] = true;
        flags[k] = MF_REUSED;
        seen[k++] = ids[i];
    }
    m_apply(m, seen, flags, k);
}

static void m_store_miss(struct model *m, const int *ids, int n)
{
    for (int i = n - 1; i >= 0; i--) {
        int l = m_where(m, ids[i]);
        double b1 = m->n[2], b2 = m->n[3];

        if (l < 2)
            continue;
        if (l == 2)
            m->target = fmin(m->target + fmax(1.0, b2 / b1), NUM_CHUNKS);
        else
            m->target = fmax(m->target - fmax(1.0, b1 / b2), 0.0);
        m_unlink(m, l, ids[i]);
        m_append(m, l, ids[i]);
    }
}

static bool m_candidate(const struct model *m, int id, const bool *prot, const bool *chosen)
{
    return m->present[id] && m->ref[id] == 0 && !prot[id] && !chosen[id];
}

/* Chooses exactly need victims, or none (false). */
static bool m_evict(struct model *m, int need, const bool *prot, int *victims)
{
    bool chosen[MK] = {false};
    int from[MK];

    if (!m->arc) {
        for (int v = 0; v < need; v++) {
            int best = -1;

            for (int id = 0; id < MK; id++)
                if (m_candidate(m, id, prot, chosen) && (best < 0 || m->rank[id] < m->rank[best]))
                    best = id;
            if (best < 0)
                return false;
            chosen[best] = true;
            victims[v] = best;
        }
        for (int v = 0; v < need; v++)
            m->present[victims[v]] = false;
        return true;
    }
    int c1 = 0, c2 = 0, virtual_t1 = m->n[0], limit = (int)m->target;

    for (int v = 0; v < need; v++) {
        int got = -1;

        if (virtual_t1 >= limit)
            while (c1 < m->n[0] && got < 0)
                if (m_candidate(m, m->l[0][c1++], prot, chosen))
                    got = 0;
        if (got >= 0)
            virtual_t1--;
        if (got < 0)
            while (c2 < m->n[1] && got < 0)
                if (m_candidate(m, m->l[1][c2++], prot, chosen))
                    got = 1;
        if (got < 0) {
            while (c1 < m->n[0] && got < 0)
                if (m_candidate(m, m->l[0][c1++], prot, chosen))
                    got = 0;
            if (got < 0)
                return false;
            virtual_t1--;
        }
        victims[v] = got == 0 ? m->l[0][c1 - 1] : m->l[1][c2 - 1];
        from[v] = got;
        chosen[victims[v]] = true;
    }
    for (int v = 0; v < need; v++) {
        m_unlink(m, from[v], victims[v]);
        m_append(m, from[v] + 2, victims[v]);
        m->present[victims[v]] = false;
    }
    for (int l = 2; l < 4; l++)
        while (m->n[l] > NUM_CHUNKS)
            m_unlink(m, l, m->l[l][0]);
    return true;
}

/* prepare_store of ids by access a (NULL: none); returns 0 or -ENOSPC, with the
 * keys it stores and the victims. A key offered twice is stored once (kvtier). */
static int m_store(struct model *m, struct macc *a, const int *ids, int n, int *stored,
                   int *n_stored, int *victims, int *n_victims)
{
    bool prot[MK] = {false}, offered[MK] = {false};
    int miss[MK], n_miss = 0, k = 0, present = 0, evictable = 0, need;

    a = m_live(m, a);
    *n_victims = 0;
    for (int i = 0; i < n; i++) {
        int id = ids[i];

        prot[id] = true;
        if (m->present[id]) {
            if (a != NULL && m->ref[id] >= 0)
                m_reuse(a, id);
        } else if (!offered[id]) {
            offered[id] = true;
            stored[k++] = id;
            if (a != NULL)
                m_see(a, id);
        }
    }
    for (int i = 0; i < k; i++) {
        if (a != NULL) {
            if (a->flags[stored[i]] & MF_MISS)
                continue;
            a->flags[stored[i]] |= MF_MISS;
        }
        miss[n_miss++] = stored[i];
    }
    if (m->arc)
        m_store_miss(m, miss, n_miss);
    *n_stored = k;
    if (k == 0)
        return 0;
    for (int id = 0; id < MK; id++) {
        present += m->present[id];
        evictable += m->present[id] && m->ref[id] == 0;
    }
    need = present + k - NUM_CHUNKS;
    if (need > 0) {
        if (need > evictable || !m_evict(m, need, prot, victims)) {
            *n_stored = 0;
            return -ENOSPC;
        }
        *n_victims = need;
    }
    for (int i = 0; i < k; i++) {
        m_insert(m, stored[i]);
        if (a != NULL)
            a->flags[stored[i]] |= MF_INSERTED;
    }
    return 0;
}

/* ---- the policy model: following the manager's calls ------------------------- */

struct mcall {
    int ev[16][NUM_CHUNKS]; /* eviction events of the call, in order */
    int ev_n[16];
    int n_ev, next_ev;
    bool obs_present[MK];
    int obs_ref[MK];
};

static void observe_entry(void *arg, const struct kvt_key *key,
                          const struct kvt_primary_entry_info *info)
{
    struct mcall *c = arg;
    int id = id_of(key);

    c->obs_present[id] = true;
    c->obs_ref[id] = info->ref_cnt;
}

static struct macc *acc_of_ctx(struct world *w, const struct kvt_req_ctx *ctx)
{
    for (int i = 0; i < MAX_REQS; i++)
        if (w->reqs[i].live && w->reqs[i].ctx == ctx)
            return &w->reqs[i].acc;
    return NULL;
}

static bool in_ids(const int *ids, int n, int id)
{
    for (int i = 0; i < n; i++)
        if (ids[i] == id)
            return true;
    return false;
}

/* After a manager call: its eviction events and the primary's entries; the
 * model forgets the keys that left by a failed write (before anything else in
 * the call: the poll comes first), re-inserted ones included (reinserted[]),
 * and takes the ref counts. */
static void m_begin(struct world *w, struct mcall *c, const int *reinserted, int n_re)
{
    struct model *m = &w->mdl;
    struct kvt_events ev;
    bool evicted[MK] = {false};

    memset(c, 0, sizeof(*c));
    kvt_events_init(&ev);
    assert_int_equal(kvt_manager_take_events(w->m, &ev), 0);
    for (size_t i = 0; i < ev.n; i++) {
        if (!ev.ev[i].removed || ev.ev[i].medium != KVT_MEDIUM_CPU)
            continue;
        assert_true(c->n_ev < 16 && ev.ev[i].n <= NUM_CHUNKS);
        for (size_t j = 0; j < ev.ev[i].n; j++) {
            c->ev[c->n_ev][j] = id_of(&ev.ev[i].keys[j]);
            evicted[c->ev[c->n_ev][j]] = true;
        }
        c->ev_n[c->n_ev++] = (int)ev.ev[i].n;
    }
    kvt_events_cleanup(&ev);
    kvt_primary_for_each(w->p, observe_entry, c);
    for (int id = 0; id < MK; id++) {
        if (!m->present[id] || evicted[id])
            continue;
        if (!c->obs_present[id] || in_ids(reinserted, n_re, id))
            m_drop(m, id);
    }
    /* An evicted key was ready and unpinned when it went (it may be back by the
     * end of the call, written again by a promotion). */
    for (int id = 0; id < MK; id++)
        if (m->present[id])
            m->ref[id] = c->obs_present[id] && !evicted[id] ? c->obs_ref[id] : 0;
}

static void m_dump(struct world *w)
{
    struct kvt_key got[NUM_CHUNKS];

    for (int l = 0; l < 4; l++) {
        fprintf(stderr, "model L%d:", l);
        for (int i = 0; i < w->mdl.n[l]; i++)
            fprintf(stderr, " %d(%d)", w->mdl.l[l][i], w->mdl.ref[w->mdl.l[l][i]]);
        fprintf(stderr, "\n");
    }
    for (int l = 0; l < 2; l++) {
        size_t n = kvt_primary_policy_list(w->p, l, got, NUM_CHUNKS);

        fprintf(stderr, "primary L%d:", l);
        for (size_t i = 0; i < n; i++)
            fprintf(stderr, " %d", id_of(&got[i]));
        fprintf(stderr, "\n");
    }
    fprintf(stderr, "target %f / %f\n", w->mdl.target, kvt_primary_arc_target(w->p));
}

/* The call's promotion attempts (vLLM's prepare_write of one key), in order. */
static void m_attempts(struct world *w, struct mcall *c)
{
    for (int i = 0; i < w->n_attempts; i++) {
        int id = w->attempt[i].id, stored[1], n_stored, victims[NUM_CHUNKS], n_victims;
        int rc = m_store(&w->mdl, acc_of_ctx(w, w->attempt[i].ctx), &id, 1, stored, &n_stored,
                         victims, &n_victims);

        w->model_attempts++;
        if (rc != 0 || n_victims == 0)
            continue;
        if (c->next_ev >= c->n_ev)
            fail_msg("model: a promotion of key %d evicts %d, the primary evicted nothing", id,
                     victims[0]);
        assert_int_equal(c->ev_n[c->next_ev], n_victims);
        for (int v = 0; v < n_victims; v++)
            if (c->ev[c->next_ev][v] != victims[v]) {
                m_dump(w);
                fail_msg("model: a promotion of key %d evicts %d, the primary %d", id, victims[v],
                         c->ev[c->next_ev][v]);
            }
        c->next_ev++;
        w->model_evictions += (unsigned long)n_victims;
    }
    w->n_attempts = 0;
}

/* Every eviction was predicted; the primary's policy state is the model's. */
static void m_end(struct world *w, struct mcall *c)
{
    struct model *m = &w->mdl;
    struct kvt_key got[NUM_CHUNKS];

    if (c->next_ev != c->n_ev)
        fail_msg("model: the primary evicted %d times in the call, the model %d", c->n_ev,
                 c->next_ev);
    for (int id = 0; id < MK; id++)
        assert_int_equal(m->present[id], c->obs_present[id]);
    if (!m->arc) {
        int order[MK], k = 0;

        for (int id = 0; id < MK; id++)
            if (m->present[id])
                order[k++] = id;
        for (int i = 1; i < k; i++) /* by rank */
            for (int j = i; j > 0 && m->rank[order[j - 1]] > m->rank[order[j]]; j--) {
                int t = order[j];

                order[j] = order[j - 1];
                order[j - 1] = t;
            }
        assert_int_equal(kvt_primary_policy_list(w->p, 0, got, NUM_CHUNKS), k);
        for (int i = 0; i < k; i++)
            if (id_of(&got[i]) != order[i])
                fail_msg("model: LRU position %d holds key %d, the model %d", i, id_of(&got[i]),
                         order[i]);
    } else {
        for (int l = 0; l < 2; l++) {
            assert_int_equal(kvt_primary_policy_list(w->p, l, got, NUM_CHUNKS), m->n[l]);
            for (int i = 0; i < m->n[l]; i++)
                if (id_of(&got[i]) != m->l[l][i])
                    fail_msg("model: T%d[%d] holds key %d, the model %d", l + 1, i, id_of(&got[i]),
                             m->l[l][i]);
        }
        assert_int_equal(kvt_primary_arc_ghost_len(w->p, 1), m->n[2]);
        assert_int_equal(kvt_primary_arc_ghost_len(w->p, 2), m->n[3]);
        for (int id = 0; id < MK; id++) {
            struct kvt_key k = kt_key(id);
            int l = m_where(m, id), want = l == 2 ? 1 : l == 3 ? 2 : 0;

            if (kvt_primary_arc_ghost_of(w->p, &k) != want)
                fail_msg("model: key %d in ghost list %d, the model %d", id,
                         kvt_primary_arc_ghost_of(w->p, &k), want);
        }
        if (fabs(kvt_primary_arc_target(w->p) - m->target) > 1e-9)
            fail_msg("model: target %f, the model %f", kvt_primary_arc_target(w->p), m->target);
    }
    w->model_checks++;
}

/* A call with nothing for the policy but polls (completions, failed writes) and
 * promotion attempts: lookups, complete_store, complete_load, schedule_end. */
static void m_plain(struct world *w)
{
    struct mcall c;
    int re[64];

    for (int i = 0; i < w->n_attempts; i++)
        re[i] = w->attempt[i].id;
    m_begin(w, &c, re, w->n_attempts);
    m_attempts(w, &c);
    m_end(w, &c);
}

static enum kvt_lookup_result mgr_lookup(struct world *w, struct rreq *q, const struct kvt_key *key)
{
    enum kvt_lookup_result r;

    w->n_attempts = 0;
    r = kvt_manager_lookup(w->m, key, q->ctx);
    m_plain(w);
    return r;
}

static size_t mgr_lookup_many(struct world *w, struct rreq *q, const struct kvt_key *keys, size_t n,
                              enum kvt_lookup_result *out)
{
    size_t done;

    w->n_attempts = 0;
    done = kvt_manager_lookup_many(w->m, keys, n, q->ctx, true, out);
    m_plain(w);
    return done;
}

static int mgr_complete_store(struct world *w, struct rreq *q, const struct kvt_key *keys, size_t n,
                              bool success)
{
    int rc;

    w->n_attempts = 0;
    rc = kvt_manager_complete_store(w->m, keys, n, q->ctx, success);
    m_plain(w);
    return rc;
}

static int mgr_prepare_load(struct world *w, struct rreq *q, const struct kvt_key *keys, size_t n,
                            int64_t *ids)
{
    struct mcall c;
    int rc;

    w->n_attempts = 0;
    rc = kvt_manager_prepare_load(w->m, keys, n, q->ctx, ids);
    m_begin(w, &c, NULL, 0);
    if (rc == 0) {
        struct macc *a = m_live(&w->mdl, &q->acc);

        for (size_t i = 0; a != NULL && i < n; i++)
            m_reuse(a, id_of(&keys[i])); /* a GPU load: a use of every key */
    }
    m_end(w, &c);
    return rc;
}

static int mgr_complete_load(struct world *w, struct rreq *q, const struct kvt_key *keys, size_t n)
{
    int rc;

    w->n_attempts = 0;
    rc = kvt_manager_complete_load(w->m, keys, n, q->ctx);
    m_plain(w);
    return rc;
}

static void mgr_touch(struct world *w, struct rreq *q, const struct kvt_key *keys, size_t n)
{
    struct mcall c;
    int ids[8];

    w->n_attempts = 0;
    kvt_manager_touch(w->m, keys, n, q->ctx);
    m_begin(w, &c, NULL, 0);
    for (size_t i = 0; i < n; i++)
        ids[i] = id_of(&keys[i]);
    m_touch(&w->mdl, ids, (int)n);
    m_end(w, &c);
}

static int mgr_request_finished(struct world *w, struct rreq *q)
{
    struct mcall c;
    int rc;

    w->n_attempts = 0;
    rc = kvt_manager_on_request_finished(w->m, q->ctx);
    m_begin(w, &c, NULL, 0);
    if (rc == 0)
        m_finish(&w->mdl, &q->acc);
    m_end(w, &c);
    return rc;
}

static void mgr_schedule_end(struct world *w)
{
    w->n_attempts = 0;
    kvt_manager_on_schedule_end(w->m, NULL);
    m_plain(w);
}

static int mgr_reset_cache(struct world *w)
{
    struct mcall c;
    int rc;

    w->n_attempts = 0;
    rc = kvt_manager_reset_cache(w->m);
    m_begin(w, &c, NULL, 0); /* everything gone, as failed writes would be */
    m_reset(&w->mdl);
    m_end(w, &c);
    return rc;
}

static int mgr_prepare_store(struct world *w, struct rreq *q, const struct kvt_key *keys, size_t n)
{
    int ids[8], re[64 + 8], n_re = 0, stored[8], n_stored, victims[NUM_CHUNKS], n_victims, rc;
    struct mcall c;

    w->n_attempts = 0;
    rc = kvt_manager_prepare_store(w->m, keys, n, q->ctx, &w->out);
    assert_true(rc == 0 || rc == -ENOSPC);
    for (size_t i = 0; i < n; i++)
        ids[i] = id_of(&keys[i]);
    for (size_t i = 0; rc == 0 && i < w->out.n_store; i++)
        re[n_re++] = id_of(&w->out.keys_to_store[i]);
    m_begin(w, &c, re, n_re);
    int mrc = m_store(&w->mdl, &q->acc, ids, (int)n, stored, &n_stored, victims, &n_victims);

    if (mrc != rc)
        fail_msg("model: prepare_store answers %d, the model %d", rc, mrc);
    if (rc == 0) {
        assert_int_equal(w->out.n_store, n_stored);
        for (int i = 0; i < n_stored; i++)
            assert_int_equal(id_of(&w->out.keys_to_store[i]), stored[i]);
        assert_int_equal(w->out.n_evicted, n_victims);
        for (int v = 0; v < n_victims; v++)
            if (id_of(&w->out.evicted[v]) != victims[v])
                fail_msg("model: eviction %d is key %d, the model's %d", v,
                         id_of(&w->out.evicted[v]), victims[v]);
        if (n_victims > 0) {
            c.next_ev++;
            w->model_evictions += (unsigned long)n_victims;
        }
    }
    m_end(w, &c);
    return rc;
}

struct recount {
    size_t evictable, pending, entries;
};

static void count_entry(void *arg, const struct kvt_key *key,
                        const struct kvt_primary_entry_info *info)
{
    struct recount *r = arg;
    assert_true(info->ref_cnt >= -1);
    assert_true(info->slot >= 0 && info->slot < NUM_CHUNKS);
    r->entries++;
    r->evictable += info->ref_cnt == 0;
    r->pending += info->ref_cnt == -1;
}

static void check_invariants(struct world *w)
{
    struct recount r = {0};
    kvt_primary_for_each(w->p, count_entry, &r);
    assert_int_equal(r.evictable, kvt_primary_num_evictable(w->p));
    assert_int_equal(r.pending, kvt_primary_num_write_pending(w->p));
    assert_int_equal(r.entries, kvt_primary_num_entries(w->p));
    assert_int_equal(r.entries + kvt_primary_num_free(w->p), NUM_CHUNKS);
}

static bool engine_holds(struct world *w, const struct kvt_key *k)
{
    for (int i = 0; i < MAX_REQS; i++) {
        struct rreq *q = &w->reqs[i];
        if (!q->live)
            continue;
        for (size_t j = 0; j < q->n_load; j++)
            if (kvt_key_eq(&q->load_keys[j], k))
                return true; /* pinned by a GPU load */
        for (size_t j = 0; q->store_pending && j < q->n_store_keys; j++)
            if (kvt_key_eq(&q->store_keys[j], k))
                return true; /* GPU -> primary write in flight */
    }
    return false;
}

static void do_store(struct world *w, struct rreq *q)
{
    struct kvt_key keys[8];
    size_t n = 1 + rnd_n(w, 6);
    for (size_t i = 0; i < n; i++)
        keys[i] = pick_key(w);
    int rc = mgr_prepare_store(w, q, keys, n);
    if (rc == -ENOSPC)
        return;
    assert_int_equal(rc, 0);
    for (size_t e = 0; e < w->out.n_evicted; e++) {
        const struct kvt_key *ek = &w->out.evicted[e];
        /* Never a chunk the engine has pinned or is writing, never one this call
         * offered (the protected set), and it is gone now. */
        assert_false(engine_holds(w, ek));
        for (size_t j = 0; j < n; j++)
            assert_false(kvt_key_eq(&keys[j], ek));
        w->evictions++;
    }
    if (w->out.n_store == 0)
        return;
    /* The engine copies GPU -> slots now. */
    uint8_t *base = kvt_primary_base(w->p);
    for (size_t i = 0; i < w->out.n_store; i++)
        fill_row(base + (size_t)w->out.chunk_ids[i] * ROW, &w->out.keys_to_store[i]);
    if (q->store_pending) {
        /* One outstanding store per request in this model: complete it now. */
        struct kvt_key done[8];
        size_t n_done = w->out.n_store;

        memcpy(done, w->out.keys_to_store, n_done * sizeof(*done));
        assert_int_equal(mgr_complete_store(w, q, done, n_done, rnd_n(w, 10) != 0), 0);
        return;
    }
    memcpy(q->store_keys, w->out.keys_to_store, w->out.n_store * sizeof(struct kvt_key));
    q->n_store_keys = w->out.n_store;
    q->store_pending = true;
}

static void do_lookup_and_load(struct world *w, struct rreq *q)
{
    struct kvt_key prefix[8];
    size_t n = 1 + rnd_n(w, 8), hits = 0;
    int64_t ids[8];
    for (size_t i = 0; i < n; i++)
        prefix[i] = pick_key(w);
    /* the scheduler's scan: HIT counts; HIT_PENDING/RETRY defer but continue. Half
     * the scans ask through the many-key lookup (the engine API's path): it must
     * answer as the one-key calls, or the loads below fail or read wrong bytes. */
    enum kvt_lookup_result res[8];
    bool defer = false, many = rnd_n(w, 2) == 0;
    for (size_t done = 0; many && done < n;) {
        done += mgr_lookup_many(w, q, prefix + done, n - done, res + done);
        if (res[done - 1] == KVT_MISS)
            break;
    }
    for (size_t i = 0; i < n; i++) {
        enum kvt_lookup_result r = many ? res[i] : mgr_lookup(w, q, &prefix[i]);
        if (r == KVT_MISS)
            break;
        if (r != KVT_HIT)
            defer = true;
        else if (!defer)
            hits = i + 1;
    }
    /* A deferred scan loads nothing this step (the connector retries the request
     * next step): the promotions it started may have evicted its earlier hits. */
    if (defer || hits == 0 || q->n_load > 0)
        return;
    /* prepare_load takes only keys confirmed HIT this step, without duplicates */
    size_t m = 0;
    for (size_t i = 0; i < hits; i++) {
        bool dup = false;
        for (size_t j = 0; j < m; j++)
            dup |= kvt_key_eq(&q->load_keys[j], &prefix[i]);
        if (!dup)
            q->load_keys[m++] = prefix[i];
    }
    assert_int_equal(mgr_prepare_load(w, q, q->load_keys, m, ids), 0);
    uint8_t *base = kvt_primary_base(w->p), want[ROW];
    for (size_t i = 0; i < m; i++) {
        fill_row(want, &q->load_keys[i]);
        assert_memory_equal(base + (size_t)ids[i] * ROW, want, ROW);
        w->loads_verified++;
    }
    q->n_load = m;
}

static void finish_loads(struct world *w, struct rreq *q)
{
    if (q->n_load) {
        assert_int_equal(mgr_complete_load(w, q, q->load_keys, q->n_load), 0);
        q->n_load = 0;
    }
}

static void finish_store(struct world *w, struct rreq *q)
{
    if (q->store_pending) {
        assert_int_equal(
            mgr_complete_store(w, q, q->store_keys, q->n_store_keys, rnd_n(w, 10) != 0), 0);
        q->store_pending = false;
    }
}

static void step_world(struct world *w)
{
    for (int op = 0; op < 6; op++) {
        struct rreq *q = &w->reqs[rnd_n(w, MAX_REQS)];
        if (!q->live) {
            char id[32];
            snprintf(id, sizeof(id), "r-%u", w->next_req++);
            q->ctx = kt_ctx(id);
            memset(&q->store_keys, 0, sizeof(q->store_keys));
            q->live = true;
            q->finished = false;
            q->n_load = 0;
            q->store_pending = false;
            memset(&q->acc, 0, sizeof(q->acc));
            q->acc.gen = w->mdl.gen;
            assert_int_equal(kvt_manager_on_new_request(w->m, q->ctx, NULL), 0);
            continue;
        }
        switch (rnd_n(w, 7)) {
        case 0:
        case 1:
            if (!q->finished)
                do_lookup_and_load(w, q);
            break;
        case 2:
            if (!q->finished)
                do_store(w, q);
            break;
        case 3:
            finish_store(w, q);
            break;
        case 4:
            finish_loads(w, q);
            break;
        case 5:
            if (q->n_load)
                mgr_touch(w, q, q->load_keys, q->n_load);
            break;
        case 6:
            if (!q->finished) {
                assert_int_equal(mgr_request_finished(w, q), 0);
                q->finished = true;
                w->finished_reqs[w->n_finished_reqs++ % MAX_SERIALS] = serial_of(q->ctx->req_id);
            } else if (!q->store_pending) {
                finish_loads(w, q);
                kvt_req_ctx_unref(q->ctx);
                q->live = false;
            }
            break;
        }
    }
    mgr_schedule_end(w);
    struct kvt_events ev;
    kvt_events_init(&ev);
    assert_int_equal(kvt_manager_take_events(w->m, &ev), 0);
    kvt_events_cleanup(&ev);
    check_invariants(w);
}

static void run_seed(uint64_t seed, unsigned steps)
{
    struct world *w = calloc(1, sizeof(*w));
    struct kvt_primary_config pc = {.num_chunks = NUM_CHUNKS,
                                    .row_bytes = ROW,
                                    .policy = seed % 2 ? "arc" : "lru",
                                    .enable_events = true};
    struct kvt_example_tier_config tc[N_TIERS] = {
        {.type = "slow", .delay_polls = 2, .fail_rate = 0.1, .copy_bytes = true},
        {.type = "retry", .retry_first_lookup = true, .copy_bytes = true, .fail_rate = 0.05},
        {.type = "reqlevel", .request_level = true, .copy_bytes = true, .delay_polls = 1},
    };
    W = w;
    w->rng = seed * 2654435761u + 7;
    w->mdl.arc = seed % 2 != 0;
    assert_int_equal(kvt_primary_create(&pc, NULL, &w->p), 0);
    for (int i = 0; i < N_TIERS; i++) {
        tc[i].seed = (unsigned)(seed + (uint64_t)i);
        tc[i].on_call = on_call;
        tc[i].cb_arg = w;
        assert_int_equal(kvt_example_tier_create(&tc[i], &w->tiers[i]), 0);
    }
    assert_int_equal(kvt_manager_create(w->p, w->tiers, N_TIERS, &w->m), 0);
    kvt_store_output_init(&w->out);

    for (unsigned s = 0; s < steps; s++) {
        step_world(w);
        if (s % 500 == 499) {
            /* reset_cache as at sleep: flush GPU loads, forget stores in flight */
            for (int i = 0; i < MAX_REQS; i++) {
                if (w->reqs[i].live) {
                    finish_loads(w, &w->reqs[i]);
                    w->reqs[i].store_pending = false;
                }
            }
            assert_int_equal(mgr_reset_cache(w), 0);
            check_invariants(w);
        }
    }
    /* Wind down: finish everything and step until idle. */
    for (int i = 0; i < MAX_REQS; i++) {
        struct rreq *q = &w->reqs[i];
        if (!q->live)
            continue;
        finish_loads(w, q);
        finish_store(w, q);
        if (!q->finished) {
            assert_int_equal(mgr_request_finished(w, q), 0);
            w->finished_reqs[w->n_finished_reqs++ % MAX_SERIALS] = serial_of(q->ctx->req_id);
        }
        kvt_req_ctx_unref(q->ctx);
        q->live = false;
    }
    for (int i = 0; i < 20 && kvt_manager_has_pending_work(w->m); i++)
        mgr_schedule_end(w);
    assert_false(kvt_manager_has_pending_work(w->m));
    assert_int_equal(kvt_manager_num_jobs(w->m), 0);
    assert_int_equal(kvt_manager_num_requests(w->m), 0);
    assert_int_equal(kvt_primary_num_write_pending(w->p), 0);
    assert_int_equal(kvt_primary_num_evictable(w->p), kvt_primary_num_entries(w->p));
    check_invariants(w);
    for (unsigned i = 0; i < w->n_finished_reqs && i < MAX_SERIALS; i++) {
        unsigned sr = w->finished_reqs[i];
        for (int t = 0; t < N_TIERS; t++)
            assert_int_equal(w->finishes[t][sr % MAX_SERIALS], 1);
    }
    print_message("seed %llu (%s): %u steps, %lu loads verified, %lu evictions, %lu promotions; "
                  "the policy model: %lu calls checked, %lu evictions and %lu promotion attempts "
                  "predicted\n",
                  (unsigned long long)seed, pc.policy, steps, w->loads_verified, w->evictions,
                  w->promotions_seen, w->model_checks, w->model_evictions, w->model_attempts);
    assert_true(w->loads_verified > 0 && w->evictions > 0 && w->promotions_seen > 0);
    assert_true(w->model_evictions > 0 && w->model_attempts > 0);
    assert_int_equal(kvt_manager_shutdown(w->m), 0);
    kvt_manager_destroy(w->m);
    kvt_store_output_cleanup(&w->out);
    free(w);
}

static void test_random_operation_sequences(void **state)
{
    const char *s = getenv("KVT_RANDOM_SEEDS"), *n = getenv("KVT_RANDOM_STEPS");
    unsigned seeds = s ? (unsigned)atoi(s) : 6, steps = n ? (unsigned)atoi(n) : 3000;
    for (unsigned i = 1; i <= seeds; i++)
        run_seed(i, steps);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_random_operation_sequences),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

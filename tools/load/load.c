/* SPDX-License-Identifier: Apache-2.0 */
/* kvtier-load: plays inference engines against one or more kvtierd nodes with a
 * shared-prefix workload, verifies every loaded byte, and prints what the cache did
 * (docs/kvtier-load.md).
 *
 * Workload. P system prompts of S blocks each are shared by C conversations; a
 * conversation's system prompt is drawn once by Zipf(s) over the prompts, and each
 * request picks a conversation by Zipf(s). Conversation c's turn t sends its system
 * prompt, the blocks of its earlier turns (history) and N new blocks; once a prompt
 * would exceed B blocks the conversation starts over (a new generation, new keys).
 * Turn counters are shared by every engine of the process, so turn t+1 of a
 * conversation often runs on another node than turn t and finds its history there
 * only through the cluster's network tier.
 *
 * Keys are chained like vLLM's block hashes: key_i = H(key_{i-1}, what block i is),
 * rooted in --seed only, so every node and every process with the same seed derives
 * the same keys. Content is a function of the key (tool_util.h), so whichever node
 * stored a chunk, a reader anywhere can check every byte of it.
 *
 * Threads. Each engine is a thread with its own client and at most --batch requests
 * in flight; one step of an engine: start requests, look up every unresolved key of
 * every request (HIT and MISS are final; HIT_PENDING and RETRY are asked again next
 * step), finish the requests whose keys are all resolved (prepare_load the hits,
 * verify, complete_load; prepare_store the misses, write, complete_store;
 * on_request_finished), then on_schedule_end with the requests started this step.
 * The main thread holds one more client per node: it drains get_stats (counter
 * deltas, summed here) and take_events, and draws the progress line. Engine
 * counters the main thread reads are atomics; everything else is the engine's own. */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <xxhash.h>

#include "kvt/version.h"
#include "kvtier/client.h"
#include "tool_util.h"

#define EX_FAIL      KVT_TOOL_EX_FAIL
#define EX_USAGE     KVT_TOOL_EX_USAGE
#define MAX_NODES    16
#define MAX_STEPS_H  4096 /* lookup-to-HIT histogram size (the last bin is ">=") */
#define US_H_PER_OCT 8    /* wall-clock histogram: 8 bins per doubling of microseconds, */
#define US_H         256  /* up to 2^32 us (the last bin is ">=") */
#define STUCK_S      20.0 /* a key still pending after this long is an error */
#define MAX_ERR_MSGS 10

struct opts {
    const char *nodes[MAX_NODES];
    size_t n_nodes;
    unsigned engines_per_node;
    double duration_s;
    unsigned prompts, conversations, blocks_per_prompt, system_blocks, new_blocks, batch;
    unsigned step_us; /* an engine step lasts at least this long (its forward pass) */
    double zipf, rate;
    uint64_t seed;
    bool json, quiet;
};

/* Counters an engine keeps; the monitor reads the atomic ones while it runs. */
struct counters {
    _Atomic uint64_t requests, keys, hits_first, hits_later, misses, errors;
    _Atomic uint64_t loaded_chunks, loaded_bytes, stored_chunks, stored_bytes;
    uint64_t verify_failures, api_errors, stuck, load_races, stores_refused, pending_answers;
    uint64_t steps;
    uint64_t to_hit[MAX_STEPS_H];
    /* Keys that were not a HIT at their request's first lookup (the node had to find
     * them: a peer, its storage tier): steps and microseconds from that lookup to HIT. */
    uint64_t later_steps[MAX_STEPS_H];
    uint64_t later_us[US_H];
    /* Of those that were HIT_PENDING on the way (the node promoting them from a tier
     * below the primary): first lookup to HIT_PENDING, HIT_PENDING to HIT. */
    uint64_t to_pending_us[US_H], pending_to_hit_us[US_H];
};

struct req {
    char id[KVTIER_REQ_ID_MAX + 1];
    size_t n;
    struct kvtier_key *keys;
    uint8_t *state;    /* 0 unresolved, 1 hit, 2 miss */
    double *pending_s; /* when the key was first HIT_PENDING (0: not yet) */
    uint64_t first_step;
    double start_s;
    bool active;
};

struct load;

struct engine {
    struct load *L;
    unsigned node, idx;
    pthread_t thread;
    struct kvtier_client *c;
    uint64_t rng;
    uint64_t seq;
    struct req *reqs;
    /* scratch, sized for one request */
    struct kvtier_key *kbuf, *done;
    uint8_t *res;
    uint32_t *sidx;
    int64_t *chunks;
    size_t *map;
    struct counters ct;
};

/* Sum of a stat over the run: counters add up, gauges keep the last value, histograms
 * add their buckets (value is their count). */
struct stat_acc {
    char name[KVTIER_STAT_NAME_MAX];
    char label[KVTIER_STAT_LABEL_MAX];
    int kind;
    double value, sum;
    uint64_t buckets[KVTIER_HIST_BUCKETS];
    struct kvtier_hist_bounds bounds;
};

struct node_mon {
    struct kvtier_client *c;
    struct stat_acc *acc;
    size_t n_acc, cap_acc;
    uint64_t events_stored, events_removed;
};

struct load {
    struct opts o;
    double *prompt_cdf, *conv_cdf;
    unsigned *conv_prompt;       /* conversation -> its system prompt */
    _Atomic uint64_t *conv_turn; /* conversation -> next turn */
    uint64_t *sys_keys;          /* prompts x system_blocks chained hashes */
    size_t row_bytes;
    struct engine *eng;
    size_t n_eng;
    struct node_mon mon[MAX_NODES];
    double start_s, deadline_s;
    atomic_bool stop;
    pthread_mutex_t err_lock;
    unsigned n_err_msgs;
    bool tty_err; /* stderr is a terminal: errors clear the progress line first */
};

static volatile sig_atomic_t interrupted;

static void on_sigint(int sig)
{
    (void)sig;
    interrupted = 1;
}

static void engine_error(struct engine *e, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static void engine_error(struct engine *e, const char *fmt, ...)
{
    va_list ap;

    atomic_fetch_add_explicit(&e->ct.errors, 1, memory_order_relaxed);
    pthread_mutex_lock(&e->L->err_lock);
    if (e->L->n_err_msgs++ < MAX_ERR_MSGS) {
        fprintf(stderr, "%skvtier-load: node %u engine %u: ", e->L->tty_err ? "\r\033[K" : "",
                e->node, e->idx);
        va_start(ap, fmt);
        vfprintf(stderr, fmt, ap);
        va_end(ap);
        /* The node's or the ring's own words, when there are some. */
        if (e->c != NULL && kvtier_client_error(e->c)[0] != '\0')
            fprintf(stderr, " [%s]", kvtier_client_error(e->c));
        fputc('\n', stderr);
    }
    pthread_mutex_unlock(&e->L->err_lock);
}

/* ---- workload ---------------------------------------------------------------------- */

static uint64_t rng_next(uint64_t *s)
{
    uint64_t x = *s;

    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *s = x;
}

static double rng_unit(uint64_t *s)
{
    return (double)(rng_next(s) >> 11) * 0x1.0p-53;
}

static double *zipf_cdf(unsigned n, double s)
{
    double *cdf = malloc(n * sizeof(*cdf)), sum = 0;

    if (cdf == NULL)
        return NULL;
    for (unsigned i = 0; i < n; i++) {
        sum += 1.0 / pow((double)(i + 1), s);
        cdf[i] = sum;
    }
    for (unsigned i = 0; i < n; i++)
        cdf[i] /= sum;
    return cdf;
}

static unsigned zipf_pick(const double *cdf, unsigned n, uint64_t *rng)
{
    double u = rng_unit(rng);
    unsigned lo = 0, hi = n - 1;

    while (lo < hi) {
        unsigned mid = (lo + hi) / 2;

        if (cdf[mid] < u)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static uint64_t chain(uint64_t parent, char kind, uint64_t a, uint64_t b, uint64_t c)
{
    uint64_t in[4] = {(uint64_t)(unsigned char)kind, a, b, c};

    return XXH3_64bits_withSeed(in, sizeof(in), parent);
}

static void key_from_hash(uint64_t h, struct kvtier_key *key)
{
    uint64_t hash[2] = {h, XXH3_64bits_withSeed(&h, sizeof(h), 0x6b767469657221ull)};
    int rc = kvtier_key_make(key, hash, sizeof(hash), 0);

    (void)rc; /* 16 + 4 bytes always fit */
}

/* The keys of conversation conv's turn: system blocks, history, new blocks. */
static size_t build_prompt(const struct load *L, unsigned conv, uint64_t turn,
                           struct kvtier_key *keys)
{
    const struct opts *o = &L->o;
    unsigned per_gen = (o->blocks_per_prompt - o->system_blocks) / o->new_blocks;
    uint64_t gen = turn / per_gen, t = turn % per_gen;
    unsigned p = L->conv_prompt[conv];
    size_t n = 0, conv_blocks = (size_t)(t + 1) * o->new_blocks;
    uint64_t h = 0;

    for (unsigned b = 0; b < o->system_blocks; b++) {
        h = L->sys_keys[(size_t)p * o->system_blocks + b];
        key_from_hash(h, &keys[n++]);
    }
    for (size_t j = 0; j < conv_blocks; j++) {
        h = chain(h, 'C', conv, gen, j);
        key_from_hash(h, &keys[n++]);
    }
    return n;
}

static int load_setup(struct load *L)
{
    const struct opts *o = &L->o;
    uint64_t rng = o->seed * 0x9e3779b97f4a7c15ull + 1;

    L->prompt_cdf = zipf_cdf(o->prompts, o->zipf);
    L->conv_cdf = zipf_cdf(o->conversations, o->zipf);
    L->conv_prompt = calloc(o->conversations, sizeof(*L->conv_prompt));
    L->conv_turn = calloc(o->conversations, sizeof(*L->conv_turn));
    L->sys_keys = calloc((size_t)o->prompts * o->system_blocks, sizeof(*L->sys_keys));
    if (!L->prompt_cdf || !L->conv_cdf || !L->conv_prompt || !L->conv_turn || !L->sys_keys)
        return -ENOMEM;
    for (unsigned c = 0; c < o->conversations; c++)
        L->conv_prompt[c] = zipf_pick(L->prompt_cdf, o->prompts, &rng);
    for (unsigned p = 0; p < o->prompts; p++) {
        uint64_t h = XXH3_64bits_withSeed("kvtier-load", 11, o->seed);

        for (unsigned b = 0; b < o->system_blocks; b++) {
            h = chain(h, 'S', p, b, 0);
            L->sys_keys[(size_t)p * o->system_blocks + b] = h;
        }
    }
    return 0;
}

/* ---- one engine ---------------------------------------------------------------------- */

/* The bin of a duration in us: bin b holds [2^(b/8), 2^((b+1)/8)) us, bin 0 below 1 us. */
static size_t us_bin(double us)
{
    size_t b = us < 1 ? 0 : (size_t)(log2(us) * US_H_PER_OCT) + 1;

    return b < US_H ? b : US_H - 1;
}

/* The upper edge of bin b, ms. */
static double us_bin_ms(size_t b)
{
    return b == 0 ? 0.001 : exp2((double)b / US_H_PER_OCT) / 1000.0;
}

static void record_hit(struct engine *e, const struct req *r, size_t k, uint64_t steps)
{
    double now;

    e->ct.to_hit[steps < MAX_STEPS_H ? steps : MAX_STEPS_H - 1]++;
    if (steps == 0)
        return;
    now = kvt_tool_now_s();
    e->ct.later_steps[steps < MAX_STEPS_H ? steps : MAX_STEPS_H - 1]++;
    e->ct.later_us[us_bin((now - r->start_s) * 1e6)]++;
    if (r->pending_s[k] > 0) {
        e->ct.to_pending_us[us_bin((r->pending_s[k] - r->start_s) * 1e6)]++;
        e->ct.pending_to_hit_us[us_bin((now - r->pending_s[k]) * 1e6)]++;
    }
}

static bool verify_row(struct engine *e, const struct kvtier_key *key, int64_t chunk)
{
    const uint8_t *row = kvtier_client_row(e->c, chunk);
    size_t off = kvt_tool_content_check(kvt_tool_key_seed(key), row, e->L->row_bytes);
    char hex[2 * KVTIER_KEY_MAX + 1];

    if (off == e->L->row_bytes)
        return true;
    e->ct.verify_failures++;
    kvt_tool_key_hex(key, hex);
    engine_error(e, "verify failed: key %s chunk %" PRId64 " differs at byte %zu", hex, chunk, off);
    return false;
}

static void count_loaded(struct engine *e, size_t n)
{
    atomic_fetch_add_explicit(&e->ct.loaded_chunks, n, memory_order_relaxed);
    atomic_fetch_add_explicit(&e->ct.loaded_bytes, n * e->L->row_bytes, memory_order_relaxed);
}

/* Loads one key on its own after a batch prepare_load failed: an eviction between
 * our lookup and the load is a race, not an error, if the key now misses. */
static void load_one(struct engine *e, struct req *r, size_t i)
{
    int64_t chunk;
    uint8_t res;
    int rc;

    /* Another engine may evict the key and store it again between our calls: a key
     * that keeps looking up HIT and keeps refusing the load is the error. */
    for (int attempt = 0;; attempt++) {
        rc = kvtier_prepare_load(e->c, r->id, &r->keys[i], 1, &chunk);
        if (rc != -EINVAL)
            break;
        rc = kvtier_lookup(e->c, r->id, &r->keys[i], 1, 0, &res, NULL);
        if (rc == 0 && res != KVTIER_HIT) {
            e->ct.load_races++;
            r->state[i] = 2; /* recompute and store it */
            return;
        }
        if (rc == 0 && attempt == 3) {
            engine_error(e, "prepare_load refuses a key that looks up HIT: %s",
                         kvt_tool_strerror(-EINVAL));
            e->ct.api_errors++;
            r->state[i] = 3;
            return;
        }
        if (rc < 0)
            break;
    }
    if (rc < 0) {
        e->ct.api_errors++;
        engine_error(e, "prepare_load: %s", kvt_tool_strerror(rc));
        r->state[i] = 3;
        return;
    }
    verify_row(e, &r->keys[i], chunk);
    count_loaded(e, 1);
    rc = kvtier_complete_load(e->c, r->id, &r->keys[i], 1);
    if (rc < 0) {
        e->ct.api_errors++;
        engine_error(e, "complete_load: %s", kvt_tool_strerror(rc));
    }
}

static void do_loads(struct engine *e, struct req *r)
{
    size_t n = 0;
    int rc;

    for (size_t i = 0; i < r->n; i++)
        if (r->state[i] == 1) {
            e->kbuf[n] = r->keys[i];
            e->map[n++] = i;
        }
    if (n == 0)
        return;
    rc = kvtier_prepare_load(e->c, r->id, e->kbuf, n, e->chunks);
    if (rc == -EINVAL) {
        for (size_t j = 0; j < n; j++)
            load_one(e, r, e->map[j]);
        return;
    }
    if (rc < 0) {
        e->ct.api_errors++;
        engine_error(e, "prepare_load of %zu keys: %s", n, kvt_tool_strerror(rc));
        return;
    }
    for (size_t j = 0; j < n; j++)
        verify_row(e, &e->kbuf[j], e->chunks[j]);
    count_loaded(e, n);
    rc = kvtier_complete_load(e->c, r->id, e->kbuf, n);
    if (rc < 0) {
        e->ct.api_errors++;
        engine_error(e, "complete_load of %zu keys: %s", n, kvt_tool_strerror(rc));
    }
}

static void do_stores(struct engine *e, struct req *r)
{
    struct kvtier_store_plan plan = {.store_index = e->sidx, .chunk_ids = e->chunks};
    struct kvtier_key *done;
    size_t n = 0;
    int rc;

    for (size_t i = 0; i < r->n; i++)
        if (r->state[i] == 2)
            e->kbuf[n++] = r->keys[i];
    if (n == 0)
        return;
    rc = kvtier_prepare_store(e->c, r->id, e->kbuf, n, &plan);
    if (rc == -ENOSPC) {
        e->ct.stores_refused++;
        return;
    }
    if (rc < 0) {
        e->ct.api_errors++;
        engine_error(e, "prepare_store of %zu keys: %s", n, kvt_tool_strerror(rc));
        return;
    }
    if (plan.n_store == 0)
        return;
    done = e->done; /* the planned keys, in plan order */
    for (size_t j = 0; j < plan.n_store; j++) {
        done[j] = e->kbuf[plan.store_index[j]];
        kvt_tool_content_fill(kvt_tool_key_seed(&done[j]),
                              kvtier_client_row(e->c, plan.chunk_ids[j]), e->L->row_bytes);
    }
    rc = kvtier_complete_store(e->c, r->id, done, plan.n_store, true);
    if (rc < 0) {
        e->ct.api_errors++;
        engine_error(e, "complete_store of %zu keys: %s", plan.n_store, kvt_tool_strerror(rc));
    } else {
        atomic_fetch_add_explicit(&e->ct.stored_chunks, plan.n_store, memory_order_relaxed);
        atomic_fetch_add_explicit(&e->ct.stored_bytes, plan.n_store * e->L->row_bytes,
                                  memory_order_relaxed);
    }
}

static void finish_req(struct engine *e, struct req *r)
{
    int rc;

    do_loads(e, r);
    do_stores(e, r);
    rc = kvtier_on_request_finished(e->c, r->id);
    if (rc < 0) {
        e->ct.api_errors++;
        engine_error(e, "on_request_finished(%s): %s", r->id, kvt_tool_strerror(rc));
    }
    r->active = false;
}

static int start_req(struct engine *e, struct req *r)
{
    const struct load *L = e->L;
    unsigned conv = zipf_pick(L->conv_cdf, L->o.conversations, &e->rng);
    uint64_t turn = atomic_fetch_add(&e->L->conv_turn[conv], 1);
    int rc;

    snprintf(r->id, sizeof(r->id), "load-%ld-%u.%u-%" PRIu64, (long)getpid(), e->node, e->idx,
             e->seq++);
    r->n = build_prompt(L, conv, turn, r->keys);
    memset(r->state, 0, r->n);
    memset(r->pending_s, 0, r->n * sizeof(*r->pending_s));
    r->first_step = e->ct.steps;
    r->start_s = kvt_tool_now_s();
    rc = kvtier_on_new_request(e->c, r->id, NULL, NULL);
    if (rc < 0) {
        e->ct.api_errors++;
        engine_error(e, "on_new_request(%s): %s", r->id, kvt_tool_strerror(rc));
        return rc;
    }
    r->active = true;
    atomic_fetch_add_explicit(&e->ct.requests, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&e->ct.keys, r->n, memory_order_relaxed);
    return 0;
}

static void lookup_req(struct engine *e, struct req *r)
{
    size_t n = 0;
    int rc;

    for (size_t i = 0; i < r->n; i++)
        if (r->state[i] == 0) {
            e->kbuf[n] = r->keys[i];
            e->map[n++] = i;
        }
    if (n == 0)
        return;
    rc = kvtier_lookup(e->c, r->id, e->kbuf, n, 0, e->res, NULL);
    if (rc < 0) {
        e->ct.api_errors++;
        engine_error(e, "lookup of %zu keys: %s", n, kvt_tool_strerror(rc));
        for (size_t j = 0; j < n; j++)
            r->state[e->map[j]] = 3; /* given up: neither loaded nor stored */
        return;
    }
    for (size_t j = 0; j < n; j++) {
        uint64_t steps = e->ct.steps - r->first_step;

        switch (e->res[j]) {
        case KVTIER_HIT:
            r->state[e->map[j]] = 1;
            record_hit(e, r, e->map[j], steps);
            atomic_fetch_add_explicit(steps == 0 ? &e->ct.hits_first : &e->ct.hits_later, 1,
                                      memory_order_relaxed);
            break;
        case KVTIER_MISS:
            r->state[e->map[j]] = 2;
            atomic_fetch_add_explicit(&e->ct.misses, 1, memory_order_relaxed);
            break;
        case KVTIER_HIT_PENDING:
            if (r->pending_s[e->map[j]] == 0)
                r->pending_s[e->map[j]] = kvt_tool_now_s();
            e->ct.pending_answers++;
            break;
        case KVTIER_RETRY:
            e->ct.pending_answers++;
            break;
        default:
            e->ct.api_errors++;
            engine_error(e, "lookup answered %u", e->res[j]);
            r->state[e->map[j]] = 3;
        }
    }
}

static bool resolved(const struct req *r)
{
    for (size_t i = 0; i < r->n; i++)
        if (r->state[i] == 0)
            return false;
    return true;
}

static void *engine_main(void *arg)
{
    struct engine *e = arg;
    struct load *L = e->L;
    const char **new_ids = calloc(L->o.batch, sizeof(*new_ids));
    uint64_t started = 0;

    if (new_ids == NULL) {
        engine_error(e, "out of memory");
        return NULL;
    }
    while (!atomic_load(&L->stop)) {
        double now = kvt_tool_now_s();
        size_t n_new = 0, n_active = 0;
        bool ending = now >= L->deadline_s;
        int rc;

        for (unsigned i = 0; i < L->o.batch && !ending; i++) {
            struct req *r = &e->reqs[i];

            if (r->active)
                continue;
            if (L->o.rate > 0 && (double)started >= L->o.rate * (now - L->start_s))
                break;
            if (start_req(e, r) < 0)
                break;
            started++;
            new_ids[n_new++] = r->id;
        }
        for (unsigned i = 0; i < L->o.batch; i++) {
            struct req *r = &e->reqs[i];

            if (!r->active)
                continue;
            lookup_req(e, r);
            if (!resolved(r) && now - r->start_s > STUCK_S) {
                e->ct.stuck++;
                engine_error(e, "%s: keys still pending after %.0f s (%" PRIu64 " steps)", r->id,
                             STUCK_S, e->ct.steps - r->first_step);
                for (size_t k = 0; k < r->n; k++)
                    if (r->state[k] == 0)
                        r->state[k] = 3;
            }
            if (resolved(r))
                finish_req(e, r);
            n_active += r->active;
        }
        rc = kvtier_on_schedule_end(e->c, new_ids, n_new, NULL, 0);
        if (rc < 0) {
            e->ct.api_errors++;
            engine_error(e, "on_schedule_end: %s", kvt_tool_strerror(rc));
            if (rc == -EPIPE || rc == -ECONNRESET || rc == -ETIMEDOUT)
                break;
        }
        e->ct.steps++;
        if (ending && n_active == 0)
            break;
        if (L->o.step_us > 0) {
            double left = now + L->o.step_us / 1e6 - kvt_tool_now_s();

            if (left > 0)
                usleep((useconds_t)(left * 1e6)); /* the rest of the forward pass */
        } else if (n_new == 0 && n_active == 0)
            usleep(1000); /* rate-limited: nothing to do this step */
    }
    free(new_ids);
    return NULL;
}

static int engine_init(struct load *L, struct engine *e, unsigned node, unsigned idx)
{
    struct kvtier_connect_opts co = {.timeout_ms = 30000};
    char name[KVTIER_NAME_MAX + 1];
    size_t B = L->o.blocks_per_prompt;
    int rc;

    e->L = L;
    e->node = node;
    e->idx = idx;
    e->rng = (L->o.seed + 1) * 0x9e3779b97f4a7c15ull ^ ((uint64_t)node << 32 | idx) ^ 0x5bd1e995;
    if (e->rng == 0)
        e->rng = 1;
    snprintf(name, sizeof(name), "kvtier-load-%u.%u", node, idx);
    co.name = name;
    rc = kvtier_connect(L->o.nodes[node], &co, &e->c);
    if (rc < 0) {
        fprintf(stderr, "kvtier-load: cannot connect to %s: %s\n", L->o.nodes[node],
                kvt_tool_strerror(rc));
        return rc;
    }
    if (kvtier_client_max_keys(e->c) < B) {
        fprintf(stderr,
                "kvtier-load: %s takes at most %zu keys per call: lower --blocks-per-prompt\n",
                L->o.nodes[node], kvtier_client_max_keys(e->c));
        return -EMSGSIZE;
    }
    if (kvtier_client_region(e->c)->row_bytes != L->row_bytes) {
        fprintf(stderr,
                "kvtier-load: %s has %zu-byte rows, the first node %zu: the nodes of a cluster "
                "share one row size\n",
                L->o.nodes[node], kvtier_client_region(e->c)->row_bytes, L->row_bytes);
        return -EINVAL;
    }
    e->reqs = calloc(L->o.batch, sizeof(*e->reqs));
    e->kbuf = calloc(B, sizeof(*e->kbuf));
    e->done = calloc(B, sizeof(*e->done));
    e->res = calloc(B, 1);
    e->sidx = calloc(B, sizeof(*e->sidx));
    e->chunks = calloc(B, sizeof(*e->chunks));
    e->map = calloc(B, sizeof(*e->map));
    if (!e->reqs || !e->kbuf || !e->done || !e->res || !e->sidx || !e->chunks || !e->map)
        return -ENOMEM;
    for (unsigned i = 0; i < L->o.batch; i++) {
        e->reqs[i].keys = calloc(B, sizeof(struct kvtier_key));
        e->reqs[i].state = calloc(B, 1);
        e->reqs[i].pending_s = calloc(B, sizeof(double));
        if (!e->reqs[i].keys || !e->reqs[i].state || !e->reqs[i].pending_s)
            return -ENOMEM;
    }
    return 0;
}

static void engine_cleanup(struct engine *e)
{
    if (e->reqs != NULL)
        for (unsigned i = 0; i < e->L->o.batch; i++) {
            free(e->reqs[i].keys);
            free(e->reqs[i].state);
            free(e->reqs[i].pending_s);
        }
    free(e->reqs);
    free(e->kbuf);
    free(e->done);
    free(e->res);
    free(e->sidx);
    free(e->chunks);
    free(e->map);
    kvtier_close(e->c);
}

/* ---- the monitor: stats and events of every node ------------------------------------- */

static void acc_add(struct node_mon *m, const struct kvtier_stat *s,
                    const struct kvtier_hist_bounds *b)
{
    struct stat_acc *a = NULL;

    for (size_t i = 0; i < m->n_acc; i++)
        if (!strcmp(m->acc[i].name, s->name) && !strcmp(m->acc[i].label, s->label)) {
            a = &m->acc[i];
            break;
        }
    if (a == NULL) {
        if (m->n_acc == m->cap_acc) {
            size_t cap = m->cap_acc ? 2 * m->cap_acc : 64;
            struct stat_acc *na = realloc(m->acc, cap * sizeof(*na));

            if (na == NULL)
                return;
            m->acc = na;
            m->cap_acc = cap;
        }
        a = &m->acc[m->n_acc++];
        memset(a, 0, sizeof(*a));
        snprintf(a->name, sizeof(a->name), "%s", s->name);
        snprintf(a->label, sizeof(a->label), "%s", s->label);
        a->kind = s->kind;
    }
    if (s->kind == KVTIER_GAUGE)
        a->value = s->value;
    else if (s->kind == KVTIER_COUNTER)
        a->value += s->value;
    else {
        a->value += (double)s->count;
        a->sum += s->sum;
        for (size_t k = 0; k < KVTIER_HIST_BUCKETS; k++)
            a->buckets[k] += s->buckets[k];
        a->bounds = *b;
    }
}

/* Drains one node's stats deltas and events; returns a negative errno on failure. */
static int mon_poll(struct node_mon *m)
{
    struct kvtier_stats *st;
    struct kvtier_events *ev;
    int rc = kvtier_get_stats(m->c, &st);

    if (rc < 0)
        return rc;
    for (size_t i = 0; i < st->n; i++)
        acc_add(m, &st->s[i], &st->stat_bounds[i]);
    kvtier_stats_free(st);
    rc = kvtier_take_events(m->c, &ev);
    if (rc < 0)
        return rc;
    for (size_t i = 0; i < ev->n; i++) {
        if (ev->ev[i].removed)
            m->events_removed += ev->ev[i].n;
        else
            m->events_stored += ev->ev[i].n;
    }
    kvtier_events_free(ev);
    return 0;
}

static void sum_counters(const struct load *L, struct counters *t)
{
    memset(t, 0, sizeof(*t));
    for (size_t i = 0; i < L->n_eng; i++) {
        const struct counters *c = &L->eng[i].ct;

        t->requests += atomic_load(&c->requests);
        t->keys += atomic_load(&c->keys);
        t->hits_first += atomic_load(&c->hits_first);
        t->hits_later += atomic_load(&c->hits_later);
        t->misses += atomic_load(&c->misses);
        t->errors += atomic_load(&c->errors);
        t->loaded_chunks += atomic_load(&c->loaded_chunks);
        t->loaded_bytes += atomic_load(&c->loaded_bytes);
        t->stored_chunks += atomic_load(&c->stored_chunks);
        t->stored_bytes += atomic_load(&c->stored_bytes);
    }
}

/* Only after the engines joined: the plain fields too. */
static void sum_final(const struct load *L, struct counters *t)
{
    sum_counters(L, t);
    for (size_t i = 0; i < L->n_eng; i++) {
        const struct counters *c = &L->eng[i].ct;

        t->verify_failures += c->verify_failures;
        t->api_errors += c->api_errors;
        t->stuck += c->stuck;
        t->load_races += c->load_races;
        t->stores_refused += c->stores_refused;
        t->pending_answers += c->pending_answers;
        t->steps += c->steps;
        for (size_t k = 0; k < MAX_STEPS_H; k++) {
            t->to_hit[k] += c->to_hit[k];
            t->later_steps[k] += c->later_steps[k];
        }
        for (size_t k = 0; k < US_H; k++) {
            t->later_us[k] += c->later_us[k];
            t->to_pending_us[k] += c->to_pending_us[k];
            t->pending_to_hit_us[k] += c->pending_to_hit_us[k];
        }
    }
}

/* The bin of histogram h (n bins) holding its q-quantile. */
static size_t percentile_n(const uint64_t *h, size_t n, double q)
{
    uint64_t total = 0, seen = 0, want;

    for (size_t k = 0; k < n; k++)
        total += h[k];
    if (total == 0)
        return 0;
    want = (uint64_t)ceil(q * (double)total);
    if (want == 0)
        want = 1;
    for (size_t k = 0; k < n; k++) {
        seen += h[k];
        if (seen >= want)
            return k;
    }
    return n - 1;
}

static uint64_t percentile(const uint64_t *h, double q)
{
    return percentile_n(h, MAX_STEPS_H, q);
}

static double percentile_ms(const uint64_t *h, double q)
{
    return us_bin_ms(percentile_n(h, US_H, q));
}

/* ---- the report ------------------------------------------------------------------------- */

struct tier_sum {
    char label[KVTIER_STAT_LABEL_MAX];
    double queries, hits;
};

static size_t tier_sums(const struct load *L, struct tier_sum *out, size_t cap)
{
    size_t n = 0;

    for (size_t k = 0; k < L->o.n_nodes; k++)
        for (size_t i = 0; i < L->mon[k].n_acc; i++) {
            const struct stat_acc *a = &L->mon[k].acc[i];
            bool q = strstr(a->name, "chunk_queries") != NULL;
            bool h = strstr(a->name, "chunk_hits") != NULL;
            size_t j;

            if ((!q && !h) || a->label[0] == '\0')
                continue;
            for (j = 0; j < n; j++)
                if (!strcmp(out[j].label, a->label))
                    break;
            if (j == n) {
                if (n == cap)
                    continue;
                memset(&out[n], 0, sizeof(out[n]));
                snprintf(out[n].label, sizeof(out[n].label), "%s", a->label);
                n++;
            }
            if (q)
                out[j].queries += a->value;
            else
                out[j].hits += a->value;
        }
    return n;
}

static double stat_prefix_sum(const struct load *L, const char *prefix, const char *contains)
{
    double v = 0;

    for (size_t k = 0; k < L->o.n_nodes; k++)
        for (size_t i = 0; i < L->mon[k].n_acc; i++) {
            const struct stat_acc *a = &L->mon[k].acc[i];

            if (!strncmp(a->name, prefix, strlen(prefix)) &&
                (contains == NULL || strstr(a->name, contains)))
                v += a->value;
        }
    return v;
}

/* A histogram of the nodes' stats, summed over every node and label: the q-quantile
 * as the upper bound of its bucket (+Inf: the last finite bound), and the mean. */
struct hist_sum {
    uint64_t count;
    double sum, p50, p99;
};

static double hist_quantile(const uint64_t *b, const struct kvtier_hist_bounds *l, uint64_t count,
                            double q)
{
    uint64_t want = (uint64_t)ceil(q * (double)count), seen = 0;

    for (uint32_t k = 0; k < l->n; k++) {
        seen += b[k];
        if (seen >= want)
            return l->bound[k];
    }
    return l->n ? l->bound[l->n - 1] : 0;
}

static struct hist_sum stat_hist(const struct load *L, const char *name)
{
    uint64_t b[KVTIER_HIST_BUCKETS] = {0};
    const struct kvtier_hist_bounds *l = NULL;
    struct hist_sum h = {0};

    for (size_t k = 0; k < L->o.n_nodes; k++)
        for (size_t i = 0; i < L->mon[k].n_acc; i++) {
            const struct stat_acc *a = &L->mon[k].acc[i];

            if (a->kind != KVTIER_HISTOGRAM || strcmp(a->name, name) != 0)
                continue;
            h.count += (uint64_t)a->value;
            h.sum += a->sum;
            for (size_t j = 0; j < KVTIER_HIST_BUCKETS; j++)
                b[j] += a->buckets[j];
            l = &a->bounds;
        }
    if (h.count > 0 && l != NULL) {
        h.p50 = hist_quantile(b, l, h.count, 0.50);
        h.p99 = hist_quantile(b, l, h.count, 0.99);
    }
    return h;
}

/* The network tier's pull phases, as the nodes time them (KVT_M_NET_*_SECONDS). */
static const struct {
    const char *metric, *name;
} pull_phases[] = {
    {"kvtier_net_lookup_queue_seconds", "lookup to LOCATE sent"},
    {"kvtier_net_locate_seconds", "locate"},
    {"kvtier_net_fetch_queue_seconds", "fetch queued"},
    {"kvtier_net_grant_wait_seconds", "fetch to grant"},
    {"kvtier_net_read_seconds", "grant to rows verified"},
    {"kvtier_net_load_job_seconds", "load job"},
    {"kvtier_net_serve_wait_seconds", "holder: fetch to grant"},
};

static uint64_t total_errors(const struct counters *t)
{
    return t->verify_failures + t->api_errors + t->stuck;
}

static void report(const struct load *L, const struct counters *t, double elapsed)
{
    struct tier_sum tiers[32];
    size_t nt = tier_sums(L, tiers, 32);
    double pulled_chunks = stat_prefix_sum(L, "kvtier_net_pulled", "chunk");
    double pulled_bytes = stat_prefix_sum(L, "kvtier_net_pulled", "bytes");
    uint64_t resolved = t->hits_first + t->hits_later + t->misses;
    double hit = resolved ? (double)(t->hits_first + t->hits_later) / (double)resolved : 0;
    double gbs = elapsed > 0 ? (double)t->loaded_bytes / elapsed / 1e9 : 0;
    double sgbs = elapsed > 0 ? (double)t->stored_bytes / elapsed / 1e9 : 0;
    uint64_t p50 = percentile(t->to_hit, 0.50), p99 = percentile(t->to_hit, 0.99);
    uint64_t lp50 = percentile(t->later_steps, 0.50), lp99 = percentile(t->later_steps, 0.99);
    double ms50 = percentile_ms(t->later_us, 0.50), ms99 = percentile_ms(t->later_us, 0.99);
    uint64_t ev_st = 0, ev_rm = 0;

    for (size_t k = 0; k < L->o.n_nodes; k++) {
        ev_st += L->mon[k].events_stored;
        ev_rm += L->mon[k].events_removed;
    }
    if (L->o.json) {
        printf("{\"duration_s\": %.3f, \"nodes\": %zu, \"engines\": %zu, \"row_bytes\": %zu,\n",
               elapsed, L->o.n_nodes, L->n_eng, L->row_bytes);
        printf(" \"requests\": %" PRIu64 ", \"keys\": %" PRIu64 ", \"steps\": %" PRIu64 ",\n",
               t->requests, t->keys, t->steps);
        printf(" \"hits_first_lookup\": %" PRIu64 ", \"hits_after_steps\": %" PRIu64
               ", \"misses\": %" PRIu64 ", \"hit_rate\": %.6f,\n",
               t->hits_first, t->hits_later, t->misses, hit);
        printf(" \"tiers\": [");
        for (size_t i = 0; i < nt; i++)
            printf("%s{\"label\": \"%s\", \"queries\": %.0f, \"hits\": %.0f, \"hit_rate\": %.6f}",
                   i ? ", " : "", tiers[i].label, tiers[i].queries, tiers[i].hits,
                   tiers[i].queries > 0 ? tiers[i].hits / tiers[i].queries : 0);
        printf("],\n");
        printf(" \"pulled_chunks\": %.0f, \"pulled_bytes\": %.0f,\n", pulled_chunks, pulled_bytes);
        printf(" \"loaded_chunks\": %" PRIu64 ", \"loaded_bytes\": %" PRIu64
               ", \"load_gb_per_s\": %.6f,\n",
               t->loaded_chunks, t->loaded_bytes, gbs);
        printf(" \"stored_chunks\": %" PRIu64 ", \"stored_bytes\": %" PRIu64
               ", \"store_gb_per_s\": %.6f,\n",
               t->stored_chunks, t->stored_bytes, sgbs);
        printf(" \"lookup_to_hit_steps_p50\": %" PRIu64 ", \"lookup_to_hit_steps_p99\": %" PRIu64
               ",\n",
               p50, p99);
        printf(
            " \"later_hits_lookup_to_hit_steps_p50\": %" PRIu64
            ", \"later_hits_lookup_to_hit_steps_p99\": %" PRIu64
            ",\n \"later_hits_lookup_to_hit_ms_p50\": %.3f, \"later_hits_lookup_to_hit_ms_p99\": "
            "%.3f,\n",
            lp50, lp99, ms50, ms99);
        printf(" \"later_hits_to_pending_ms_p50\": %.3f, \"later_hits_to_pending_ms_p99\": %.3f,"
               " \"later_hits_pending_to_hit_ms_p50\": %.3f, \"later_hits_pending_to_hit_ms_p99\": "
               "%.3f,\n",
               percentile_ms(t->to_pending_us, 0.50), percentile_ms(t->to_pending_us, 0.99),
               percentile_ms(t->pending_to_hit_us, 0.50),
               percentile_ms(t->pending_to_hit_us, 0.99));
        printf(" \"pull_phases_ms\": {");
        for (size_t i = 0; i < sizeof(pull_phases) / sizeof(pull_phases[0]); i++) {
            struct hist_sum h = stat_hist(L, pull_phases[i].metric);

            printf("%s\"%s\": {\"count\": %" PRIu64
                   ", \"mean\": %.3f, \"p50_le\": %.3f, \"p99_le\": %.3f}",
                   i ? ", " : "", pull_phases[i].metric, h.count,
                   h.count ? 1e3 * h.sum / (double)h.count : 0, 1e3 * h.p50, 1e3 * h.p99);
        }
        printf("},\n");
        printf(" \"stores_refused\": %" PRIu64 ", \"load_races\": %" PRIu64
               ", \"events_stored\": %" PRIu64 ", \"events_removed\": %" PRIu64 ",\n",
               t->stores_refused, t->load_races, ev_st, ev_rm);
        printf(" \"verify_failures\": %" PRIu64 ", \"api_errors\": %" PRIu64
               ", \"stuck_lookups\": %" PRIu64 ", \"errors\": %" PRIu64 "}\n",
               t->verify_failures, t->api_errors, t->stuck, total_errors(t));
        return;
    }
    printf("\nkvtier-load: %zu node%s x %u engine%s, %.1f s, %zu-byte chunks, seed %" PRIu64
           ", engine steps of at least %u us\n\n",
           L->o.n_nodes, L->o.n_nodes == 1 ? "" : "s", L->o.engines_per_node,
           L->o.engines_per_node == 1 ? "" : "s", elapsed, L->row_bytes, L->o.seed, L->o.step_us);
    printf("  %-34s %s\n", "requests", "");
    printf("    %-32s %" PRIu64 " (%.0f/s), %" PRIu64 " keys, %" PRIu64 " engine steps\n", "done",
           t->requests, elapsed > 0 ? (double)t->requests / elapsed : 0, t->keys, t->steps);
    printf("    %-32s %.1f%% (%" PRIu64 " at the first lookup, %" PRIu64 " after steps, %" PRIu64
           " misses)\n",
           "hit rate (engine's view)", 100 * hit, t->hits_first, t->hits_later, t->misses);
    printf("  %-34s\n", "hit rate per tier (node stats)");
    if (nt == 0)
        printf("    (no lookup stats reported by the nodes)\n");
    for (size_t i = 0; i < nt; i++)
        printf("    %-32s %5.1f%%  (%.0f hits / %.0f queries)\n", tiers[i].label,
               tiers[i].queries > 0 ? 100 * tiers[i].hits / tiers[i].queries : 0, tiers[i].hits,
               tiers[i].queries);
    printf("  %-34s %.0f (%.1f MB)\n", "chunks pulled from peers", pulled_chunks,
           pulled_bytes / 1e6);
    printf("  %-34s %.3f GB/s (%" PRIu64 " chunks, every byte verified)\n", "loaded", gbs,
           t->loaded_chunks);
    printf("  %-34s %.3f GB/s (%" PRIu64 " chunks; %" PRIu64 " stores refused)\n", "stored", sgbs,
           t->stored_chunks, t->stores_refused);
    printf("  %-34s p50 %" PRIu64 ", p99 %" PRIu64 "\n", "lookup-to-HIT steps", p50, p99);
    printf("  %-34s p50 %.2f ms, p99 %.2f ms (steps p50 %" PRIu64 ", p99 %" PRIu64 ")\n",
           "  of hits found after steps", ms50, ms99, lp50, lp99);
    printf("    %-32s p50 %.2f ms, p99 %.2f ms; then to HIT p50 %.2f ms, p99 %.2f ms\n",
           "first lookup to HIT_PENDING", percentile_ms(t->to_pending_us, 0.50),
           percentile_ms(t->to_pending_us, 0.99), percentile_ms(t->pending_to_hit_us, 0.50),
           percentile_ms(t->pending_to_hit_us, 0.99));
    printf("  %-34s\n", "pull phases (node timings, ms)");
    for (size_t i = 0; i < sizeof(pull_phases) / sizeof(pull_phases[0]); i++) {
        struct hist_sum h = stat_hist(L, pull_phases[i].metric);

        if (h.count == 0)
            continue;
        printf("    %-32s mean %.2f, p50 <= %.2f, p99 <= %.2f (%" PRIu64 ")\n", pull_phases[i].name,
               1e3 * h.sum / (double)h.count, 1e3 * h.p50, 1e3 * h.p99, h.count);
    }
    printf("  %-34s %" PRIu64 " stored, %" PRIu64 " removed; %" PRIu64
           " loads lost to eviction races\n",
           "events", ev_st, ev_rm, t->load_races);
    printf("  %-34s %" PRIu64 " (verify failures %" PRIu64 ", API errors %" PRIu64
           ", stuck lookups %" PRIu64 ")\n",
           "ERRORS", total_errors(t), t->verify_failures, t->api_errors, t->stuck);
}

/* ---- main ---------------------------------------------------------------------------------- */

static void usage(FILE *f)
{
    fprintf(
        f,
        "usage: kvtier-load --node SOCKET [--node SOCKET]... [options]\n\n"
        "  --node SOCKET          a kvtierd engine socket (repeat for several nodes; up to %d)\n"
        "  --engines-per-node K   engine threads per node, each its own client (default 2)\n"
        "  --duration S           seconds of load (default 30)\n"
        "  --prompts N            distinct system prompts (default 8)\n"
        "  --conversations N      conversations (default 64)\n"
        "  --blocks-per-prompt B  longest prompt, in blocks (chunks) (default 16)\n"
        "  --system-blocks S      blocks of a system prompt (default 4)\n"
        "  --new-blocks N         new blocks per turn (default 2)\n"
        "  --zipf S               Zipf exponent of prompt and conversation popularity\n"
        "                         (default 1.0; 0 = uniform)\n"
        "  --batch R              requests in flight per engine (default 4)\n"
        "  --rate R               requests started per second per engine (default 0:\n"
        "                         as fast as the node answers)\n"
        "  --step-us US           an engine step lasts at least US microseconds, as a\n"
        "                         model's forward pass would (default 0: steps follow\n"
        "                         each other as fast as the node answers)\n"
        "  --seed N               workload seed; same seed = same keys (default 1)\n"
        "  --json                 the final report as JSON on stdout\n"
        "  --quiet                no progress output\n"
        "  -h, --help             this text\n"
        "  -V, --version          the version and git revision of this build\n\n"
        "exit status: 0 no errors, 1 errors (verify failures, API errors) or no node,\n"
        "2 bad command line\n",
        MAX_NODES);
}

static int bad_usage(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int bad_usage(const char *fmt, ...)
{
    va_list ap;

    fprintf(stderr, "kvtier-load: ");
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\n(kvtier-load --help for usage)\n");
    return EX_USAGE;
}

enum {
    O_NODE = 256,
    O_EPN,
    O_DURATION,
    O_PROMPTS,
    O_CONVS,
    O_BPP,
    O_SYS,
    O_NEW,
    O_ZIPF,
    O_BATCH,
    O_RATE,
    O_STEP,
    O_SEED,
    O_JSON,
    O_QUIET
};

static int parse_args(int argc, char **argv, struct opts *o)
{
    static const struct option lo[] = {
        {"node", required_argument, NULL, O_NODE},
        {"engines-per-node", required_argument, NULL, O_EPN},
        {"duration", required_argument, NULL, O_DURATION},
        {"prompts", required_argument, NULL, O_PROMPTS},
        {"conversations", required_argument, NULL, O_CONVS},
        {"blocks-per-prompt", required_argument, NULL, O_BPP},
        {"system-blocks", required_argument, NULL, O_SYS},
        {"new-blocks", required_argument, NULL, O_NEW},
        {"zipf", required_argument, NULL, O_ZIPF},
        {"batch", required_argument, NULL, O_BATCH},
        {"rate", required_argument, NULL, O_RATE},
        {"step-us", required_argument, NULL, O_STEP},
        {"seed", required_argument, NULL, O_SEED},
        {"json", no_argument, NULL, O_JSON},
        {"quiet", no_argument, NULL, O_QUIET},
        {"help", no_argument, NULL, 'h'},
        {"version", no_argument, NULL, 'V'},
        {NULL, 0, NULL, 0},
    };
    int opt;
    uint64_t v;

    *o = (struct opts){.engines_per_node = 2,
                       .duration_s = 30,
                       .prompts = 8,
                       .conversations = 64,
                       .blocks_per_prompt = 16,
                       .system_blocks = 4,
                       .new_blocks = 2,
                       .batch = 4,
                       .zipf = 1.0,
                       .seed = 1};
    opterr = 0;
    while ((opt = getopt_long(argc, argv, ":hV", lo, NULL)) != -1) {
        switch (opt) {
        case 'h':
            usage(stdout);
            return 1;
        case 'V':
            printf("kvtier-load %s\n", kvt_version_string());
            return 1;
        case '?':
            return bad_usage("unknown option '%s'", argv[optind - 1]);
        case ':':
            return bad_usage("option '%s' needs a value", argv[optind - 1]);
        case O_NODE:
            if (o->n_nodes == MAX_NODES)
                return bad_usage("--node: at most %d nodes", MAX_NODES);
            if (*optarg == '\0' || strlen(optarg) > 107)
                return bad_usage("--node: a unix socket path of 1 to 107 bytes");
            o->nodes[o->n_nodes++] = optarg;
            break;
#define U32_OPT(code, field, lo_, hi_, what)                                                       \
    case code:                                                                                     \
        if (kvt_tool_parse_u64(optarg, lo_, hi_, &v) < 0)                                          \
            return bad_usage("%s: '%s' is not an integer in %llu..%llu", what, optarg,             \
                             (unsigned long long)(lo_), (unsigned long long)(hi_));                \
        o->field = (unsigned)v;                                                                    \
        break;
            U32_OPT(O_EPN, engines_per_node, 1, 256, "--engines-per-node")
            U32_OPT(O_PROMPTS, prompts, 1, 1000000, "--prompts")
            U32_OPT(O_CONVS, conversations, 1, 10000000, "--conversations")
            U32_OPT(O_BPP, blocks_per_prompt, 1, 65536, "--blocks-per-prompt")
            U32_OPT(O_SYS, system_blocks, 0, 65536, "--system-blocks")
            U32_OPT(O_NEW, new_blocks, 1, 65536, "--new-blocks")
            U32_OPT(O_BATCH, batch, 1, 1024, "--batch")
            U32_OPT(O_STEP, step_us, 0, 10000000, "--step-us")
#undef U32_OPT
        case O_DURATION:
            if (kvt_tool_parse_double(optarg, 0.1, 86400, &o->duration_s) < 0)
                return bad_usage("--duration: '%s' is not 0.1..86400 seconds", optarg);
            break;
        case O_ZIPF:
            if (kvt_tool_parse_double(optarg, 0, 10, &o->zipf) < 0)
                return bad_usage("--zipf: '%s' is not an exponent in 0..10", optarg);
            break;
        case O_RATE:
            if (kvt_tool_parse_double(optarg, 0, 1e7, &o->rate) < 0)
                return bad_usage("--rate: '%s' is not 0..1e7 requests per second", optarg);
            break;
        case O_SEED:
            if (kvt_tool_parse_u64(optarg, 0, UINT64_MAX, &o->seed) < 0)
                return bad_usage("--seed: '%s' is not an unsigned integer", optarg);
            break;
        case O_JSON:
            o->json = true;
            break;
        case O_QUIET:
            o->quiet = true;
            break;
        }
    }
    if (optind < argc)
        return bad_usage("unexpected argument '%s'", argv[optind]);
    if (o->n_nodes == 0)
        return bad_usage("give at least one --node SOCKET");
    if ((uint64_t)o->system_blocks + o->new_blocks > o->blocks_per_prompt)
        return bad_usage("--system-blocks (%u) + --new-blocks (%u) exceed --blocks-per-prompt (%u)",
                         o->system_blocks, o->new_blocks, o->blocks_per_prompt);
    return 0;
}

int main(int argc, char **argv)
{
    struct load L = {0};
    struct counters t;
    struct kvt_progress pg;
    struct sigaction sa = {.sa_handler = on_sigint};
    size_t started = 0, joined = 0;
    double elapsed;
    int rc, ret = 0;

    rc = parse_args(argc, argv, &L.o);
    if (rc != 0)
        return rc == 1 ? 0 : rc;
    pthread_mutex_init(&L.err_lock, NULL);
    L.tty_err = isatty(STDERR_FILENO);
    if (load_setup(&L) < 0) {
        fprintf(stderr, "kvtier-load: out of memory\n");
        return EX_FAIL;
    }
    for (size_t k = 0; k < L.o.n_nodes; k++) {
        struct kvtier_connect_opts co = {.name = "kvtier-load-monitor", .timeout_ms = 30000};

        rc = kvtier_connect(L.o.nodes[k], &co, &L.mon[k].c);
        if (rc < 0) {
            fprintf(stderr, "kvtier-load: cannot connect to %s: %s\n", L.o.nodes[k],
                    kvt_tool_strerror(rc));
            ret = EX_FAIL;
            goto out;
        }
        if (k == 0)
            L.row_bytes = kvtier_client_region(L.mon[k].c)->row_bytes;
        /* Drain what accumulated before this run: the report counts this run only. */
        struct node_mon drain = {.c = L.mon[k].c};

        mon_poll(&drain);
        free(drain.acc);
    }
    L.n_eng = L.o.n_nodes * L.o.engines_per_node;
    L.eng = calloc(L.n_eng, sizeof(*L.eng));
    if (L.eng == NULL) {
        ret = EX_FAIL;
        goto out;
    }
    for (size_t i = 0; i < L.n_eng; i++) {
        rc = engine_init(&L, &L.eng[i], (unsigned)(i / L.o.engines_per_node),
                         (unsigned)(i % L.o.engines_per_node));
        if (rc < 0) {
            if (rc == -ENOMEM)
                fprintf(stderr, "kvtier-load: out of memory\n");
            ret = EX_FAIL;
            goto out;
        }
    }
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    L.start_s = kvt_tool_now_s();
    L.deadline_s = L.start_s + L.o.duration_s;
    for (; started < L.n_eng; started++)
        if (pthread_create(&L.eng[started].thread, NULL, engine_main, &L.eng[started]) != 0) {
            fprintf(stderr, "kvtier-load: cannot start engine threads\n");
            atomic_store(&L.stop, true);
            ret = EX_FAIL;
            break;
        }
    kvt_progress_init(&pg, stderr, 5.0);
    for (;;) {
        double now = kvt_tool_now_s();
        uint64_t resolved;

        if (interrupted && now < L.deadline_s)
            L.deadline_s = now; /* engines finish their requests and stop */
        if (now >= L.deadline_s + STUCK_S + 10)
            atomic_store(&L.stop, true); /* engines that cannot finish */
        /* A node that went away shows up as its engines' API errors. */
        for (size_t k = 0; k < L.o.n_nodes; k++)
            mon_poll(&L.mon[k]);
        sum_counters(&L, &t);
        resolved = t.hits_first + t.hits_later + t.misses;
        if (!L.o.quiet && !L.o.json)
            kvt_progress_update(
                &pg, now - L.start_s, (now - L.start_s) / L.o.duration_s,
                "%5.1fs  %" PRIu64 " req  hit %.1f%%  loaded %.2f GB  %" PRIu64 " errors",
                now - L.start_s, t.requests,
                resolved ? 100.0 * (double)(t.hits_first + t.hits_later) / (double)resolved : 0.0,
                (double)t.loaded_bytes / 1e9, t.errors);
        while (joined < started && pthread_tryjoin_np(L.eng[joined].thread, NULL) == 0)
            joined++;
        if (joined == started)
            break;
        usleep(50000);
    }
    if (!L.o.quiet && !L.o.json)
        kvt_progress_done(&pg);
    elapsed = kvt_tool_now_s() - L.start_s;
    for (size_t k = 0; k < L.o.n_nodes; k++)
        mon_poll(&L.mon[k]);
    sum_final(&L, &t);
    report(&L, &t, elapsed);
    if (total_errors(&t) > 0)
        ret = EX_FAIL;
out:
    if (L.eng != NULL)
        for (size_t i = 0; i < L.n_eng; i++)
            if (L.eng[i].L != NULL)
                engine_cleanup(&L.eng[i]);
    for (size_t k = 0; k < L.o.n_nodes; k++) {
        kvtier_close(L.mon[k].c);
        free(L.mon[k].acc);
    }
    free(L.eng);
    free(L.prompt_cdf);
    free(L.conv_cdf);
    free(L.conv_prompt);
    free(L.conv_turn);
    free(L.sys_keys);
    pthread_mutex_destroy(&L.err_lock);
    return ret;
}

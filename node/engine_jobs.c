/* SPDX-License-Identifier: Apache-2.0 */
/* Attached regions and jobs of the engine API: how an engine that keeps its own
 * CPU region (vLLM's primary tier, a shared-memory file) uses kvtier as a
 * secondary tier.
 *
 * ATTACH: the engine passes the region's fd (SCM_RIGHTS) with its geometry (rows,
 * stride, size, offset). The node checks it against the fd (a regular file large
 * enough), against its own rows (stride == the primary's row bytes, so a chunk is
 * one row on both sides and the network tier's checksums cover it) and maps it
 * MAP_SHARED. The client gets a request of its own in the manager,
 * "kvtier-jobs-<client id>", that every lookup and job below runs under (no
 * engine may create a request of that prefix: engine_api.c refuses it). A request
 * records every key it sees until it finishes (its cache access, and the metrics'
 * observed lookups) and only its finish gives those keys their recency, so one
 * that lived as long as the engine would grow without bound and leave the policy
 * blind to the engine's reuse: once a request has seen JOBS_REQ_KEYS keys, the next
 * JOBS message starts another ("kvtier-jobs-<client id>.<n>") and the one before
 * finishes at the JOBS_REQ_GRACE-th message after (a lookup still pending, RETRY, counts
 * towards the new one by then, as the engine asks again every step).
 *
 * JOBS, one message per engine step: the step's lookup keys, answered at once with
 * the manager's verdicts (MISS / HIT / HIT_PENDING / RETRY: a key in a secondary
 * tier or on a peer answers RETRY, then HIT_PENDING while the node promotes it),
 * and the step's jobs:
 *   store  the node copies the job's rows from the attached region into rows of its
 *          primary (prepare_store / complete_store, so its storage and network tiers
 *          take them as any chunk); keys it holds already count as stored;
 *   load   the node fills the job's rows of the attached region from its primary;
 *          a key still being promoted (from storage) waits, in the client's
 *          pending list, until it is HIT, MISS or the wait times out; a key on a
 *          peer is READ by the network tier straight into the job's row
 *          (kvt_net_tier_fetch_into, the region registered with the transport at
 *          ATTACH): no copy through the node's primary, and the key does not enter
 *          it (a second copy would cost a primary row and the memcpy this avoids;
 *          the peer keeps its own, so a later load pulls again).
 *
 * DIRECT READS: when the node has a network tier, the jobs request's lookups leave
 * it out of the manager (its load_tier_filter names every other tier), so the
 * manager never promotes a peer's chunk for an engine's lookup; a key the manager
 * misses is asked of the network tier, whose HIT (a live holder located) is the
 * engine's HIT. A load job's keys the manager misses and the network tier locates
 * go to one fetch into per pass; each key's row is reported done only once the
 * network tier validated it (its fence word, or its checksum: network.verify),
 * else it fails - a torn or rewritten row is a failed key, never wrong bytes
 * reported loaded. Without a network tier, or when it cannot register the region,
 * or when another tier has the network tier's medium and locality (the filter
 * could not tell them apart), peer keys take the old path through the primary.
 * A row is reported done only after it was validated (rows read from a peer: as
 * above): a stored row compares equal
 * in the engine's region and in the primary (then its checksum is kept); a loaded row hashes to the
 * checksum the primary holds for the chunk (set when it was stored, or by the network tier when it
 * verified a peer's bytes), or when none is held, to the primary row's hash after the copy. The
 * reply carries the jobs finished since the last JOBS, each with one byte per key (1 done), so the
 * engine polls with an empty JOBS.
 *
 * Threads: the daemon's loop thread only (the manager's), like engine_api.c. The
 * copies run on it: a job's rows are copied within one call, and the engine's
 * region is not touched after the client is gone.
 *
 * A region that shrinks: the file is the engine's, and it may truncate it under
 * the node's mapping whenever it likes (or its filesystem may fail a page); a copy
 * from or to a page past its end then raises SIGBUS, which would end the daemon.
 * The node's SIGBUS handler (installed at ATTACH, chaining to the one before it)
 * looks up the faulting address among the regions attached and not unmapped yet
 * (a process-wide table: the access may be on any thread, and a region outlives its
 * client while a peer's READ into it is in flight): for one of them, it maps
 * anonymous pages over the whole region (as libwayland does for a client's shm
 * pool) and marks it lost, so the access completes, and from then on every row of
 * that client's jobs fails - a miss, never wrong bytes reported done. A SIGBUS
 * anywhere else goes on to the handler before (by default, the process ends as it
 * would have). */
#include <errno.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine_jobs_int.h"
#include "kvt/alloc.h"
#include "kvt/clock.h"
#include "kvt/common.h"
#include "kvt/hash.h"
#include "kvt/log.h"
#include "kvt/list.h"
#include "kvt/manager.h"
#include "kvt/net_tier.h"
#include "kvt/primary.h"

#define MOD "engine_jobs"
/* How long a load waits for a chunk the node is promoting. */
#define EJOB_WAIT_NS (10ull * 1000000000ull)
/* Keys of load jobs one client may have waiting. */
#define EJOB_MAX_WAITING (1u << 20)
/* Keys a jobs request is given (looked up, stored, loaded) before the next JOBS
 * message starts another, and at which message after that the one before ends. */
#define JOBS_REQ_KEYS  4096
#define JOBS_REQ_GRACE 2

/* KEY_REMOTE: in a fetch into; still counted waiting until its callback. */
enum { KEY_WAITING = 0, KEY_OK = 1, KEY_FAILED = 2, KEY_REMOTE = 3 };

/* One job, from submission to its report. */
struct ejob {
    uint64_t id;
    int kind; /* KVT_EJ_STORE / KVT_EJ_LOAD */
    uint32_t n;
    uint32_t n_waiting;
    struct kvt_key *keys;
    int64_t *rows;
    uint8_t *state; /* KEY_* per key */
    uint64_t deadline_ns;
    struct ejob *next;
};

/* One fetch into of a job's keys, until its callback (or the client's end). */
struct ejob_into {
    struct kvt_list link; /* kvt_ejobs.into */
    struct kvt_ejobs *j;
    struct ejob *e;
    uint32_t n;
    uint32_t idx[]; /* the keys' places in e */
};

/* Loop thread only. */
struct kvt_ejobs {
    struct kvt_manager *m;
    struct kvt_primary *primary;
    uint8_t *pbase; /* the node's primary rows */
    size_t prow;    /* and their bytes */
    uint8_t *map;   /* the engine's region as mapped (map_len bytes) */
    size_t map_len;
    size_t rows; /* its rows, each stride (== prow) bytes */
    struct kvt_req_ctx *ctx;
    struct ejob *waiting, **waiting_tail; /* loads with keys still waiting */
    struct ejob *done, **done_tail;       /* finished, not reported yet */
    uint32_t n_waiting_keys;
    uint32_t keys_per_pass; /* kvt__ejobs_progress's bound */
    struct kvt_store_output out;
    struct kvt_engine_server_counters *ctr;
    struct kvt_tier *net;        /* the network tier when reads go direct, else NULL */
    struct kvt_net_region *nreg; /* the region, registered with it */
    struct kvt_list into;        /* ejob_into in flight */
    uint64_t client_id;
    struct kvt_req_ctx *prev_ctx; /* the request before j->ctx, finishing, or NULL */
    unsigned prev_steps;          /* JOBS messages since prev_ctx was replaced */
    uint64_t ctx_keys;            /* keys j->ctx has been given */
    uint64_t req_seq;             /* requests after the first */
    struct region_guard *guard;   /* the region's entry in the SIGBUS handler's table */
    bool lost_logged;
};

/* The attached regions still mapped, for the SIGBUS handler, which may run on any
 * thread: an entry is published by storing its base last (release) and retired by
 * clearing the base before the region is unmapped, so the handler (acquire) never
 * reads a half-made entry. Entries are taken and retired on the loop thread; a
 * region is retired only once nothing accesses it (its client gone, no READ into
 * it in flight), so no handler is at work on it then. */
#define GUARDS_MAX 1024
static struct region_guard {
    _Atomic uintptr_t base;
    size_t len;
    volatile sig_atomic_t lost; /* faulted: anonymous pages now */
} guards[GUARDS_MAX];
/* The SIGBUS handler before the node's. */
static struct sigaction sigbus_next;

static void ejob_free(struct ejob *e)
{
    kvt_free(e->keys);
    kvt_free(e->rows);
    kvt_free(e->state);
    kvt_free(e);
}

static uint8_t *arow(const struct kvt_ejobs *j, int64_t row)
{
    return j->map + (size_t)row * j->prow;
}

/* ---- attach ----------------------------------------------------------------------- */

static void on_sigbus(int sig, siginfo_t *si, void *uc)
{
    const uint8_t *a = si->si_addr;
    struct sigaction dfl = {.sa_handler = SIG_DFL};

    for (size_t i = 0; si->si_code > 0 && i < GUARDS_MAX; i++) {
        uint8_t *base = (uint8_t *)atomic_load_explicit(&guards[i].base, memory_order_acquire);

        if (base == NULL || a < base || a >= base + guards[i].len)
            continue;
        if (mmap(base, guards[i].len, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_FIXED | MAP_ANONYMOUS, -1, 0) == MAP_FAILED)
            break;
        guards[i].lost = 1;
        return; /* the access is made again, on the anonymous pages */
    }
    if (sigbus_next.sa_flags & SA_SIGINFO) {
        sigbus_next.sa_sigaction(sig, si, uc);
    } else if (sigbus_next.sa_handler != SIG_DFL && sigbus_next.sa_handler != SIG_IGN) {
        sigbus_next.sa_handler(sig);
    } else {
        sigaction(SIGBUS, &dfl, NULL);
        raise(SIGBUS); /* delivered on return: the process ends by it */
    }
}

/* Installs on_sigbus unless it is the handler already (another may have replaced it). */
static void sigbus_install(void)
{
    struct sigaction sa = {.sa_sigaction = on_sigbus, .sa_flags = SA_SIGINFO | SA_RESTART}, cur;

    if (sigaction(SIGBUS, NULL, &cur) == 0 && (cur.sa_flags & SA_SIGINFO) &&
        cur.sa_sigaction == on_sigbus)
        return;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGBUS, &sa, &sigbus_next) != 0)
        kvt_warn(MOD, "cannot install a SIGBUS handler: %s", strerror(errno));
}

/* An entry for a region just mapped, or NULL when the table is full. */
static struct region_guard *guard_take(void *base, size_t len)
{
    for (size_t i = 0; i < GUARDS_MAX; i++) {
        if (atomic_load_explicit(&guards[i].base, memory_order_relaxed) != 0)
            continue;
        guards[i].len = len;
        guards[i].lost = 0;
        atomic_store_explicit(&guards[i].base, (uintptr_t)base, memory_order_release);
        return &guards[i];
    }
    return NULL;
}

/* Every row of a lost region fails; said once in the log. */
static bool region_lost(struct kvt_ejobs *j)
{
    if (j->guard->lost && !j->lost_logged) {
        j->lost_logged = true;
        kvt_warn(MOD,
                 "client %llu: its region faulted (its file shrank under the mapping?); its "
                 "jobs fail from now on",
                 (unsigned long long)j->client_id);
    }
    return j->guard->lost != 0;
}

/* Retires the region's entry (if it has one), then unmaps it. */
static void region_unmap(void *base, size_t len)
{
    for (size_t i = 0; i < GUARDS_MAX; i++)
        if (atomic_load_explicit(&guards[i].base, memory_order_relaxed) == (uintptr_t)base)
            atomic_store_explicit(&guards[i].base, 0, memory_order_release);
    munmap(base, len);
}

/* Direct reads (see above): the network tier, the jobs request's filter without
 * it, the region registered. Left off (the old path) when any of it cannot be. */
static void direct_setup(struct kvt_ejobs *j, uint64_t client_id, size_t size)
{
    struct kvt_tier_filter f = {.all = false, .n = 0};
    struct kvt_tier *net = NULL;
    size_t n = kvt_manager_num_tiers(j->m);
    int rc;

    for (size_t i = 0; i < n; i++) {
        if (kvt_net_tier_is(kvt_manager_tier(j->m, i)))
            net = kvt_manager_tier(j->m, i);
    }
    if (net == NULL)
        return;
    for (size_t i = 0; i < n; i++) {
        struct kvt_tier *t = kvt_manager_tier(j->m, i);

        if (t == net)
            continue;
        if ((t->medium == net->medium && t->locality == net->locality) ||
            f.n == KVT_FILTER_MAX_MATCHERS) {
            kvt_info(MOD,
                     "client %llu: tier %s cannot be told from the network tier; peer "
                     "rows go through the primary",
                     (unsigned long long)client_id, t->type);
            return;
        }
        f.m[f.n++] = (struct kvt_tier_matcher){.medium = t->medium, .locality = t->locality};
    }
    rc = kvt_net_tier_region_add(net, j->map, size, &j->nreg);
    if (rc < 0) {
        kvt_warn(MOD,
                 "client %llu: its region cannot be registered (%s); peer rows go through "
                 "the primary",
                 (unsigned long long)client_id, strerror(-rc));
        j->nreg = NULL;
        return;
    }
    j->net = net;
    j->ctx->load_tier_filter = f;
}

int kvt__ejobs_attach(struct kvt_ejobs **jobs_p, struct kvt_manager *m, uint64_t client_id, int fd,
                      const struct kvt_emsg *q, struct kvt_emsg *r,
                      struct kvt_engine_server_counters *ctr, uint32_t keys_per_pass)
{
    struct kvt_primary *primary = kvt_manager_primary(m);
    enum kvt_offload_policy policy;
    struct kvt_ejobs *j = NULL;
    char req_id[64];
    struct stat st;
    uint64_t rows, stride, size, off;
    long page = sysconf(_SC_PAGESIZE);
    int rc;

    if (*jobs_p != NULL) {
        rc = -EBUSY;
        goto refuse;
    }
    if (fd < 0) {
        rc = -EBADF;
        goto refuse;
    }
    rc = -EINVAL;
    if (!kvt__emsg_has(q, KVT_EF_GEOM) || q->n_geom < KVT_EA_COUNT)
        goto refuse;
    rows = q->geom[KVT_EA_ROWS];
    stride = q->geom[KVT_EA_STRIDE];
    size = q->geom[KVT_EA_SIZE];
    off = q->geom[KVT_EA_OFFSET];
    if (rows == 0 || rows > UINT32_MAX || stride == 0 || stride != kvt_primary_row_bytes(primary) ||
        size / rows != stride || size % rows != 0 || off % (uint64_t)page != 0 ||
        off > UINT64_MAX - size || kvt_primary_base(primary) == NULL) {
        kvt_warn(MOD,
                 "client %llu: region of %llu rows x %llu bytes (size %llu at %llu) refused: "
                 "the node's rows are %zu bytes",
                 (unsigned long long)client_id, (unsigned long long)rows,
                 (unsigned long long)stride, (unsigned long long)size, (unsigned long long)off,
                 kvt_primary_row_bytes(primary));
        goto refuse;
    }
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || (uint64_t)st.st_size < off + size) {
        kvt_warn(MOD, "client %llu: the region's fd is not a regular file of %llu bytes or more",
                 (unsigned long long)client_id, (unsigned long long)(off + size));
        goto refuse;
    }
    j = kvt_calloc(1, sizeof(*j));
    if (j == NULL) {
        rc = -ENOMEM;
        goto refuse;
    }
    j->map = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, (off_t)off);
    if (j->map == MAP_FAILED) {
        rc = -errno;
        kvt_warn(MOD, "client %llu: mmap of its region: %s", (unsigned long long)client_id,
                 strerror(-rc));
        goto err_free;
    }
    j->map_len = size;
    /* Guarded before anything touches it; the handler, before any job runs. */
    sigbus_install();
    j->guard = guard_take(j->map, size);
    if (j->guard == NULL) {
        rc = -EBUSY;
        kvt_warn(MOD, "client %llu: %d regions attached already", (unsigned long long)client_id,
                 GUARDS_MAX);
        munmap(j->map, size);
        goto err_free;
    }
    j->rows = rows;
    j->m = m;
    j->primary = primary;
    j->pbase = kvt_primary_base(primary);
    j->prow = kvt_primary_row_bytes(primary);
    j->waiting_tail = &j->waiting;
    j->done_tail = &j->done;
    j->ctr = ctr;
    j->keys_per_pass = keys_per_pass;
    j->client_id = client_id;
    kvt_store_output_init(&j->out);
    snprintf(req_id, sizeof(req_id), KVT_EJOBS_REQ_PREFIX "%llu", (unsigned long long)client_id);
    rc = kvt_req_ctx_create(req_id, NULL, &j->ctx);
    if (rc < 0)
        goto err_unmap;
    kvt_list_init(&j->into);
    direct_setup(j, client_id, size);
    rc = kvt_manager_on_new_request(m, j->ctx, &policy);
    if (rc < 0)
        goto err_ctx;
    close(fd);
    r->geom[KVT_EG_CLIENT_ID] = client_id;
    r->geom[KVT_EG_NUM_CHUNKS] = kvt_primary_num_chunks(primary);
    r->geom[KVT_EG_ROW_BYTES] = j->prow;
    r->n_geom = KVT_EG_ROW_BYTES + 1;
    r->has |= 1u << KVT_EF_GEOM;
    ctr->attached++;
    kvt_info(MOD, "client %llu attached a region of %zu rows", (unsigned long long)client_id,
             j->rows);
    *jobs_p = j;
    return 0;

err_ctx:
    kvt_req_ctx_unref(j->ctx);
    if (j->nreg != NULL) {
        kvt_net_tier_region_remove(j->net, j->nreg, region_unmap);
        j->map = NULL; /* unmapped by the network tier's callback */
    }
err_unmap:
    kvt_store_output_cleanup(&j->out);
    if (j->map != NULL)
        region_unmap(j->map, j->map_len);
err_free:
    kvt_free(j);
refuse:
    if (fd >= 0)
        close(fd);
    ctr->attach_refused++;
    return rc;
}

void kvt__ejobs_destroy(struct kvt_ejobs *j)
{
    struct ejob *e, *next;

    if (j == NULL)
        return;
    /* First: no callback fires after this, and the network tier unmaps the region
     * once no READ of it is in flight. */
    if (j->nreg != NULL)
        kvt_net_tier_region_remove(j->net, j->nreg, region_unmap);
    while (!kvt_list_empty(&j->into)) {
        struct kvt_list *l = j->into.next;

        kvt_list_del(l);
        kvt_free(kvt_list_entry(l, struct ejob_into, link));
    }
    for (e = j->waiting; e != NULL; e = next) {
        next = e->next;
        ejob_free(e);
    }
    for (e = j->done; e != NULL; e = next) {
        next = e->next;
        ejob_free(e);
    }
    if (j->prev_ctx != NULL) {
        kvt_manager_on_request_finished(j->m, j->prev_ctx);
        kvt_req_ctx_unref(j->prev_ctx);
    }
    kvt_manager_on_request_finished(j->m, j->ctx);
    kvt_req_ctx_unref(j->ctx);
    kvt_store_output_cleanup(&j->out);
    if (j->nreg == NULL)
        region_unmap(j->map, j->map_len);
    kvt_free(j);
}

/* ---- jobs ----------------------------------------------------------------------------- */

static void finish(struct kvt_ejobs *j, struct ejob *e)
{
    for (uint32_t i = 0; i < e->n; i++) {
        if (e->state[i] == KEY_OK) {
            if (e->kind == KVT_EJ_STORE)
                j->ctr->job_rows_stored++;
            else
                j->ctr->job_rows_loaded++;
        } else {
            j->ctr->job_rows_failed++;
        }
    }
    e->next = NULL;
    *j->done_tail = e;
    j->done_tail = &e->next;
}

/* The place of key in e, looked for from from on, then before it; e->n if absent.
 * prepare_store plans a job's absent keys in the job's order, each once, so a
 * cursor past the last one found finds each in one step: a job's keys are matched
 * in one pass, not one pass per key. */
static uint32_t job_key_at(const struct ejob *e, const struct kvt_key *key, uint32_t from)
{
    for (uint32_t i = from; i < e->n; i++)
        if (kvt_key_eq(&e->keys[i], key))
            return i;
    for (uint32_t i = 0; i < from && i < e->n; i++)
        if (kvt_key_eq(&e->keys[i], key))
            return i;
    return e->n;
}

/* A store job, start to end. */
static void run_store(struct kvt_ejobs *j, struct ejob *e)
{
    struct kvt_store_output *out = &j->out;
    struct kvt_key *bad = NULL;
    size_t n_bad = 0;
    int rc;

    if (e->n == 0)
        return;
    if (region_lost(j)) {
        memset(e->state, KEY_FAILED, e->n);
        return;
    }
    rc = kvt_manager_prepare_store(j->m, e->keys, e->n, j->ctx, out);
    if (rc < 0) {
        memset(e->state, KEY_FAILED, e->n); /* -ENOSPC: nothing changed */
        return;
    }
    memset(e->state, KEY_OK, e->n); /* the keys the node holds already */
    if (out->n_store == 0)
        return;
    bad = kvt_calloc(out->n_store, sizeof(*bad));
    for (uint32_t s = 0, i = 0; s < out->n_store; s++) {
        uint8_t *dst = j->pbase + (size_t)out->chunk_ids[s] * j->prow;

        i = job_key_at(e, &out->keys_to_store[s], i);
        if (i == e->n || bad == NULL) { /* (not planned from this job; no memory) */
            if (bad != NULL)
                bad[n_bad++] = out->keys_to_store[s];
            continue;
        }
        memcpy(dst, arow(j, e->rows[i]), j->prow);
        if (memcmp(dst, arow(j, e->rows[i]), j->prow) != 0 || j->guard->lost) {
            /* The engine wrote its row during the copy, or its region faulted: not a
             * chunk to keep. */
            bad[n_bad++] = out->keys_to_store[s];
            for (uint32_t k = 0; k < e->n; k++)
                if (kvt_key_eq(&e->keys[k], &out->keys_to_store[s]))
                    e->state[k] = KEY_FAILED;
        } else {
            /* The row's checksum now, while the row is in cache (complete_store then
             * keeps it): after the job's last copy it is a pass over memory. Two
             * such passes (complete_store's and one more here) took half of a
             * 1024-row job's time. */
            kvt_primary_set_checksum(j->primary, &out->keys_to_store[s], kvt_hash64(dst, j->prow));
        }
        i++;
    }
    if (bad == NULL) {
        kvt_manager_complete_store(j->m, out->keys_to_store, out->n_store, j->ctx, false);
        memset(e->state, KEY_FAILED, e->n);
        return;
    }
    if (n_bad > 0) {
        /* Out of the plan first, so the one complete_store below names only good
         * keys and still balances the one prepare_store. */
        kvt_primary_complete_store(j->primary, bad, n_bad, false);
        size_t w = 0;
        for (size_t s = 0; s < out->n_store; s++) {
            bool is_bad = false;

            for (size_t b = 0; b < n_bad && !is_bad; b++)
                is_bad = kvt_key_eq(&bad[b], &out->keys_to_store[s]);
            if (!is_bad)
                out->keys_to_store[w++] = out->keys_to_store[s];
        }
        out->n_store = w;
    }
    kvt_manager_complete_store(j->m, out->keys_to_store, out->n_store, j->ctx, true);
    kvt_free(bad);
}

/* One waiting key of a load that the manager answers HIT: copy and validate. */
static uint8_t load_one(struct kvt_ejobs *j, const struct kvt_key *key, int64_t row)
{
    struct kvt_primary_entry_info info;
    int64_t slot;
    uint8_t *src, *dst = arow(j, row);
    uint64_t h;
    bool ok;

    if (region_lost(j) || kvt_manager_prepare_load(j->m, key, 1, j->ctx, &slot) != 0)
        return KEY_FAILED;
    src = j->pbase + (size_t)slot * j->prow;
    memcpy(dst, src, j->prow);
    h = kvt_hash64(dst, j->prow);
    if (kvt_primary_entry_info(j->primary, key, &info) == 0 && info.has_checksum)
        ok = h == info.checksum;
    else
        ok = h == kvt_hash64(src, j->prow);
    ok = ok && !j->guard->lost; /* (the copy went to anonymous pages) */
    kvt_manager_complete_load(j->m, key, 1, j->ctx);
    if (!ok)
        kvt_warn(MOD, "a loaded row did not validate; reported failed");
    return ok ? KEY_OK : KEY_FAILED;
}

/* The network tier read (or failed) a fetch into's keys. */
static void into_done(void *arg, const bool *ok, size_t n)
{
    struct ejob_into *in = arg;
    struct kvt_ejobs *j = in->j;
    struct ejob *e = in->e;

    for (size_t k = 0; k < n && k < in->n; k++) {
        uint32_t i = in->idx[k];

        e->state[i] = ok[k] && !j->guard->lost ? KEY_OK : KEY_FAILED;
        if (e->state[i] == KEY_OK)
            j->ctr->job_rows_read_direct++;
        e->n_waiting--;
        j->n_waiting_keys--;
    }
    kvt_list_del(&in->link);
    kvt_free(in);
}

/* The keys idx[0..n) of e, located on peers: one fetch into their rows. */
static void fetch_into(struct kvt_ejobs *j, struct ejob *e, const uint32_t *idx, uint32_t n)
{
    /* (zeroed: the failure path below looks at in->link) */
    struct ejob_into *in = kvt_calloc(1, sizeof(*in) + n * sizeof(uint32_t));
    struct kvt_key *keys = kvt_calloc(n, sizeof(*keys));
    uint64_t *offs = kvt_calloc(n, sizeof(*offs));
    int rc = -ENOMEM;

    if (region_lost(j)) {
        rc = -EIO;
    } else if (in != NULL && keys != NULL && offs != NULL) {
        *in = (struct ejob_into){.j = j, .e = e, .n = n};
        for (uint32_t k = 0; k < n; k++) {
            in->idx[k] = idx[k];
            keys[k] = e->keys[idx[k]];
            offs[k] = (uint64_t)e->rows[idx[k]] * j->prow;
            e->state[idx[k]] = KEY_REMOTE;
        }
        kvt_list_add_tail(&j->into, &in->link);
        rc = kvt_net_tier_fetch_into(j->net, j->nreg, keys, offs, n, into_done, in);
    }
    kvt_free(keys);
    kvt_free(offs);
    if (rc == -EINPROGRESS)
        return;
    kvt_warn(MOD, "a fetch into the engine's region of %u keys failed to start: %s", n,
             strerror(-rc));
    for (uint32_t k = 0; k < n; k++) {
        e->state[idx[k]] = KEY_FAILED;
        e->n_waiting--;
        j->n_waiting_keys--;
    }
    if (in != NULL && in->link.next != NULL)
        kvt_list_del(&in->link);
    kvt_free(in);
}

/* Advances one load job; true when it is finished. Keys the manager misses go to
 * the network tier when reads are direct: located ones are fetched into their rows
 * (all of this pass at once), the others wait for its lookup or fail. *looked: the
 * keys looked up. */
static bool advance_load(struct kvt_ejobs *j, struct ejob *e, uint64_t now, uint32_t *looked)
{
    size_t cap = e->n_waiting ? e->n_waiting : 1;
    struct kvt_key *keys = kvt_calloc(cap, sizeof(*keys));
    enum kvt_lookup_result *res = kvt_calloc(cap, sizeof(*res));
    uint32_t *idx = kvt_calloc(cap, sizeof(*idx));
    uint32_t *remote = kvt_calloc(cap, sizeof(*remote));
    uint32_t n = 0, n_remote = 0;
    bool expired = now >= e->deadline_ns;

    *looked = 0;
    if (keys == NULL || res == NULL || idx == NULL || remote == NULL)
        goto out; /* try again on the next pass */
    for (uint32_t i = 0; i < e->n; i++) {
        if (e->state[i] == KEY_WAITING) {
            idx[n] = i;
            keys[n++] = e->keys[i];
        }
    }
    kvt_manager_lookup_many(j->m, keys, n, j->ctx, false, res);
    *looked = n;
    for (uint32_t k = 0; k < n; k++) {
        uint32_t i = idx[k];
        enum kvt_lookup_result r = res[k];

        if (r == KVT_MISS && j->net != NULL)
            r = kvt_tier_lookup(j->net, &e->keys[i], j->ctx);
        if (res[k] == KVT_MISS && r == KVT_HIT) {
            remote[n_remote++] = i; /* on a peer: read straight into its row */
            continue;
        }
        if (r == KVT_HIT)
            e->state[i] = load_one(j, &e->keys[i], e->rows[i]);
        else if (r == KVT_MISS || expired)
            e->state[i] = KEY_FAILED;
        if (e->state[i] != KEY_WAITING) {
            e->n_waiting--;
            j->n_waiting_keys--;
        }
    }
    if (n_remote > 0)
        fetch_into(j, e, remote, n_remote);
out:
    kvt_free(keys);
    kvt_free(res);
    kvt_free(idx);
    kvt_free(remote);
    return e->n_waiting == 0;
}

bool kvt__ejobs_waiting(const struct kvt_ejobs *j)
{
    return j->waiting != NULL;
}

bool kvt__ejobs_unreported(const struct kvt_ejobs *j)
{
    return j->waiting != NULL || j->done != NULL;
}

bool kvt__ejobs_progress(struct kvt_ejobs *j)
{
    struct ejob *seen = NULL, **seen_tail = &seen;
    uint64_t budget = j->keys_per_pass, now;

    if (j->waiting == NULL)
        return false;
    now = kvt_now_ns();
    /* From the head while the pass has keys left; the jobs advanced and not done go
     * to the tail, so every job has its turn (a job's deadline is checked on its). */
    while (j->waiting != NULL && budget > 0) {
        struct ejob *e = j->waiting;
        uint32_t looked;

        j->waiting = e->next;
        e->next = NULL;
        if (advance_load(j, e, now, &looked)) {
            finish(j, e);
        } else {
            *seen_tail = e;
            seen_tail = &e->next;
        }
        j->ctr->job_keys_relooked += looked;
        budget -= KVT_MIN(budget, (uint64_t)looked + 1); /* a job's scan costs too */
    }
    j->waiting_tail = &j->waiting;
    while (*j->waiting_tail != NULL)
        j->waiting_tail = &(*j->waiting_tail)->next;
    *j->waiting_tail = seen;
    if (seen != NULL)
        j->waiting_tail = seen_tail;
    return j->waiting != NULL;
}

/* Checks a whole JOBS request before anything runs. */
static int check(const struct kvt_ejobs *j, const struct kvt_emsg *q)
{
    uint64_t keys = 0, loads = 0;

    if (q->n_ids != q->n_job_keys)
        return -EINVAL;
    for (uint32_t t = 0; t < q->n_jobs; t += 3) {
        uint64_t kind = q->jobs[t + 1], n = q->jobs[t + 2];

        if (kind != KVT_EJ_STORE && kind != KVT_EJ_LOAD)
            return -EINVAL;
        if (n > q->n_job_keys - keys)
            return -EINVAL;
        if (kind == KVT_EJ_LOAD)
            loads += n;
        keys += n;
    }
    if (keys != q->n_job_keys)
        return -EINVAL;
    for (uint32_t i = 0; i < q->n_ids; i++) {
        if (q->ids[i] < 0 || (uint64_t)q->ids[i] >= j->rows)
            return -EINVAL;
    }
    if (j->n_waiting_keys + loads > EJOB_MAX_WAITING)
        return -ENOBUFS;
    return 0;
}

/* Moves finished jobs into the reply, at most max_keys keys' worth. */
static int report(struct kvt_ejobs *j, struct kvt_emsg *r, uint32_t max_keys)
{
    uint32_t n_jobs = 0, n_keys = 0;
    struct ejob *e;

    for (e = j->done; e != NULL; e = e->next) {
        if (n_jobs > 0 && n_keys + e->n > max_keys)
            break;
        n_jobs++;
        n_keys += e->n;
    }
    r->jobs = kvt_calloc(n_jobs ? (size_t)n_jobs * 3 : 1, sizeof(*r->jobs));
    r->ok = kvt_calloc(n_keys ? n_keys : 1, 1);
    if (r->jobs == NULL || r->ok == NULL)
        return -ENOMEM; /* (freed with r) the jobs stay for the next call */
    r->n_jobs = 0;
    r->n_ok = 0;
    for (uint32_t t = 0; t < n_jobs; t++) {
        bool all = true;

        e = j->done;
        j->done = e->next;
        for (uint32_t i = 0; i < e->n; i++) {
            r->ok[r->n_ok++] = e->state[i] == KEY_OK;
            all = all && e->state[i] == KEY_OK;
        }
        r->jobs[r->n_jobs++] = e->id;
        r->jobs[r->n_jobs++] = all ? KVT_EJ_OK : KVT_EJ_FAILED;
        r->jobs[r->n_jobs++] = e->n;
        ejob_free(e);
    }
    if (j->done == NULL)
        j->done_tail = &j->done;
    r->has |= 1u << KVT_EF_JOBS | 1u << KVT_EF_OK;
    return 0;
}

/* The jobs request's turn (see the top of the file), at each JOBS message. A new
 * request that cannot be made (no memory) is tried again at the next. */
static void jobs_request_turn(struct kvt_ejobs *j)
{
    enum kvt_offload_policy policy;
    struct kvt_req_ctx *next;
    char req_id[64];

    if (j->prev_ctx != NULL && ++j->prev_steps >= JOBS_REQ_GRACE) {
        kvt_manager_on_request_finished(j->m, j->prev_ctx);
        kvt_req_ctx_unref(j->prev_ctx);
        j->prev_ctx = NULL;
    }
    if (j->ctx_keys < JOBS_REQ_KEYS || j->prev_ctx != NULL)
        return;
    snprintf(req_id, sizeof(req_id), KVT_EJOBS_REQ_PREFIX "%llu.%llu",
             (unsigned long long)j->client_id, (unsigned long long)j->req_seq + 1);
    if (kvt_req_ctx_create(req_id, NULL, &next) < 0)
        return;
    next->load_tier_filter = j->ctx->load_tier_filter;
    if (kvt_manager_on_new_request(j->m, next, &policy) < 0) {
        kvt_req_ctx_unref(next);
        return;
    }
    j->req_seq++;
    j->prev_ctx = j->ctx;
    j->prev_steps = 0;
    j->ctx = next;
    j->ctx_keys = 0;
}

int kvt__ejobs_step(struct kvt_ejobs *j, const struct kvt_emsg *q, struct kvt_emsg *r,
                    uint32_t max_keys)
{
    const struct kvt_key *qkeys = (const struct kvt_key *)q->keys;
    const struct kvt_key *jkeys = (const struct kvt_key *)q->job_keys;
    uint64_t now = kvt_now_ns();
    uint32_t off = 0;
    int rc = check(j, q);

    if (rc < 0) {
        j->ctr->jobs_refused++;
        return rc;
    }
    jobs_request_turn(j);
    j->ctx_keys += q->n_keys;
    for (uint32_t t = 0; t < q->n_jobs; t += 3)
        j->ctx_keys += q->jobs[t + 2];
    if (q->n_keys > 0) {
        enum kvt_lookup_result *res = kvt_calloc(q->n_keys, sizeof(*res));

        r->results = kvt_malloc(q->n_keys);
        if (res == NULL || r->results == NULL) {
            kvt_free(res);
            return -ENOMEM;
        }
        kvt_manager_lookup_many(j->m, qkeys, q->n_keys, j->ctx, false, res);
        for (uint32_t i = 0; i < q->n_keys; i++) {
            /* Direct reads: a key on a peer is loadable as it is (HIT), not once
             * promoted. */
            if (res[i] == KVT_MISS && j->net != NULL)
                res[i] = kvt_tier_lookup(j->net, &qkeys[i], j->ctx);
            r->results[i] = (uint8_t)res[i];
        }
        r->n_results = q->n_keys;
        r->has |= 1u << KVT_EF_RESULTS;
        kvt_free(res);
    }
    for (uint32_t t = 0; t < q->n_jobs; t += 3) {
        uint32_t n = (uint32_t)q->jobs[t + 2];
        struct ejob *e = kvt_calloc(1, sizeof(*e));

        if (e != NULL) {
            e->keys = kvt_calloc(n ? n : 1, sizeof(*e->keys));
            e->rows = kvt_calloc(n ? n : 1, sizeof(*e->rows));
            e->state = kvt_calloc(n ? n : 1, 1);
        }
        if (e == NULL || e->keys == NULL || e->rows == NULL || e->state == NULL) {
            /* The jobs before this one run; this one and the rest are lost to the
             * engine, which times them out. Log it once. */
            if (e != NULL)
                ejob_free(e);
            kvt_error(MOD, "no memory for a job; the engine will time it out");
            break;
        }
        e->id = q->jobs[t];
        e->kind = (int)q->jobs[t + 1];
        e->n = n;
        memcpy(e->keys, jkeys + off, (size_t)n * sizeof(*e->keys));
        memcpy(e->rows, q->ids + off, (size_t)n * sizeof(*e->rows));
        off += n;
        j->ctr->jobs++;
        if (e->kind == KVT_EJ_STORE) {
            run_store(j, e);
            finish(j, e);
        } else {
            e->n_waiting = n;
            e->deadline_ns = now + EJOB_WAIT_NS;
            j->n_waiting_keys += n;
            *j->waiting_tail = e;
            j->waiting_tail = &e->next;
        }
    }
    kvt__ejobs_progress(j);
    return report(j, r, max_keys);
}

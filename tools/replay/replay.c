/* SPDX-License-Identifier: Apache-2.0 */
/* kvtier-replay: replays a trace of manager calls (JSON lines, docs/replay-format.md)
 * on a manager built from the command line, prints the result of every call as one
 * JSON line, then a summary. Users replay engine traces with it to size caches and
 * compare policies; the tests replay the spec's scenarios with it.
 *
 * The tool owns the request contexts (by req id) and drains the manager's events
 * after every step, so that evictions are counted even when the trace never asks
 * for events; a take_events line prints what was drained since the last one. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <jansson.h>

#include "kvt/example_tier.h"
#include "kvt/manager.h"
#include "kvt/map.h"
#include "kvt/metrics.h"
#include "kvt/pins.h"
#include "kvt/storage_tier.h"
#include "kvt/version.h"
#include "replay.h"

#define EX_USAGE   64
#define EX_DATAERR 65

struct tier_spec {
    struct kvt_example_tier_config ex;
    bool storage;
    struct kvt_storage_tier_config st;
    char type[32];
};

struct replay {
    struct kvt_manager *m;
    struct kvt_map reqs; /* req id -> struct kvt_req_ctx * */
    /* the load pins the trace holds (kvt/pins.h): complete_load releases only these,
     * as the engine API lets an engine release only its own */
    struct kvt_map pins;
    struct kvt_map named; /* kvt_pins_cover's scratch */
    struct kvt_events events;
    struct kvt_stats totals;
    struct kvt_store_output out;
    size_t n_tiers;
    char types[KVT_MAX_TIERS][32];
    /* summary */
    unsigned long lines, calls, steps, lookups, hits, stores_refused;
    unsigned long evicted, promoted_chunks, promotion_jobs, cascade_jobs;
    bool quiet;
    bool arc;       /* the primary's policy is ARC */
    FILE *results;  /* the lines' results and the summary */
    FILE *messages; /* a bad line's message */
};

static void on_tier_call(void *arg, struct kvt_tier *t, enum kvt_example_call call,
                         const struct kvt_job *job, struct kvt_req_ctx *ctx,
                         const struct kvt_key *keys, size_t n)
{
    struct replay *r = arg;

    if (call == KVT_EX_SUBMIT_LOAD) {
        r->promotion_jobs++;
        r->promoted_chunks += job->n;
    } else if (call == KVT_EX_SUBMIT_STORE) {
        r->cascade_jobs++;
    }
}

/* Parses "key=value,flag,..." options of one --tier into spec. */
static int parse_tier(const char *arg, struct tier_spec *spec, struct replay *r)
{
    char buf[512];
    char *opts, *tok, *save = NULL;

    memset(spec, 0, sizeof(*spec));
    if (snprintf(buf, sizeof(buf), "%s", arg) >= (int)sizeof(buf))
        return -EINVAL;
    opts = strchr(buf, ':');
    if (opts != NULL)
        *opts++ = '\0';
    if (strcmp(buf, "example") == 0) {
        snprintf(spec->type, sizeof(spec->type), "example");
        spec->ex.on_call = on_tier_call;
        spec->ex.cb_arg = r;
    } else if (strcmp(buf, "storage") == 0) {
        spec->storage = true;
        snprintf(spec->type, sizeof(spec->type), "storage");
    } else {
        fprintf(stderr, "kvtier-replay: --tier %s: unknown tier kind '%s'\n", arg, buf);
        return -EINVAL;
    }
    for (tok = opts ? strtok_r(opts, ",", &save) : NULL; tok; tok = strtok_r(NULL, ",", &save)) {
        char *val = strchr(tok, '=');
        char *end = NULL;

        if (val != NULL)
            *val++ = '\0';
        if (strcmp(tok, "type") == 0 && val) {
            snprintf(spec->type, sizeof(spec->type), "%s", val);
        } else if (!spec->storage && strcmp(tok, "delay") == 0 && val) {
            spec->ex.delay_polls = (unsigned)strtoul(val, &end, 10);
        } else if (!spec->storage && strcmp(tok, "fail") == 0 && val) {
            spec->ex.fail_rate = strtod(val, &end);
            if (spec->ex.fail_rate < 0 || spec->ex.fail_rate > 1)
                end = val;
        } else if (!spec->storage && strcmp(tok, "seed") == 0 && val) {
            spec->ex.seed = (unsigned)strtoul(val, &end, 10);
        } else if (!spec->storage && strcmp(tok, "retry_first") == 0 && !val) {
            spec->ex.retry_first_lookup = true;
        } else if (!spec->storage && strcmp(tok, "request_level") == 0 && !val) {
            spec->ex.request_level = true;
        } else if (!spec->storage && strcmp(tok, "medium") == 0 && val) {
            if (strcmp(val, "cpu") == 0)
                spec->ex.medium = KVT_MEDIUM_CPU;
            else if (strcmp(val, "storage") == 0)
                spec->ex.medium = KVT_MEDIUM_STORAGE;
            else
                end = val;
        } else if (strcmp(tok, "locality") == 0 && val) {
            int loc = strcmp(val, "local") == 0    ? KVT_LOCAL
                      : strcmp(val, "remote") == 0 ? KVT_REMOTE
                                                   : -2;
            if (loc == -2)
                end = val;
            spec->ex.locality = loc;
            spec->st.locality = loc;
        } else if (spec->storage && strcmp(tok, "root") == 0 && val) {
            spec->st.root = strdup(val);
        } else if (spec->storage && strcmp(tok, "capacity") == 0 && val) {
            spec->st.capacity_bytes = strtoull(val, &end, 10);
        } else {
            fprintf(stderr, "kvtier-replay: --tier %s: bad option '%s'\n", arg, tok);
            return -EINVAL;
        }
        if (end != NULL && *end != '\0') {
            fprintf(stderr, "kvtier-replay: --tier %s: bad value for '%s'\n", arg, tok);
            return -EINVAL;
        }
    }
    if (spec->storage && spec->st.root == NULL) {
        fprintf(stderr, "kvtier-replay: --tier %s: storage needs root=DIR\n", arg);
        return -EINVAL;
    }
    return 0;
}

/* ------------------------------------------------------------------ trace lines */

struct line_err {
    char msg[256];
};

__attribute__((format(printf, 2, 3))) static int fail(struct line_err *e, const char *fmt, ...)
{
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(e->msg, sizeof(e->msg), fmt, ap);
    va_end(ap);
    return -EINVAL;
}

/* kv_transfer_params["kv_load_tiers"] -> the request's tier filter. */
static void parse_load_tiers(json_t *params, struct kvt_tier_filter *f)
{
    json_t *list = json_is_object(params) ? json_object_get(params, "kv_load_tiers") : NULL;
    struct kvt_tier_filter_entry ent[64];
    size_t i, n = 0;
    json_t *v;

    if (!json_is_array(list)) {
        kvt_tier_filter_parse(f, false, NULL, 0);
        return;
    }
    json_array_foreach(list, i, v)
    {
        if (n == 64)
            break;
        json_t *m = json_object_get(v, "medium"), *l = json_object_get(v, "locality");

        ent[n].is_dict = json_is_object(v) && (m == NULL || json_is_string(m)) &&
                         (l == NULL || json_is_string(l));
        ent[n].medium = json_string_value(m);
        ent[n].locality = json_string_value(l);
        n++;
    }
    kvt_tier_filter_parse(f, true, ent, n);
}

/* A key is a hex string, or an integer i meaning make_offload_key(str(i), 0). */
static int key_from_json(json_t *j, struct kvt_key *k, struct line_err *e)
{
    if (json_is_string(j)) {
        if (kvt_key_from_hex(k, json_string_value(j)) < 0)
            return fail(e, "bad hex key \"%s\"", json_string_value(j));
        return 0;
    }
    if (json_is_integer(j)) {
        char s[32];
        int len = snprintf(s, sizeof(s), "%lld", (long long)json_integer_value(j));

        return kvt_key_make(k, s, (size_t)len, 0);
    }
    return fail(e, "a key must be a hex string or an integer");
}

static int keys_from_json(json_t *obj, struct kvt_key **keys_p, size_t *n_p, struct line_err *e)
{
    json_t *arr = json_object_get(obj, "keys");
    size_t n, i;
    json_t *v;

    if (!json_is_array(arr))
        return fail(e, "\"keys\" must be an array");
    n = json_array_size(arr);
    *keys_p = calloc(n ? n : 1, sizeof(**keys_p));
    if (*keys_p == NULL)
        return -ENOMEM;
    json_array_foreach(arr, i, v)
    {
        int rc = key_from_json(v, &(*keys_p)[i], e);

        if (rc < 0) {
            free(*keys_p);
            return rc;
        }
    }
    *n_p = n;
    return 0;
}

static json_t *keys_to_json(const struct kvt_key *keys, size_t n)
{
    json_t *arr = json_array();
    char hex[2 * KVT_KEY_MAX + 1];

    for (size_t i = 0; i < n; i++) {
        kvt_key_to_hex(&keys[i], hex);
        json_array_append_new(arr, json_string(hex));
    }
    return arr;
}

static struct kvt_req_ctx *find_req(struct replay *r, json_t *obj, struct line_err *e)
{
    const char *id = json_string_value(json_object_get(obj, "req"));
    struct kvt_req_ctx *ctx;

    if (id == NULL) {
        fail(e, "\"req\" (a string) is required");
        return NULL;
    }
    ctx = kvt_map_get(&r->reqs, id, strlen(id));
    if (ctx == NULL)
        fail(e, "request \"%s\" was never started (new_request)", id);
    return ctx;
}

static int str_list(json_t *obj, const char *name, const char ***list_p, size_t *n_p,
                    struct line_err *e)
{
    json_t *arr = json_object_get(obj, name), *v;
    size_t i;

    *list_p = NULL;
    *n_p = 0;
    if (arr == NULL)
        return 0;
    if (!json_is_array(arr))
        return fail(e, "\"%s\" must be an array of strings", name);
    *list_p = calloc(json_array_size(arr) + 1, sizeof(char *));
    if (*list_p == NULL)
        return -ENOMEM;
    json_array_foreach(arr, i, v)
    {
        if (!json_is_string(v)) {
            free(*list_p);
            return fail(e, "\"%s\" must be an array of strings", name);
        }
        (*list_p)[i] = json_string_value(v);
    }
    *n_p = json_array_size(arr);
    return 0;
}

static void drain_events(struct replay *r)
{
    size_t from = r->events.n;

    kvt_manager_take_events(r->m, &r->events);
    for (size_t i = from; i < r->events.n; i++)
        if (r->events.ev[i].removed && r->events.ev[i].medium == KVT_MEDIUM_CPU)
            r->evicted += r->events.ev[i].n;
}

/* The primary's policy state: its lists LRU first (LRU: "l1" alone; ARC: "l1" =
 * T1, "l2" = T2), ARC's target and ghost list lengths, and for each key of the
 * optional "keys" which ghost list holds it (0 none, 1 B1, 2 B2): ghosts keep a
 * fingerprint, not the key, so they can only be asked about. */
static int policy_state(struct replay *r, json_t *obj, json_t *res, struct line_err *e)
{
    struct kvt_primary *p = kvt_manager_primary(r->m);
    size_t cap = kvt_primary_num_chunks(p);
    struct kvt_key *all = calloc(cap, sizeof(*all));
    bool arc = r->arc;

    if (all == NULL)
        return -ENOMEM;
    for (int which = 0; which < (arc ? 2 : 1); which++) {
        size_t n = kvt_primary_policy_list(p, which, all, cap);

        json_object_set_new(res, which == 0 ? "l1" : "l2", keys_to_json(all, n));
    }
    free(all);
    if (!arc)
        return 0;
    json_object_set_new(res, "target", json_real(kvt_primary_arc_target(p)));
    json_object_set_new(res, "b1", json_integer((json_int_t)kvt_primary_arc_ghost_len(p, 1)));
    json_object_set_new(res, "b2", json_integer((json_int_t)kvt_primary_arc_ghost_len(p, 2)));
    if (json_object_get(obj, "keys") != NULL) {
        struct kvt_key *keys;
        size_t n;
        char hex[2 * KVT_KEY_MAX + 1];
        json_t *g = json_object();
        int rc = keys_from_json(obj, &keys, &n, e);

        if (rc < 0) {
            json_decref(g);
            return rc;
        }
        for (size_t i = 0; i < n; i++) {
            kvt_key_to_hex(&keys[i], hex);
            json_object_set_new(g, hex, json_integer(kvt_primary_arc_ghost_of(p, &keys[i])));
        }
        free(keys);
        json_object_set_new(res, "ghosts", g);
    }
    return 0;
}

static int run_line(struct replay *r, json_t *obj, json_t *res, struct line_err *e)
{
    const char *op = json_string_value(json_object_get(obj, "op"));
    struct kvt_key *keys = NULL;
    size_t n = 0;
    int rc = 0;

    if (op == NULL)
        return fail(e, "\"op\" (a string) is required");
    json_object_set_new(res, "op", json_string(op));
    r->calls++;

    if (strcmp(op, "new_request") == 0) {
        const char *id = json_string_value(json_object_get(obj, "req"));
        json_t *params = json_object_get(obj, "params");
        char *params_txt = NULL;
        struct kvt_req_ctx *ctx;
        enum kvt_offload_policy pol;

        if (id == NULL)
            return fail(e, "\"req\" (a string) is required");
        if (kvt_map_get(&r->reqs, id, strlen(id)) != NULL)
            return fail(e, "request \"%s\" already exists", id);
        if (params != NULL)
            params_txt = json_dumps(params, JSON_COMPACT);
        rc = kvt_req_ctx_create(id, params_txt, &ctx);
        free(params_txt);
        if (rc < 0)
            return fail(e, "bad request id \"%s\"", id);
        parse_load_tiers(params, &ctx->load_tier_filter);
        rc = kvt_manager_on_new_request(r->m, ctx, &pol);
        if (rc < 0) {
            kvt_req_ctx_unref(ctx);
            return fail(e, "on_new_request: %s", strerror(-rc));
        }
        kvt_map_put(&r->reqs, id, strlen(id), ctx);
        json_object_set_new(res, "policy",
                            json_string(pol == KVT_REQUEST_LEVEL ? "request" : "chunk"));
        return 0;
    }
    if (strcmp(op, "request_finished") == 0) {
        struct kvt_req_ctx *ctx = find_req(r, obj, e);

        if (ctx == NULL)
            return -EINVAL;
        rc = kvt_manager_on_request_finished(r->m, ctx);
        kvt_map_remove(&r->reqs, ctx->req_id, ctx->req_id_len);
        kvt_req_ctx_unref(ctx);
        json_object_set_new(res, "ok", json_boolean(rc == 0));
        return 0;
    }
    if (strcmp(op, "schedule_end") == 0) {
        const char **new_ids, **pre_ids;
        size_t n_new, n_pre;

        if ((rc = str_list(obj, "new", &new_ids, &n_new, e)) < 0)
            return rc;
        if ((rc = str_list(obj, "preempted", &pre_ids, &n_pre, e)) < 0) {
            free(new_ids);
            return rc;
        }
        struct kvt_schedule_end_ctx se = {new_ids, n_new, pre_ids, n_pre};

        kvt_manager_on_schedule_end(r->m, &se);
        free(new_ids);
        free(pre_ids);
        r->steps++;
        drain_events(r);
        struct kvt_stats st;

        kvt_stats_init(&st);
        kvt_manager_get_stats(r->m, &st);
        kvt_stats_aggregate(&r->totals, &st);
        kvt_stats_cleanup(&st);
        json_object_set_new(res, "pending_work", json_boolean(kvt_manager_has_pending_work(r->m)));
        return 0;
    }
    if (strcmp(op, "take_events") == 0) {
        drain_events(r);
        json_t *arr = json_array();

        for (size_t i = 0; i < r->events.n; i++) {
            const struct kvt_event *ev = &r->events.ev[i];
            json_t *o = json_object();

            json_object_set_new(o, "keys", keys_to_json(ev->keys, ev->n));
            json_object_set_new(o, "medium",
                                json_string(ev->medium == KVT_MEDIUM_CPU ? "cpu" : "storage"));
            json_object_set_new(o, "removed", json_boolean(ev->removed));
            json_array_append_new(arr, o);
        }
        json_object_set_new(res, "events", arr);
        kvt_events_cleanup(&r->events);
        kvt_events_init(&r->events);
        return 0;
    }
    if (strcmp(op, "get_stats") == 0) {
        struct kvt_stats st;
        json_t *o = json_object();

        kvt_stats_init(&st);
        kvt_manager_get_stats(r->m, &st);
        for (size_t i = 0; i < st.n; i++) {
            char name[KVT_STAT_NAME_MAX + KVT_STAT_LABEL_MAX + 4];

            snprintf(name, sizeof(name), "%s{%s}", st.s[i].name, st.s[i].label);
            json_object_set_new(o, name,
                                json_real(kvt_stats_value(&st, st.s[i].name, st.s[i].label)));
        }
        kvt_stats_aggregate(&r->totals, &st);
        kvt_stats_cleanup(&st);
        json_object_set_new(res, "stats", o);
        return 0;
    }

    if (strcmp(op, "reset_cache") == 0) {
        rc = kvt_manager_reset_cache(r->m);
        if (rc == 0)
            kvt_map_clear(&r->pins); /* the primary's pins went with it */
        json_object_set_new(res, "ok", json_boolean(rc == 0));
        return 0;
    }
    if (strcmp(op, "policy") == 0)
        return policy_state(r, obj, res, e);

    /* Every other op takes keys and a request. */
    if ((rc = keys_from_json(obj, &keys, &n, e)) < 0)
        return rc;
    struct kvt_req_ctx *ctx = find_req(r, obj, e);

    if (ctx == NULL) {
        free(keys);
        return -EINVAL;
    }
    if (strcmp(op, "lookup") == 0) {
        json_t *arr = json_array();

        for (size_t i = 0; i < n; i++) {
            enum kvt_lookup_result lr = kvt_manager_lookup(r->m, &keys[i], ctx);

            r->lookups++;
            r->hits += lr == KVT_HIT;
            json_array_append_new(arr, json_string(kvt_lookup_result_name(lr)));
        }
        json_object_set_new(res, "results", arr);
    } else if (strcmp(op, "prepare_store") == 0) {
        rc = kvt_manager_prepare_store(r->m, keys, n, ctx, &r->out);
        if (rc == -ENOSPC) {
            r->stores_refused++;
            json_object_set_new(res, "ok", json_false());
            rc = 0;
        } else if (rc == 0) {
            json_t *slots = json_array();

            for (size_t i = 0; i < r->out.n_store; i++)
                json_array_append_new(slots, json_integer(r->out.chunk_ids[i]));
            json_object_set_new(res, "ok", json_true());
            json_object_set_new(res, "store", keys_to_json(r->out.keys_to_store, r->out.n_store));
            json_object_set_new(res, "slots", slots);
            json_object_set_new(res, "evicted", keys_to_json(r->out.evicted, r->out.n_evicted));
        } else {
            fail(e, "prepare_store: %s", strerror(-rc));
        }
    } else if (strcmp(op, "complete_store") == 0) {
        json_t *s = json_object_get(obj, "success");
        bool success = s == NULL || json_is_true(s);

        if (s != NULL && !json_is_boolean(s)) {
            rc = fail(e, "\"success\" must be a boolean");
        } else {
            rc = kvt_manager_complete_store(r->m, keys, n, ctx, success);
            json_object_set_new(res, "ok", json_boolean(rc == 0));
            rc = 0;
        }
    } else if (strcmp(op, "prepare_load") == 0) {
        int64_t *ids = calloc(n ? n : 1, sizeof(*ids));

        rc = ids ? kvt_manager_prepare_load(r->m, keys, n, ctx, ids) : -ENOMEM;
        if (rc == 0 && kvt_pins_add(&r->pins, keys, n) != 0)
            rc = -ENOMEM;
        json_object_set_new(res, "ok", json_boolean(rc == 0));
        if (rc == 0) {
            json_t *slots = json_array();

            for (size_t i = 0; i < n; i++)
                json_array_append_new(slots, json_integer(ids[i]));
            json_object_set_new(res, "slots", slots);
        }
        free(ids);
        rc = rc == -ENOMEM ? rc : 0;
    } else if (strcmp(op, "complete_load") == 0) {
        rc = kvt_pins_cover(&r->pins, keys, n, &r->named);
        rc = rc == 1 ? kvt_manager_complete_load(r->m, keys, n, ctx) : rc == 0 ? -EINVAL : rc;
        if (rc == 0)
            kvt_pins_drop(&r->pins, keys, n);
        json_object_set_new(res, "ok", json_boolean(rc == 0));
        rc = rc == -ENOMEM ? rc : 0;
    } else if (strcmp(op, "touch") == 0) {
        kvt_manager_touch(r->m, keys, n, ctx);
    } else {
        rc = fail(e, "unknown op \"%s\"", op);
    }
    free(keys);
    return rc;
}

static int build_manager(struct replay *r, size_t chunks, size_t row_bytes, const char *policy,
                         struct tier_spec *specs, size_t n_specs)
{
    struct kvt_primary_config pc = {
        .num_chunks = chunks, .row_bytes = row_bytes, .policy = policy, .enable_events = true};
    struct kvt_tier *tiers[KVT_MAX_TIERS];
    struct kvt_primary *p;
    int rc;

    rc = kvt_primary_create(&pc, NULL, &p);
    if (rc < 0) {
        fprintf(stderr, "kvtier-replay: primary (%zu chunks, policy %s): %s\n", chunks, policy,
                strerror(-rc));
        return rc;
    }
    for (size_t i = 0; i < n_specs; i++) {
        if (specs[i].storage) {
            specs[i].st.type = specs[i].type;
            rc = kvt_storage_tier_create(&specs[i].st, &tiers[i]);
        } else {
            specs[i].ex.type = specs[i].type;
            specs[i].ex.copy_bytes = row_bytes > 0;
            rc = kvt_example_tier_create(&specs[i].ex, &tiers[i]);
        }
        if (rc < 0) {
            fprintf(stderr, "kvtier-replay: tier %zu (%s): %s\n", i + 1, specs[i].type,
                    strerror(-rc));
            while (i-- > 0)
                tiers[i]->ops->destroy(tiers[i]);
            kvt_primary_destroy(p);
            return rc;
        }
        snprintf(r->types[i], sizeof(r->types[i]), "%s", specs[i].type);
    }
    r->n_tiers = n_specs;
    rc = kvt_manager_create(p, tiers, n_specs, &r->m);
    if (rc < 0) {
        for (size_t i = 0; i < n_specs; i++)
            tiers[i]->ops->destroy(tiers[i]);
        kvt_primary_destroy(p);
    }
    return rc;
}

static void print_summary(struct replay *r, const char *policy)
{
    json_t *s = json_object(), *tiers = json_object();

    for (size_t i = 0; i <= r->n_tiers; i++) {
        char label[64]; /* "<tier index>:<type>", a type is up to 31 bytes */
        json_t *t = json_object();

        if (i == 0)
            snprintf(label, sizeof(label), "%s", KVT_PRIMARY_LABEL);
        else
            snprintf(label, sizeof(label), "%zu:%s", i, r->types[i - 1]);
        double q = kvt_stats_value(&r->totals, KVT_M_CHUNK_QUERIES, label);
        double h = kvt_stats_value(&r->totals, KVT_M_CHUNK_HITS, label);

        json_object_set_new(t, "queries", json_integer((json_int_t)q));
        json_object_set_new(t, "hits", json_integer((json_int_t)h));
        json_object_set_new(t, "hit_rate", json_real(q > 0 ? h / q : 0.0));
        json_object_set_new(tiers, label, t);
    }
    json_object_set_new(s, "policy", json_string(policy));
    json_object_set_new(s, "lines", json_integer((json_int_t)r->lines));
    json_object_set_new(s, "steps", json_integer((json_int_t)r->steps));
    json_object_set_new(s, "lookups", json_integer((json_int_t)r->lookups));
    json_object_set_new(s, "lookup_hits", json_integer((json_int_t)r->hits));
    json_object_set_new(s, "tiers", tiers);
    json_object_set_new(s, "evictions", json_integer((json_int_t)r->evicted));
    json_object_set_new(s, "promotion_jobs", json_integer((json_int_t)r->promotion_jobs));
    json_object_set_new(s, "promoted_chunks", json_integer((json_int_t)r->promoted_chunks));
    json_object_set_new(s, "cascade_jobs", json_integer((json_int_t)r->cascade_jobs));
    json_object_set_new(s, "stores_refused", json_integer((json_int_t)r->stores_refused));
    json_t *wrap = json_pack("{s:o}", "summary", s);
    char *txt = json_dumps(wrap, JSON_COMPACT | JSON_SORT_KEYS);

    fprintf(r->results, "%s\n", txt);
    free(txt);
    json_decref(wrap);
}

/* Replays the trace's lines on r's manager; 0 or EX_DATAERR. */
static int replay_lines(struct replay *r, char **lines, size_t n_lines, const char *path)
{
    for (size_t i = 0; i < n_lines; i++) {
        const char *line = lines[i];
        json_error_t jerr;
        struct line_err e = {{0}};
        json_t *obj, *res;

        r->lines++;
        if (line[0] == '\0' || line[0] == '\n' || line[0] == '#')
            continue;
        obj = json_loads(line, 0, &jerr);
        if (obj == NULL || !json_is_object(obj)) {
            fprintf(r->messages, "kvtier-replay: %s:%lu: not a JSON object: %s\n", path, r->lines,
                    obj ? "" : jerr.text);
            json_decref(obj);
            return EX_DATAERR;
        }
        res = json_object();
        json_object_set_new(res, "line", json_integer((json_int_t)r->lines));
        int rc = run_line(r, obj, res, &e);

        if (rc < 0) {
            fprintf(r->messages, "kvtier-replay: %s:%lu: %s\n", path, r->lines,
                    e.msg[0] ? e.msg : strerror(-rc));
            json_decref(obj);
            json_decref(res);
            return EX_DATAERR;
        }
        if (!r->quiet) {
            char *txt = json_dumps(res, JSON_COMPACT | JSON_PRESERVE_ORDER);

            fprintf(r->results, "%s\n", txt);
            free(txt);
        }
        json_decref(obj);
        json_decref(res);
    }
    return 0;
}

/* One replay of the whole trace under policy; 0, EX_USAGE, EX_DATAERR or 1. */
static int replay_policy(struct replay *r, const char *policy, size_t chunks, size_t row_bytes,
                         struct tier_spec *specs, size_t n_specs, char **lines, size_t n_lines,
                         const char *path)
{
    int status;

    kvt_map_init(&r->reqs);
    kvt_map_init(&r->pins);
    kvt_map_init(&r->named);
    kvt_events_init(&r->events);
    kvt_stats_init(&r->totals);
    kvt_store_output_init(&r->out);
    r->arc = strcmp(policy, "arc") == 0;
    if (build_manager(r, chunks, row_bytes, policy, specs, n_specs) < 0) {
        status = EX_USAGE;
        goto out;
    }
    status = replay_lines(r, lines, n_lines, path);
    if (status == 0) {
        /* what the trace's last steps left undrained counts too */
        struct kvt_stats st;

        drain_events(r);
        kvt_stats_init(&st);
        kvt_manager_get_stats(r->m, &st);
        kvt_stats_aggregate(&r->totals, &st);
        kvt_stats_cleanup(&st);
        print_summary(r, policy);
    }

    struct kvt_map_entry *me;

    for (size_t it = 0; kvt_map_next(&r->reqs, &it, &me);) {
        kvt_manager_on_request_finished(r->m, me->value);
        kvt_req_ctx_unref(me->value);
    }
    if (kvt_manager_shutdown(r->m) < 0 && status == 0)
        status = 1;
    kvt_manager_destroy(r->m);
out:
    kvt_map_cleanup(&r->reqs);
    kvt_map_cleanup(&r->pins);
    kvt_map_cleanup(&r->named);
    kvt_events_cleanup(&r->events);
    kvt_stats_cleanup(&r->totals);
    kvt_store_output_cleanup(&r->out);
    return status;
}

/* The whole trace in memory: each policy replays it from the start. */
static int read_lines(FILE *in, char ***lines_p, size_t *n_p)
{
    char **lines = NULL, *line = NULL;
    size_t n = 0, cap = 0, lcap = 0;

    while (getline(&line, &lcap, in) >= 0) {
        if (n == cap) {
            size_t c = cap ? 2 * cap : 64;
            char **l = realloc(lines, c * sizeof(*l));

            if (l == NULL)
                goto fail;
            lines = l;
            cap = c;
        }
        lines[n++] = line;
        line = NULL;
        lcap = 0;
    }
    free(line);
    *lines_p = lines;
    *n_p = n;
    return 0;
fail:
    free(line);
    while (n > 0)
        free(lines[--n]);
    free(lines);
    return -ENOMEM;
}

int kvt__replay_text(const char *text, size_t len, const char *policy, size_t chunks,
                     const char *tier, FILE *out, FILE *err)
{
    struct replay run = {.quiet = false, .results = out, .messages = err};
    struct tier_spec spec;
    char **lines = NULL;
    size_t n_lines = 0;
    FILE *in = len > 0 ? fmemopen((void *)text, len, "r") : NULL;
    int status = 1;

    if (len > 0 && in == NULL)
        return 1;
    if ((tier == NULL || parse_tier(tier, &spec, &run) == 0) &&
        (in == NULL || read_lines(in, &lines, &n_lines) == 0))
        status =
            replay_policy(&run, policy, chunks, 0, &spec, tier != NULL, lines, n_lines, "fuzz");
    for (size_t i = 0; i < n_lines; i++)
        free(lines[i]);
    free(lines);
    if (in != NULL)
        fclose(in);
    return status;
}

#ifndef KVT_REPLAY_NO_MAIN
static void usage(FILE *f)
{
    fprintf(
        f,
        "usage: kvtier-replay [options] [TRACE.jsonl | -]\n"
        "  --chunks N           primary chunks (default 1024)\n"
        "  --row-bytes B        bytes per chunk (default 0: index only)\n"
        "  --policy lru|arc     primary cache policy (default lru)\n"
        "  --tier SPEC          add a secondary tier, in order; SPEC is\n"
        "                       example[:type=T,delay=N,fail=P,seed=S,retry_first,\n"
        "                               request_level,medium=cpu|storage,locality=local|remote]\n"
        "                       storage:root=DIR[,capacity=BYTES,type=T]\n"
        "  --summary-only       print only the summary line\n"
        "  -V, --version        the version and git revision of this build\n"
        "See docs/replay-format.md for the trace format.\n");
}

int main(int argc, char **argv)
{
    struct tier_spec specs[KVT_MAX_TIERS];
    size_t n_specs = 0, chunks = 1024, row_bytes = 0, n_lines = 0, n_policies = 0;
    const char *policy_arg = "lru", *path = "-", *policies[8];
    char policy_buf[64], **lines = NULL;
    struct replay r;
    int status = 0;

    memset(&r, 0, sizeof(r));
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        char *end;

        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            usage(stdout);
            return 0;
        } else if (strcmp(a, "--version") == 0 || strcmp(a, "-V") == 0) {
            printf("kvtier-replay %s\n", kvt_version_string());
            return 0;
        } else if (strcmp(a, "--summary-only") == 0) {
            r.quiet = true;
        } else if (i + 1 < argc && strcmp(a, "--chunks") == 0) {
            chunks = strtoull(argv[++i], &end, 10);
            if (*end || chunks == 0) {
                fprintf(stderr, "kvtier-replay: --chunks: a positive integer, not '%s'\n", argv[i]);
                return EX_USAGE;
            }
        } else if (i + 1 < argc && strcmp(a, "--row-bytes") == 0) {
            row_bytes = strtoull(argv[++i], &end, 10);
            if (*end) {
                fprintf(stderr, "kvtier-replay: --row-bytes: an integer, not '%s'\n", argv[i]);
                return EX_USAGE;
            }
        } else if (i + 1 < argc && strcmp(a, "--policy") == 0) {
            policy_arg = argv[++i];
        } else if (i + 1 < argc && strcmp(a, "--tier") == 0) {
            if (n_specs == KVT_MAX_TIERS) {
                fprintf(stderr, "kvtier-replay: at most %d tiers\n", KVT_MAX_TIERS);
                return EX_USAGE;
            }
            if (parse_tier(argv[++i], &specs[n_specs], &r) < 0)
                return EX_USAGE;
            n_specs++;
        } else if (a[0] == '-' && a[1] != '\0') {
            fprintf(stderr, "kvtier-replay: unknown option '%s'\n", a);
            usage(stderr);
            return EX_USAGE;
        } else {
            path = a;
        }
    }
    /* --policy lru,arc (or all): the trace once per policy, a summary each. */
    if (strcmp(policy_arg, "all") == 0)
        policy_arg = "lru,arc";
    if (snprintf(policy_buf, sizeof(policy_buf), "%s", policy_arg) >= (int)sizeof(policy_buf)) {
        fprintf(stderr, "kvtier-replay: --policy: too long\n");
        return EX_USAGE;
    }
    for (char *save = NULL, *tok = strtok_r(policy_buf, ",", &save); tok != NULL;
         tok = strtok_r(NULL, ",", &save)) {
        if (n_policies == sizeof(policies) / sizeof(policies[0])) {
            fprintf(stderr, "kvtier-replay: --policy: at most 8 policies\n");
            return EX_USAGE;
        }
        policies[n_policies++] = tok;
    }
    if (n_policies == 0) {
        fprintf(stderr, "kvtier-replay: --policy: no policy named\n");
        return EX_USAGE;
    }
    FILE *in = strcmp(path, "-") == 0 ? stdin : fopen(path, "r");

    if (in == NULL) {
        fprintf(stderr, "kvtier-replay: %s: %s\n", path, strerror(errno));
        return 66;
    }
    if (read_lines(in, &lines, &n_lines) < 0) {
        fprintf(stderr, "kvtier-replay: %s: out of memory\n", path);
        status = 1;
    }
    for (size_t q = 0; status == 0 && q < n_policies; q++) {
        struct replay run = {.quiet = r.quiet, .results = stdout, .messages = stderr};
        const char *roots[KVT_MAX_TIERS] = {NULL};

        /* Each policy's storage tiers in a folder of their own under root. */
        for (size_t i = 0; n_policies > 1 && i < n_specs; i++) {
            if (!specs[i].storage)
                continue;
            char *sub = NULL;

            roots[i] = specs[i].st.root;
            if (asprintf(&sub, "%s/%s", roots[i], policies[q]) < 0) {
                roots[i] = NULL;
                status = 1;
                break;
            }
            specs[i].st.root = sub;
            if (mkdir(sub, 0700) < 0 && errno != EEXIST) {
                fprintf(stderr, "kvtier-replay: cannot make %s: %s\n", sub, strerror(errno));
                status = 1;
            }
        }
        for (size_t i = 0; i < n_specs; i++)
            if (!specs[i].storage)
                specs[i].ex.cb_arg = &run;
        if (status == 0)
            status = replay_policy(&run, policies[q], chunks, row_bytes, specs, n_specs, lines,
                                   n_lines, path);
        for (size_t i = 0; i < n_specs; i++) {
            if (roots[i] != NULL) {
                free((char *)specs[i].st.root);
                specs[i].st.root = roots[i];
            }
        }
    }
    for (size_t i = 0; i < n_lines; i++)
        free(lines[i]);
    free(lines);
    for (size_t i = 0; i < n_specs; i++)
        free((char *)specs[i].st.root);
    if (in != stdin)
        fclose(in);
    return status;
}
#endif

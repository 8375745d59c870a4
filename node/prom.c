/* SPDX-License-Identifier: Apache-2.0 */
/* The Prometheus text exposition format (0.0.4) for kvtierd's /metrics: running totals
 * of the tiering core's stats deltas, and one renderer for them and the node's own
 * samples (see kvt/prom.h for the naming rules).
 *
 * The page is a sequence of families; a family is every series of one name, written
 * together after its "# HELP" and "# TYPE" lines, in the order the names first appear
 * (the tiering stats first, then the node's samples). Histograms come out as the
 * format wants them: cumulative "_bucket" series with an "le" label ending at "+Inf"
 * (kvt_stats keeps per-bucket counts; each metric's bounds are its own,
 * kvt_hist_layout_of), then "_sum" and "_count". The text is built in a private buffer
 * that is handed over only when complete, so an error leaves nothing behind. Families
 * are found by scanning (quadratic in the number of series): a node has a few hundred
 * at most. */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvt/alloc.h"
#include "kvt/common.h"
#include "kvt/metrics.h"
#include "kvt/net_tier.h"
#include "kvt/prom.h"
#include "kvt/storage_tier.h"
#include "kvt/vec.h"

#define NAME_MAX_LEN 200 /* exposition names, "_total" included */

/* ---- accumulator ---- */

void kvt_prom_acc_init(struct kvt_prom_acc *acc)
{
    kvt_stats_init(&acc->totals);
    acc->n_adds = 0;
}

void kvt_prom_acc_cleanup(struct kvt_prom_acc *acc)
{
    kvt_stats_cleanup(&acc->totals);
    acc->n_adds = 0;
}

static const struct kvt_stat *find_name(const struct kvt_stats *st, const char *name, size_t before)
{
    for (size_t i = 0; i < before && i < st->n; i++)
        if (strcmp(st->s[i].name, name) == 0)
            return &st->s[i];
    return NULL;
}

int kvt_prom_acc_add(struct kvt_prom_acc *acc, const struct kvt_stats *delta)
{
    struct kvt_stats next;
    int rc;

    for (size_t i = 0; i < delta->n; i++) {
        const struct kvt_stat *d = &delta->s[i];
        const struct kvt_stat *seen = find_name(&acc->totals, d->name, acc->totals.n);

        if (seen == NULL)
            seen = find_name(delta, d->name, i);
        if (seen != NULL && seen->kind != d->kind)
            return -EINVAL;
        if (d->kind == KVT_METRIC_COUNTER && !(d->value >= 0))
            return -EINVAL; /* negative or NaN: the total would stop being monotonic */
        if (d->kind == KVT_METRIC_HISTOGRAM && isnan(d->sum))
            return -EINVAL;
    }
    /* Aggregate into a copy so that -ENOMEM half-way leaves the totals as they were. */
    kvt_stats_init(&next);
    rc = kvt_stats_aggregate(&next, &acc->totals);
    if (rc == 0)
        rc = kvt_stats_aggregate(&next, delta);
    if (rc < 0) {
        kvt_stats_cleanup(&next);
        return rc;
    }
    kvt_stats_cleanup(&acc->totals);
    acc->totals = next;
    acc->n_adds++;
    return 0;
}

/* ---- help texts ---- */

static const struct {
    const char *name, *help;
} helps[] = {
    {KVT_M_LOOKUP_SYNC_DELAY, "Time spent inside a tier's lookup, in seconds."},
    {KVT_M_LOOKUP_ASYNC_DELAY, "Time from a lookup's first RETRY to its HIT or MISS, in seconds."},
    {KVT_M_READ_BYTES, "Bytes promoted from the tier into the primary tier."},
    {KVT_M_READ_TIME, "Transfer time of promotions from the tier, in seconds."},
    {KVT_M_WRITE_BYTES, "Bytes cascaded from the primary tier to the tier."},
    {KVT_M_WRITE_TIME, "Transfer time of cascades to the tier, in seconds."},
    {KVT_M_PROMOTION_FAILURES, "Promotion jobs from the tier that failed."},
    {KVT_M_CASCADE_FAILURES, "Cascade jobs to the tier that failed."},
    {KVT_M_CHUNK_QUERIES, "Resolved chunk lookups per request and tier, before allocation."},
    {KVT_M_CHUNK_HITS, "Chunk lookups that were hits, per request and tier."},
    {KVT_M_PRIMARY_WRITE_USAGE,
     "Fraction of primary chunks being written by promotions from the tier."},
    {KVT_M_PRIMARY_READ_USAGE, "Fraction of primary chunks pinned by cascades to the tier."},
    {KVT_M_PROMOTION_ALLOC_FAILURES, "Promotions that found no room in the primary tier."},
    {KVT_M_ACTIVE_PROMOTIONS, "Promotion jobs in flight from the tier."},
    {KVT_M_ACTIVE_CASCADES, "Cascade jobs in flight to the tier."},
    {KVT_M_BP_EMA, "Back-pressure detector's store latency EMA, in seconds per MiB."},
    {KVT_M_BP_STORES_DROPPED, "Cascades dropped by back-pressure."},
    {KVT_M_BP_BLOCKS_DROPPED, "Chunks of cascades dropped by back-pressure."},
    {KVT_M_CPU_USAGE, "Fraction of the primary tier's chunks in use."},
    {KVT_M_CPU_WRITE_USAGE, "Fraction of the primary tier's chunks being written."},
    {KVT_M_CPU_READ_USAGE, "Fraction of the primary tier's chunks pinned by readers."},
    {KVT_M_CPU_ALLOC_SIZE, "Chunks per prepare_store call."},
    {KVT_M_STORAGE_STORED_CHUNKS, "Chunks the storage tier wrote to files."},
    {KVT_M_STORAGE_SKIPPED_CHUNKS, "Chunks the storage tier already held."},
    {KVT_M_STORAGE_LOADED_CHUNKS, "Chunks the storage tier read from files."},
    {KVT_M_STORAGE_EVICTIONS, "Chunk files the storage tier evicted."},
    {KVT_M_STORAGE_CHECKSUM_FAIL, "Chunk files refused for their content (bad header, MAC or "
                                  "format), removed."},
    {KVT_M_STORAGE_MAC_FAIL, "Chunk files whose MAC did not verify (changed, or another key)."},
    {KVT_M_STORAGE_OLD_FORMAT, "Chunk files of the old unkeyed format, removed."},
    {KVT_M_STORAGE_FOREIGN, "Chunk files refused: another user's or a link (left alone), or "
                            "open to group/others (removed)."},
    {KVT_M_STORAGE_ERRORS, "Chunks the storage tier failed to store or load."},
    {KVT_M_STORAGE_ENOSPC, "Storage tier writes that failed for lack of space."},
    {KVT_M_STORAGE_EIO, "Storage tier operations that failed with an I/O error."},
    {KVT_M_STORAGE_NO_SPACE, "Stores dropped: no evictable room under the capacity."},
    {KVT_M_STORAGE_USED_BYTES, "Bytes of the storage tier's chunk files."},
    {KVT_M_STORAGE_CAPACITY_BYTES, "Capacity bound of the storage tier in bytes (0 = none)."},
    {KVT_M_STORAGE_FILES, "Chunk files of the storage tier."},
    {KVT_M_NET_LOOKUP_QUEUE_SECONDS,
     "Time from a step's first new key asked of the network tier to its LOCATEs sent, in "
     "seconds."},
    {KVT_M_NET_LOCATE_SECONDS, "Round trip of a LOCATE to a key's home node, in seconds."},
    {KVT_M_NET_FETCH_QUEUE_SECONDS,
     "Time a fetch waited behind its peer's fetches in flight, in seconds."},
    {KVT_M_NET_GRANT_WAIT_SECONDS, "Time from a FETCH sent to its GRANT, in seconds."},
    {KVT_M_NET_READ_SECONDS, "Time from a GRANT to the fetch's last row verified, in seconds."},
    {KVT_M_NET_LOAD_JOB_SECONDS,
     "Time from a network load job submitted to its report, in seconds."},
    {KVT_M_NET_SERVE_WAIT_SECONDS,
     "Holder side: time from a peer's FETCH arriving to its GRANT sent, in seconds."},
    {KVT_M_NET_PUBLISH_WAITING,
     "Keys whose PUBLISH or UNPUBLISH waits for a peer link's send credits."},
};

const char *kvt_prom_help(const char *stat_name)
{
    for (size_t i = 0; i < KVT_ARRAY_SIZE(helps); i++)
        if (strcmp(helps[i].name, stat_name) == 0)
            return helps[i].help;
    return "kvtier statistic.";
}

/* ---- output buffer ---- */

struct buf {
    char *p;
    size_t len, cap;
    int err; /* first error; later appends are no-ops */
};

static void buf_reserve(struct buf *b, size_t more)
{
    if (b->err == 0 && kvt_vec_reserve(b->p, b->cap, b->len + more + 1, 4096) < 0)
        b->err = -ENOMEM;
}

static void buf_put(struct buf *b, const char *s, size_t n)
{
    buf_reserve(b, n);
    if (b->err)
        return;
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
}

static void buf_puts(struct buf *b, const char *s)
{
    buf_put(b, s, strlen(s));
}

static void buf_printf(struct buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void buf_printf(struct buf *b, const char *fmt, ...)
{
    va_list ap;
    int n;

    va_start(ap, fmt);
    n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0) {
        b->err = b->err ? b->err : -EINVAL;
        return;
    }
    buf_reserve(b, (size_t)n);
    if (b->err)
        return;
    va_start(ap, fmt);
    vsnprintf(b->p + b->len, b->cap - b->len, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
}

/* Label values: backslash, double quote and newline escaped. HELP text: backslash and
 * newline only (the format's two escaping rules). */
static void buf_escaped(struct buf *b, const char *s, bool quote)
{
    for (; *s; s++) {
        if (*s == '\\')
            buf_puts(b, "\\\\");
        else if (*s == '\n')
            buf_puts(b, "\\n");
        else if (*s == '"' && quote)
            buf_puts(b, "\\\"");
        else
            buf_put(b, s, 1);
    }
}

/* The shortest decimal that reads back as v; "+Inf", "-Inf", "NaN" as the format
 * spells them. */
static void fmt_value(double v, char *s, size_t len)
{
    if (isnan(v)) {
        snprintf(s, len, "NaN");
        return;
    }
    if (isinf(v)) {
        snprintf(s, len, "%s", v > 0 ? "+Inf" : "-Inf");
        return;
    }
    if (v == floor(v) && fabs(v) < 9007199254740992.0) { /* integral and exact: 2^53 */
        snprintf(s, len, "%.0f", v);
        if (strcmp(s, "-0") == 0)
            snprintf(s, len, "0");
        return;
    }
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(s, len, "%.*g", prec, v);
        if (strtod(s, NULL) == v)
            return;
    }
}

static void buf_value(struct buf *b, double v)
{
    char s[40];

    fmt_value(v, s, sizeof(s));
    buf_puts(b, s);
}

/* ---- names ---- */

static bool name_char(char c, bool first, bool colons)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || (c == ':' && colons) ||
           (!first && c >= '0' && c <= '9');
}

static bool ends_with(const char *s, const char *suffix)
{
    size_t n = strlen(s), m = strlen(suffix);

    return n >= m && strcmp(s + n - m, suffix) == 0;
}

/* The exposition name of a family; -EINVAL when empty or too long. */
static int expo_name(const char *name, enum kvt_metric_kind kind, unsigned flags, char *out,
                     size_t len)
{
    bool colons = !(flags & KVT_PROM_NO_COLONS);
    size_t o = 0;

    if (name == NULL || name[0] == '\0')
        return -EINVAL;
    if (!name_char(name[0], true, colons) && name[0] >= '0' && name[0] <= '9')
        out[o++] = '_';
    for (const char *p = name; *p; p++) {
        if (o + 1 >= len)
            return -EINVAL;
        out[o] = name_char(*p, o == 0, colons) ? *p : '_';
        o++;
    }
    out[o] = '\0';
    if (kind == KVT_METRIC_COUNTER && !ends_with(out, "_total")) {
        if (o + sizeof("_total") > len)
            return -EINVAL;
        memcpy(out + o, "_total", sizeof("_total"));
    }
    return 0;
}

static bool valid_label_name(const char *s)
{
    if (s == NULL || !name_char(s[0], true, false) || strncmp(s, "__", 2) == 0)
        return false;
    for (; *s; s++)
        if (!name_char(*s, false, false))
            return false;
    return true;
}

/* The exposition names written so far, to refuse two families that print alike. */
struct names {
    char (*v)[NAME_MAX_LEN + 1];
    size_t n;
};

static int names_add(struct names *ns, const char *name)
{
    void *v;

    for (size_t i = 0; i < ns->n; i++)
        if (strcmp(ns->v[i], name) == 0)
            return -EINVAL;
    v = kvt_reallocarray(ns->v, ns->n + 1, sizeof(*ns->v));
    if (v == NULL)
        return -ENOMEM;
    ns->v = v;
    snprintf(ns->v[ns->n++], NAME_MAX_LEN + 1, "%s", name);
    return 0;
}

static const char *type_word(enum kvt_metric_kind kind)
{
    switch (kind) {
    case KVT_METRIC_COUNTER:
        return "counter";
    case KVT_METRIC_GAUGE:
        return "gauge";
    case KVT_METRIC_HISTOGRAM:
        return "histogram";
    }
    return "untyped";
}

static void family_head(struct buf *b, const char *name, const char *help,
                        enum kvt_metric_kind kind)
{
    buf_printf(b, "# HELP %s ", name);
    buf_escaped(b, help != NULL && help[0] ? help : "kvtier metric.", false);
    buf_printf(b, "\n# TYPE %s %s\n", name, type_word(kind));
}

static void label(struct buf *b, const char *name, const char *value, bool comma)
{
    buf_printf(b, "%s%s=\"", comma ? "," : "", name);
    buf_escaped(b, value, true);
    buf_puts(b, "\"");
}

/* name{label_name="label_value"[,label2_name="label2_value"][,le="..."]} (no braces
 * when there is no label). */
static void series2(struct buf *b, const char *name, const char *suffix, const char *label_name,
                    const char *label_value, const char *label2_name, const char *label2_value,
                    const char *le)
{
    bool has = label_name != NULL && label_value != NULL;
    bool has2 = has && label2_name != NULL && label2_value != NULL;

    buf_puts(b, name);
    buf_puts(b, suffix);
    if (!has && le == NULL)
        return;
    buf_puts(b, "{");
    if (has)
        label(b, label_name, label_value, false);
    if (has2)
        label(b, label2_name, label2_value, true);
    if (le != NULL)
        buf_printf(b, "%sle=\"%s\"", has ? "," : "", le);
    buf_puts(b, "}");
}

static void series(struct buf *b, const char *name, const char *suffix, const char *label_name,
                   const char *label_value, const char *le)
{
    series2(b, name, suffix, label_name, label_value, NULL, NULL, le);
}

static void render_stat(struct buf *b, const char *name, const struct kvt_stat *st)
{
    const char *ln = st->label[0] ? KVT_PROM_TIER_LABEL : NULL;
    const char *lv = st->label[0] ? st->label : NULL;

    /* The network tier's per-peer series carry "peer:<id>": a peer label, not a tier. */
    if (lv != NULL && strncmp(lv, "peer:", 5) == 0) {
        ln = "peer";
        lv += 5;
    }

    if (st->kind != KVT_METRIC_HISTOGRAM) {
        series(b, name, "", ln, lv, NULL);
        buf_puts(b, " ");
        buf_value(b, st->value);
        buf_puts(b, "\n");
        return;
    }
    /* The metric's own buckets (kvt_hist_layout_of), then +Inf. */
    const struct kvt_hist_layout *l = st->layout ? st->layout : kvt_hist_layout_of(st->name);
    uint64_t cum = 0;

    for (size_t i = 0; i <= l->n; i++) {
        char le[40];

        cum += st->buckets[i];
        if (i == l->n) {
            for (size_t j = i + 1; j < KVT_HIST_BUCKETS; j++)
                cum += st->buckets[j]; /* none: the layout has no bucket there */
            snprintf(le, sizeof(le), "+Inf");
        } else {
            fmt_value(l->bounds[i], le, sizeof(le));
        }
        series(b, name, "_bucket", ln, lv, le);
        buf_printf(b, " %llu\n", (unsigned long long)cum);
    }
    series(b, name, "_sum", ln, lv, NULL);
    buf_puts(b, " ");
    buf_value(b, st->sum);
    buf_puts(b, "\n");
    series(b, name, "_count", ln, lv, NULL);
    /* The +Inf bucket and _count agree by construction of the page. */
    buf_printf(b, " %llu\n", (unsigned long long)cum);
}

static int render_stats(struct buf *b, struct names *ns, const struct kvt_stats *st, unsigned flags)
{
    char name[NAME_MAX_LEN + 1];
    int rc;

    for (size_t i = 0; i < st->n; i++) {
        const struct kvt_stat *first = &st->s[i];

        if (find_name(st, first->name, i) != NULL)
            continue; /* written with its family */
        rc = expo_name(first->name, first->kind, flags, name, sizeof(name));
        if (rc == 0)
            rc = names_add(ns, name);
        if (rc < 0)
            return rc;
        family_head(b, name, kvt_prom_help(first->name), first->kind);
        for (size_t j = i; j < st->n; j++) {
            if (strcmp(st->s[j].name, first->name) != 0)
                continue;
            if (st->s[j].kind != first->kind)
                return -EINVAL;
            render_stat(b, name, &st->s[j]);
        }
    }
    return 0;
}

static bool same_str(const char *a, const char *b)
{
    return (a == NULL && b == NULL) || (a != NULL && b != NULL && strcmp(a, b) == 0);
}

static int check_sample(const struct kvt_prom_sample *s)
{
    if (s->name == NULL || (s->kind != KVT_METRIC_COUNTER && s->kind != KVT_METRIC_GAUGE))
        return -EINVAL;
    if ((s->label_name == NULL) != (s->label_value == NULL))
        return -EINVAL;
    if (s->label_name != NULL && !valid_label_name(s->label_name))
        return -EINVAL;
    if ((s->label2_name == NULL) != (s->label2_value == NULL))
        return -EINVAL;
    if (s->label2_name != NULL &&
        (s->label_name == NULL || !valid_label_name(s->label2_name) ||
         strcmp(s->label2_name, s->label_name) == 0 || strcmp(s->label2_name, "le") == 0))
        return -EINVAL;
    return 0;
}

static int render_samples(struct buf *b, struct names *ns, const struct kvt_prom_sample *ss,
                          size_t n, unsigned flags)
{
    char name[NAME_MAX_LEN + 1];
    int rc;

    for (size_t i = 0; i < n; i++) {
        rc = check_sample(&ss[i]);
        if (rc < 0)
            return rc;
        for (size_t j = 0; j < i; j++) {
            if (strcmp(ss[j].name, ss[i].name) != 0)
                continue;
            if (ss[j].kind != ss[i].kind || (same_str(ss[j].label_name, ss[i].label_name) &&
                                             same_str(ss[j].label_value, ss[i].label_value) &&
                                             same_str(ss[j].label2_name, ss[i].label2_name) &&
                                             same_str(ss[j].label2_value, ss[i].label2_value)))
                return -EINVAL; /* another kind, or the same series twice */
        }
    }
    for (size_t i = 0; i < n; i++) {
        bool seen = false;

        for (size_t j = 0; j < i && !seen; j++)
            seen = strcmp(ss[j].name, ss[i].name) == 0;
        if (seen)
            continue;
        rc = expo_name(ss[i].name, ss[i].kind, flags, name, sizeof(name));
        if (rc == 0)
            rc = names_add(ns, name);
        if (rc < 0)
            return rc;
        family_head(b, name, ss[i].help, ss[i].kind);
        for (size_t j = i; j < n; j++) {
            if (strcmp(ss[j].name, ss[i].name) != 0)
                continue;
            series2(b, name, "", ss[j].label_name, ss[j].label_value, ss[j].label2_name,
                    ss[j].label2_value, NULL);
            buf_puts(b, " ");
            buf_value(b, ss[j].value);
            buf_puts(b, "\n");
        }
    }
    return 0;
}

int kvt_prom_render(const struct kvt_stats *totals, const struct kvt_prom_sample *samples,
                    size_t n_samples, unsigned flags, char **text_p, size_t *len_p)
{
    struct buf b = {0};
    struct names ns = {0};
    int rc = 0;

    buf_reserve(&b, 0); /* an empty page is "" */
    if (b.p != NULL)
        b.p[0] = '\0';
    if (totals != NULL)
        rc = render_stats(&b, &ns, totals, flags);
    if (rc == 0)
        rc = render_samples(&b, &ns, samples, n_samples, flags);
    if (rc == 0)
        rc = b.err;
    kvt_free(ns.v);
    if (rc < 0) {
        kvt_free(b.p);
        return rc;
    }
    *text_p = b.p;
    *len_p = b.len;
    return 0;
}

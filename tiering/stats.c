/* OffloadingConnectorStats: a flat list of (name, label) -> value.
 * A get_stats() holds a few dozen entries, so a linear search is both the simplest
 * and the fastest structure; histograms keep fixed buckets instead of Python's list
 * of observations (aggregate then adds bucket counts, which is what Prometheus
 * would do with the concatenated observations anyway). */
#include <errno.h>
#include <string.h>

#include "kvt/alloc.h"
#include "kvt/common.h"
#include "kvt/metrics.h"
#include "kvt/stats.h"

const double kvt_hist_bounds[KVT_HIST_BUCKETS] = {
    1e-6, 1e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1, 4, 16, 64, 256, 1e300,
};

const struct kvt_hist_layout kvt_hist_default = {
    15, {1e-6, 1e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1, 4, 16, 64, 256}};

/* vLLM's buckets for the histograms vLLM defines (its kv_offload tiering and CPU
 * specs), so that its dashboards read kvtier's series as its own. */
static const struct {
    const char *name;
    struct kvt_hist_layout layout;
} vllm_layouts[] = {
    {KVT_M_LOOKUP_SYNC_DELAY, {11, {1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1}}},
    {KVT_M_LOOKUP_ASYNC_DELAY, {11, {1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1, 5, 10}}},
    {KVT_M_CPU_ALLOC_SIZE, {10, {1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144}}},
};

/* kvtier's own, by unit: latencies from 10 us to 10 s (about 3 per decade), counts of
 * chunks from 1 to 65536 (powers of 4). */
static const struct kvt_hist_layout seconds_layout = {
    13, {1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1, 3, 10}};
static const struct kvt_hist_layout chunks_layout = {9,
                                                     {1, 4, 16, 64, 256, 1024, 4096, 16384, 65536}};

static bool ends_with(const char *s, const char *suffix)
{
    size_t n = strlen(s), m = strlen(suffix);

    return n >= m && strcmp(s + n - m, suffix) == 0;
}

const struct kvt_hist_layout *kvt_hist_layout_of(const char *name)
{
    for (size_t i = 0; i < KVT_ARRAY_SIZE(vllm_layouts); i++)
        if (strcmp(vllm_layouts[i].name, name) == 0)
            return &vllm_layouts[i].layout;
    if (strncmp(name, "vllm:", 5) != 0 && ends_with(name, "_seconds"))
        return &seconds_layout;
    if (strncmp(name, "vllm:", 5) != 0 && ends_with(name, "_chunks"))
        return &chunks_layout;
    return &kvt_hist_default;
}

size_t kvt_hist_bucket(const struct kvt_hist_layout *l, double v)
{
    size_t b = 0;

    while (b < l->n && v > l->bounds[b])
        b++;
    return b;
}

void kvt_stats_init(struct kvt_stats *st)
{
    memset(st, 0, sizeof(*st));
}

void kvt_stats_cleanup(struct kvt_stats *st)
{
    kvt_free(st->s);
    memset(st, 0, sizeof(*st));
}

void kvt_stats_clear(struct kvt_stats *st)
{
    st->n = 0;
}

bool kvt_stats_is_empty(const struct kvt_stats *st)
{
    return st->n == 0;
}

const struct kvt_stat *kvt_stats_find(const struct kvt_stats *st, const char *name,
                                      const char *label)
{
    if (label == NULL)
        label = "";
    for (size_t i = 0; i < st->n; i++)
        if (strcmp(st->s[i].name, name) == 0 && strcmp(st->s[i].label, label) == 0)
            return &st->s[i];
    return NULL;
}

double kvt_stats_value(const struct kvt_stats *st, const char *name, const char *label)
{
    const struct kvt_stat *s = kvt_stats_find(st, name, label);

    if (s == NULL)
        return 0;
    return s->kind == KVT_METRIC_HISTOGRAM ? (double)s->count : s->value;
}

/* Finds or appends (name, label) of the given kind. */
static int stat_slot(struct kvt_stats *st, const char *name, const char *label,
                     enum kvt_metric_kind kind, struct kvt_stat **s_p)
{
    if (label == NULL)
        label = "";
    if (name == NULL || strlen(name) >= KVT_STAT_NAME_MAX || strlen(label) >= KVT_STAT_LABEL_MAX)
        return -EINVAL;
    for (size_t i = 0; i < st->n; i++) {
        if (strcmp(st->s[i].name, name) != 0)
            continue;
        if (st->s[i].kind != kind)
            return -EINVAL; /* one name, one kind */
        if (strcmp(st->s[i].label, label) == 0) {
            *s_p = &st->s[i];
            return 0;
        }
    }
    if (st->n == st->cap) {
        size_t cap = st->cap ? st->cap * 2 : 16;
        struct kvt_stat *s = kvt_reallocarray(st->s, cap, sizeof(*s));

        if (s == NULL)
            return -ENOMEM;
        st->s = s;
        st->cap = cap;
    }
    struct kvt_stat *s = &st->s[st->n++];

    memset(s, 0, sizeof(*s));
    strcpy(s->name, name);
    strcpy(s->label, label);
    s->kind = kind;
    if (kind == KVT_METRIC_HISTOGRAM)
        s->layout = kvt_hist_layout_of(name);
    *s_p = s;
    return 0;
}

int kvt_stats_increase(struct kvt_stats *st, const char *name, const char *label, double v)
{
    struct kvt_stat *s;
    int rc = stat_slot(st, name, label, KVT_METRIC_COUNTER, &s);

    if (rc == 0)
        s->value += v;
    return rc;
}

int kvt_stats_set_gauge(struct kvt_stats *st, const char *name, const char *label, double v)
{
    struct kvt_stat *s;
    int rc = stat_slot(st, name, label, KVT_METRIC_GAUGE, &s);

    if (rc == 0)
        s->value = v;
    return rc;
}

int kvt_stats_observe(struct kvt_stats *st, const char *name, const char *label, double v)
{
    struct kvt_stat *s;
    int rc = stat_slot(st, name, label, KVT_METRIC_HISTOGRAM, &s);

    if (rc == 0) {
        s->count++;
        s->sum += v;
        s->buckets[kvt_hist_bucket(s->layout, v)]++;
    }
    return rc;
}

int kvt_stats_aggregate(struct kvt_stats *dst, const struct kvt_stats *src)
{
    for (size_t i = 0; i < src->n; i++) {
        const struct kvt_stat *from = &src->s[i];
        struct kvt_stat *to;
        int rc = stat_slot(dst, from->name, from->label, from->kind, &to);

        if (rc < 0)
            return rc;
        switch (from->kind) {
        case KVT_METRIC_COUNTER:
            to->value += from->value;
            break;
        case KVT_METRIC_GAUGE:
            to->value = from->value;
            break;
        case KVT_METRIC_HISTOGRAM:
            to->count += from->count;
            to->sum += from->sum;
            for (size_t b = 0; b < KVT_HIST_BUCKETS; b++)
                to->buckets[b] += from->buckets[b];
            break;
        }
    }
    return 0;
}

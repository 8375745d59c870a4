/* OffloadingConnectorStats: metric name -> label value -> value.
 * Counters add on aggregate, gauges overwrite, histograms merge their buckets.
 * Label is one value (the "tier" label, e.g. "1:fs") or "" for unlabelled metrics.
 *
 * A histogram's buckets are chosen per metric, by its name (kvt_hist_layout_of), so
 * that two histograms of one name always share them: vLLM's buckets for vLLM's
 * metrics; by unit for kvtier's own ("..._seconds": 10 us to 10 s, "..._chunks": 1
 * to 65536 chunks); the old common layout for any other name. */
#ifndef KVT_STATS_H
#define KVT_STATS_H

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>

enum kvt_metric_kind { KVT_METRIC_COUNTER, KVT_METRIC_GAUGE, KVT_METRIC_HISTOGRAM };

#define KVT_STAT_NAME_MAX  96
#define KVT_STAT_LABEL_MAX 48
#define KVT_HIST_BUCKETS   16

/* A histogram's buckets: n finite upper bounds, ascending; bucket i < n counts the
 * observations in (bounds[i-1], bounds[i]], bucket n everything above (+Inf). */
struct kvt_hist_layout {
    size_t n; /* < KVT_HIST_BUCKETS */
    double bounds[KVT_HIST_BUCKETS - 1];
};

/* The layout for any name without one of its own: 1e-6 .. 256. */
extern const struct kvt_hist_layout kvt_hist_default;
/* kvt_hist_default's bounds, 16 of them, the last (1e300) standing for +Inf: what the
 * engine API sends as its one "bounds" list, for clients that know no other. */
extern const double kvt_hist_bounds[KVT_HIST_BUCKETS];

/* The buckets of the histogram called name (see the top of this file). */
const struct kvt_hist_layout *kvt_hist_layout_of(const char *name);
/* The bucket of v (0..l->n). */
size_t kvt_hist_bucket(const struct kvt_hist_layout *l, double v);

struct kvt_stat {
    char name[KVT_STAT_NAME_MAX];
    char label[KVT_STAT_LABEL_MAX];
    enum kvt_metric_kind kind;
    double value;                         /* counter / gauge */
    uint64_t count;                       /* histogram: observations */
    double sum;                           /* histogram: sum of observations */
    uint64_t buckets[KVT_HIST_BUCKETS];   /* histogram: per-bucket (not cumulative) */
    const struct kvt_hist_layout *layout; /* histogram: kvt_hist_layout_of(name) */
};

struct kvt_stats {
    struct kvt_stat *s;
    size_t n, cap;
};

void kvt_stats_init(struct kvt_stats *st);
void kvt_stats_cleanup(struct kvt_stats *st);
void kvt_stats_clear(struct kvt_stats *st);
bool kvt_stats_is_empty(const struct kvt_stats *st);

/* label may be NULL (= ""). Names and labels longer than the maxima are -EINVAL.
 * Using one name with two kinds is -EINVAL. */
int kvt_stats_increase(struct kvt_stats *st, const char *name, const char *label, double v);
int kvt_stats_set_gauge(struct kvt_stats *st, const char *name, const char *label, double v);
int kvt_stats_observe(struct kvt_stats *st, const char *name, const char *label, double v);
/* Merges src into dst (counters add, gauges overwrite, histograms add). */
int kvt_stats_aggregate(struct kvt_stats *dst, const struct kvt_stats *src);

const struct kvt_stat *kvt_stats_find(const struct kvt_stats *st, const char *name,
                                      const char *label);
/* Counter/gauge value, or a histogram's count; 0 when absent. */
double kvt_stats_value(const struct kvt_stats *st, const char *name, const char *label);

#endif

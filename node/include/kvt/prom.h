/* The Prometheus text exposition format (version 0.0.4) of kvtierd's /metrics.
 *
 * Two sources make one page:
 * - the tiering core's stats (struct kvt_stats, vLLM's metric names, the tier label
 *   "tier"), which kvt_manager_get_stats hands out as deltas since its last call: a
 *   struct kvt_prom_acc keeps the running totals (counters and histograms add,
 *   gauges take the latest value), so the page's counters only ever grow;
 * - the node's own series (peers, bytes served, leases, checksum failures...), given
 *   per render as a list of samples whose counters the node keeps cumulative itself.
 *
 * Names: a counter's exposition name ends in "_total" (appended unless present), as
 * vLLM's Python client prints them; characters outside [a-zA-Z0-9_:] become '_' and a
 * leading digit gets a '_' before it. vLLM's names keep their "vllm:" prefix so that
 * vLLM's dashboards work; KVT_PROM_NO_COLONS turns ':' into '_' as well, for scrapers
 * that lint (promtool warns that ':' is meant for recording rules). Label values and
 * HELP text are escaped (backslash, double quote, newline).
 *
 * Single-threaded: the node loop accumulates and renders; the HTTP thread only ever
 * sees the rendered text (kvt/metrics_http.h). */
#ifndef KVT_PROM_H
#define KVT_PROM_H

#include <stddef.h>
#include <stdint.h>

#include "kvt/stats.h"

#define KVT_PROM_CONTENT_TYPE "text/plain; version=0.0.4; charset=utf-8"

/* The label name of the tiering core's stats labels. */
#define KVT_PROM_TIER_LABEL "tier"

/* Running totals of kvt_manager_get_stats deltas (caller's storage). */
struct kvt_prom_acc {
    struct kvt_stats totals;
    uint64_t n_adds; /* deltas accumulated */
};

void kvt_prom_acc_init(struct kvt_prom_acc *acc);
void kvt_prom_acc_cleanup(struct kvt_prom_acc *acc);
/* Adds one delta. -EINVAL (and acc unchanged) when a name changes kind or a counter
 * delta is negative or not a number; -ENOMEM (acc unchanged). */
int kvt_prom_acc_add(struct kvt_prom_acc *acc, const struct kvt_stats *delta);

/* One series of the node's own. A family is every sample of one name, which must agree
 * on kind and help; the first sample's help is printed. */
struct kvt_prom_sample {
    const char *name; /* "kvtier_peers_up" */
    const char *help;
    enum kvt_metric_kind kind; /* counter or gauge */
    const char *label_name;    /* NULL: no label */
    const char *label_value;
    double value; /* gauge: now; counter: since the node started */
    /* A second label (NULL: none; only beside a first one, under another name). */
    const char *label2_name;
    const char *label2_value;
};

#define KVT_PROM_NO_COLONS 0x1u

/* Renders totals (NULL: none) then samples into a new NUL-terminated text (*text_p,
 * kvt_free it; *len_p without the NUL). -EINVAL for a sample that is a histogram, has
 * an invalid label name, repeats a series or clashes with another family's name or
 * kind; -ENOMEM. Nothing is written to *text_p on error. */
int kvt_prom_render(const struct kvt_stats *totals, const struct kvt_prom_sample *samples,
                    size_t n_samples, unsigned flags, char **text_p, size_t *len_p);

/* The HELP text used for a tiering stat name (vLLM's documentation where known). */
const char *kvt_prom_help(const char *stat_name);

#endif

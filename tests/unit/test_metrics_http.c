/* SPDX-License-Identifier: Apache-2.0 */
/* kvtierd's /metrics: the Prometheus renderer and its accumulator (node/prom.c), fed by
 * the real tiering metrics tracker, and the HTTP server (node/metrics_http.c) fetched
 * with a plain socket client. Every page is checked with `promtool check metrics`
 * (Debian's prometheus package, installed by tools/install-deps): a missing promtool
 * fails the test. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include "test_util.h"

#include "kvt/alloc.h"
#include "kvt/alloc_test.h"
#include "kvt/clock.h"
#include "kvt/common.h"
#include "kvt/metrics.h"
#include "kvt/metrics_http.h"
#include "kvt/prom.h"
#include "kvt/stats.h"

/* ---- helpers ---- */

static char *render(const struct kvt_stats *st, const struct kvt_prom_sample *ss, size_t n,
                    unsigned flags)
{
    char *text = NULL;
    size_t len = 0;

    assert_int_equal(kvt_prom_render(st, ss, n, flags, &text, &len), 0);
    assert_non_null(text);
    assert_int_equal(strlen(text), len);
    return text;
}

/* Whether text holds this exact line. */
static bool has_line(const char *text, const char *line)
{
    size_t n = strlen(line);

    for (const char *p = text; (p = strstr(p, line)) != NULL; p++)
        if ((p == text || p[-1] == '\n') && p[n] == '\n')
            return true;
    return false;
}

#define assert_line(text, line)                                                                    \
    do {                                                                                           \
        if (!has_line((text), (line)))                                                             \
            fail_msg("no line \"%s\" in:\n%s", (line), (text));                                    \
    } while (0)

struct promtool_result {
    int status; /* exit status, or -1 when it did not run */
    char out[8192];
};

/* Runs `promtool check metrics` on text. */
static void promtool(const char *text, struct promtool_result *r)
{
    char *dir = kt_tmpdir("promtool"), path[512], cmd[1200];
    FILE *f, *p;
    size_t n;

    assert_non_null(dir);
    snprintf(path, sizeof(path), "%s/page.txt", dir);
    f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    assert_int_equal(fclose(f), 0);
    if (system("command -v promtool >/dev/null 2>&1") != 0)
        fail_msg("promtool is missing: tools/install-deps installs it (package prometheus)");
    snprintf(cmd, sizeof(cmd), "promtool check metrics < '%s' 2>&1", path);
    p = popen(cmd, "r");
    assert_non_null(p);
    n = fread(r->out, 1, sizeof(r->out) - 1, p);
    r->out[n] = '\0';
    int st = pclose(p);

    r->status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    unlink(path);
    rmdir(dir);
    free(dir);
}

/* Strict: promtool accepts the page with no remark at all. */
static void assert_promtool_clean(const char *text)
{
    struct promtool_result r;

    promtool(text, &r);
    if (r.status != 0 || r.out[0] != '\0')
        fail_msg("promtool exit %d:\n%s\non:\n%s", r.status, r.out, text);
}

/* vLLM's names: the page parses (exit 1 is a parse error); the only lint remark allowed
 * is the one about ':' in vLLM's own names (exit 3). */
static void assert_promtool_vllm_names(const char *text)
{
    struct promtool_result r;
    char *save = NULL;

    promtool(text, &r);
    if (r.status != 0 && r.status != 3)
        fail_msg("promtool exit %d:\n%s\non:\n%s", r.status, r.out, text);
    for (char *l = strtok_r(r.out, "\n", &save); l; l = strtok_r(NULL, "\n", &save))
        if (strstr(l, "should not contain ':'") == NULL || strncmp(l, "vllm:", 5) != 0)
            fail_msg("promtool remark \"%s\" on:\n%s", l, text);
}

/* A tracker with one "fs" tier, driven through a promotion, lookups and an
 * allocation failure. */
static struct kvt_metrics *tracker(void)
{
    static const char *const types[] = {"fs"};
    struct kvt_metrics *mt;

    assert_int_equal(kvt_metrics_create(types, 1, 100, 4096, &mt), 0);
    return mt;
}

static void one_promotion(struct kvt_metrics *mt, size_t n_keys)
{
    struct kvt_key keys[4];
    struct kvt_job job = {.id = 1, .n = n_keys, .keys = keys, .is_promotion = true};
    struct kvt_job_result res = {
        .job_id = 1, .success = true, .transfer_time = 0.25, .transfer_bytes = -1};

    kt_keys(keys, 0, n_keys);
    kvt_metrics_on_job_registered(mt, &job, 0);
    kvt_metrics_on_job_finished(mt, &job, 0, &res);
}

/* ---- the renderer ---- */

/* The checker itself can fail: a broken page and a linted one are both caught. */
static void test_promtool_catches_bad_pages(void **state)
{
    struct promtool_result r;

    (void)state;
    promtool("# TYPE x gauge\nx{a=\"1\"} one\n", &r);
    assert_int_equal(r.status, 1);
    promtool("# TYPE x_total counter\nx_total 1\n", &r); /* no HELP */
    assert_int_not_equal(r.status, 0);
    promtool("# HELP x_total a\n# TYPE x_total counter\nx_total 1\n", &r);
    assert_int_equal(r.status, 0);
}

/* The network tier's per-peer series (label "peer:<id>") get a peer label. */
static void test_render_peer_label(void **state)
{
    struct kvt_stats st;
    char *text;

    (void)state;
    kvt_stats_init(&st);
    assert_int_equal(
        kvt_stats_increase(&st, "kvtier_net_peer_pulled_bytes", "peer:00000000000000ab", 65536), 0);
    assert_int_equal(kvt_stats_increase(&st, KVT_M_READ_BYTES, "2:p2p", 4096), 0);
    text = render(&st, NULL, 0, 0);
    assert_line(text, "kvtier_net_peer_pulled_bytes_total{peer=\"00000000000000ab\"} 65536");
    assert_line(text, "vllm:kv_offload_tiering_read_bytes_total{tier=\"2:p2p\"} 4096");
    assert_promtool_vllm_names(text);
    free(text);
    kvt_stats_cleanup(&st);
}

static void test_render_basic_and_histogram(void **state)
{
    struct kvt_stats st;
    char *text;

    (void)state;
    kvt_stats_init(&st);
    assert_int_equal(kvt_stats_increase(&st, KVT_M_READ_BYTES, "1:fs", 8192), 0);
    assert_int_equal(kvt_stats_set_gauge(&st, KVT_M_ACTIVE_PROMOTIONS, "1:fs", 2), 0);
    assert_int_equal(kvt_stats_increase(&st, KVT_M_PROMOTION_ALLOC_FAILURES, NULL, 1), 0);
    assert_int_equal(kvt_stats_increase(&st, KVT_M_READ_BYTES, "2:p2p", 4096), 0);
    assert_int_equal(kvt_stats_observe(&st, KVT_M_LOOKUP_SYNC_DELAY, "0:primary", 0.002), 0);
    assert_int_equal(kvt_stats_observe(&st, KVT_M_LOOKUP_SYNC_DELAY, "0:primary", 3), 0);
    assert_int_equal(kvt_stats_observe(&st, KVT_M_LOOKUP_SYNC_DELAY, "0:primary", 100), 0);
    /* A name without buckets of its own: the common layout. */
    assert_int_equal(kvt_stats_observe(&st, "kvtier_test_values", "0:primary", 0.002), 0);
    assert_int_equal(kvt_stats_observe(&st, "kvtier_test_values", "0:primary", 3), 0);
    assert_int_equal(kvt_stats_observe(&st, "kvtier_test_values", "0:primary", 100), 0);
    text = render(&st, NULL, 0, 0);

    assert_line(text, "# TYPE vllm:kv_offload_tiering_read_bytes_total counter");
    assert_non_null(strstr(text, "# HELP vllm:kv_offload_tiering_read_bytes_total Bytes"));
    assert_line(text, "vllm:kv_offload_tiering_read_bytes_total{tier=\"1:fs\"} 8192");
    assert_line(text, "vllm:kv_offload_tiering_read_bytes_total{tier=\"2:p2p\"} 4096");
    /* One family: the two tiers' series follow one HELP/TYPE pair. */
    {
        const char *a = strstr(text, "read_bytes_total{tier=\"1:fs\"}");
        const char *b = strstr(text, "read_bytes_total{tier=\"2:p2p\"}");
        const char *t = strstr(text, "# TYPE vllm:kv_offload_tiering_active_promotion_jobs");

        assert_non_null(a);
        assert_non_null(b);
        assert_non_null(t);
        assert_true(a < b && b < t);
    }
    assert_line(text, "# TYPE vllm:kv_offload_tiering_active_promotion_jobs gauge");
    assert_line(text, "vllm:kv_offload_tiering_active_promotion_jobs{tier=\"1:fs\"} 2");
    assert_line(text, "vllm:kv_offload_tiering_promotion_allocation_failures_total 1");

    /* vLLM's own buckets for its metric: 10 us .. 1 s (tiering/spec.py). */
    assert_line(text, "# TYPE vllm:kv_offload_tiering_lookup_sync_delay_seconds histogram");
    assert_line(text, "vllm:kv_offload_tiering_lookup_sync_delay_seconds_bucket"
                      "{tier=\"0:primary\",le=\"1e-05\"} 0");
    assert_line(text, "vllm:kv_offload_tiering_lookup_sync_delay_seconds_bucket"
                      "{tier=\"0:primary\",le=\"5e-05\"} 0");
    assert_line(text, "vllm:kv_offload_tiering_lookup_sync_delay_seconds_bucket"
                      "{tier=\"0:primary\",le=\"0.001\"} 0");
    assert_line(text, "vllm:kv_offload_tiering_lookup_sync_delay_seconds_bucket"
                      "{tier=\"0:primary\",le=\"0.005\"} 1");
    assert_line(text, "vllm:kv_offload_tiering_lookup_sync_delay_seconds_bucket"
                      "{tier=\"0:primary\",le=\"0.5\"} 1");
    assert_line(text, "vllm:kv_offload_tiering_lookup_sync_delay_seconds_bucket"
                      "{tier=\"0:primary\",le=\"1\"} 1");
    assert_line(text, "vllm:kv_offload_tiering_lookup_sync_delay_seconds_bucket"
                      "{tier=\"0:primary\",le=\"+Inf\"} 3");
    assert_line(text, "vllm:kv_offload_tiering_lookup_sync_delay_seconds_sum"
                      "{tier=\"0:primary\"} 103.002");
    assert_line(text, "vllm:kv_offload_tiering_lookup_sync_delay_seconds_count"
                      "{tier=\"0:primary\"} 3");
    assert_null(strstr(text, "lookup_sync_delay_seconds_bucket{tier=\"0:primary\",le=\"1e-06\"}"));
    assert_null(strstr(text, "lookup_sync_delay_seconds_bucket{tier=\"0:primary\",le=\"4\"}"));
    /* The common layout, for a name without its own. */
    assert_line(text, "# TYPE kvtier_test_values histogram");
    assert_line(text, "kvtier_test_values_bucket{tier=\"0:primary\",le=\"1e-06\"} 0");
    assert_line(text, "kvtier_test_values_bucket{tier=\"0:primary\",le=\"0.001\"} 0");
    assert_line(text, "kvtier_test_values_bucket{tier=\"0:primary\",le=\"0.005\"} 1");
    assert_line(text, "kvtier_test_values_bucket{tier=\"0:primary\",le=\"4\"} 2");
    assert_line(text, "kvtier_test_values_bucket{tier=\"0:primary\",le=\"64\"} 2");
    assert_line(text, "kvtier_test_values_bucket{tier=\"0:primary\",le=\"256\"} 3");
    assert_line(text, "kvtier_test_values_bucket{tier=\"0:primary\",le=\"+Inf\"} 3");
    assert_line(text, "kvtier_test_values_sum{tier=\"0:primary\"} 103.002");
    assert_line(text, "kvtier_test_values_count{tier=\"0:primary\"} 3");
    assert_null(strstr(text, "1e+300"));
    assert_promtool_vllm_names(text);
    kvt_free(text);

    text = render(&st, NULL, 0, KVT_PROM_NO_COLONS);
    assert_line(text, "vllm_kv_offload_tiering_read_bytes_total{tier=\"1:fs\"} 8192");
    assert_null(strstr(text, "vllm:"));
    assert_promtool_clean(text);
    kvt_free(text);

    /* Nothing at all is an empty page. */
    text = render(NULL, NULL, 0, 0);
    assert_string_equal(text, "");
    kvt_free(text);
    kvt_stats_cleanup(&st);
}

static void test_accumulator_keeps_running_totals(void **state)
{
    struct kvt_metrics *mt = tracker();
    struct kvt_prom_acc acc;
    struct kvt_stats delta;
    char *text;

    (void)state;
    kvt_prom_acc_init(&acc);

    /* Step 1: one promotion of 2 chunks, one allocation failure. */
    one_promotion(mt, 2);
    kvt_metrics_on_promotion_allocation_failure(mt);
    kvt_stats_init(&delta);
    assert_int_equal(kvt_metrics_take_stats(mt, &delta), 0);
    assert_true(kvt_stats_value(&delta, KVT_M_READ_BYTES, "1:fs") == 2 * 4096.0);
    assert_int_equal(kvt_prom_acc_add(&acc, &delta), 0);
    kvt_stats_cleanup(&delta);

    /* Step 2: the tracker's delta holds only the new promotion... */
    one_promotion(mt, 3);
    kvt_metrics_on_promotion_allocation_failure(mt);
    kvt_stats_init(&delta);
    assert_int_equal(kvt_metrics_take_stats(mt, &delta), 0);
    assert_true(kvt_stats_value(&delta, KVT_M_READ_BYTES, "1:fs") == 3 * 4096.0);
    assert_int_equal(kvt_prom_acc_add(&acc, &delta), 0);
    kvt_stats_cleanup(&delta);

    /* Step 3: nothing new; counters must not fall back. */
    kvt_stats_init(&delta);
    assert_int_equal(kvt_metrics_take_stats(mt, &delta), 0);
    assert_int_equal(kvt_prom_acc_add(&acc, &delta), 0);
    kvt_stats_cleanup(&delta);
    assert_int_equal(acc.n_adds, 3);

    /* ...the page the cumulative totals. */
    text = render(&acc.totals, NULL, 0, 0);
    assert_line(text, "vllm:kv_offload_tiering_read_bytes_total{tier=\"1:fs\"} 20480");
    assert_line(text, "vllm:kv_offload_tiering_read_time_total{tier=\"1:fs\"} 0.5");
    assert_line(text, "vllm:kv_offload_tiering_promotion_allocation_failures_total 2");
    /* Gauges are the latest value, not a sum. */
    assert_line(text, "vllm:kv_offload_tiering_active_promotion_jobs{tier=\"1:fs\"} 0");
    assert_line(text, "vllm:kv_offload_tiering_primary_write_usage_perc{tier=\"1:fs\"} 0");
    assert_promtool_vllm_names(text);
    kvt_free(text);

    /* A gauge that moves overwrites; a histogram adds. */
    kvt_stats_init(&delta);
    assert_int_equal(kvt_stats_set_gauge(&delta, KVT_M_BP_EMA, "1:fs", 0.5), 0);
    assert_int_equal(kvt_stats_observe(&delta, KVT_M_CPU_ALLOC_SIZE, NULL, 4), 0);
    assert_int_equal(kvt_prom_acc_add(&acc, &delta), 0);
    kvt_stats_clear(&delta);
    assert_int_equal(kvt_stats_set_gauge(&delta, KVT_M_BP_EMA, "1:fs", 0.125), 0);
    assert_int_equal(kvt_stats_observe(&delta, KVT_M_CPU_ALLOC_SIZE, NULL, 8), 0);
    assert_int_equal(kvt_prom_acc_add(&acc, &delta), 0);
    kvt_stats_cleanup(&delta);
    text = render(&acc.totals, NULL, 0, KVT_PROM_NO_COLONS);
    assert_line(text,
                "vllm_kv_offload_tiering_backpressure_store_latency_ema{tier=\"1:fs\"} 0.125");
    assert_line(text, "vllm_kv_offload_cpu_allocation_size_count 2");
    assert_line(text, "vllm_kv_offload_cpu_allocation_size_sum 12");
    assert_line(text, "vllm_kv_offload_cpu_allocation_size_bucket{le=\"4\"} 1");
    assert_line(text, "vllm_kv_offload_cpu_allocation_size_bucket{le=\"16\"} 2");
    assert_promtool_clean(text);
    kvt_free(text);

    kvt_prom_acc_cleanup(&acc);
    kvt_metrics_destroy(mt);
}

static void test_accumulator_refuses_bad_deltas(void **state)
{
    struct kvt_prom_acc acc;
    struct kvt_stats d;
    char *before, *after;

    (void)state;
    kvt_prom_acc_init(&acc);
    kvt_stats_init(&d);
    assert_int_equal(kvt_stats_increase(&d, "kvtier_x", "a", 5), 0);
    assert_int_equal(kvt_prom_acc_add(&acc, &d), 0);
    before = render(&acc.totals, NULL, 0, 0);

    /* The same name as a gauge: refused, totals unchanged. */
    kvt_stats_clear(&d);
    assert_int_equal(kvt_stats_increase(&d, "kvtier_y", "a", 1), 0);
    assert_int_equal(kvt_stats_set_gauge(&d, "kvtier_x", "b", 1), 0);
    assert_int_equal(kvt_prom_acc_add(&acc, &d), -EINVAL);
    /* A counter that goes down, or NaN. */
    kvt_stats_clear(&d);
    assert_int_equal(kvt_stats_increase(&d, "kvtier_x", "a", -1), 0);
    assert_int_equal(kvt_prom_acc_add(&acc, &d), -EINVAL);
    kvt_stats_clear(&d);
    assert_int_equal(kvt_stats_increase(&d, "kvtier_x", "a", NAN), 0);
    assert_int_equal(kvt_prom_acc_add(&acc, &d), -EINVAL);
    /* Out of memory half-way. */
    kvt_stats_clear(&d);
    assert_int_equal(kvt_stats_increase(&d, "kvtier_x", "a", 1), 0);
    assert_int_equal(kvt_stats_increase(&d, "kvtier_z", NULL, 1), 0);
    kvt_alloc_fail_after(0);
    assert_int_equal(kvt_prom_acc_add(&acc, &d), -ENOMEM);
    kvt_alloc_fail_after(-1);
    assert_int_equal(acc.n_adds, 1);

    after = render(&acc.totals, NULL, 0, 0);
    assert_string_equal(before, after);
    assert_line(after, "kvtier_x_total{tier=\"a\"} 5");
    kvt_free(before);
    kvt_free(after);
    kvt_stats_cleanup(&d);
    kvt_prom_acc_cleanup(&acc);
}

static const struct kvt_prom_sample node_samples[] = {
    {"kvtier_peers", "Peers by state.", KVT_METRIC_GAUGE, "state", "up", 2, NULL, NULL},
    {"kvtier_peers", "Peers by state.", KVT_METRIC_GAUGE, "state", "down", 1, NULL, NULL},
    {"kvtier_bytes_served", "Bytes peers read from this node's region.", KVT_METRIC_COUNTER, NULL,
     NULL, 1e12, NULL, NULL},
    {"kvtier_leases_active", "Grants whose lease has not ended.", KVT_METRIC_GAUGE, NULL, NULL, 3,
     NULL, NULL},
    {"kvtier_checksum_failures_total", "Chunks pulled from peers that failed the checksum.",
     KVT_METRIC_COUNTER, "peer", "10.0.0.2:7170", 0, NULL, NULL},
    {"kvtier_build_info", "Version.", KVT_METRIC_GAUGE, "version", "0.1.0", 1, NULL, NULL},
};

static void test_node_samples(void **state)
{
    struct kvt_stats st;
    char *text;

    (void)state;
    kvt_stats_init(&st);
    assert_int_equal(kvt_stats_increase(&st, KVT_M_CHUNK_HITS, "1:fs", 7), 0);
    text = render(&st, node_samples, KVT_ARRAY_SIZE(node_samples), 0);
    assert_line(text, "# HELP kvtier_peers Peers by state.");
    assert_line(text, "# TYPE kvtier_peers gauge");
    assert_line(text, "kvtier_peers{state=\"up\"} 2");
    assert_line(text, "kvtier_peers{state=\"down\"} 1");
    assert_line(text, "# TYPE kvtier_bytes_served_total counter");
    assert_line(text, "kvtier_bytes_served_total 1000000000000");
    assert_line(text, "kvtier_leases_active 3");
    /* "_total" is not doubled. */
    assert_line(text, "kvtier_checksum_failures_total{peer=\"10.0.0.2:7170\"} 0");
    assert_null(strstr(text, "_total_total"));
    /* The tiering stats come first. */
    assert_true(strstr(text, "vllm:kv_offload_tiering_chunk_hits_total") <
                strstr(text, "kvtier_peers"));
    assert_promtool_vllm_names(text);
    kvt_free(text);
    text = render(&st, node_samples, KVT_ARRAY_SIZE(node_samples), KVT_PROM_NO_COLONS);
    assert_promtool_clean(text);
    kvt_free(text);
    kvt_stats_cleanup(&st);
}

static void test_escaping_and_names(void **state)
{
    const struct kvt_prom_sample ss[] = {
        {"kvtier_odd", "Help with \\ and\nnewline \"quoted\".", KVT_METRIC_GAUGE, "v", "a\"b\\c\nd",
         1.5, NULL, NULL},
        {"9lives", "x", KVT_METRIC_GAUGE, NULL, NULL, -0.25, NULL, NULL},
        {"kvtier.dotted-name", "x", KVT_METRIC_GAUGE, NULL, NULL, INFINITY, NULL, NULL},
        {"kvtier_nan", "", KVT_METRIC_GAUGE, NULL, NULL, NAN, NULL, NULL},
        {"kvtier_small", "x", KVT_METRIC_GAUGE, NULL, NULL, 1e-7, NULL, NULL},
    };
    struct kvt_stats st;
    char *text;

    (void)state;
    kvt_stats_init(&st);
    assert_int_equal(kvt_stats_increase(&st, "tier stat/with spaces", "1:\"fs\"\\x", 1), 0);
    text = render(&st, ss, KVT_ARRAY_SIZE(ss), 0);
    assert_line(text, "# HELP kvtier_odd Help with \\\\ and\\nnewline \"quoted\".");
    assert_line(text, "kvtier_odd{v=\"a\\\"b\\\\c\\nd\"} 1.5");
    assert_line(text, "_9lives -0.25");
    assert_line(text, "kvtier_dotted_name +Inf");
    assert_line(text, "kvtier_nan NaN");
    assert_line(text, "# HELP kvtier_nan kvtier metric.");
    assert_line(text, "kvtier_small 1e-07");
    assert_line(text, "tier_stat_with_spaces_total{tier=\"1:\\\"fs\\\"\\\\x\"} 1");
    assert_promtool_clean(text);
    kvt_free(text);
    kvt_stats_cleanup(&st);
}

static void test_render_refuses_bad_samples(void **state)
{
    const struct kvt_prom_sample hist[] = {
        {"kvtier_h", "h", KVT_METRIC_HISTOGRAM, NULL, NULL, 1, NULL, NULL}};
    const struct kvt_prom_sample bad_label[] = {
        {"kvtier_l", "l", KVT_METRIC_GAUGE, "1x", "v", 1, NULL, NULL}};
    const struct kvt_prom_sample reserved[] = {
        {"kvtier_l", "l", KVT_METRIC_GAUGE, "__x", "v", 1, NULL, NULL}};
    const struct kvt_prom_sample half_label[] = {
        {"kvtier_l", "l", KVT_METRIC_GAUGE, "x", NULL, 1, NULL, NULL}};
    const struct kvt_prom_sample twice[] = {
        {"kvtier_t", "t", KVT_METRIC_GAUGE, "a", "1", 1, NULL, NULL},
        {"kvtier_t", "t", KVT_METRIC_GAUGE, "a", "1", 2, NULL, NULL}};
    const struct kvt_prom_sample kinds[] = {
        {"kvtier_k", "k", KVT_METRIC_GAUGE, "a", "1", 1, NULL, NULL},
        {"kvtier_k", "k", KVT_METRIC_COUNTER, "a", "2", 2, NULL, NULL}};
    const struct kvt_prom_sample clash[] = {
        {KVT_M_CHUNK_HITS, "same name as a stat", KVT_METRIC_COUNTER, NULL, NULL, 1, NULL, NULL}};
    const struct kvt_prom_sample alike[] = {
        {"kvtier_a-b", "x", KVT_METRIC_GAUGE, NULL, NULL, 1, NULL, NULL},
        {"kvtier_a_b", "x", KVT_METRIC_GAUGE, NULL, NULL, 1, NULL, NULL}};
    const struct kvt_prom_sample noname[] = {
        {"", "x", KVT_METRIC_GAUGE, NULL, NULL, 1, NULL, NULL}};
    struct {
        const struct kvt_prom_sample *s;
        size_t n;
    } cases[] = {{hist, 1},  {bad_label, 1}, {reserved, 1}, {half_label, 1}, {twice, 2},
                 {kinds, 2}, {clash, 1},     {alike, 2},    {noname, 1}};
    struct kvt_stats st;
    char *text = (char *)"untouched";
    size_t len = 77;

    (void)state;
    kvt_stats_init(&st);
    assert_int_equal(kvt_stats_increase(&st, KVT_M_CHUNK_HITS, "1:fs", 7), 0);
    for (size_t i = 0; i < KVT_ARRAY_SIZE(cases); i++) {
        int rc = kvt_prom_render(&st, cases[i].s, cases[i].n, 0, &text, &len);

        if (rc != -EINVAL)
            fail_msg("case %zu: %d", i, rc);
        assert_string_equal(text, "untouched");
        assert_int_equal(len, 77);
    }
    kvt_stats_cleanup(&st);
}

/* A second label (kvtier_build_info's version and revision): printed after the first,
 * escaped alike; one family may hold series that differ in either; a second label
 * without a first, under the first's name or "le", half given, or a series twice is
 * refused. */
static void test_render_two_labels(void **state)
{
    const struct kvt_prom_sample ok2[] = {
        {"kvtier_build_info", "Build.", KVT_METRIC_GAUGE, "version", "0.1.0", 1, "revision",
         "1a2b3c4d, dirty"},
        {"kvtier_pair", "p", KVT_METRIC_COUNTER, "a", "1", 2, "b", "x\"y"},
        {"kvtier_pair", "p", KVT_METRIC_COUNTER, "a", "1", 3, "b", "z"},
        {"kvtier_pair", "p", KVT_METRIC_COUNTER, "a", "2", 4, "b", "z"},
    };
    const struct kvt_prom_sample no_first[] = {
        {"kvtier_l", "l", KVT_METRIC_GAUGE, NULL, NULL, 1, "b", "v"}};
    const struct kvt_prom_sample same_name[] = {
        {"kvtier_l", "l", KVT_METRIC_GAUGE, "a", "1", 1, "a", "2"}};
    const struct kvt_prom_sample le[] = {
        {"kvtier_l", "l", KVT_METRIC_GAUGE, "a", "1", 1, "le", "2"}};
    const struct kvt_prom_sample half[] = {
        {"kvtier_l", "l", KVT_METRIC_GAUGE, "a", "1", 1, "b", NULL}};
    const struct kvt_prom_sample bad_name[] = {
        {"kvtier_l", "l", KVT_METRIC_GAUGE, "a", "1", 1, "2b", "v"}};
    const struct kvt_prom_sample twice[] = {
        {"kvtier_t", "t", KVT_METRIC_GAUGE, "a", "1", 1, "b", "2"},
        {"kvtier_t", "t", KVT_METRIC_GAUGE, "a", "1", 2, "b", "2"}};
    const struct {
        const struct kvt_prom_sample *s;
        size_t n;
    } bad[] = {{no_first, 1}, {same_name, 1}, {le, 1}, {half, 1}, {bad_name, 1}, {twice, 2}};
    char *text;
    size_t len;

    (void)state;
    text = render(NULL, ok2, KVT_ARRAY_SIZE(ok2), 0);
    assert_line(text, "kvtier_build_info{version=\"0.1.0\",revision=\"1a2b3c4d, dirty\"} 1");
    assert_line(text, "kvtier_pair_total{a=\"1\",b=\"x\\\"y\"} 2");
    assert_line(text, "kvtier_pair_total{a=\"1\",b=\"z\"} 3");
    assert_line(text, "kvtier_pair_total{a=\"2\",b=\"z\"} 4");
    assert_promtool_clean(text);
    kvt_free(text);
    for (size_t i = 0; i < KVT_ARRAY_SIZE(bad); i++) {
        text = NULL;
        if (kvt_prom_render(NULL, bad[i].s, bad[i].n, 0, &text, &len) != -EINVAL)
            fail_msg("case %zu rendered", i);
        assert_null(text);
    }
}

static void test_render_out_of_memory(void **state)
{
    struct kvt_stats st;
    char *text = NULL, *want;
    size_t len;
    int rc = -ENOMEM;
    long n;

    (void)state;
    kvt_stats_init(&st);
    for (int i = 0; i < 200; i++) {
        char label[32];

        snprintf(label, sizeof(label), "%d:t", i);
        assert_int_equal(kvt_stats_observe(&st, KVT_M_LOOKUP_SYNC_DELAY, label, i * 0.01), 0);
    }
    want = render(&st, node_samples, KVT_ARRAY_SIZE(node_samples), 0);
    for (n = 0; n < 1000 && rc == -ENOMEM; n++) {
        kvt_alloc_fail_after(n);
        rc = kvt_prom_render(&st, node_samples, KVT_ARRAY_SIZE(node_samples), 0, &text, &len);
        kvt_alloc_fail_after(-1);
    }
    assert_int_equal(rc, 0);
    assert_true(n > 2); /* the page needed the buffer to grow */
    assert_string_equal(text, want);
    kvt_free(text);
    kvt_free(want);
    kvt_stats_cleanup(&st);
}

/* ---- the HTTP server ---- */

struct http_reply {
    int status;
    char headers[2048];
    char *body; /* malloc'd, NUL-terminated */
    size_t body_len;
};

/* One request over a fresh connection to 127.0.0.1:port; reads until the server closes. */
static void http_request(uint16_t port, const char *method, const char *path, struct http_reply *r)
{
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port)};
    struct timeval tv = {.tv_sec = 20};
    char req[512], *buf = NULL, *sep;
    size_t len = 0, cap = 0;
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);

    assert_true(fd >= 0);
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0)
        fail_msg("connect to port %u: %s", port, strerror(errno));
    bool post = strcmp(method, "POST") == 0;
    int n = snprintf(req, sizeof(req),
                     "%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n%s\r\n%s", method,
                     path, post ? "Content-Length: 5\r\n" : "", post ? "hello" : "");
    assert_int_equal(send(fd, req, (size_t)n, MSG_NOSIGNAL), n);
    for (;;) {
        if (cap - len < 4096) {
            cap = cap ? cap * 2 : 65536;
            buf = realloc(buf, cap);
            assert_non_null(buf);
        }
        ssize_t got = recv(fd, buf + len, cap - len - 1, 0);

        if (got < 0 && errno == EINTR)
            continue;
        if (got < 0)
            fail_msg("recv: %s", strerror(errno));
        if (got == 0)
            break;
        len += (size_t)got;
    }
    close(fd);
    buf[len] = '\0';
    assert_int_equal(sscanf(buf, "HTTP/1.%*d %d", &r->status), 1);
    sep = strstr(buf, "\r\n\r\n");
    assert_non_null(sep);
    snprintf(r->headers, sizeof(r->headers), "%.*s", (int)(sep - buf), buf);
    r->body_len = len - (size_t)(sep + 4 - buf);
    r->body = malloc(r->body_len + 1);
    assert_non_null(r->body);
    memcpy(r->body, sep + 4, r->body_len);
    r->body[r->body_len] = '\0';
    free(buf);
}

static bool has_header(const struct http_reply *r, const char *name, const char *value)
{
    char want[512];
    const char *p = r->headers;

    snprintf(want, sizeof(want), "%s: %s", name, value);
    for (; (p = strcasestr(p, want)) != NULL; p++)
        if (p[-1] == '\n' && (p[strlen(want)] == '\r' || p[strlen(want)] == '\0'))
            return true;
    return false;
}

static struct kvt_metrics_http *start_server(void)
{
    struct kvt_metrics_http *srv = NULL;

    assert_int_equal(kvt_metrics_http_create("127.0.0.1", 0, &srv), 0);
    assert_non_null(srv);
    assert_int_not_equal(kvt_metrics_http_port(srv), 0);
    print_message("metrics server on 127.0.0.1:%u\n", (unsigned)kvt_metrics_http_port(srv));
    return srv;
}

/* A page as the node loop makes it: tracker deltas accumulated, node samples. */
static char *node_page(struct kvt_prom_acc *acc, struct kvt_metrics *mt, unsigned flags)
{
    struct kvt_stats delta;
    char *text;

    one_promotion(mt, 2);
    kvt_stats_init(&delta);
    assert_int_equal(kvt_metrics_take_stats(mt, &delta), 0);
    assert_int_equal(kvt_prom_acc_add(acc, &delta), 0);
    kvt_stats_cleanup(&delta);
    text = render(&acc->totals, node_samples, KVT_ARRAY_SIZE(node_samples), flags);
    return text;
}

static void test_http_endpoints(void **state)
{
    struct kvt_metrics_http *srv = start_server();
    uint16_t port = kvt_metrics_http_port(srv);
    struct kvt_metrics *mt = tracker();
    struct kvt_prom_acc acc;
    struct http_reply r;
    char *page;

    (void)state;
    kvt_prom_acc_init(&acc);

    /* Nothing published yet. */
    http_request(port, "GET", "/metrics", &r);
    assert_int_equal(r.status, 503);
    free(r.body);

    http_request(port, "GET", "/healthz", &r);
    assert_int_equal(r.status, 200);
    assert_string_equal(r.body, "ok\n");
    free(r.body);

    page = node_page(&acc, mt, 0);
    assert_int_equal(kvt_metrics_http_publish(srv, page, strlen(page)), 0);
    http_request(port, "GET", "/metrics", &r);
    assert_int_equal(r.status, 200);
    assert_true(has_header(&r, "Content-Type", "text/plain; version=0.0.4; charset=utf-8"));
    assert_int_equal(r.body_len, strlen(page));
    assert_string_equal(r.body, page);
    assert_line(r.body, "vllm:kv_offload_tiering_read_bytes_total{tier=\"1:fs\"} 8192");
    assert_promtool_vllm_names(r.body);
    free(r.body);
    kvt_free(page);

    /* The next publish replaces the page; counters grew. */
    page = node_page(&acc, mt, KVT_PROM_NO_COLONS);
    assert_int_equal(kvt_metrics_http_publish(srv, page, strlen(page)), 0);
    kvt_free(page);
    http_request(port, "GET", "/metrics", &r);
    assert_int_equal(r.status, 200);
    assert_line(r.body, "vllm_kv_offload_tiering_read_bytes_total{tier=\"1:fs\"} 16384");
    assert_line(r.body, "kvtier_peers{state=\"up\"} 2");
    assert_promtool_clean(r.body);
    free(r.body);

    /* HEAD: headers only. */
    http_request(port, "HEAD", "/metrics", &r);
    assert_int_equal(r.status, 200);
    assert_int_equal(r.body_len, 0);
    free(r.body);

    http_request(port, "GET", "/nope", &r);
    assert_int_equal(r.status, 404);
    free(r.body);
    http_request(port, "GET", "/metrics/x", &r);
    assert_int_equal(r.status, 404);
    free(r.body);

    static const char *const methods[] = {"POST", "PUT", "DELETE", "PATCH"};

    for (size_t i = 0; i < KVT_ARRAY_SIZE(methods); i++) {
        http_request(port, methods[i], "/metrics", &r);
        if (r.status != 405)
            fail_msg("%s /metrics: %d", methods[i], r.status);
        assert_true(has_header(&r, "Allow", "GET, HEAD"));
        free(r.body);
    }
    http_request(port, "POST", "/healthz", &r);
    assert_int_equal(r.status, 405);
    free(r.body);

    /* Not healthy (draining): /healthz says so, /metrics still serves. */
    kvt_metrics_http_set_healthy(srv, false);
    http_request(port, "GET", "/healthz", &r);
    assert_int_equal(r.status, 503);
    free(r.body);
    http_request(port, "GET", "/metrics", &r);
    assert_int_equal(r.status, 200);
    free(r.body);
    kvt_metrics_http_set_healthy(srv, true);
    http_request(port, "GET", "/healthz", &r);
    assert_int_equal(r.status, 200);
    free(r.body);

    /* An empty page is a valid page. */
    assert_int_equal(kvt_metrics_http_publish(srv, "", 0), 0);
    http_request(port, "GET", "/metrics", &r);
    assert_int_equal(r.status, 200);
    assert_int_equal(r.body_len, 0);
    free(r.body);

    kvt_metrics_http_destroy(srv);
    kvt_prom_acc_cleanup(&acc);
    kvt_metrics_destroy(mt);
}

/* The node loop publishes while clients fetch: every body is one whole published page
 * and a client never sees the version go back. */
struct fetcher {
    uint16_t port;
    atomic_bool *stop;
    int fetched;
    int bad;
};

static void *fetch_loop(void *arg)
{
    struct fetcher *f = arg;
    long last = -1;

    while (!atomic_load(f->stop) || f->fetched < 5) {
        struct http_reply r;
        long v;

        http_request(f->port, "GET", "/metrics", &r);
        if (r.status == 200) {
            if (sscanf(r.body,
                       "# HELP kvtier_page_version v\n# TYPE kvtier_page_version "
                       "gauge\nkvtier_page_version %ld\n",
                       &v) != 1 ||
                v < last || strlen(r.body) != r.body_len || !has_line(r.body, "kvtier_pad 1"))
                f->bad++;
            last = v;
            f->fetched++;
        } else if (r.status != 503) {
            f->bad++;
        }
        free(r.body);
    }
    return NULL;
}

static void test_http_publish_while_serving(void **state)
{
    struct kvt_metrics_http *srv = start_server();
    struct fetcher f[3];
    pthread_t th[3];
    atomic_bool stop;
    char pad[20000];

    (void)state;
    atomic_init(&stop, false);
    memset(pad, '#', sizeof(pad) - 1); /* a page of some size */
    pad[sizeof(pad) - 1] = '\0';
    for (int i = 0; i < 3; i++) {
        f[i] = (struct fetcher){.port = kvt_metrics_http_port(srv), .stop = &stop};
        assert_int_equal(pthread_create(&th[i], NULL, fetch_loop, &f[i]), 0);
    }
    for (long v = 0; v < 400; v++) {
        char *page;
        int n = asprintf(&page,
                         "# HELP kvtier_page_version v\n# TYPE kvtier_page_version gauge\n"
                         "kvtier_page_version %ld\n# %s\n# HELP kvtier_pad p\n"
                         "# TYPE kvtier_pad gauge\nkvtier_pad 1\n",
                         v, pad + (v % 1000));

        assert_true(n > 0);
        assert_int_equal(kvt_metrics_http_publish(srv, page, (size_t)n), 0);
        free(page);
        usleep(500);
    }
    atomic_store(&stop, true);
    for (int i = 0; i < 3; i++) {
        assert_int_equal(pthread_join(th[i], NULL), 0);
        assert_int_equal(f[i].bad, 0);
        assert_true(f[i].fetched >= 5);
        print_message("client %d: %d pages while 400 were published\n", i, f[i].fetched);
    }
    kvt_metrics_http_destroy(srv);
}

/* A render that fails is never hidden behind the last good page: /metrics answers
 * 500 naming the cause until a page is published again (kvtierd froze its page for
 * good when two families clashed after a pull). */
static void test_http_render_failure_is_500(void **state)
{
    struct kvt_metrics_http *srv = start_server();
    uint16_t port = kvt_metrics_http_port(srv);
    static const char good[] = "# TYPE kvtier_x counter\nkvtier_x_total 1\n";
    struct http_reply r;
    (void)state;

    assert_int_equal(kvt_metrics_http_publish(srv, good, sizeof(good) - 1), 0);
    http_request(port, "GET", "/metrics", &r);
    assert_int_equal(r.status, 200);
    assert_string_equal(r.body, good);
    free(r.body);

    kvt_metrics_http_publish_failure(srv, -EINVAL);
    http_request(port, "GET", "/metrics", &r);
    assert_int_equal(r.status, 500);
    assert_non_null(strstr(r.body, strerror(EINVAL)));
    assert_null(strstr(r.body, "kvtier_x"));
    free(r.body);
    http_request(port, "GET", "/healthz", &r); /* health is the node's, not the page's */
    assert_int_equal(r.status, 200);
    free(r.body);

    assert_int_equal(kvt_metrics_http_publish(srv, good, sizeof(good) - 1), 0);
    http_request(port, "GET", "/metrics", &r);
    assert_int_equal(r.status, 200);
    free(r.body);

    /* A publish that cannot copy its page (out of memory) fails the page too. */
    kvt_alloc_fail_after(0);
    assert_int_equal(kvt_metrics_http_publish(srv, good, sizeof(good) - 1), -ENOMEM);
    kvt_alloc_fail_after(-1);
    http_request(port, "GET", "/metrics", &r);
    assert_int_equal(r.status, 500);
    free(r.body);
    kvt_metrics_http_destroy(srv);
}

static void test_http_listen_errors_and_cleanup(void **state)
{
    struct kvt_metrics_http *srv = NULL, *other = NULL;
    int before;

    (void)state;
    srv = start_server();
    /* The port is taken. */
    assert_int_equal(kvt_metrics_http_create("127.0.0.1", kvt_metrics_http_port(srv), &other),
                     -EADDRINUSE);
    assert_null(other);
    kvt_metrics_http_destroy(srv);

    assert_int_equal(kvt_metrics_http_create("256.1.2.3", 0, &other), -EINVAL);
    assert_int_equal(kvt_metrics_http_create("no-such-host.invalid", 0, &other), -EINVAL);
    /* An address this machine does not have. */
    assert_int_equal(kvt_metrics_http_create("192.0.2.1", 0, &other), -EADDRNOTAVAIL);
    assert_null(other);

    /* IPv6 loopback, when the machine has it. */
    {
        int fd = socket(AF_INET6, SOCK_STREAM, 0);
        struct sockaddr_in6 sa6 = {.sin6_family = AF_INET6, .sin6_addr = IN6ADDR_LOOPBACK_INIT};
        bool has_v6 = fd >= 0 && bind(fd, (struct sockaddr *)&sa6, sizeof(sa6)) == 0;

        if (fd >= 0)
            close(fd);
        if (has_v6) {
            assert_int_equal(kvt_metrics_http_create("::1", 0, &other), 0);
            assert_int_not_equal(kvt_metrics_http_port(other), 0);
            kvt_metrics_http_destroy(other);
            other = NULL;
        }
    }

    /* Start and stop leak no descriptor (the server closes every socket it opened). */
    before = kt_open_fds();
    for (int i = 0; i < 10; i++) {
        struct http_reply r;

        srv = start_server();
        http_request(kvt_metrics_http_port(srv), "GET", "/healthz", &r);
        assert_int_equal(r.status, 200);
        free(r.body);
        kvt_metrics_http_destroy(srv);
    }
    assert_int_equal(kt_open_fds(), before);
}

/* ---- slow and hostile clients ---- */

static int tcp_connect(uint16_t port)
{
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port)};
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);

    assert_true(fd >= 0);
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0)
        fail_msg("connect to port %u: %s", port, strerror(errno));
    return fd;
}

/* Whether the server closed fd within ms (EOF or reset). */
static bool closed_within(int fd, int ms)
{
    struct timeval tv = {.tv_sec = ms / 1000, .tv_usec = (ms % 1000) * 1000};
    char buf[4096];

    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    for (;;) {
        ssize_t n = recv(fd, buf, sizeof(buf), 0);

        if (n == 0 || (n < 0 && errno == ECONNRESET))
            return true;
        if (n < 0)
            return false; /* timed out */
    }
}

static struct kvt_metrics_http_counters http_counters(struct kvt_metrics_http *srv)
{
    struct kvt_metrics_http_counters c;

    kvt_metrics_http_get_counters(srv, &c);
    return c;
}

/* 80 connections that each send one byte and stop (more than libmicrohttpd's 64 slots,
 * which then refused every scrape): a scrape still gets its page at once. */
static void test_http_idle_crowd_cannot_block_scrapes(void **state)
{
    struct kvt_metrics_http *srv = start_server();
    uint16_t port = kvt_metrics_http_port(srv);
    int fds[80];
    struct http_reply r;
    uint64_t t0;

    (void)state;
    assert_int_equal(kvt_metrics_http_publish(srv, "# x\n", 4), 0);
    for (int i = 0; i < 80; i++) {
        fds[i] = tcp_connect(port);
        assert_int_equal(send(fds[i], "G", 1, MSG_NOSIGNAL), 1);
    }
    usleep(100000);
    t0 = kvt_now_ns();
    http_request(port, "GET", "/metrics", &r);
    print_message("scrape behind 80 idle connections: %.1f ms\n",
                  (double)(kvt_now_ns() - t0) / 1e6);
    assert_int_equal(r.status, 200);
    assert_string_equal(r.body, "# x\n");
    free(r.body);
    assert_true(kvt_now_ns() - t0 < 2000000000ull);
    struct kvt_metrics_http_counters c = http_counters(srv);
    assert_true(c.dropped[KVT_MHTTP_FULL] >= 80 - 16);
    assert_true(c.connections <= 16);
    for (int i = 0; i < 80; i++)
        close(fds[i]);
    kvt_metrics_http_destroy(srv);
}

/* A request trickled a byte at a time is closed at read_timeout_ms from its
 * connection, however steadily it trickles; a reply nobody reads at
 * write_timeout_ms. Both are counted. */
static void test_http_read_and_write_timeouts(void **state)
{
    struct kvt_metrics_http_config cfg = {.listen = "127.0.0.1",
                                          .max_connections = 4,
                                          .read_timeout_ms = 300,
                                          .write_timeout_ms = 300};
    struct kvt_metrics_http *srv = NULL;
    const char *req = "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n";
    size_t big = 64u << 20;
    char *page = malloc(big);
    uint64_t t0;
    int fd, rcv = 4096, sent = 0;

    (void)state;
    assert_int_equal(kvt_metrics_http_create_cfg(&cfg, &srv), 0);
    /* Trickle: one byte every 50 ms would need 1.7 s; the deadline is 300 ms. */
    fd = tcp_connect(kvt_metrics_http_port(srv));
    t0 = kvt_now_ns();
    while (kvt_now_ns() - t0 < 2000000000ull && sent < (int)strlen(req) &&
           send(fd, req + sent, 1, MSG_NOSIGNAL) == 1) {
        sent++;
        usleep(50000);
    }
    assert_true(closed_within(fd, 2000));
    print_message("trickling client closed after %.0f ms, %d bytes sent\n",
                  (double)(kvt_now_ns() - t0) / 1e6, sent);
    assert_true(sent < (int)strlen(req));
    close(fd);
    assert_int_equal(http_counters(srv).dropped[KVT_MHTTP_READ_TIMEOUT], 1);

    /* A 64 MiB page to a client that never reads it. */
    memset(page, '#', big);
    page[big - 1] = '\n';
    assert_int_equal(kvt_metrics_http_publish(srv, page, big), 0);
    free(page);
    fd = tcp_connect(kvt_metrics_http_port(srv));
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcv, sizeof(rcv));
    assert_int_equal(send(fd, req, strlen(req), MSG_NOSIGNAL), (ssize_t)strlen(req));
    for (int i = 0; i < 400 && http_counters(srv).dropped[KVT_MHTTP_WRITE_TIMEOUT] == 0; i++)
        usleep(10000);
    assert_int_equal(http_counters(srv).dropped[KVT_MHTTP_WRITE_TIMEOUT], 1);
    close(fd);
    /* The server still serves. */
    struct http_reply r;
    http_request(kvt_metrics_http_port(srv), "GET", "/healthz", &r);
    assert_int_equal(r.status, 200);
    free(r.body);
    kvt_metrics_http_destroy(srv);
}

/* The answer on fd is a 400 (recv with flags); closes fd. */
static void expect_400(int fd, int flags)
{
    char buf[256];
    ssize_t n = recv(fd, buf, sizeof(buf) - 1, flags);

    assert_true(n > 12);
    buf[n] = '\0';
    assert_int_equal(strncmp(buf, "HTTP/1.1 400 ", 13), 0);
    close(fd);
}

/* Not HTTP, or headers that never end: 400, counted. */
static void test_http_bad_requests(void **state)
{
    struct kvt_metrics_http *srv = start_server();
    uint16_t port = kvt_metrics_http_port(srv);
    char *junk = malloc(9000);
    int fd;

    (void)state;
    fd = tcp_connect(port);
    assert_int_equal(send(fd, "hello\r\n\r\n", 9, MSG_NOSIGNAL), 9);
    expect_400(fd, MSG_WAITALL);

    memset(junk, 'a', 9000);
    memcpy(junk, "GET /metrics HTTP/1.1\r\nX: ", 26);
    fd = tcp_connect(port);
    assert_int_equal(send(fd, junk, 9000, MSG_NOSIGNAL), 9000);
    expect_400(fd, 0);
    free(junk);

    struct kvt_metrics_http_counters c = http_counters(srv);
    assert_int_equal(c.dropped[KVT_MHTTP_BAD_REQUEST], 2);
    assert_int_equal(c.accepted, 2);
    assert_string_equal(kvt_metrics_http_drop_name(KVT_MHTTP_BAD_REQUEST), "bad_request");
    kvt_metrics_http_destroy(srv);
}

/* A NUL byte before the end of the headers: 400, not a crash. The end of the headers is
 * looked for in the new bytes only, so it is found past a NUL that hides the request
 * line from string functions (the request in two sends: the server reads the first
 * before the second arrives). */
static void test_http_nul_in_request(void **state)
{
    struct kvt_metrics_http *srv = start_server();
    uint16_t port = kvt_metrics_http_port(srv);
    int fd;

    (void)state;
    fd = tcp_connect(port);
    assert_int_equal(send(fd, "\0xyz", 4, MSG_NOSIGNAL), 4);
    usleep(100 * 1000);
    assert_int_equal(send(fd, "\r\n\r\n", 4, MSG_NOSIGNAL), 4);
    expect_400(fd, MSG_WAITALL);

    /* A NUL inside the request line of a well-formed request: 400 as well. */
    fd = tcp_connect(port);
    assert_int_equal(send(fd, "GET /metrics\0 HTTP/1.1\r\n\r\n", 27, MSG_NOSIGNAL), 27);
    expect_400(fd, MSG_WAITALL);

    assert_int_equal(http_counters(srv).dropped[KVT_MHTTP_BAD_REQUEST], 2);
    kvt_metrics_http_destroy(srv);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_promtool_catches_bad_pages),
        cmocka_unit_test(test_render_basic_and_histogram),
        cmocka_unit_test(test_render_peer_label),
        cmocka_unit_test(test_accumulator_keeps_running_totals),
        cmocka_unit_test(test_accumulator_refuses_bad_deltas),
        cmocka_unit_test(test_node_samples),
        cmocka_unit_test(test_escaping_and_names),
        cmocka_unit_test(test_render_refuses_bad_samples),
        cmocka_unit_test(test_render_two_labels),
        cmocka_unit_test(test_render_out_of_memory),
        cmocka_unit_test(test_http_endpoints),
        cmocka_unit_test(test_http_publish_while_serving),
        cmocka_unit_test(test_http_render_failure_is_500),
        cmocka_unit_test(test_http_listen_errors_and_cleanup),
        cmocka_unit_test(test_http_idle_crowd_cannot_block_scrapes),
        cmocka_unit_test(test_http_read_and_write_timeouts),
        cmocka_unit_test(test_http_bad_requests),
        cmocka_unit_test(test_http_nul_in_request),
    };

    return cmocka_run_group_tests(tests, NULL, NULL);
}

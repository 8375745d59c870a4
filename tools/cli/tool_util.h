/* Helpers shared by the kvtier CLI and kvtier-load (tools/cli/, tools/load/):
 * hex keys, deterministic chunk content, a tiny HTTP/1.0 GET for /metrics and
 * /healthz, a Prometheus text parser and a progress line. None of them touch the
 * daemon's internals: the tools speak only <kvtier/client.h> and HTTP. */
#ifndef KVT_TOOL_UTIL_H
#define KVT_TOOL_UTIL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "kvtier/client.h"

#define KVT_TOOL_EX_USAGE 2 /* bad command line */
#define KVT_TOOL_EX_FAIL  1 /* the operation failed */

/* "00ff.." (even length, 2..128 digits, optional 0x) -> key; -EINVAL otherwise. */
int kvt_tool_parse_key(const char *hex, struct kvtier_key *key);
/* key -> lowercase hex, NUL-terminated; out needs 2 * KVTIER_KEY_MAX + 1 bytes. */
void kvt_tool_key_hex(const struct kvtier_key *key, char *out);

/* Strict number parsers: the whole string, in range; -EINVAL otherwise. */
int kvt_tool_parse_u64(const char *s, uint64_t min, uint64_t max, uint64_t *v_p);
int kvt_tool_parse_double(const char *s, double min, double max, double *v_p);

/* Content of a test chunk: a function of seed and offset only, so any writer (any
 * node, any process) produces the same bytes for the same seed. */
void kvt_tool_content_fill(uint64_t seed, uint8_t *buf, size_t len);
/* Offset of the first byte of buf that differs from the content, or len. */
size_t kvt_tool_content_check(uint64_t seed, const uint8_t *buf, size_t len);
/* The content seed of a key (kvtier-load: content is a function of the key). */
uint64_t kvt_tool_key_seed(const struct kvtier_key *key);
/* XXH3-64 of buf (what `kvtier get` prints). */
uint64_t kvt_tool_hash(const void *buf, size_t len);

/* "host:port" (host may be [v6]) -> parts; -EINVAL if malformed. */
int kvt_tool_parse_hostport(const char *s, char *host, size_t host_len, char *port,
                            size_t port_len);

/* GET http://hostport/path with a timeout; *body_p (NUL-terminated, free()) and
 * *status_p on success. -ECONNREFUSED, -ETIMEDOUT, -EPROTO (not HTTP), ... */
int kvt_tool_http_get(const char *hostport, const char *path, int timeout_ms, int *status_p,
                      char **body_p, size_t *len_p);

/* One sample of the Prometheus text format. */
struct kvt_prom_sample {
    char name[128];
    char labels[256]; /* the text between the braces, "" when none */
    double value;
};
struct kvt_prom_samples {
    struct kvt_prom_sample *s;
    size_t n;
};
/* Parses the text format (comments skipped); -EPROTO names the first bad line
 * in *bad_line_p (1-based, may be NULL). */
int kvt_tool_prom_parse(const char *text, struct kvt_prom_samples *out, size_t *bad_line_p);
void kvt_tool_prom_free(struct kvt_prom_samples *ps);
/* The value of label key in a sample's label text into out; false if absent. */
bool kvt_tool_prom_label(const struct kvt_prom_sample *s, const char *key, char *out,
                         size_t out_len);

/* Progress: on a terminal one line redrawn in place, otherwise a plain line at most
 * every plain_every_s seconds. frac < 0: no bar (unknown total). */
struct kvt_progress {
    FILE *f;
    bool tty;
    double plain_every_s;
    double last_plain_s;
    bool drawn;
};
void kvt_progress_init(struct kvt_progress *p, FILE *f, double plain_every_s);
void kvt_progress_update(struct kvt_progress *p, double now_s, double frac, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* Ends the redrawn line (newline) so later output starts on a fresh line. */
void kvt_progress_done(struct kvt_progress *p);

/* Human-readable errno text for a negative errno from the client library. */
const char *kvt_tool_strerror(int neg_errno);

double kvt_tool_now_s(void);

#endif

/* Helpers shared by the kvtier CLI and kvtier-load (tools/cli/, tools/load/):
 * hex keys, deterministic chunk content and a progress line. None of them touch the
 * daemon's internals: the tools speak only <kvtier/client.h>. */
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

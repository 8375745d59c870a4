/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer target for kvtier-replay's trace (tools/replay, docs/replay-format.md):
 * the line reader, jansson's parse of each line and the replay's own reading of its
 * fields (op, req, keys as hex or integers, params and kv_load_tiers, new/preempted,
 * success), and the manager calls they drive, through kvt__replay_text (the tool
 * without its command line) as kvtier-replay runs one policy.
 *
 * Input: byte 0 picks the manager: bit 0 the policy (lru, arc), bits 1-3 the primary's
 * chunks (1..8, so that evictions happen), bit 4 an example tier behind it (delay=1,
 * so promotions and cascades run). The rest is the trace. (Seeds in corpus/replay:
 * docs/replay-format.md's example and a line of every op, and hostile lines: bad JSON,
 * wrong types, unknown ops and requests, bad keys, deep nesting, NULs.)
 *
 * Checked on every input, beyond the sanitizers' own checks:
 * - the replay exits 0 or 65, nothing else;
 * - 65 says one line, "kvtier-replay: fuzz:<N>: ..." with N a line of the trace, and
 *   prints no summary; the replay of the lines before N alone exits 0 (the replay
 *   stops at the first bad line, and nothing before it was bad);
 * - 0 prints one result per replayed line (lines neither empty nor comments) and
 *   then one summary whose "lines" is the trace's line count. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "replay.h"
#include "fuzz_check.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define EX_DATAERR 65

struct run {
    char *out, *err;
    size_t out_len, err_len;
    int status;
};

static void replay(const char *text, size_t len, uint8_t mode, struct run *r)
{
    FILE *out = open_memstream(&r->out, &r->out_len), *err = open_memstream(&r->err, &r->err_len);

    CHECK(out != NULL && err != NULL);
    r->status = kvt__replay_text(text, len, (mode & 1) ? "arc" : "lru", 1 + ((mode >> 1) & 7),
                                 (mode & 16) ? "example:delay=1" : NULL, out, err);
    CHECK(fclose(out) == 0 && fclose(err) == 0);
}

static size_t count(const char *s, size_t len, char c)
{
    size_t n = 0;

    for (size_t i = 0; i < len; i++)
        n += s[i] == c;
    return n;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const char *text = (const char *)data + 1;
    size_t len, lines = 0, replayed = 0;
    struct run r;

    if (size == 0)
        return 0;
    len = size - 1;
    /* The trace's lines as getline splits them, and those the replay runs. */
    for (size_t at = 0; at < len; lines++) {
        const char *nl = memchr(text + at, '\n', len - at);
        size_t end = nl != NULL ? (size_t)(nl - text) + 1 : len;

        replayed += text[at] != '\0' && text[at] != '\n' && text[at] != '#';
        at = end;
    }
    replay(text, len, data[0], &r);
    CHECK(r.status == 0 || r.status == EX_DATAERR);
    if (r.status == EX_DATAERR) {
        unsigned long bad;
        char *end;

        CHECK(strncmp(r.err, "kvtier-replay: fuzz:", 20) == 0);
        bad = strtoul(r.err + 20, &end, 10);
        CHECK(end > r.err + 20 && *end == ':' && bad >= 1 && bad <= lines);
        CHECK(count(r.err, r.err_len, '\n') == 1 && r.err[r.err_len - 1] == '\n');
        CHECK(strstr(r.out, "{\"summary\"") == NULL);
        /* the lines before the bad one replay */
        const char *cut = text;

        for (unsigned long i = 1; i < bad; i++)
            cut = (const char *)memchr(cut, '\n', len - (size_t)(cut - text)) + 1;
        free(r.out);
        free(r.err);
        replay(text, (size_t)(cut - text), data[0], &r);
        if (r.status != 0)
            fprintf(stderr, "fuzz_replay: the lines before line %lu do not replay: %s", bad, r.err);
        CHECK(r.status == 0);
    } else {
        char want[64];

        CHECK(r.err_len == 0);
        CHECK(count(r.out, r.out_len, '\n') == replayed + 1);
        snprintf(want, sizeof(want), "\"lines\":%zu,", lines);
        CHECK(strstr(r.out, want) != NULL);
    }
    free(r.out);
    free(r.err);
    return 0;
}

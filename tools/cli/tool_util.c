/* SPDX-License-Identifier: Apache-2.0 */
/* Helpers of the kvtier CLI and kvtier-load (see tool_util.h).
 *
 * Chunk content is splitmix64 over (seed + word index): cheap enough to generate
 * and check at memory speed, and a function of the seed alone, so a chunk stored by
 * one node and pulled by another verifies the same everywhere. The tools speak to
 * the daemon through its engine API only. */
#include "tool_util.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <xxhash.h>

static int hexval(int c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    c = tolower(c);
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    return -1;
}

int kvt_tool_parse_key(const char *hex, struct kvtier_key *key)
{
    uint8_t b[KVTIER_KEY_MAX];
    size_t len;

    if (hex == NULL)
        return -EINVAL;
    if (hex[0] == '0' && (hex[1] == 'x' || hex[1] == 'X'))
        hex += 2;
    len = strlen(hex);
    if (len == 0 || len % 2 != 0 || len / 2 > KVTIER_KEY_MAX)
        return -EINVAL;
    for (size_t i = 0; i < len / 2; i++) {
        int hi = hexval((unsigned char)hex[2 * i]), lo = hexval((unsigned char)hex[2 * i + 1]);

        if (hi < 0 || lo < 0)
            return -EINVAL;
        b[i] = (uint8_t)(hi << 4 | lo);
    }
    return kvtier_key_set(key, b, len / 2);
}

void kvt_tool_key_hex(const struct kvtier_key *key, char *out)
{
    static const char digits[] = "0123456789abcdef";

    for (size_t i = 0; i < key->len; i++) {
        out[2 * i] = digits[key->bytes[i] >> 4];
        out[2 * i + 1] = digits[key->bytes[i] & 15];
    }
    out[2 * key->len] = '\0';
}

int kvt_tool_parse_u64(const char *s, uint64_t min, uint64_t max, uint64_t *v_p)
{
    char *end;
    unsigned long long v;

    if (s == NULL || *s == '\0' || *s == '-' || isspace((unsigned char)*s))
        return -EINVAL;
    errno = 0;
    v = strtoull(s, &end, 0);
    if (errno != 0 || *end != '\0' || v < min || v > max)
        return -EINVAL;
    *v_p = v;
    return 0;
}

int kvt_tool_parse_double(const char *s, double min, double max, double *v_p)
{
    char *end;
    double v;

    if (s == NULL || *s == '\0' || isspace((unsigned char)*s))
        return -EINVAL;
    errno = 0;
    v = strtod(s, &end);
    if (errno != 0 || *end != '\0' || !isfinite(v) || v < min || v > max)
        return -EINVAL;
    *v_p = v;
    return 0;
}

static inline uint64_t splitmix64(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

void kvt_tool_content_fill(uint64_t seed, uint8_t *buf, size_t len)
{
    size_t words = len / 8;
    uint64_t w;

    for (size_t i = 0; i < words; i++) {
        w = splitmix64(seed + i * 0x9e3779b97f4a7c15ull);
        memcpy(buf + 8 * i, &w, 8);
    }
    if (len % 8) {
        w = splitmix64(seed + words * 0x9e3779b97f4a7c15ull);
        memcpy(buf + 8 * words, &w, len % 8);
    }
}

size_t kvt_tool_content_check(uint64_t seed, const uint8_t *buf, size_t len)
{
    size_t words = len / 8;
    uint64_t w, got;

    for (size_t i = 0; i < words; i++) {
        w = splitmix64(seed + i * 0x9e3779b97f4a7c15ull);
        memcpy(&got, buf + 8 * i, 8);
        if (got != w) {
            for (size_t j = 0; j < 8; j++)
                if (((const uint8_t *)&got)[j] != ((const uint8_t *)&w)[j])
                    return 8 * i + j;
        }
    }
    if (len % 8) {
        uint8_t tail[8];

        w = splitmix64(seed + words * 0x9e3779b97f4a7c15ull);
        memcpy(tail, &w, 8);
        for (size_t j = 0; j < len % 8; j++)
            if (buf[8 * words + j] != tail[j])
                return 8 * words + j;
    }
    return len;
}

uint64_t kvt_tool_key_seed(const struct kvtier_key *key)
{
    return XXH3_64bits(key->bytes, key->len);
}

uint64_t kvt_tool_hash(const void *buf, size_t len)
{
    return XXH3_64bits(buf, len);
}

void kvt_progress_init(struct kvt_progress *p, FILE *f, double plain_every_s)
{
    p->f = f;
    p->tty = isatty(fileno(f));
    p->plain_every_s = plain_every_s;
    p->last_plain_s = -1e9;
    p->drawn = false;
}

void kvt_progress_update(struct kvt_progress *p, double now_s, double frac, const char *fmt, ...)
{
    char text[256], bar[41];
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(text, sizeof(text), fmt, ap);
    va_end(ap);
    if (!p->tty) {
        if (now_s - p->last_plain_s < p->plain_every_s)
            return;
        p->last_plain_s = now_s;
        fprintf(p->f, "%s\n", text);
        fflush(p->f);
        return;
    }
    if (frac >= 0) {
        int fill = (int)(frac > 1 ? 40 : frac * 40);

        memset(bar, '#', (size_t)fill);
        memset(bar + fill, '.', (size_t)(40 - fill));
        bar[40] = '\0';
        fprintf(p->f, "\r\033[K[%s] %3.0f%% %s", bar, (frac > 1 ? 1 : frac) * 100, text);
    } else {
        fprintf(p->f, "\r\033[K%s", text);
    }
    fflush(p->f);
    p->drawn = true;
}

void kvt_progress_done(struct kvt_progress *p)
{
    if (p->tty && p->drawn) {
        fputc('\n', p->f);
        fflush(p->f);
    }
    p->drawn = false;
}

const char *kvt_tool_strerror(int neg_errno)
{
    switch (-neg_errno) {
    case ENOENT:
        return "no such socket (is kvtierd running?)";
    case ECONNREFUSED:
        return "connection refused (is kvtierd running?)";
    case EPROTO:
        return "protocol error (daemon of another version?)";
    case EBADFD:
        return "the node's region file is shorter than the node says (cut under it?)";
    case ENOSPC:
        return "cannot store (no room)";
    default:
        return strerror(-neg_errno);
    }
}

double kvt_tool_now_s(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Helpers of the kvtier CLI and kvtier-load (see tool_util.h).
 *
 * Chunk content is splitmix64 over (seed + word index): cheap enough to generate
 * and check at memory speed, and a function of the seed alone, so a chunk stored by
 * one node and pulled by another verifies the same everywhere. The HTTP client is
 * deliberately minimal (HTTP/1.0, Connection: close, read to EOF): the daemon's
 * /metrics and /healthz are the only servers it talks to. */
#include "tool_util.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <netdb.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
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

int kvt_tool_parse_hostport(const char *s, char *host, size_t host_len, char *port, size_t port_len)
{
    const char *colon, *h = s;
    size_t hl;

    if (s == NULL || *s == '\0')
        return -EINVAL;
    if (*s == '[') {
        const char *close = strchr(s, ']');

        if (close == NULL || close[1] != ':')
            return -EINVAL;
        h = s + 1;
        hl = (size_t)(close - h);
        colon = close + 1;
    } else {
        colon = strrchr(s, ':');
        if (colon == NULL)
            return -EINVAL;
        hl = (size_t)(colon - s);
    }
    if (hl == 0 || hl >= host_len || strlen(colon + 1) == 0 || strlen(colon + 1) >= port_len)
        return -EINVAL;
    for (const char *p = colon + 1; *p; p++)
        if (!isdigit((unsigned char)*p))
            return -EINVAL;
    if (atoi(colon + 1) < 1 || atoi(colon + 1) > 65535)
        return -EINVAL;
    memcpy(host, h, hl);
    host[hl] = '\0';
    strcpy(port, colon + 1);
    return 0;
}

int kvt_tool_http_get(const char *hostport, const char *path, int timeout_ms, int *status_p,
                      char **body_p, size_t *len_p)
{
    char host[256], port[16], req[512];
    struct addrinfo hints = {.ai_socktype = SOCK_STREAM}, *res = NULL;
    struct timeval tv = {.tv_sec = timeout_ms / 1000, .tv_usec = (timeout_ms % 1000) * 1000};
    char *buf = NULL, *body;
    size_t len = 0, cap = 0;
    int fd = -1, rc, status;

    rc = kvt_tool_parse_hostport(hostport, host, sizeof(host), port, sizeof(port));
    if (rc < 0)
        return rc;
    rc = getaddrinfo(host, port, &hints, &res);
    if (rc != 0)
        return rc == EAI_SYSTEM ? -errno : -EHOSTUNREACH;
    fd = socket(res->ai_family, res->ai_socktype | SOCK_CLOEXEC, res->ai_protocol);
    if (fd < 0) {
        rc = -errno;
        goto out;
    }
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv)); /* bounds connect too */
    if (connect(fd, res->ai_addr, res->ai_addrlen) < 0) {
        rc = errno == EINPROGRESS || errno == EAGAIN ? -ETIMEDOUT : -errno;
        goto out;
    }
    snprintf(req, sizeof(req), "GET %s HTTP/1.0\r\nHost: %s\r\nConnection: close\r\n\r\n", path,
             hostport);
    for (size_t off = 0, n = strlen(req); off < n;) {
        ssize_t w = send(fd, req + off, n - off, MSG_NOSIGNAL);

        if (w < 0) {
            rc = errno == EAGAIN ? -ETIMEDOUT : -errno;
            goto out;
        }
        off += (size_t)w;
    }
    for (;;) {
        ssize_t r;

        if (cap - len < 4096) {
            char *nb;

            if (cap > (64u << 20)) {
                rc = -EMSGSIZE;
                goto out;
            }
            nb = realloc(buf, cap ? 2 * cap : 16384);
            if (nb == NULL) {
                rc = -ENOMEM;
                goto out;
            }
            buf = nb;
            cap = cap ? 2 * cap : 16384;
        }
        r = recv(fd, buf + len, cap - len - 1, 0);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            rc = errno == EAGAIN ? -ETIMEDOUT : -errno;
            goto out;
        }
        if (r == 0)
            break;
        len += (size_t)r;
    }
    if (buf == NULL) {
        rc = -EPROTO;
        goto out;
    }
    buf[len] = '\0';
    if (sscanf(buf, "HTTP/%*d.%*d %d", &status) != 1) {
        rc = -EPROTO;
        goto out;
    }
    body = strstr(buf, "\r\n\r\n");
    if (body == NULL) {
        rc = -EPROTO;
        goto out;
    }
    body += 4;
    len -= (size_t)(body - buf);
    memmove(buf, body, len + 1);
    *status_p = status;
    *body_p = buf;
    if (len_p != NULL)
        *len_p = len;
    buf = NULL;
    rc = 0;
out:
    free(buf);
    if (fd >= 0)
        close(fd);
    freeaddrinfo(res);
    return rc;
}

static int prom_line(const char *line, size_t n, struct kvt_prom_sample *s)
{
    const char *p = line, *end = line + n, *v;
    size_t nl;
    char num[64], *e;

    while (p < end && (isalnum((unsigned char)*p) || *p == '_' || *p == ':'))
        p++;
    nl = (size_t)(p - line);
    if (nl == 0 || nl >= sizeof(s->name) || isdigit((unsigned char)line[0]))
        return -EPROTO;
    memcpy(s->name, line, nl);
    s->name[nl] = '\0';
    s->labels[0] = '\0';
    if (p < end && *p == '{') {
        const char *q = ++p;
        bool in_str = false;

        while (q < end && (in_str || *q != '}')) {
            if (*q == '\\' && in_str && q + 1 < end)
                q++;
            else if (*q == '"')
                in_str = !in_str;
            q++;
        }
        if (q >= end || (size_t)(q - p) >= sizeof(s->labels))
            return -EPROTO;
        memcpy(s->labels, p, (size_t)(q - p));
        s->labels[q - p] = '\0';
        p = q + 1;
    }
    if (p >= end || (*p != ' ' && *p != '\t'))
        return -EPROTO;
    while (p < end && (*p == ' ' || *p == '\t'))
        p++;
    v = p;
    while (p < end && *p != ' ' && *p != '\t')
        p++;
    if (p == v || (size_t)(p - v) >= sizeof(num))
        return -EPROTO;
    memcpy(num, v, (size_t)(p - v));
    num[p - v] = '\0';
    if (strcmp(num, "+Inf") == 0)
        s->value = INFINITY;
    else if (strcmp(num, "-Inf") == 0)
        s->value = -INFINITY;
    else if (strcmp(num, "NaN") == 0)
        s->value = NAN;
    else {
        s->value = strtod(num, &e);
        if (*e != '\0')
            return -EPROTO;
    }
    return 0; /* an optional timestamp may follow */
}

int kvt_tool_prom_parse(const char *text, struct kvt_prom_samples *out, size_t *bad_line_p)
{
    struct kvt_prom_samples ps = {0};
    size_t cap = 0, lineno = 0;
    const char *p = text;

    while (*p) {
        const char *nl = strchr(p, '\n');
        size_t n = nl ? (size_t)(nl - p) : strlen(p);

        lineno++;
        while (n > 0 && (p[n - 1] == '\r' || p[n - 1] == ' '))
            n--;
        if (n > 0 && p[0] != '#') {
            if (ps.n == cap) {
                struct kvt_prom_sample *ns = realloc(ps.s, (cap ? 2 * cap : 64) * sizeof(*ns));

                if (ns == NULL) {
                    kvt_tool_prom_free(&ps);
                    return -ENOMEM;
                }
                ps.s = ns;
                cap = cap ? 2 * cap : 64;
            }
            if (prom_line(p, n, &ps.s[ps.n]) < 0) {
                kvt_tool_prom_free(&ps);
                if (bad_line_p != NULL)
                    *bad_line_p = lineno;
                return -EPROTO;
            }
            ps.n++;
        }
        p += nl ? (size_t)(nl - p) + 1 : strlen(p);
    }
    *out = ps;
    return 0;
}

void kvt_tool_prom_free(struct kvt_prom_samples *ps)
{
    free(ps->s);
    ps->s = NULL;
    ps->n = 0;
}

bool kvt_tool_prom_label(const struct kvt_prom_sample *s, const char *key, char *out,
                         size_t out_len)
{
    const char *p = s->labels;
    size_t kl = strlen(key);

    while (*p) {
        const char *eq = strchr(p, '=');
        size_t o = 0;
        bool match;

        if (eq == NULL || eq[1] != '"')
            return false;
        match = (size_t)(eq - p) == kl && strncmp(p, key, kl) == 0;
        p = eq + 2;
        while (*p && *p != '"') {
            char c = *p;

            if (c == '\\' && p[1]) {
                p++;
                c = *p == 'n' ? '\n' : *p;
            }
            if (match && o + 1 < out_len)
                out[o++] = c;
            p++;
        }
        if (*p != '"')
            return false;
        if (match) {
            out[o] = '\0';
            return true;
        }
        p++;
        while (*p == ',' || *p == ' ')
            p++;
    }
    return false;
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

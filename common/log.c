/* Logging: one line per event on stderr, "<LEVEL> <module>: text". The level is a
 * process-wide setting (daemon config or KVT_LOG_LEVEL in the environment).
 *
 * Strings from engines and peers go through kvt_log_escape at their call sites (a
 * readable, unambiguous form), and kvt_log_write replaces any control byte still in a
 * line, so that no input can end a line early and forge the next one. */
#include <errno.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvt/log.h"

static const char *const level_names[] = {"error", "warn", "info", "debug"};
/* Read by every thread that logs: atomic, and -1 until the environment is read
 * (racing first readers all compute the same value). */
static _Atomic int log_level = -1;

int kvt_log_parse_level(const char *s, enum kvt_log_level *level_p)
{
    for (size_t i = 0; i < sizeof(level_names) / sizeof(level_names[0]); i++) {
        if (strcmp(s, level_names[i]) == 0) {
            *level_p = (enum kvt_log_level)i;
            return 0;
        }
    }
    return -EINVAL;
}

void kvt_log_set_level(enum kvt_log_level level)
{
    atomic_store_explicit(&log_level, (int)level, memory_order_relaxed);
}

enum kvt_log_level kvt_log_get_level(void)
{
    int l = atomic_load_explicit(&log_level, memory_order_relaxed);

    if (l < 0) {
        enum kvt_log_level from_env = KVT_LOG_WARN;
        const char *env = getenv("KVT_LOG_LEVEL");
        int unset = -1;

        if (env != NULL)
            kvt_log_parse_level(env, &from_env);
        /* A concurrent kvt_log_set_level wins over the environment. */
        atomic_compare_exchange_strong(&log_level, &unset, (int)from_env);
        l = atomic_load_explicit(&log_level, memory_order_relaxed);
    }
    return (enum kvt_log_level)l;
}

void kvt_log_write(enum kvt_log_level level, const char *module, const char *fmt, ...)
{
    char buf[1024];
    va_list ap;
    int n = snprintf(buf, sizeof(buf), "%s %s: ", level_names[level], module);
    va_start(ap, fmt);
    vsnprintf(buf + n, sizeof(buf) - (size_t)n, fmt, ap);
    va_end(ap);
    /* One event, one line: a control byte from an unescaped string cannot start
     * another. */
    for (char *p = buf; *p != '\0'; p++)
        if ((unsigned char)*p < 0x20 || *p == 0x7f)
            *p = '?';
    fprintf(stderr, "%s\n", buf);
}

/* The escaped form of byte c into e[4]; its length. */
static size_t escape_byte(unsigned char c, char e[4])
{
    static const char hex[] = "0123456789abcdef";

    if (c == '\\' || c == '\n' || c == '\r' || c == '\t') {
        e[0] = '\\';
        e[1] = c == '\\' ? '\\' : c == '\n' ? 'n' : c == '\r' ? 'r' : 't';
        return 2;
    }
    if (c >= 0x20 && c < 0x7f) {
        e[0] = (char)c;
        return 1;
    }
    e[0] = '\\';
    e[1] = 'x';
    e[2] = hex[c >> 4];
    e[3] = hex[c & 0xf];
    return 4;
}

const char *kvt_log_escape(char *buf, size_t len, const char *s)
{
    const unsigned char *p;
    size_t o = 0, total = 0;
    char e[4];

    if (len == 0)
        return buf;
    if (s == NULL)
        s = "(null)";
    for (p = (const unsigned char *)s; *p != '\0'; p++)
        total += escape_byte(*p, e);
    /* Cut short, the result keeps room for "..." after the last whole escape. */
    size_t room = total < len ? len - 1 : len >= 4 ? len - 4 : 0;

    for (p = (const unsigned char *)s; *p != '\0'; p++) {
        size_t n = escape_byte(*p, e);

        if (o + n > room)
            break;
        memcpy(buf + o, e, n);
        o += n;
    }
    if (total >= len && len >= 4) {
        memcpy(buf + o, "...", 3);
        o += 3;
    }
    buf[o] = '\0';
    return buf;
}

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

const char *kvt_log_escape(char *buf, size_t len, const char *s)
{
    static const char hex[] = "0123456789abcdef";
    size_t o = 0;

    if (len == 0)
        return buf;
    if (s == NULL)
        s = "(null)";
    for (const unsigned char *p = (const unsigned char *)s; *p != '\0'; p++) {
        char e[4];
        size_t n = 0;

        if (*p == '\\' || *p == '\n' || *p == '\r' || *p == '\t') {
            e[n++] = '\\';
            e[n++] = *p == '\\' ? '\\' : *p == '\n' ? 'n' : *p == '\r' ? 'r' : 't';
        } else if (*p >= 0x20 && *p < 0x7f) {
            e[n++] = (char)*p;
        } else {
            e[n++] = '\\';
            e[n++] = 'x';
            e[n++] = hex[*p >> 4];
            e[n++] = hex[*p & 0xf];
        }
        /* Room for this escape and, when more follows, for "..." after it. */
        if (o + n + (p[1] != '\0' ? 3 : 0) >= len) {
            if (len >= 4) { /* the reservation above left room for it */
                memcpy(buf + o, "...", 3);
                o += 3;
            } else {
                o = 0;
            }
            break;
        }
        memcpy(buf + o, e, n);
        o += n;
    }
    buf[o] = '\0';
    return buf;
}

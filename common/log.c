/* SPDX-License-Identifier: Apache-2.0 */
/* Logging: one line per event on stderr, "<time> <level> <module>: text", the time
 * in UTC to the microsecond (RFC 3339). When stderr is systemd's journal (the
 * JOURNAL_STREAM it exports names our stderr), the line starts with the syslog
 * priority instead ("<3>error module: text"): journald takes the priority from it
 * and stamps the time itself. The level is a process-wide setting (daemon config or
 * KVT_LOG_LEVEL in the environment).
 *
 * Strings from engines and peers go through kvt_log_escape at their call sites (a
 * readable, unambiguous form), and kvt_log_write replaces any control byte still in a
 * line, so that no input can end a line early and forge the next one. */
#include <errno.h>
#include <stdbool.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

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

/* Asked at every line (a getenv and an fstat: logging is not a hot path), so that a
 * stderr redirected later is followed. */
static bool stderr_is_journal(void)
{
    const char *env = getenv("JOURNAL_STREAM");
    unsigned long long dev, ino;
    struct stat st;

    return env != NULL && sscanf(env, "%llu:%llu", &dev, &ino) == 2 && fstat(2, &st) == 0 &&
           (unsigned long long)st.st_dev == dev && (unsigned long long)st.st_ino == ino;
}

/* The line's prefix: "<N>" (syslog priority) for the journal, else the UTC time. */
static int line_prefix(char *buf, size_t cap, enum kvt_log_level level)
{
    static const int syslog_prio[] = {3, 4, 6, 7}; /* err, warning, info, debug */
    struct timespec ts;
    struct tm tm;

    if (stderr_is_journal())
        return snprintf(buf, cap, "<%d>", syslog_prio[level]);
    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    return snprintf(buf, cap, "%04d-%02d-%02dT%02d:%02d:%02d.%06ldZ ", tm.tm_year + 1900,
                    tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000);
}

void kvt_log_write(enum kvt_log_level level, const char *module, const char *fmt, ...)
{
    char buf[1024];
    va_list ap;
    int n = line_prefix(buf, sizeof(buf), level);

    n += snprintf(buf + n, sizeof(buf) - (size_t)n, "%s %s: ", level_names[level], module);
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

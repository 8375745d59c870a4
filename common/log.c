/* Logging: one line per event on stderr, "<LEVEL> <module>: text". The level is a
 * process-wide setting (daemon config or KVT_LOG_LEVEL in the environment). */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvt/log.h"

static const char *const level_names[] = {"error", "warn", "info", "debug"};
static int log_level = -1; /* -1: not yet read from the environment */

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
    log_level = (int)level;
}

enum kvt_log_level kvt_log_get_level(void)
{
    if (log_level < 0) {
        enum kvt_log_level l = KVT_LOG_WARN;
        const char *env = getenv("KVT_LOG_LEVEL");
        if (env != NULL)
            kvt_log_parse_level(env, &l);
        log_level = (int)l;
    }
    return (enum kvt_log_level)log_level;
}

void kvt_log_write(enum kvt_log_level level, const char *module, const char *fmt, ...)
{
    char buf[1024];
    va_list ap;
    int n = snprintf(buf, sizeof(buf), "%s %s: ", level_names[level], module);
    va_start(ap, fmt);
    vsnprintf(buf + n, sizeof(buf) - (size_t)n, fmt, ap);
    va_end(ap);
    fprintf(stderr, "%s\n", buf);
}

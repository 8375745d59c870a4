/* SPDX-License-Identifier: Apache-2.0 */
/* One log family for the whole project: level-filtered lines to stderr,
 * "<level> <module>: message". Log once, where the error is found, with its cause.
 *
 * A string that comes from outside (an engine's name, a request id, a peer's address)
 * is logged through kvt_log_escape / KVT_LOG_STR, so that it cannot end the line or
 * forge another one. kvt_log_write also turns any control byte left in a line into
 * '?', so even a call site that forgot stays one line. */
#ifndef KVT_LOG_H
#define KVT_LOG_H

#include <stddef.h>

enum kvt_log_level {
    KVT_LOG_ERROR = 0,
    KVT_LOG_WARN = 1,
    KVT_LOG_INFO = 2,
    KVT_LOG_DEBUG = 3,
};

void kvt_log_set_level(enum kvt_log_level level);
enum kvt_log_level kvt_log_get_level(void);
/* Parses "error|warn|info|debug"; returns -EINVAL for anything else. */
int kvt_log_parse_level(const char *s, enum kvt_log_level *level_p);
void kvt_log_write(enum kvt_log_level level, const char *module, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Bytes of the buffer KVT_LOG_STR uses: a 63-character name escaped in full. */
#define KVT_LOG_ESC_MAX 256

/* Writes s into buf[0..len) as one printable line: printable ASCII stays as it is
 * but a backslash is doubled; newline, carriage return and tab become a backslash and
 * n, r or t; any other byte becomes a backslash, x and two hex digits. A result that
 * does not fit ends in "...". NULL prints as "(null)". Returns buf. */
const char *kvt_log_escape(char *buf, size_t len, const char *s);
/* kvt_log_escape into a temporary that lives until the end of the enclosing block:
 * kvt_warn(MOD, "client %s gone", KVT_LOG_STR(name)). */
#define KVT_LOG_STR(s) kvt_log_escape((char[KVT_LOG_ESC_MAX]){0}, KVT_LOG_ESC_MAX, (s))

#define KVT_LOG(level, module, ...)                                                                \
    do {                                                                                           \
        if ((level) <= kvt_log_get_level())                                                        \
            kvt_log_write((level), (module), __VA_ARGS__);                                         \
    } while (0)
#define kvt_error(module, ...) KVT_LOG(KVT_LOG_ERROR, module, __VA_ARGS__)
#define kvt_warn(module, ...)  KVT_LOG(KVT_LOG_WARN, module, __VA_ARGS__)
#define kvt_info(module, ...)  KVT_LOG(KVT_LOG_INFO, module, __VA_ARGS__)
#define kvt_debug(module, ...) KVT_LOG(KVT_LOG_DEBUG, module, __VA_ARGS__)

#endif

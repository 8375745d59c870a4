/* One log family for the whole project: level-filtered lines to stderr,
 * "<level> <module>: message". Log once, where the error is found, with its cause. */
#ifndef KVT_LOG_H
#define KVT_LOG_H

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

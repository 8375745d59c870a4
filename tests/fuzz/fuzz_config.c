/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer target for kvtierd's configuration (node/config.c): the YAML file and the
 * `--set key=value` overrides applied after it, through the schema, the derived values
 * and the cross-key checks, as kvt_config_load runs them (kvt__config_load_text: the
 * same loader with the file's text in memory), and the SIGHUP reload.
 *
 * Input: byte 0's bits 0-1 say how many --set arguments (0..3) end the input, each
 * after a NUL byte (taken from the end: an argument holds no NUL, as argv cannot; the
 * file's text may); the rest is the file's text. Bit 2: the text is the file of a
 * reload (kvt_config_reload, read from a memfd through its /proc path) over a running
 * configuration of the defaults. (Seeds in corpus/config: the shipped example, every
 * kind of key, nesting and dotted keys, lists both ways, --set, and hostile files:
 * duplicates, NULs, tabs, anchors and aliases, deep nesting, bad UTF-8, two
 * documents, cross-key conflicts.)
 *
 * Checked on every input, beyond the sanitizers' own checks:
 * - the load returns 0 or -EINVAL (a reload also -EPERM), nothing else;
 * - a failed load leaves the caller's struct unwritten and says one line that names
 *   where: "config fuzz:<line>: ..." with a line of the text (or an offset within it
 *   for bytes libyaml cannot read), or "option --set <one of the arguments>: ...";
 *   never the defaults (the table's defaults agree with each other);
 * - an accepted configuration re-validates: its dump loads again, to a configuration
 *   that dumps the same bytes and diffs as unchanged, and so does its copy;
 * - a failed reload leaves the running configuration as it was (the same dump); a
 *   reload that succeeds changed reloadable keys only and gives what a fresh load of
 *   the same file and arguments gives. */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "kvt/config.h"
#include "fuzz_check.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define NAME    "fuzz"
#define ERR_LEN 8192

/* The dump of cfg, malloc'd. */
static char *dump(const struct kvt_config *cfg)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);

    CHECK(f != NULL);
    kvt_config_dump(f, cfg);
    CHECK(fclose(f) == 0);
    return buf;
}

/* Line breaks as libyaml counts them (\r, \n, and NEL, LS, PS of UTF-8), at most. */
static unsigned long max_line(const char *text, size_t len)
{
    unsigned long n = 1;

    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)text[i];

        n += c == '\n' || c == '\r' || c == 0x85 || c == 0xa8 || c == 0xa9;
    }
    return n;
}

/* err is one line naming where: prefix (the file's name) at a line or an offset of
 * the text, or one of the --set arguments. */
static void check_err(const char *err, const char *prefix, const char *text, size_t len,
                      char *const *sets, size_t n_sets)
{
    size_t plen = strlen(prefix);
    bool named = false;

    CHECK(err[0] != '\0' && strlen(err) < ERR_LEN - 1);
    for (const char *c = err; *c != '\0'; c++)
        CHECK((unsigned char)*c >= 0x20 && *c != 0x7f);
    if (strncmp(err, prefix, plen) == 0 && err[plen] == ':') {
        const char *p = err + plen + 1;
        char *end;
        unsigned long v;

        if (strncmp(p, " offset ", 8) == 0) {
            v = strtoul(p + 8, &end, 10);
            named = end > p + 8 && *end == ':' && v <= len;
        } else {
            v = strtoul(p, &end, 10);
            named = end > p && *end == ':' && v >= 1 && v <= max_line(text, len);
        }
    }
    for (size_t i = 0; i < n_sets && !named; i++) {
        /* the argument up to its first control character (escaped from there on) */
        size_t alen = strlen(sets[i]), plain = 0;

        while (plain < alen && (unsigned char)sets[i][plain] >= 0x20 && sets[i][plain] != 0x7f)
            plain++;
        named = strncmp(err, "option --set ", 13) == 0 && strncmp(err + 13, sets[i], plain) == 0 &&
                err[13 + plain] == (plain == alen ? ':' : '\\');
    }
    if (!named)
        fprintf(stderr, "fuzz_config: the error names no line or argument: %s\n", err);
    CHECK(named);
}

/* cfg (accepted) re-validates: its dump loads to one that dumps the same. */
static void check_accepted(const struct kvt_config *cfg)
{
    struct kvt_config again, copy;
    struct kvt_config_diff d;
    char *text = dump(cfg), *text2, err[ERR_LEN];
    int rc = kvt__config_load_text(&again, "dump", text, strlen(text), NULL, 0, err, sizeof(err));

    if (rc != 0)
        fprintf(stderr, "fuzz_config: the dump does not load: %s\n%s", err, text);
    CHECK(rc == 0);
    text2 = dump(&again);
    CHECK(strcmp(text, text2) == 0);
    kvt_config_diff_reloadable(cfg, &again, &d);
    CHECK(d.n_changed == 0);
    free(text2);
    CHECK(kvt_config_copy(&copy, cfg) == 0);
    text2 = dump(&copy);
    CHECK(strcmp(text, text2) == 0);
    free(text2);
    kvt_config_free(&copy);
    kvt_config_free(&again);
    free(text);
}

static void check_load(const char *text, size_t len, char *const *sets, size_t n_sets)
{
    struct kvt_config cfg, pattern;
    char err[ERR_LEN];
    int rc;

    memset(&pattern, 0x5a, sizeof(pattern));
    memcpy(&cfg, &pattern, sizeof(cfg));
    rc = kvt__config_load_text(&cfg, NAME, text, len, sets, n_sets, err, sizeof(err));
    CHECK(rc == 0 || rc == -EINVAL);
    if (rc != 0) {
        CHECK(memcmp(&cfg, &pattern, sizeof(cfg)) == 0);
        check_err(err, "config " NAME, text, len, sets, n_sets);
        return;
    }
    check_accepted(&cfg);
    kvt_config_free(&cfg);
}

/* A reload of the text (a file) over the defaults. */
static void check_reload(const char *text, size_t len, char *const *sets, size_t n_sets)
{
    static int fd = -1;
    struct kvt_config running, fresh;
    struct kvt_config_diff d;
    char path[64], prefix[80], err[ERR_LEN], *before, *after;
    int rc;

    if (fd < 0)
        CHECK((fd = memfd_create("fuzz_config", MFD_CLOEXEC)) >= 0);
    CHECK(ftruncate(fd, 0) == 0);
    CHECK(pwrite(fd, text, len, 0) == (ssize_t)len);
    snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
    snprintf(prefix, sizeof(prefix), "config %s", path);
    CHECK(kvt_config_defaults(&running) == 0);
    before = dump(&running);
    rc = kvt_config_reload(&running, path, sets, n_sets, &d, err, sizeof(err));
    CHECK(rc == 0 || rc == -EINVAL || rc == -EPERM);
    after = dump(&running);
    if (rc != 0) {
        CHECK(strcmp(before, after) == 0);
        if (rc == -EINVAL)
            check_err(err, prefix, text, len, sets, n_sets);
        else
            CHECK(strstr(err, ": cannot change at run time") != NULL);
    } else {
        for (size_t i = 0; i < d.n_changed; i++)
            CHECK(kvt_config_key_reloadable(d.changed[i]));
        CHECK(kvt__config_load_text(&fresh, path, text, len, sets, n_sets, err, sizeof(err)) == 0);
        free(before);
        before = dump(&fresh);
        CHECK(strcmp(before, after) == 0);
        kvt_config_free(&fresh);
    }
    free(before);
    free(after);
    kvt_config_free(&running);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *buf, *sets[3];
    size_t n_sets, len;

    if (size == 0)
        return 0;
    n_sets = data[0] & 3;
    len = size - 1;
    buf = malloc(len + 1);
    CHECK(buf != NULL);
    memcpy(buf, data + 1, len);
    buf[len] = '\0';
    for (size_t i = n_sets; i-- > 0;) {
        char *nul = memrchr(buf, '\0', len);

        if (nul == NULL) { /* fewer arguments than byte 0 says: not an input */
            free(buf);
            return 0;
        }
        sets[i] = nul + 1;
        len = (size_t)(nul - buf);
    }
    if (data[0] & 4)
        check_reload(buf, len, sets, n_sets);
    else
        check_load(buf, len, sets, n_sets);
    free(buf);
    return 0;
}

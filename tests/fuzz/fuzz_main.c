/* SPDX-License-Identifier: Apache-2.0 */
/* A stand-in for libFuzzer's main, for builds without KVT_FUZZ: runs the target
 * once on every file named on the command line (directories: every regular file in
 * them), so each sanitizer build of the test suite replays the committed seed
 * corpora. Exit status 0 when every input ran (a finding aborts the process). */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int run_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    uint8_t *buf = NULL;
    size_t len = 0, cap = 0, n;

    if (f == NULL) {
        perror(path);
        return -1;
    }
    do {
        if (len == cap) {
            cap = cap ? 2 * cap : 4096;
            buf = realloc(buf, cap);
            if (buf == NULL)
                abort();
        }
        n = fread(buf + len, 1, cap - len, f);
        len += n;
    } while (n > 0);
    fclose(f);
    LLVMFuzzerTestOneInput(buf, len);
    free(buf);
    return 0;
}

int main(int argc, char **argv)
{
    unsigned ran = 0, failed = 0;

    for (int i = 1; i < argc; i++) {
        struct stat st;

        if (stat(argv[i], &st) != 0) {
            perror(argv[i]);
            failed++;
            continue;
        }
        if (!S_ISDIR(st.st_mode)) {
            failed += run_file(argv[i]) != 0;
            ran++;
            continue;
        }
        DIR *d = opendir(argv[i]);
        struct dirent *e;

        if (d == NULL) {
            perror(argv[i]);
            failed++;
            continue;
        }
        while ((e = readdir(d)) != NULL) {
            char path[4096];

            snprintf(path, sizeof(path), "%s/%s", argv[i], e->d_name);
            if (stat(path, &st) != 0 || !S_ISREG(st.st_mode))
                continue;
            failed += run_file(path) != 0;
            ran++;
        }
        closedir(d);
    }
    printf("%s: %u inputs run, %u unreadable\n", argv[0], ran, failed);
    return ran == 0 || failed != 0;
}

/* SPDX-License-Identifier: Apache-2.0 */
/* kvtier-bench: the benchmarks of kvtier, one subcommand per module. Each
 * subcommand lives in bench_<name>.c; the weak declarations let a build without
 * that module still link and say so instead of failing. */
#include <stdio.h>
#include <string.h>

#include "bench.h"
#include "kvt/version.h"

struct subcommand {
    const char *name;
    int (*run)(int argc, char **argv);
    const char *what;
};

static const struct subcommand subcommands[] = {
    {"core", kvt_bench_core, "primary tier: ns per lookup / store / touch, index bytes"},
    {"storage", kvt_bench_storage, "storage tier: write/read GB/s vs fio, index rebuild"},
    {"transport", kvt_bench_transport, "READ GB/s and 4 KiB latency vs ucx_perftest"},
    {"pull", kvt_bench_pull, "two nodes: pull rate and lookup-to-HIT vs transport, redis"},
    {"engine", kvt_bench_engine, "engine API: us per call, ring vs socket vs in-process vs floor"},
    {"connect", kvt_bench_connect, "peer link set-up: dial to authenticated (UP), us"},
};

static void usage(FILE *f)
{
    fprintf(f, "usage: kvtier-bench <subcommand> [--json] [options]\n"
               "       kvtier-bench --version\n\nsubcommands:\n");
    for (size_t i = 0; i < sizeof(subcommands) / sizeof(subcommands[0]); i++)
        fprintf(f, "  %-10s %s%s\n", subcommands[i].name, subcommands[i].what,
                subcommands[i].run ? "" : " (not built)");
}

int main(int argc, char **argv)
{
    if (argc < 2 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    if (strcmp(argv[1], "--version") == 0 || strcmp(argv[1], "-V") == 0) {
        printf("kvtier-bench %s\n", kvt_version_string());
        return 0;
    }
    for (size_t i = 0; i < sizeof(subcommands) / sizeof(subcommands[0]); i++) {
        if (strcmp(argv[1], subcommands[i].name) != 0)
            continue;
        if (subcommands[i].run == NULL) {
            fprintf(stderr, "kvtier-bench: '%s' is not built in this build\n", argv[1]);
            return 2;
        }
        return subcommands[i].run(argc - 1, argv + 1);
    }
    fprintf(stderr, "kvtier-bench: unknown subcommand '%s'\n", argv[1]);
    usage(stderr);
    return 2;
}

/* SPDX-License-Identifier: Apache-2.0 */
/* Subcommands of kvtier-bench. Each takes (argc, argv) with argv[0] the subcommand
 * name and returns the process exit status. Weak: a subcommand whose file is not in
 * the build is NULL. */
#ifndef KVT_BENCH_H
#define KVT_BENCH_H

int kvt_bench_core(int argc, char **argv) __attribute__((weak));
int kvt_bench_storage(int argc, char **argv) __attribute__((weak));
int kvt_bench_transport(int argc, char **argv) __attribute__((weak));
int kvt_bench_pull(int argc, char **argv) __attribute__((weak));
int kvt_bench_engine(int argc, char **argv) __attribute__((weak));
int kvt_bench_connect(int argc, char **argv) __attribute__((weak));

#endif

/* SPDX-License-Identifier: Apache-2.0 */
/* kvtier-replay's trace replay without its command line, for tests/fuzz/fuzz_replay
 * (the library kvt_replay: replay.c without main). */
#ifndef KVT_REPLAY_H
#define KVT_REPLAY_H

#include <stddef.h>
#include <stdio.h>

/* Replays the trace text[0..len) (lines as kvtier-replay reads a file named "fuzz")
 * under policy on a primary of chunks chunks (index only) and, when tier is not NULL,
 * one secondary tier of that --tier SPEC, as kvtier-replay does for one policy: the
 * results and the summary to out, a bad line's message to err. Returns kvtier-replay's
 * exit status: 0, 65 (a bad line, named), 64 (the manager could not be built) or 1. */
int kvt__replay_text(const char *text, size_t len, const char *policy, size_t chunks,
                     const char *tier, FILE *out, FILE *err);

#endif

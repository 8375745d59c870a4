/* libFuzzer target for the engine API codec (node/client/engine_proto.c): the
 * decoder kvtierd runs on every frame an engine sends, and the one the client runs
 * on the daemon's replies.
 *
 * Input: byte 0 picks the limits (even: the server's request limits, with no events,
 * stats or peers allowed; odd: the client's), the rest is one body for
 * kvt__emsg_decode. (Seeds in corpus/engine: one request or reply of every op, the
 * minor-1 fields - fingerprint, ERROR message, peers with a newer minor's extra
 * field - and hostile headers.)
 *
 * Checked on every input, beyond the sanitizers' own checks:
 * - decode fails only with -EBADMSG, -EPROTO or -EMSGSIZE (never -ENOMEM: no
 *   allocation is sized beyond what the body justifies);
 * - a decoded message holds at most 130 heap bytes per body byte (plus 1 KiB);
 * - it re-encodes, the re-encoding decodes under the same limits, and encoding
 *   that again gives identical bytes (no field is lost or changed). */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvtier/engine_proto.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "fuzz_engine: check failed: %s (line %d)\n", #cond, __LINE__);         \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct kvt_eproto_limits lim;
    struct kvt_emsg m, m2;
    struct kvt_ebuf b1, b2;
    int rc;

    if (size == 0)
        return 0;
    kvt__eproto_limits_default(&lim);
    lim.max_body = 64u << 10;
    lim.max_keys = 1024;
    if ((data[0] & 1) == 0) {
        lim.max_events = 0;
        lim.max_stats = 0;
        lim.max_peers = 0;
    }
    data++;
    size--;
    rc = kvt__emsg_decode(data, size, &lim, &m);
    if (rc != 0) {
        CHECK(rc == -EBADMSG || rc == -EPROTO || rc == -EMSGSIZE);
        return 0;
    }
    CHECK(m.heap_bytes <= 130 * size + 1024);
    kvt__ebuf_init(&b1);
    kvt__ebuf_init(&b2);
    CHECK(kvt__emsg_encode(&m, &b1) == 0);
    CHECK(b1.len >= KVT_EPROTO_HDR);
    CHECK(kvt__eproto_frame_len(b1.data) == b1.len - KVT_EPROTO_HDR);
    CHECK(b1.len - KVT_EPROTO_HDR <= lim.max_body);
    rc = kvt__emsg_decode(b1.data + KVT_EPROTO_HDR, b1.len - KVT_EPROTO_HDR, &lim, &m2);
    CHECK(rc == 0);
    CHECK(m2.op == m.op && m2.has == m.has && m2.seq == m.seq);
    CHECK(kvt__emsg_encode(&m2, &b2) == 0);
    CHECK(b1.len == b2.len && memcmp(b1.data, b2.data, b1.len) == 0);
    kvt__emsg_free(&m2);
    kvt__emsg_free(&m);
    kvt__ebuf_cleanup(&b2);
    kvt__ebuf_cleanup(&b1);
    return 0;
}

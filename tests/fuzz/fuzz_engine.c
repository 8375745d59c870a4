/* SPDX-License-Identifier: Apache-2.0 */
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
 * The same body goes to the binary messages' parsers too (kvt__ebin_req_parse,
 * and kvt__ebin_rep_parse against a lookup or prepare_load request of 16 keys as
 * byte 0's bit 1 says; seeds bin-*): what they accept adds up to the body's length
 * exactly, within the limits.
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
#include "fuzz_check.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

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
    {
        struct kvt_ebin_req h,
            q = {.op = (data[-1] & 2) ? KVT_EOP_PREPARE_LOAD : KVT_EOP_LOOKUP, .n = 16, .seq = 7};
        struct kvt_ebin_rep rh;
        const uint8_t *keys, *payload;
        const char *id;

        if (kvt__ebin_req_parse(data, size, &lim, &h, &id, &keys) == 0) {
            CHECK(h.magic == KVT_EBIN_MAGIC && kvt__ebin_op(h.op));
            CHECK(h.key_len >= 1 && h.key_len <= KVTIER_KEY_MAX && h.n <= lim.max_keys);
            CHECK(h.id_len <= KVT_EPROTO_ID_MAX && memchr(id, 0, h.id_len) == NULL);
            CHECK((const uint8_t *)id == data + KVT_EBIN_HDR &&
                  keys == data + KVT_EBIN_HDR + h.id_len);
            CHECK(KVT_EBIN_HDR + h.id_len + (size_t)h.n * h.key_len == size);
        }
        if (kvt__ebin_rep_parse(data, size, &q, &rh, &payload) == 0) {
            CHECK(rh.op == (q.op | KVT_EOP_REPLY) && rh.seq == q.seq && rh.n <= q.n);
            CHECK(rh.rc <= 0 && (rh.rc == 0 || rh.n == 0) && payload == data + KVT_EBIN_HDR);
            CHECK(KVT_EBIN_HDR + (size_t)rh.n * kvt__ebin_rep_elem(q.op) == size);
        }
    }
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

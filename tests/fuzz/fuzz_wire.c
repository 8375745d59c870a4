/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer target for the wire codec: the stream reader and the decoder, and on
 * every successful decode a re-encode that must decode again to the same bytes.
 *
 * Input: byte 0 is the mode. Odd: the rest is one message body for
 * kvt_wire_decode. Even: the rest is a byte stream pushed through the frame reader
 * in pieces of (mode >> 1) + 1 bytes, each complete frame decoded. (The seeds in
 * corpus/wire are written by test_wire's test_wire_seed_corpus.)
 *
 * Checked on every input, beyond the sanitizers' own checks:
 * - decode fails only with -EBADMSG, -EPROTO or -EMSGSIZE (never -ENOMEM: no
 *   allocation is ever sized beyond what the body can justify, and RSS is capped);
 * - a decoded message holds at most 24 heap bytes per body byte;
 * - it re-encodes (what we accept we can send), the re-encoding is within the same
 *   limits and decodes, and encoding that again gives identical bytes (the encoder's
 *   output is a fixed point, so no field is lost or changed on the way);
 * - the reader's frames are never longer than max_frame, and its errors are
 *   -EMSGSIZE only. */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvt/wire.h"
#include "fuzz_check.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const struct kvt_wire_limits lim = {.max_frame = 64 << 10, .max_keys = 1024};

static void check_message(const uint8_t *body, size_t len)
{
    struct kvt_wire_msg m, m2;
    struct kvt_wire_buf b1, b2;
    const uint8_t *body1;
    size_t len1;
    int rc = kvt_wire_decode(body, len, &lim, &m);

    if (rc != 0) {
        CHECK(rc == -EBADMSG || rc == -EPROTO || rc == -EMSGSIZE);
        return;
    }
    CHECK(m.heap_bytes <= 24 * len);
    kvt_wire_buf_init(&b1);
    kvt_wire_buf_init(&b2);
    CHECK(kvt_wire_encode(&m, &b1) == 0);
    CHECK(kvt_wire_unframe(b1.data, b1.len, &lim, &body1, &len1) == 0);
    CHECK(len1 <= len);
    rc = kvt_wire_decode(body1, len1, &lim, &m2);
    CHECK(rc == 0);
    CHECK(m2.type == m.type && m2.has == m.has);
    CHECK(kvt_wire_encode(&m2, &b2) == 0);
    CHECK(b1.len == b2.len && memcmp(b1.data, b2.data, b1.len) == 0);
    kvt_wire_msg_free(&m2);
    kvt_wire_msg_free(&m);
    kvt_wire_buf_cleanup(&b2);
    kvt_wire_buf_cleanup(&b1);
}

static void check_stream(const uint8_t *data, size_t size, size_t piece)
{
    struct kvt_wire_reader r;

    CHECK(kvt_wire_reader_init(&r, &lim) == 0);
    while (size > 0) {
        size_t n = size < piece ? size : piece, used;
        int rc = kvt_wire_reader_push(&r, data, n, &used);

        if (rc < 0) {
            CHECK(rc == -EMSGSIZE);
            break;
        }
        CHECK(used <= n && (rc == 1 || used == n));
        data += used;
        size -= used;
        if (rc == 1) {
            const uint8_t *body;
            size_t len;

            kvt_wire_reader_frame(&r, &body, &len);
            CHECK(len <= lim.max_frame);
            check_message(body, len);
        }
    }
    kvt_wire_reader_cleanup(&r);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size == 0)
        return 0;
    uint8_t mode = data[0];

    if (mode & 1)
        check_message(data + 1, size - 1);
    else
        check_stream(data + 1, size - 1, (size_t)(mode >> 1) + 1);
    return 0;
}

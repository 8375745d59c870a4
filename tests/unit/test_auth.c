/* SPDX-License-Identifier: Apache-2.0 */
/* Peer authentication: proofs, their known answers, nonces and secret files.
 *
 * The known answers were computed outside kvtier, once, with OpenSSL's command line
 * (OpenSSL 3.0) and cross-checked with Python's hmac module:
 *   msg = "kvtier-auth-v1\0" || role (0x00 client, 0x01 server) || 00 01 .. 3f (the
 *         client nonce 00..1f then the server nonce 20..3f) || 01 02 03 04 05 06 07 08
 *         (id_client, big-endian) || 11 22 33 44 55 66 77 88 (id_server) || 40 41 .. 5f
 *         (the namespace): 128 bytes
 *   openssl dgst -sha256 -hmac '0123456789abcdef0123456789abcdef' msg.bin
 *   python3: hmac.new(secret, msg, hashlib.sha256).hexdigest()
 * and the namespace fingerprint with `printf abc | openssl dgst -sha256` (the FIPS
 * 180-2 vector) and `printf 'kvtier cluster "prod" model=llama-3-8b' | openssl dgst
 * -sha256`. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "test_util.h"
#include "kvt/auth.h"

static const uint8_t kat_secret[] = "0123456789abcdef0123456789abcdef";
#define KAT_SECRET_LEN 32

static const uint8_t kat_client[KVT_AUTH_PROOF_BYTES] = {
    0x05, 0x09, 0xfc, 0x15, 0x60, 0x82, 0x25, 0x1c, 0x80, 0x61, 0x9e, 0xe5, 0x00, 0x23, 0x1e, 0x82,
    0xcd, 0xbb, 0xbf, 0xd1, 0x5e, 0xc3, 0xb0, 0x2b, 0x66, 0x7b, 0x07, 0x49, 0x17, 0x56, 0x56, 0x21,
};
static const uint8_t kat_server[KVT_AUTH_PROOF_BYTES] = {
    0x3b, 0x50, 0x2c, 0xf9, 0x59, 0x0d, 0xd4, 0x8d, 0xf8, 0xd5, 0xf6, 0x93, 0xcd, 0x8c, 0x19, 0xdc,
    0x9a, 0xf0, 0x1f, 0x39, 0x19, 0xca, 0x03, 0xc1, 0x1c, 0x2d, 0xa1, 0xe5, 0x55, 0x49, 0xe9, 0x2b,
};

/* The inputs of the known answers; tests copy and vary them. */
struct fixture {
    uint8_t nc[KVT_AUTH_NONCE_BYTES], ns_nonce[KVT_AUTH_NONCE_BYTES], ns[KVT_AUTH_NS_BYTES];
    struct kvt_auth_params p;
};

static void fixture_init(struct fixture *f)
{
    for (int i = 0; i < KVT_AUTH_NONCE_BYTES; i++) {
        f->nc[i] = (uint8_t)i;
        f->ns_nonce[i] = (uint8_t)(0x20 + i);
    }
    for (int i = 0; i < KVT_AUTH_NS_BYTES; i++)
        f->ns[i] = (uint8_t)(0x40 + i);
    f->p = (struct kvt_auth_params){
        .nonce_client = f->nc,
        .nonce_server = f->ns_nonce,
        .id_client = 0x0102030405060708ull,
        .id_server = 0x1122334455667788ull,
        .ns = f->ns,
    };
}

static bool verify(const struct kvt_auth_params *p, enum kvt_auth_role role, const uint8_t *proof)
{
    return kvt_auth_verify(kat_secret, KAT_SECRET_LEN, role, p, proof, KVT_AUTH_PROOF_BYTES);
}

static void test_auth_proof_known_answer(void **state)
{
    struct fixture f;
    uint8_t proof[KVT_AUTH_PROOF_BYTES];

    fixture_init(&f);
    assert_int_equal(kvt_auth_proof(kat_secret, KAT_SECRET_LEN, KVT_AUTH_CLIENT, &f.p, proof), 0);
    assert_memory_equal(proof, kat_client, sizeof(proof));
    assert_int_equal(kvt_auth_proof(kat_secret, KAT_SECRET_LEN, KVT_AUTH_SERVER, &f.p, proof), 0);
    assert_memory_equal(proof, kat_server, sizeof(proof));
    assert_true(verify(&f.p, KVT_AUTH_CLIENT, kat_client));
    assert_true(verify(&f.p, KVT_AUTH_SERVER, kat_server));
}

/* A server that sends the client's own proof back (reflection) is refused. */
static void test_auth_role_swap_is_refused(void **state)
{
    struct fixture f;

    fixture_init(&f);
    assert_false(verify(&f.p, KVT_AUTH_SERVER, kat_client));
    assert_false(verify(&f.p, KVT_AUTH_CLIENT, kat_server));
}

/* A proof recorded under other nonces does not verify under fresh ones (replay). */
static void test_auth_other_nonce_is_refused(void **state)
{
    for (int which = 0; which < 2; which++)
        for (int byte = 0; byte < KVT_AUTH_NONCE_BYTES; byte += KVT_AUTH_NONCE_BYTES - 1) {
            struct fixture f;

            fixture_init(&f);
            (which ? f.ns_nonce : f.nc)[byte] ^= 0x01;
            assert_false(verify(&f.p, KVT_AUTH_CLIENT, kat_client));
            assert_false(verify(&f.p, KVT_AUTH_SERVER, kat_server));
        }

    /* Swapping the two nonces is another exchange, too. */
    struct fixture f;

    fixture_init(&f);
    f.p.nonce_client = f.ns_nonce;
    f.p.nonce_server = f.nc;
    assert_false(verify(&f.p, KVT_AUTH_CLIENT, kat_client));
}

static void test_auth_other_ids_are_refused(void **state)
{
    struct fixture f;

    fixture_init(&f);
    f.p.id_client ^= 1ull << 63;
    assert_false(verify(&f.p, KVT_AUTH_CLIENT, kat_client));
    fixture_init(&f);
    f.p.id_server ^= 1;
    assert_false(verify(&f.p, KVT_AUTH_SERVER, kat_server));
    fixture_init(&f);
    f.p.id_client = 0x1122334455667788ull;
    f.p.id_server = 0x0102030405060708ull;
    assert_false(verify(&f.p, KVT_AUTH_CLIENT, kat_client));
    assert_false(verify(&f.p, KVT_AUTH_SERVER, kat_server));
}

static void test_auth_other_namespace_is_refused(void **state)
{
    struct fixture f;

    fixture_init(&f);
    f.ns[KVT_AUTH_NS_BYTES - 1] ^= 0x80;
    assert_false(verify(&f.p, KVT_AUTH_CLIENT, kat_client));
    fixture_init(&f);
    kvt_auth_namespace("kvtier cluster \"staging\"", f.ns);
    assert_false(verify(&f.p, KVT_AUTH_SERVER, kat_server));
}

static void test_auth_other_secret_is_refused(void **state)
{
    uint8_t other[KAT_SECRET_LEN];
    struct fixture f;

    fixture_init(&f);
    memcpy(other, kat_secret, sizeof(other));
    other[5] ^= 0x20;
    assert_false(kvt_auth_verify(other, sizeof(other), KVT_AUTH_CLIENT, &f.p, kat_client,
                                 KVT_AUTH_PROOF_BYTES));
    /* A prefix of the secret is another secret. */
    assert_false(kvt_auth_verify(kat_secret, KAT_SECRET_LEN - 1, KVT_AUTH_CLIENT, &f.p, kat_client,
                                 KVT_AUTH_PROOF_BYTES));
}

static void test_auth_damaged_proof_is_refused(void **state)
{
    uint8_t proof[KVT_AUTH_PROOF_BYTES + 1];
    struct fixture f;

    fixture_init(&f);
    for (int i = 0; i < KVT_AUTH_PROOF_BYTES; i++) {
        memcpy(proof, kat_client, KVT_AUTH_PROOF_BYTES);
        proof[i] ^= 0x01;
        assert_false(verify(&f.p, KVT_AUTH_CLIENT, proof));
    }
    memcpy(proof, kat_client, KVT_AUTH_PROOF_BYTES);
    proof[KVT_AUTH_PROOF_BYTES] = 0;
    for (size_t len = 0; len < KVT_AUTH_PROOF_BYTES; len++)
        assert_false(
            kvt_auth_verify(kat_secret, KAT_SECRET_LEN, KVT_AUTH_CLIENT, &f.p, proof, len));
    assert_false(kvt_auth_verify(kat_secret, KAT_SECRET_LEN, KVT_AUTH_CLIENT, &f.p, proof,
                                 KVT_AUTH_PROOF_BYTES + 1));
    assert_true(kvt_auth_verify(kat_secret, KAT_SECRET_LEN, KVT_AUTH_CLIENT, &f.p, proof,
                                KVT_AUTH_PROOF_BYTES));
}

static void test_auth_proof_refuses_bad_arguments(void **state)
{
    uint8_t proof[KVT_AUTH_PROOF_BYTES], big[KVT_AUTH_SECRET_MAX + 1] = {0};
    struct fixture f;

    fixture_init(&f);
    assert_int_equal(kvt_auth_proof(NULL, KAT_SECRET_LEN, KVT_AUTH_CLIENT, &f.p, proof), -EINVAL);
    assert_int_equal(kvt_auth_proof(kat_secret, 0, KVT_AUTH_CLIENT, &f.p, proof), -EINVAL);
    assert_int_equal(
        kvt_auth_proof(kat_secret, KVT_AUTH_SECRET_MIN - 1, KVT_AUTH_CLIENT, &f.p, proof), -EINVAL);
    assert_int_equal(kvt_auth_proof(kat_secret, KVT_AUTH_SECRET_MIN, KVT_AUTH_CLIENT, &f.p, proof),
                     0);
    assert_int_equal(kvt_auth_proof(big, KVT_AUTH_SECRET_MAX, KVT_AUTH_CLIENT, &f.p, proof), 0);
    assert_int_equal(kvt_auth_proof(big, KVT_AUTH_SECRET_MAX + 1, KVT_AUTH_CLIENT, &f.p, proof),
                     -EINVAL);
    assert_int_equal(kvt_auth_proof(kat_secret, KAT_SECRET_LEN, (enum kvt_auth_role)2, &f.p, proof),
                     -EINVAL);
    assert_int_equal(kvt_auth_proof(kat_secret, KAT_SECRET_LEN, KVT_AUTH_CLIENT, NULL, proof),
                     -EINVAL);
    f.p.ns = NULL;
    assert_int_equal(kvt_auth_proof(kat_secret, KAT_SECRET_LEN, KVT_AUTH_CLIENT, &f.p, proof),
                     -EINVAL);
    assert_false(kvt_auth_verify(kat_secret, KAT_SECRET_LEN, KVT_AUTH_CLIENT, &f.p, kat_client,
                                 KVT_AUTH_PROOF_BYTES));
}

static void test_auth_namespace_known_answer(void **state)
{
    static const uint8_t abc[KVT_AUTH_NS_BYTES] = {
        0xba, 0x78, 0x16, 0xbf, 0x8f, 0x01, 0xcf, 0xea, 0x41, 0x41, 0x40,
        0xde, 0x5d, 0xae, 0x22, 0x23, 0xb0, 0x03, 0x61, 0xa3, 0x96, 0x17,
        0x7a, 0x9c, 0xb4, 0x10, 0xff, 0x61, 0xf2, 0x00, 0x15, 0xad,
    };
    static const uint8_t prod[KVT_AUTH_NS_BYTES] = {
        0x34, 0xd2, 0x0f, 0x18, 0xbb, 0xff, 0xa6, 0x13, 0xb1, 0xa2, 0xdc,
        0xcb, 0x0e, 0x7f, 0xea, 0xe0, 0xa2, 0x38, 0x24, 0x56, 0xaf, 0x3a,
        0xa1, 0x6b, 0xf1, 0x20, 0x89, 0xcf, 0xc0, 0xf2, 0x8c, 0xa7,
    };
    uint8_t ns[KVT_AUTH_NS_BYTES];

    kvt_auth_namespace("abc", ns);
    assert_memory_equal(ns, abc, sizeof(ns));
    kvt_auth_namespace("kvtier cluster \"prod\" model=llama-3-8b", ns);
    assert_memory_equal(ns, prod, sizeof(ns));
}

static void test_auth_nonces_differ(void **state)
{
    uint8_t a[KVT_AUTH_NONCE_BYTES], b[KVT_AUTH_NONCE_BYTES], zero[KVT_AUTH_NONCE_BYTES] = {0};

    assert_int_equal(kvt_auth_nonce(a), 0);
    assert_int_equal(kvt_auth_nonce(b), 0);
    assert_memory_not_equal(a, b, sizeof(a));
    assert_memory_not_equal(a, zero, sizeof(a));
    assert_memory_not_equal(b, zero, sizeof(b));
}

/* A secret file in a fresh directory: the test's path, which the caller frees. */
static char *write_secret(const char *dir, const char *name, const void *data, size_t len,
                          mode_t mode)
{
    char *path;
    int fd;

    assert_true(asprintf(&path, "%s/%s", dir, name) > 0);
    fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, data, len), (ssize_t)len);
    assert_int_equal(fchmod(fd, mode), 0);
    close(fd);
    return path;
}

static void remove_secret(char *path)
{
    unlink(path);
    free(path);
}

static void test_auth_load_secret(void **state)
{
    char *dir = kt_tmpdir("auth"), *path;
    uint8_t buf[KVT_AUTH_SECRET_MAX + 1];
    size_t len = 12345;

    assert_non_null(dir);

    /* 0600 with a trailing newline: accepted, newline dropped. */
    path = write_secret(dir, "ok", "0123456789abcdef0123\n", 21, 0600);
    assert_int_equal(kvt_auth_load_secret(path, buf, sizeof(buf), &len), 0);
    assert_int_equal(len, 20);
    assert_memory_equal(buf, "0123456789abcdef0123", 20);
    /* 0400 is fine, too; CRLF is dropped. */
    assert_int_equal(chmod(path, 0400), 0);
    len = 0;
    assert_int_equal(kvt_auth_load_secret(path, buf, sizeof(buf), &len), 0);
    assert_int_equal(len, 20);
    remove_secret(path);
    path = write_secret(dir, "crlf", "0123456789abcdef\r\n", 18, 0400);
    assert_int_equal(kvt_auth_load_secret(path, buf, sizeof(buf), &len), 0);
    assert_int_equal(len, 16);
    remove_secret(path);

    /* Readable by group or others: refused, and len untouched. */
    len = 777;
    path = write_secret(dir, "wide", "0123456789abcdef0123", 20, 0644);
    assert_int_equal(kvt_auth_load_secret(path, buf, sizeof(buf), &len), -EPERM);
    assert_int_equal(chmod(path, 0640), 0);
    assert_int_equal(kvt_auth_load_secret(path, buf, sizeof(buf), &len), -EPERM);
    assert_int_equal(chmod(path, 0604), 0);
    assert_int_equal(kvt_auth_load_secret(path, buf, sizeof(buf), &len), -EPERM);
    assert_int_equal(len, 777);
    remove_secret(path);

    /* Missing, empty, only a newline, one byte short of the minimum. */
    assert_true(asprintf(&path, "%s/missing", dir) > 0);
    assert_int_equal(kvt_auth_load_secret(path, buf, sizeof(buf), &len), -ENOENT);
    free(path);
    path = write_secret(dir, "empty", "", 0, 0600);
    assert_int_equal(kvt_auth_load_secret(path, buf, sizeof(buf), &len), -EINVAL);
    remove_secret(path);
    path = write_secret(dir, "nl", "\n", 1, 0600);
    assert_int_equal(kvt_auth_load_secret(path, buf, sizeof(buf), &len), -EINVAL);
    remove_secret(path);
    path = write_secret(dir, "short", "0123456789abcde\n", 16, 0600);
    assert_int_equal(kvt_auth_load_secret(path, buf, sizeof(buf), &len), -EINVAL);
    remove_secret(path);
    assert_int_equal(len, 777);

    /* A directory is not a secret file. */
    assert_int_equal(kvt_auth_load_secret(dir, buf, sizeof(buf), &len), -EINVAL);
    rmdir(dir);
    free(dir);
}

/* Exactly KVT_AUTH_SECRET_MAX bytes load; one more does not. */
static void test_auth_load_secret_size_limits(void **state)
{
    char *dir = kt_tmpdir("auth-max"), *path;
    uint8_t data[KVT_AUTH_SECRET_MAX + 2], buf[KVT_AUTH_SECRET_MAX + 16];
    size_t len = 0;

    assert_non_null(dir);
    memset(data, 'x', sizeof(data));
    path = write_secret(dir, "max", data, KVT_AUTH_SECRET_MAX, 0600);
    assert_int_equal(kvt_auth_load_secret(path, buf, sizeof(buf), &len), 0);
    assert_int_equal(len, KVT_AUTH_SECRET_MAX);
    remove_secret(path);
    path = write_secret(dir, "max+1", data, KVT_AUTH_SECRET_MAX + 1, 0600);
    assert_int_equal(kvt_auth_load_secret(path, buf, sizeof(buf), &len), -EINVAL);
    remove_secret(path);
    rmdir(dir);
    free(dir);
}

/* A file longer than the caller's buffer is refused and the buffer wiped, also when
 * the buffer's last byte is a newline (that newline used to be stripped and the
 * truncated prefix accepted as the whole secret). */
static void test_auth_load_secret_longer_than_buffer(void **state)
{
    char *dir = kt_tmpdir("auth-cap"), *path;
    const char data[] = "0123456789abcdefghi\nJKLMNOPQRSTUVWXYZ";
    uint8_t buf[20], zero[20] = {0};
    size_t len = 99;

    assert_non_null(dir);
    path = write_secret(dir, "long", data, sizeof(data) - 1, 0600);
    assert_int_equal(kvt_auth_load_secret(path, buf, sizeof(buf), &len), -EINVAL);
    assert_int_equal(len, 99);
    assert_memory_equal(buf, zero, sizeof(buf));
    /* The same file fits a larger buffer; the inner newline is part of the secret. */
    uint8_t big[64];

    assert_int_equal(kvt_auth_load_secret(path, big, sizeof(big), &len), 0);
    assert_int_equal(len, sizeof(data) - 1);
    assert_memory_equal(big, data, sizeof(data) - 1);
    remove_secret(path);
    /* A file of exactly cap bytes is fine: the end of file is seen. */
    path = write_secret(dir, "exact", data, sizeof(buf), 0600);
    assert_int_equal(kvt_auth_load_secret(path, buf, sizeof(buf), &len), 0);
    assert_int_equal(len, 19);
    assert_memory_equal(buf, data, 19);
    remove_secret(path);
    rmdir(dir);
    free(dir);
}

/* A symlink to a good secret file is refused (O_NOFOLLOW). */
static void test_auth_load_secret_refuses_symlink(void **state)
{
    char *dir = kt_tmpdir("auth-link"), *path, *link;
    uint8_t buf[64];
    size_t len = 5;

    assert_non_null(dir);
    path = write_secret(dir, "real", "0123456789abcdef", 16, 0600);
    assert_true(asprintf(&link, "%s/link", dir) > 0);
    assert_int_equal(symlink(path, link), 0);
    assert_int_equal(kvt_auth_load_secret(link, buf, sizeof(buf), &len), -ELOOP);
    assert_int_equal(len, 5);
    remove_secret(link);
    remove_secret(path);
    rmdir(dir);
    free(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_auth_proof_known_answer),
        cmocka_unit_test(test_auth_role_swap_is_refused),
        cmocka_unit_test(test_auth_other_nonce_is_refused),
        cmocka_unit_test(test_auth_other_ids_are_refused),
        cmocka_unit_test(test_auth_other_namespace_is_refused),
        cmocka_unit_test(test_auth_other_secret_is_refused),
        cmocka_unit_test(test_auth_damaged_proof_is_refused),
        cmocka_unit_test(test_auth_proof_refuses_bad_arguments),
        cmocka_unit_test(test_auth_namespace_known_answer),
        cmocka_unit_test(test_auth_nonces_differ),
        cmocka_unit_test(test_auth_load_secret),
        cmocka_unit_test(test_auth_load_secret_size_limits),
        cmocka_unit_test(test_auth_load_secret_longer_than_buffer),
        cmocka_unit_test(test_auth_load_secret_refuses_symlink),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

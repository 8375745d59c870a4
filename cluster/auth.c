/* SPDX-License-Identifier: Apache-2.0 */
/* Peer authentication (see kvt/auth.h). OpenSSL's HMAC and SHA-256 in one place;
 * CRYPTO_memcmp so that a proof check takes the same time wherever it differs. */
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include "kvt/auth.h"
#include "kvt/log.h"

#define MOD "auth"
static const char auth_label[] = "kvtier-auth-v1";

int kvt_auth_nonce(uint8_t nonce[KVT_AUTH_NONCE_BYTES])
{
    size_t got = 0;

    while (got < KVT_AUTH_NONCE_BYTES) {
        ssize_t n = getrandom(nonce + got, KVT_AUTH_NONCE_BYTES - got, 0);

        if (n < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        got += (size_t)n;
    }
    return 0;
}

static void put_u64(uint8_t *p, uint64_t v)
{
    for (int i = 7; i >= 0; i--, v >>= 8)
        p[i] = (uint8_t)v;
}

int kvt_auth_proof(const uint8_t *secret, size_t secret_len, enum kvt_auth_role role,
                   const struct kvt_auth_params *p, uint8_t proof[KVT_AUTH_PROOF_BYTES])
{
    uint8_t msg[sizeof(auth_label) + 1 + 2 * KVT_AUTH_NONCE_BYTES + 16 + KVT_AUTH_NS_BYTES];
    uint8_t *w = msg;
    unsigned int len = KVT_AUTH_PROOF_BYTES;

    if (secret == NULL || secret_len < KVT_AUTH_SECRET_MIN || secret_len > KVT_AUTH_SECRET_MAX ||
        (role != KVT_AUTH_CLIENT && role != KVT_AUTH_SERVER) || p == NULL ||
        p->nonce_client == NULL || p->nonce_server == NULL || p->ns == NULL)
        return -EINVAL;
    memcpy(w, auth_label, sizeof(auth_label));
    w += sizeof(auth_label);
    *w++ = (uint8_t)role;
    memcpy(w, p->nonce_client, KVT_AUTH_NONCE_BYTES);
    w += KVT_AUTH_NONCE_BYTES;
    memcpy(w, p->nonce_server, KVT_AUTH_NONCE_BYTES);
    w += KVT_AUTH_NONCE_BYTES;
    put_u64(w, p->id_client);
    put_u64(w + 8, p->id_server);
    w += 16;
    memcpy(w, p->ns, KVT_AUTH_NS_BYTES);
    w += KVT_AUTH_NS_BYTES;
    if (HMAC(EVP_sha256(), secret, (int)secret_len, msg, (size_t)(w - msg), proof, &len) == NULL ||
        len != KVT_AUTH_PROOF_BYTES)
        return -EINVAL;
    return 0;
}

bool kvt_auth_verify(const uint8_t *secret, size_t secret_len, enum kvt_auth_role role,
                     const struct kvt_auth_params *p, const uint8_t *proof, size_t proof_len)
{
    uint8_t want[KVT_AUTH_PROOF_BYTES];

    if (proof_len != KVT_AUTH_PROOF_BYTES)
        return false;
    if (kvt_auth_proof(secret, secret_len, role, p, want) < 0)
        return false;
    return CRYPTO_memcmp(want, proof, KVT_AUTH_PROOF_BYTES) == 0;
}

/* Reads up to cap bytes; *eof_p tells whether the file ended within them. */
static int read_all(int fd, uint8_t *buf, size_t cap, size_t *n_p, bool *eof_p)
{
    size_t got = 0;
    uint8_t extra;

    for (;;) {
        ssize_t n = got < cap ? read(fd, buf + got, cap - got) : read(fd, &extra, 1);

        if (n < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (n == 0 || got == cap) {
            *eof_p = n == 0;
            *n_p = got;
            return 0;
        }
        got += (size_t)n;
    }
}

int kvt_auth_load_secret(const char *path, uint8_t *buf, size_t cap, size_t *len_p)
{
    struct stat st;
    size_t n = 0;
    bool eof = false;
    int fd, rc = 0;

    if (path == NULL || buf == NULL || len_p == NULL)
        return -EINVAL;
    fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) {
        rc = -errno;
        kvt_error(MOD, "secret file %s: %s", path, strerror(errno));
        return rc;
    }
    if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode)) {
        kvt_error(MOD, "secret file %s: not a regular file", path);
        rc = -EINVAL;
        goto out;
    }
    if (st.st_mode & (S_IRWXG | S_IRWXO)) {
        kvt_error(MOD, "secret file %s: mode %03o lets others read it (want 0600)", path,
                  (unsigned)(st.st_mode & 0777));
        rc = -EPERM;
        goto out;
    }
    rc = read_all(fd, buf, cap, &n, &eof);
    if (rc < 0) {
        kvt_error(MOD, "secret file %s: %s", path, strerror(-rc));
        goto out;
    }
    if (!eof) {
        kvt_error(MOD, "secret file %s: longer than %zu bytes", path, cap);
        rc = -EINVAL;
        goto out;
    }
    while (n > 0 && (buf[n - 1] == '\n' || buf[n - 1] == '\r'))
        n--;
    if (n < KVT_AUTH_SECRET_MIN || n > KVT_AUTH_SECRET_MAX) {
        kvt_error(MOD, "secret file %s: %zu bytes; want %d..%d", path, n, KVT_AUTH_SECRET_MIN,
                  KVT_AUTH_SECRET_MAX);
        rc = -EINVAL;
        goto out;
    }
    *len_p = n;
out:
    if (rc < 0)
        OPENSSL_cleanse(buf, cap); /* no partial secret left behind */
    close(fd);
    return rc;
}

void kvt_auth_namespace(const char *description, uint8_t ns[KVT_AUTH_NS_BYTES])
{
    unsigned int len = KVT_AUTH_NS_BYTES;

    EVP_Digest(description, strlen(description), ns, &len, EVP_sha256(), NULL);
}

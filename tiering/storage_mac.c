/* SPDX-License-Identifier: Apache-2.0 */
/* The storage tier's keyed MACs (the only file of the tier that includes OpenSSL).
 *
 * Why a MAC and not a checksum: an unkeyed hash (the XXH3 sums of format 1) proves
 * nothing against someone who can write a file: they write a valid sum with their
 * bytes, and an engine loads those bytes as its KV. Each file now carries two tags,
 * AES-256-GMAC (NIST SP 800-38D: GCM with the data as additional authenticated data
 * and nothing encrypted) under a random 96-bit nonce of its own:
 *   row tag    = GMAC(key_row, nonce, row)
 *   header tag = GMAC(key_hdr, nonce, the 4 KiB header block with this tag zeroed)
 * The header holds the nonce and the row tag, so the header tag binds the row to its
 * key, namespace and length; the warm-restart scan checks the header tag alone (one
 * 4 KiB block per file), a load checks both. The nonces are random per file (fresh
 * getrandom bytes at every write): GMAC needs a nonce never used twice under one key,
 * and 96 random bits keep that likely for far more files than a tier ever writes.
 * An attacker who controls the rows' contents (it can make engines store chosen KV)
 * still cannot forge a tag: GMAC is a Wegman-Carter MAC whose per-nonce mask is an
 * AES block it does not know; a forgery succeeds with probability about
 * (row bytes / 16) / 2^128 per try.
 *
 * Why GMAC and not HMAC-SHA256: HMAC-SHA256 runs at 0.3-0.6 GB/s on one core here,
 * GMAC (PCLMULQDQ) at 4-8 GB/s, close to what the disk reads (docs/bench-storage.md
 * has the measured cost).
 *
 * Keys: key_x = HMAC-SHA256(secret, "kvtier-storage-v2 " x "\0" || namespace), from the
 * caller's secret (kvtierd passes the cluster secret) or, without one, from 32 random
 * bytes kept in <root>/storage.key: created 0600 at the first start (written under a
 * temporary name and linked into place, so two tiers starting at once agree on one
 * key), refused when it is not this user's private regular file. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include "kvt/alloc.h"
#include "kvt/log.h"
#include "kvt/safe_path.h"
#include "storage_int.h"

#define MOD "storage"

struct st_mac {
    EVP_CIPHER_CTX *hdr, *row; /* keyed once; each MAC sets only the nonce */
};

static int derive(const uint8_t *secret, size_t len, const char *what, const uint8_t *ns,
                  uint8_t out[ST_KEY_BYTES])
{
    uint8_t msg[64 + KVT_STORAGE_NS_BYTES];
    unsigned int out_len = ST_KEY_BYTES;
    int n = snprintf((char *)msg, 64, "kvtier-storage-v2 %s", what) + 1; /* with its NUL */

    memcpy(msg + n, ns, KVT_STORAGE_NS_BYTES);
    if (HMAC(EVP_sha256(), secret, (int)len, msg, (size_t)n + KVT_STORAGE_NS_BYTES, out,
             &out_len) == NULL ||
        out_len != ST_KEY_BYTES)
        return -EIO;
    return 0;
}

static int random_bytes(uint8_t *buf, size_t len)
{
    size_t got = 0;

    while (got < len) {
        ssize_t n = getrandom(buf + got, len - got, 0);

        if (n < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        got += (size_t)n;
    }
    return 0;
}

int kvt__st_mac_nonce(uint8_t nonce[ST_NONCE_BYTES])
{
    return random_bytes(nonce, ST_NONCE_BYTES);
}

int kvt__st_random(uint8_t *buf, size_t len)
{
    return random_bytes(buf, len);
}

/* Reads the key file: our own private regular file of exactly ST_KEY_BYTES. */
static int read_key_file(int root_fd, const char *root, uint8_t key[ST_KEY_BYTES])
{
    char what[4200];
    uint8_t extra;
    ssize_t n;
    int fd, rc;

    snprintf(what, sizeof(what), "%s/%s", root, ST_KEY_FILE);
    /* O_NONBLOCK: a FIFO there is refused by the check below, not waited on. */
    fd = openat(root_fd, ST_KEY_FILE, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
        rc = -errno;
        if (rc == -ELOOP) {
            kvt_error(MOD, "%s is a symbolic link: refusing it", what);
            return -EPERM;
        }
        return rc; /* -ENOENT: the caller creates it */
    }
    rc = kvt_private_file_check(fd, what, 0600, NULL);
    if (rc == 0) {
        n = pread(fd, key, ST_KEY_BYTES, 0);
        if (n != ST_KEY_BYTES || pread(fd, &extra, 1, ST_KEY_BYTES) != 0) {
            kvt_error(MOD,
                      "%s is not a key of %d bytes: remove it (the chunk files written "
                      "under it are then removed too)",
                      what, ST_KEY_BYTES);
            rc = -EINVAL;
        }
    }
    close(fd);
    return rc;
}

/* First start without a secret: a random key, published atomically (link fails when
 * another tier published one first; then that one is read). The temporary name has a
 * random part besides the pid: a start killed before its link leaves its file, and
 * the next process may have the same pid (a container's first), which O_EXCL would
 * then refuse at every start. */
static int create_key_file(int root_fd, const char *root, uint8_t key[ST_KEY_BYTES])
{
    char tmp[64];
    uint8_t salt[8];
    int fd, rc;

    rc = random_bytes(salt, sizeof(salt));
    if (rc < 0)
        return rc;
    snprintf(tmp, sizeof(tmp), "%s.%d.%02x%02x%02x%02x%02x%02x%02x%02x.tmp", ST_KEY_FILE,
             (int)getpid(), salt[0], salt[1], salt[2], salt[3], salt[4], salt[5], salt[6], salt[7]);
    rc = random_bytes(key, ST_KEY_BYTES);
    if (rc < 0)
        return rc;
    fd = openat(root_fd, tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0)
        return -errno;
    errno = EIO; /* a short write sets none */
    if (write(fd, key, ST_KEY_BYTES) != ST_KEY_BYTES || fsync(fd) != 0)
        rc = -errno;
    close(fd);
    if (rc == 0 && linkat(root_fd, tmp, root_fd, ST_KEY_FILE, 0) != 0)
        rc = -errno;
    unlinkat(root_fd, tmp, 0);
    if (rc == -EEXIST)
        return read_key_file(root_fd, root, key);
    if (rc == 0) {
        fsync(root_fd);
        kvt_info(MOD,
                 "created the random key %s/%s for the chunk files' MACs (no secret given; "
                 "kvtierd uses cluster.secret_file when set)",
                 root, ST_KEY_FILE);
    }
    return rc;
}

int kvt__st_mac_keys(struct st_tier *s, int root_fd, const uint8_t *secret, size_t secret_len)
{
    uint8_t file_key[ST_KEY_BYTES];
    int rc = 0;

    if (secret == NULL) {
        rc = read_key_file(root_fd, s->root, file_key);
        if (rc == -ENOENT)
            rc = create_key_file(root_fd, s->root, file_key);
        if (rc < 0) {
            if (rc != -EPERM && rc != -EINVAL)
                kvt_error(MOD, "key file %s/%s: %s", s->root, ST_KEY_FILE, strerror(-rc));
            goto out;
        }
        secret = file_key;
        secret_len = ST_KEY_BYTES;
    }
    rc = derive(secret, secret_len, "header", s->ns, s->key_hdr);
    if (rc == 0)
        rc = derive(secret, secret_len, "row", s->ns, s->key_row);
out:
    OPENSSL_cleanse(file_key, sizeof(file_key));
    return rc;
}

static EVP_CIPHER_CTX *keyed_ctx(const uint8_t *key)
{
    EVP_CIPHER_CTX *c = EVP_CIPHER_CTX_new();

    if (c != NULL && EVP_EncryptInit_ex(c, EVP_aes_256_gcm(), NULL, key, NULL) != 1) {
        EVP_CIPHER_CTX_free(c);
        c = NULL;
    }
    return c;
}

struct st_mac *kvt__st_mac_new(const struct st_tier *s)
{
    struct st_mac *m = kvt_calloc(1, sizeof(*m));

    if (m == NULL)
        return NULL;
    m->hdr = keyed_ctx(s->key_hdr);
    m->row = keyed_ctx(s->key_row);
    if (m->hdr == NULL || m->row == NULL) {
        kvt__st_mac_free(m);
        return NULL;
    }
    return m;
}

void kvt__st_mac_free(struct st_mac *m)
{
    if (m == NULL)
        return;
    EVP_CIPHER_CTX_free(m->hdr);
    EVP_CIPHER_CTX_free(m->row);
    kvt_free(m);
}

int kvt__st_mac(struct st_mac *m, bool hdr, const uint8_t *nonce, const uint8_t *data, size_t len,
                uint8_t tag[ST_TAG_BYTES])
{
    EVP_CIPHER_CTX *c = hdr ? m->hdr : m->row;
    uint8_t none[16];
    int out_len;

    if (EVP_EncryptInit_ex(c, NULL, NULL, NULL, nonce) != 1)
        return -EIO;
    /* The data goes in as additional authenticated data (nothing is encrypted), in
     * pieces below INT_MAX. */
    while (len > 0) {
        int piece = len > (1u << 30) ? 1 << 30 : (int)len;

        if (EVP_EncryptUpdate(c, NULL, &out_len, data, piece) != 1)
            return -EIO;
        data += piece;
        len -= (size_t)piece;
    }
    if (EVP_EncryptFinal_ex(c, none, &out_len) != 1 ||
        EVP_CIPHER_CTX_ctrl(c, EVP_CTRL_GCM_GET_TAG, ST_TAG_BYTES, tag) != 1)
        return -EIO;
    return 0;
}

bool kvt__st_tag_eq(const uint8_t *a, const uint8_t *b)
{
    return CRYPTO_memcmp(a, b, ST_TAG_BYTES) == 0;
}

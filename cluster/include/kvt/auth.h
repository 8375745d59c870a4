/* SPDX-License-Identifier: Apache-2.0 */
/* Peer authentication: an HMAC-SHA256 challenge-response over a shared secret.
 *
 *   A -> B  HELLO(version, node id a, incarnation, namespace, nonce_a)
 *   B -> A  HELLO_ACK(node id b, incarnation, namespace, nonce_b, proof_b)
 *   A -> B  AUTH(proof_a)
 * proof_x = HMAC-SHA256(secret, "kvtier-auth-v1\0" || role x (1 byte) || nonce_a || nonce_b
 *                       || id_a (8 bytes big-endian) || id_b (same) || namespace)
 * (the label's terminating NUL is part of the message; a is the client, b the server).
 * Each side proves it knows the secret for this exact pair of fresh nonces, so a
 * recorded exchange cannot be replayed and one side's proof is not the other's.
 * A peer with another namespace is refused before any proof is computed. */
#ifndef KVT_AUTH_H
#define KVT_AUTH_H

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>

#define KVT_AUTH_NONCE_BYTES 32
#define KVT_AUTH_PROOF_BYTES 32
#define KVT_AUTH_NS_BYTES    32
#define KVT_AUTH_SECRET_MIN  16
#define KVT_AUTH_SECRET_MAX  1024

enum kvt_auth_role { KVT_AUTH_CLIENT = 0, KVT_AUTH_SERVER = 1 };

struct kvt_auth_params {
    const uint8_t *nonce_client, *nonce_server; /* KVT_AUTH_NONCE_BYTES each */
    uint64_t id_client, id_server;
    const uint8_t *ns; /* KVT_AUTH_NS_BYTES */
};

/* Fills a fresh random nonce (getrandom). 0 or -errno. */
int kvt_auth_nonce(uint8_t nonce[KVT_AUTH_NONCE_BYTES]);
/* The proof of role for these parameters. 0, or -EINVAL for a secret outside
 * KVT_AUTH_SECRET_MIN..MAX bytes, an unknown role or a missing parameter. */
int kvt_auth_proof(const uint8_t *secret, size_t secret_len, enum kvt_auth_role role,
                   const struct kvt_auth_params *p, uint8_t proof[KVT_AUTH_PROOF_BYTES]);
/* Constant-time check of a peer's proof. */
bool kvt_auth_verify(const uint8_t *secret, size_t secret_len, enum kvt_auth_role role,
                     const struct kvt_auth_params *p, const uint8_t *proof, size_t proof_len);
/* Reads a secret file into buf (cap bytes): it must be a regular file, not a symlink,
 * with no group/other permission bits (-EPERM), of KVT_AUTH_SECRET_MIN..MAX bytes
 * once trailing newlines are dropped, and must fit in cap (-EINVAL otherwise).
 * On failure buf is wiped. */
int kvt_auth_load_secret(const char *path, uint8_t *buf, size_t cap, size_t *len_p);
/* The namespace fingerprint: SHA-256 of a canonical description string. */
void kvt_auth_namespace(const char *description, uint8_t ns[KVT_AUTH_NS_BYTES]);

#endif

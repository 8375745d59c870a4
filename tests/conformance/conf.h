/* Shared by the two sides of the transport conformance suite: the control messages
 * between the checker (client) and its peer (server), the data pattern of the peer's
 * region, and the event-loop helper both sides use. */
#ifndef KVT_CONF_H
#define KVT_CONF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvt/transport.h"

#define CONF_REGION_BYTES (64ull << 20) /* the peer's registered (remote) region */
#define CONF_MAX_MSG      (64u << 10)
#define CONF_EXIT_QUIT    3 /* a peer's exit status after M_QUIT (two-host supervisor) */

/* Control messages; every one starts with this header. */
enum conf_msg_type {
    M_HANDLE = 1,  /* peer -> client: a = region bytes, data = packed handle */
    M_STREAM,      /* client -> peer: a = n; both sides then send n M_DATA */
    M_DATA,        /* a = seq, data = conf_payload(seq) */
    M_STREAM_DONE, /* peer -> client: a = M_DATA received in order, b = errors */
    M_STALL,       /* client -> peer: do not progress for a ms */
    M_SILENCE,     /* client -> peer: take the host's link (KVT_NETDEV) down for a ms */
    M_KILL,        /* client -> peer: raise(SIGKILL) */
    M_QUIT,        /* client -> peer: exit with CONF_EXIT_QUIT (ends a supervisor) */
    M_AUTHORIZE,   /* client -> peer: authorize your end (the client's handshake) */
    M_EXPECT,      /* client -> peer: at exit, refusal counter a must be exactly b */
    M_DENY,        /* client -> peer: may_read refuses [a, a + b) of the region */
    M_ACK,         /* peer -> client: M_AUTHORIZE, M_EXPECT or M_DENY (a) is done */
};

struct conf_msg {
    uint32_t type;
    uint32_t pad;
    uint64_t a;
    uint64_t b;
    uint8_t data[];
};

/* Fills buf with the region pattern: byte o is a function of o only. */
void conf_pattern(uint8_t *buf, size_t len);
/* Length and bytes of the payload of M_DATA number seq (some above the eager size). */
size_t conf_payload_len(uint64_t seq);
void conf_payload(uint64_t seq, uint8_t *buf, size_t len);
/* True when buf holds conf_payload(seq). */
bool conf_payload_ok(uint64_t seq, const uint8_t *buf, size_t len);

uint64_t conf_now_ms(void);
/* Runs progress (sleeping on the event fd when arm allows) until done(arg) or
 * timeout_ms; 0, -ETIMEDOUT, or progress's error. done may be NULL: run the time. */
int conf_pump(struct kvt_transport *tp, bool (*done)(void *), void *arg, unsigned timeout_ms);

/* The peer side: serves one connection on addr:port (0 = pick) and a mute listener
 * on mute_port (0 = pick) that never progresses; writes "<port> <mute_port>\n" to
 * ready_fd (if >= 0). Returns the process exit status. */
int conf_peer_main(const char *backend, const char *addr, uint16_t port, uint16_t mute_port,
                   int ready_fd);

#endif

/* SPDX-License-Identifier: Apache-2.0 */
/* kvtierd's configuration: a YAML file (libyaml) and `--set key=value` overrides applied
 * after it, both checked against one schema table (node/config.c) that also gives the
 * defaults, the ranges, which keys reload on SIGHUP and the --help text.
 *
 * Keys are dotted ("primary.size"); in the file they nest ("primary: {size: 2GiB}") or
 * may be written dotted at any level. Sizes take KiB/MiB/GiB/TiB (x1024) or kB/MB/GB/TB
 * (x1000) suffixes. In path keys "{id}" expands to node.id as 16 hex digits.
 * Derived defaults: node.id = kvt_hash64("<hostname>:<network.port>") (never 0),
 * primary.path /run/kvtier/{id}/primary.mmap, engine.socket /run/kvtier/{id}/engine.sock
 * (the runtime folder, on the /run tmpfs), storage.root /var/lib/kvtier/{id}: folders
 * the daemon creates 0700 (0750 with node.group) and refuses to use when another user
 * owns them or may write to them. With no file at all the node serves one machine:
 * a 1 GiB primary region in /run, the storage tier in /var/lib, the network tier on
 * 127.0.0.1:7170 with no peers, /metrics on 127.0.0.1:9464.
 *
 * Loading only reads: it creates, opens for writing and removes nothing (the secret
 * file is opened read-only to check it), so a bad configuration leaves no trace. A file
 * nested deeper than KVT_CONFIG_DEPTH_MAX collections is refused at the line where it
 * gets too deep, before the rest is parsed; one over KVT_CONFIG_FILE_MAX bytes too.
 * Reloadable keys (SIGHUP): log.level, loop.tick_ms, network.peers; a reload that
 * changes any other key is refused as a whole and the old configuration stays. */
#ifndef KVT_CONFIG_H
#define KVT_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "kvt/log.h"

/* The exit status for any configuration error (sysexits.h EX_CONFIG). */
#define KVT_CONFIG_EXIT 78

enum kvt_policy_kind { KVT_POLICY_LRU, KVT_POLICY_ARC };
enum kvt_transport_kind { KVT_TRANSPORT_UCX, KVT_TRANSPORT_VERBS };
/* network.verify: how pulled rows are checked (kvt/net_tier.h's enum kvt_net_verify). */
enum kvt_verify_kind { KVT_VERIFY_FENCE, KVT_VERIFY_CHECKSUM };
/* network.fetch: how rows are pulled (kvt/net_tier.h's enum kvt_net_fetch). */
enum kvt_fetch_kind { KVT_FETCH_LEASE, KVT_FETCH_DIRECT };
enum kvt_tier_kind { KVT_TIER_STORAGE, KVT_TIER_NETWORK };

#define KVT_CONFIG_TIERS_MAX 2
/* Collections (mappings, lists) nested in a configuration file, at most. */
#define KVT_CONFIG_DEPTH_MAX 16
/* Bytes of a configuration file, at most. */
#define KVT_CONFIG_FILE_MAX (16 << 20)
/* Upper bound of the number of keys of the schema (for struct kvt_config_diff). */
#define KVT_CONFIG_KEYS_MAX 64

/* The effective configuration after kvt_config_load: every derived default and "{id}"
 * is resolved. Strings and the peer list are owned (kvt_config_free). */
struct kvt_config {
    uint64_t node_id;
    char *node_namespace;
    /* NULL when unset (the first engine that declares one sets the node's); else
     * 1..255 bytes without control characters. */
    char *node_model_fingerprint;
    /* NULL when unset; else a group that exists (a name, or a number), checked at load:
     * the runtime folders are made 0750 with this group so that its engines reach the
     * socket. */
    char *node_group;

    char *primary_path;
    uint64_t primary_size;      /* bytes, a multiple of primary_row_bytes */
    uint64_t primary_row_bytes; /* a multiple of primary_workers */
    enum kvt_policy_kind primary_policy;
    uint32_t primary_workers;

    bool storage_enabled;
    char *storage_root;
    uint64_t storage_capacity;   /* bytes; 0 = no bound */
    uint32_t storage_read_depth; /* reads in flight per read thread */
    /* Back-pressure watermarks of the storage tier's detector (store latency EMA, in
     * microseconds per MiB; high >= low). */
    uint32_t storage_high_water_us;
    uint32_t storage_low_water_us;

    bool network_enabled;
    char *network_listen;
    char *network_advertise;         /* what peers are told; NULL: network_listen */
    uint16_t network_advertise_port; /* what peers are told; 0: network_port */
    uint16_t network_port;           /* 0: any */
    enum kvt_transport_kind network_transport;
    enum kvt_verify_kind network_verify; /* fence (default) or checksum */
    enum kvt_fetch_kind network_fetch;   /* lease or direct */
    uint32_t network_busy_poll_us;       /* 100; 0 = poll while anything is in flight */
    char **network_peers;                /* "host:port" or "[v6]:port" seeds */
    size_t n_network_peers;
    uint32_t network_lease_ms;             /* >= network_fetch_timeout_ms */
    uint32_t network_fetch_timeout_ms;     /* a FETCH not granted by then fails */
    uint32_t network_locate_timeout_ms;    /* a LOCATE not answered by then: a miss */
    uint32_t network_heartbeat_ms;         /* < network_lease_ms */
    uint32_t network_heartbeat_misses;     /* a peer missing this many is down */
    uint32_t network_keys_per_fetch;       /* keys of one FETCH, 1..256 */
    uint32_t network_fetches_per_peer;     /* FETCHes out to one peer at once */
    uint32_t network_reads_per_batch;      /* one-sided READs posted together, 1..256 */
    uint32_t network_max_unauthenticated;  /* accepted, not yet authenticated, at most */
    uint32_t network_max_records_per_peer; /* directory records of one peer; 0 = auto */
    uint32_t network_serve_per_peer;       /* a peer's FETCHes served at once */

    /* NULL when unset (then network.peers must be empty); else a regular file, not a
     * symlink, no group/other access, KVT_AUTH_SECRET_MIN..MAX bytes (checked at load). */
    char *cluster_secret_file;

    char *engine_socket;
    uint32_t engine_socket_mode;       /* permission bits of the socket file; owner rw always */
    char *engine_socket_group;         /* NULL: the daemon's group; else an existing group */
    uint32_t engine_hello_timeout_ms;  /* a connection has this long to say HELLO */
    uint32_t engine_max_requests;      /* live requests per engine */
    uint64_t engine_max_params_bytes;  /* kv_transfer_params of one request */
    uint64_t engine_max_client_params; /* params bytes of all of one engine's requests */
    uint64_t engine_max_output_bytes;  /* replies queued for one engine */
    uint32_t engine_max_event_keys;    /* keys of events queued for take_events */
    uint64_t engine_ring_bytes;        /* each engine's ring, each way; 0: none */
    uint32_t engine_ring_spin_us;      /* the loop polls the rings this long after a request */
    char *metrics_listen;
    uint16_t metrics_port;             /* 0: /metrics off */
    uint32_t metrics_max_connections;  /* HTTP connections at once */
    uint32_t metrics_read_timeout_ms;  /* to receive a whole request */
    uint32_t metrics_write_timeout_ms; /* to send a whole reply */
    enum kvt_log_level log_level;
    uint32_t loop_tick_ms;

    /* Secondary tiers in lookup/cascade order; a listed tier that is not enabled is
     * skipped by the daemon. Every kind appears at most once. */
    enum kvt_tier_kind tiers[KVT_CONFIG_TIERS_MAX];
    size_t n_tiers;
};

/* Fills *cfg with the defaults (derived ones resolved). 0 or -ENOMEM. */
int kvt_config_defaults(struct kvt_config *cfg);
void kvt_config_free(struct kvt_config *cfg);
/* A deep copy of src into *dst (its own strings and peer list); 0 or -ENOMEM (then *dst
 * is not written). */
int kvt_config_copy(struct kvt_config *dst, const struct kvt_config *src);

/* Defaults, then the file at path (NULL: none), then sets[] ("key=value") in order, then
 * derived defaults and cross-key checks (secret file present and mode 0600 or stricter).
 * On error err holds one line naming where ("config <path>:<line>" or "option --set
 * <arg>"), the key and the cause, and *cfg is not written; any error is an exit with
 * KVT_CONFIG_EXIT for the daemon. Returns 0, -EINVAL (bad content), -ENOENT / -EACCES /
 * -EISDIR ... (file not readable) or -ENOMEM. */
int kvt_config_load(struct kvt_config *cfg, const char *path, char *const *sets, size_t n_sets,
                    char *err, size_t err_len);
/* kvt_config_load with the file's len bytes of text in memory (tests/fuzz/fuzz_config);
 * errors name the file name. */
int kvt__config_load_text(struct kvt_config *cfg, const char *name, const char *text, size_t len,
                          char *const *sets, size_t n_sets, char *err, size_t err_len);

/* The keys, their types, defaults and ranges, one per line, for --help. */
void kvt_config_print_help(FILE *out);
/* The effective configuration as YAML that kvt_config_load reads back to an equal one. */
void kvt_config_dump(FILE *out, const struct kvt_config *cfg);

/* What a reload (SIGHUP) would change. */
struct kvt_config_diff {
    size_t n_changed;
    const char *changed[KVT_CONFIG_KEYS_MAX]; /* key names (static strings) */
    bool reloadable;                          /* every changed key can change at run time */
    const char *first_fixed;                  /* the first changed key that cannot, or NULL */
};
/* Compares every key (by its printed value); lists the changed keys in table order.
 * Returns d->reloadable. */
bool kvt_config_diff_reloadable(const struct kvt_config *old_cfg, const struct kvt_config *new_cfg,
                                struct kvt_config_diff *d);
/* Whether key (e.g. "log.level") exists and can change at run time. */
bool kvt_config_key_reloadable(const char *key);

/* SIGHUP: loads the file at path with the running --set arguments (as
 * kvt_config_load), diffs it against *running and, when every changed key is
 * reloadable, replaces *running by the new configuration (the old one is freed) and
 * fills *d. Otherwise *running is untouched and err names the problem: a load error
 * as kvt_config_load gives it (its return value), or "<key>: cannot change at run
 * time (restart kvtierd)" with -EPERM. No change at all is 0 with d->n_changed 0. */
int kvt_config_reload(struct kvt_config *running, const char *path, char *const *sets,
                      size_t n_sets, struct kvt_config_diff *d, char *err, size_t err_len);

/* Parses a size ("4096", "256KiB", "2GiB", "10GB"); 0 or -EINVAL / -ERANGE. */
int kvt_config_parse_size(const char *s, uint64_t *bytes_p);
/* Names of the enum values, as the file spells them. */
const char *kvt_tier_kind_name(enum kvt_tier_kind k);
const char *kvt_transport_kind_name(enum kvt_transport_kind k);
const char *kvt_verify_kind_name(enum kvt_verify_kind k);
const char *kvt_fetch_kind_name(enum kvt_fetch_kind k);
const char *kvt_policy_kind_name(enum kvt_policy_kind k);

#endif

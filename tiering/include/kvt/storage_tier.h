/* SPDX-License-Identifier: Apache-2.0 */
/* The storage tier: a secondary tier that keeps chunks in files on a local disk, when
 * memory is full and across restarts (vLLM's fs tier, plus what it lacks:
 * a capacity bound with LRU eviction, an in-memory index, checksums, warm restart).
 *
 * Layout under cfg.root (every folder 0700, every file 0600, all of the tier's user):
 *   <root>/storage.key                                         random MAC key (no cfg.key)
 *   <root>/<64 hex of the namespace fingerprint>/LOCK          flock: one tier per folder
 *   <root>/<ns hex>/STATE                                      generation, model fingerprint
 *   <root>/<ns hex>/<2 hex shard>/<key hex>.kvc                one chunk per file
 *   <root>/<ns hex>/<2 hex shard>/<key hex>.tmp                being written (removed at start)
 * Each file: a 4096-byte header block (magic, version 2, key, row length, namespace, a
 * random nonce, the GMAC of the row, the GMAC of the whole block) then the row. The
 * MACs are keyed (AES-256-GMAC, keys derived from cfg.key or storage.key and the
 * namespace): a file someone else wrote or changed fails them, is refused and removed.
 * The root must be this user's own and not writable by group or others (see
 * kvt/safe_path.h); the tier never follows a link inside it and never removes a file
 * of another user.
 *
 * Lookups are answered synchronously from the in-memory index (HIT/MISS, never RETRY):
 * the tier needs no async lookup helper. A key counts as present only once its file is
 * published (renamed into place).
 *
 * Generations and the model fingerprint (STATE): every file carries the folder's
 * generation, 32 bytes; a file of another one is stale: never served, removed where it
 * is found (at start, at a load). The tier's reset op (the node's reset) starts a new
 * generation, so what it dropped is not served again even when a restart comes before
 * the files are gone. STATE also records the model fingerprint the chunks were stored
 * under (an opaque string, the node's node.model_fingerprint or the one its engines
 * declare; none until one is known):
 *   - the node's fingerprint known at create (cfg.fingerprint) or set later
 *     (kvt_storage_tier_set_fingerprint) and none recorded: it is recorded, the files
 *     are kept (chunks stored before any fingerprint was declared count as this one's);
 *   - it differs from the recorded one: a new generation, every file dropped (counted,
 *     KVT_M_STORAGE_FINGERPRINT_DROPS), the new one recorded;
 *   - none known at create and one recorded: the chunks are withheld (lookups MISS,
 *     stores go on) until the node's fingerprint is set, then kept or dropped as above. */
#ifndef KVT_STORAGE_TIER_H
#define KVT_STORAGE_TIER_H

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>

#include "kvt/tier.h"

struct kvt_bp_config;

#define KVT_STORAGE_NS_BYTES 32
#define KVT_STORAGE_FP_MAX   255 /* bytes of a model fingerprint */

/* How chunk files are read and written. AUTO probes O_DIRECT once at create and uses it
 * when the file system takes it and rows are multiples of 4096 bytes at 4096-aligned
 * addresses; buffered I/O otherwise. DIRECT fails create when the probe fails. */
enum kvt_storage_io {
    KVT_STORAGE_IO_AUTO = 0,
    KVT_STORAGE_IO_BUFFERED = 1,
    KVT_STORAGE_IO_DIRECT = 2,
};

struct kvt_storage_tier_config {
    const char *root;                           /* required; created if missing */
    uint8_t namespace_id[KVT_STORAGE_NS_BYTES]; /* fingerprint of what makes bytes meaningful */
    uint64_t capacity_bytes;  /* bound on file bytes (header + row per chunk); 0 = none */
    unsigned n_read_threads;  /* 0 = 4 */
    unsigned n_write_threads; /* 0 = 2 */
    /* Chunk reads each read thread keeps in flight through its io_uring, so that it
     * checks one chunk while the next are read; 0 = 16 (docs/bench-storage.md: 2 read
     * at 0.72-0.79x fio, 8 and 16 at 0.92-1.05x). 1, no_io_uring, or a kernel
     * (or seccomp policy) that refuses io_uring: one blocking read at a time. */
    unsigned read_depth;
    bool no_io_uring;
    unsigned scan_threads; /* warm restart; 0 = 4 */
    int locality;          /* enum kvt_locality; a zeroed config is LOCAL */
    enum kvt_storage_io io;
    bool fsync;           /* fsync each file (and its folder) before it counts as stored */
    bool enable_events;   /* stored/removed events (medium STORAGE) */
    bool no_backpressure; /* no detector (default: one with the LOCAL or NETWORK watermarks) */
    const struct kvt_bp_config *bp; /* NULL = kvt_bp_default_config(type, locality) */
    const char *type;               /* default "storage" */
    /* Secret the files' MAC keys derive from (with the namespace), e.g. the cluster
     * secret, 16..1024 bytes; copied. NULL: a random key kept in <root>/storage.key,
     * created 0600 at the first start. Files written under another key fail their MAC
     * and are removed. */
    const uint8_t *key;
    size_t key_len;
    /* The node's model fingerprint (1..KVT_STORAGE_FP_MAX bytes, copied), or NULL when
     * it is not known yet (see the top of this file). */
    const char *fingerprint;
};

/* Creates the folders, takes the folder lock, probes O_DIRECT, reads (or writes) STATE,
 * rebuilds the index from the headers (temporary files and files with bad headers,
 * bad MACs, the old format or another generation are deleted; another user's files
 * are left alone and counted) and starts the I/O threads. -EINVAL for a bad config, the negative
 * errno when the root or the namespace folder cannot be created or written (a configuration error,
 * logged with the path), -EPERM when the root, a folder or the key file is another user's, a link
 * or open to group/others, -EBUSY when another tier holds the folder. */
int kvt_storage_tier_create(const struct kvt_storage_tier_config *cfg, struct kvt_tier **tier_p);

/* Stat names (label "<index+1>:<type>"); counters are return-and-reset, gauges re-emitted. */
#define KVT_M_STORAGE_STORED_CHUNKS  "kvtier_storage_stored_chunks"     /* counter */
#define KVT_M_STORAGE_SKIPPED_CHUNKS "kvtier_storage_skipped_chunks"    /* already present */
#define KVT_M_STORAGE_LOADED_CHUNKS  "kvtier_storage_loaded_chunks"     /* counter */
#define KVT_M_STORAGE_EVICTIONS      "kvtier_storage_evictions"         /* counter */
#define KVT_M_STORAGE_CHECKSUM_FAIL  "kvtier_storage_checksum_failures" /* bad header/payload */
/* Reasons among the checksum failures (each file also counts there): */
#define KVT_M_STORAGE_MAC_FAIL   "kvtier_storage_mac_failures"     /* MAC did not verify */
#define KVT_M_STORAGE_OLD_FORMAT "kvtier_storage_old_format_files" /* an older format */
/* Files refused because another user owns them (left alone) or group/others may use
 * them (removed); counted at start and at loads. */
#define KVT_M_STORAGE_FOREIGN        "kvtier_storage_foreign_files"
#define KVT_M_STORAGE_ERRORS         "kvtier_storage_tier_errors"    /* every failed chunk */
#define KVT_M_STORAGE_ENOSPC         "kvtier_storage_enospc_errors"  /* subset of errors */
#define KVT_M_STORAGE_EIO            "kvtier_storage_eio_errors"     /* subset of errors */
#define KVT_M_STORAGE_NO_SPACE       "kvtier_storage_capacity_drops" /* no evictable room */
#define KVT_M_STORAGE_USED_BYTES     "kvtier_storage_used_bytes"     /* gauge */
#define KVT_M_STORAGE_CAPACITY_BYTES "kvtier_storage_capacity_bytes" /* gauge (0 = none) */
#define KVT_M_STORAGE_FILES          "kvtier_storage_files"          /* gauge */
/* Files dropped by a reset; by a change of the model fingerprint (at start, or when
 * the node's is set); files of an earlier generation found at start or at a load (a
 * reset or model change that stopped before its files were removed). */
#define KVT_M_STORAGE_RESET_DROPS       "kvtier_storage_reset_drops"
#define KVT_M_STORAGE_FINGERPRINT_DROPS "kvtier_storage_fingerprint_drops"
#define KVT_M_STORAGE_STALE             "kvtier_storage_stale_files"
/* Gauge: 1 while the chunks recorded under a fingerprint wait for the node's. */
#define KVT_M_STORAGE_WITHHELD "kvtier_storage_withheld"

/* The node's model fingerprint is now fp (1..KVT_STORAGE_FP_MAX bytes): the chunks of
 * the recorded one are served again, or dropped (a new generation) when it differs; a
 * folder with none recorded records fp and keeps its files. 0, -EINVAL (fp), or the
 * -errno of writing STATE (nothing changed). Scheduler thread. */
int kvt_storage_tier_set_fingerprint(struct kvt_tier *t, const char *fp);
/* The fingerprint STATE records, or NULL. */
const char *kvt_storage_tier_fingerprint(struct kvt_tier *t);

/* Introspection (scheduler thread). */
struct kvt_storage_restart_info {
    size_t files_found;       /* valid chunk files indexed */
    size_t tmp_removed;       /* leftover temporary files deleted */
    size_t bad_removed;       /* files with bad headers (or foreign names) deleted */
    size_t mac_removed;       /* of those: the header's MAC did not verify */
    size_t old_removed;       /* of those: an older file format */
    size_t foreign;           /* refused: another user's (left) or open to group/others */
    size_t evicted;           /* over capacity at start, evicted */
    size_t stale_removed;     /* of another generation (reset, model change), deleted */
    size_t skipped;           /* not opened or read for a transient error: kept, not indexed */
    bool fingerprint_changed; /* cfg.fingerprint differed from STATE's: all dropped */
    uint64_t bytes_found;     /* file bytes indexed */
    double seconds;           /* time to rebuild the index */
};
void kvt_storage_tier_restart_info(struct kvt_tier *t, struct kvt_storage_restart_info *info_p);

struct kvt_storage_tier_info {
    size_t num_keys;     /* published */
    size_t num_writing;  /* stores admitted, not yet published */
    size_t num_doomed;   /* evicted or failed, file being removed */
    uint64_t used_bytes; /* published + reserved */
    uint64_t capacity_bytes;
    bool direct_io;        /* O_DIRECT in use for the current row size */
    bool io_uring;         /* every read thread reads through its io_uring */
    unsigned read_depth;   /* chunk reads in flight per read thread */
    size_t num_unreported; /* jobs submitted and not yet reported */
    bool withheld;         /* chunks wait for the node's fingerprint: lookups MISS */
};
void kvt_storage_tier_info(struct kvt_tier *t, struct kvt_storage_tier_info *info_p);
/* True when key is indexed and published. */
bool kvt_storage_tier_has(struct kvt_tier *t, const struct kvt_key *key);
/* Path of key's chunk file; -ENAMETOOLONG if it does not fit in len bytes. */
int kvt_storage_tier_path(struct kvt_tier *t, const struct kvt_key *key, char *buf, size_t len);
/* The namespace folder. */
const char *kvt_storage_tier_dir(struct kvt_tier *t);

/* Blocks until every queued or running task (jobs and file removals) is done; the
 * results stay queued for get_finished_jobs. */
void kvt_storage_tier_wait_idle(struct kvt_tier *t);

#endif

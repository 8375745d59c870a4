/* SPDX-License-Identifier: Apache-2.0 */
/* Private parts of the storage tier shared by storage_tier.c (the scheduler-thread
 * front end: index, LRU, capacity, completions, stats) and storage_io.c (file format,
 * I/O thread pool, warm-restart scan).
 *
 * Threads and what they touch:
 * - scheduler thread: everything under "scheduler only" below, without a lock.
 * - I/O threads: the queues, counters and done list under pool.mu; the items of the
 *   task they run (key, chunk, err), the primary rows named by those items, the disk.
 *   They never see st_entry, the map or the manager. */
#ifndef KVT_STORAGE_INT_H
#define KVT_STORAGE_INT_H

#include <errno.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>
#include <sys/types.h>
#include <sys/uio.h>

#include "kvt/common.h"
#include "kvt/list.h"
#include "kvt/map.h"
#include "kvt/storage_tier.h"
#include "kvt/types.h"

#define ST_BLOCK       4096u       /* header block; payload offset; O_DIRECT alignment */
#define ST_MAGIC       0x5354564bu /* "KVTS" little-endian */
#define ST_VERSION     2u          /* keyed MACs; 1 had unkeyed XXH3 sums (refused) */
#define ST_VERSION_OLD 1u
#define ST_NAME_MAX    (3 + 2 * KVT_KEY_MAX + 4 + 1) /* "ab/<hex>.kvc" */
#define ST_BUCKETS     32
#define ST_SCAN_SHARDS 256

/* Header field offsets (little-endian on disk). */
#define ST_OFF_MAGIC   0
#define ST_OFF_VERSION 4
#define ST_OFF_KEYLEN  6
#define ST_OFF_PAYLOAD 8
#define ST_OFF_FLAGS   12
#define ST_OFF_ROWLEN  16
#define ST_OFF_GEN     24 /* the folder's generation (ST_GEN_BYTES) */
#define ST_OFF_KEY     56
#define ST_OFF_NONCE   120 /* ST_NONCE_BYTES random, fresh for every file */
#define ST_OFF_ROWTAG  136 /* GMAC of the row (ST_TAG_BYTES) */
#define ST_OFF_HDRTAG  152 /* GMAC of the whole block with this field zeroed */
#define ST_NONCE_BYTES 12
#define ST_TAG_BYTES   16
#define ST_KEY_BYTES   32 /* AES-256 */
#define ST_KEY_FILE    "storage.key"
#define ST_GEN_BYTES   32
#define ST_STATE_FILE  "STATE" /* in the namespace folder: generation, fingerprint */

/* Errors the I/O threads report per chunk besides errnos (positive values no file
 * call returns). */
#define ST_ERR_CORRUPT EBADMSG      /* bad header, size or key, truncated file */
#define ST_ERR_MAC     EKEYREJECTED /* a MAC did not verify: changed, or another key */
#define ST_ERR_OLD     EPROTO       /* a file of format version 1 */
#define ST_ERR_FOREIGN EPERM        /* another user's file, or open to group/others */
#define ST_ERR_STALE   ESTALE       /* ours, of an earlier generation (reset, model change) */

/* Errors of a load that say nothing of the file: the process ran out of descriptors
 * or memory, or the call was interrupted. The load of that chunk fails (a miss); its
 * file and its key stay, and lookups of the key MISS for ST_TRANSIENT_MISS_NS (a
 * positive verdict that keeps failing would promote the chunk for ever). (EIO does say something:
 * the medium could not give the bytes, and a file that cannot be read is removed like a bad one.)
 */
#define ST_TRANSIENT_MISS_NS 1000000000ull

static inline bool kvt__st_err_transient(int err)
{
    return kvt_err_no_resources(err) || err == EAGAIN || err == EINTR;
}

enum st_state { ST_WRITING, ST_PUBLISHED, ST_DOOMED };

/* One indexed key (scheduler only). WRITING: a store is admitted, its bytes reserved;
 * PUBLISHED: on disk, in the LRU list, lookups HIT; DOOMED: evicted or failed, waiting
 * for its file removal (unlink_pending) and its readers (pins) before it leaves the
 * map. While a key has an entry no second store of it is admitted. */
struct st_entry {
    struct kvt_key key;
    uint64_t bytes;    /* file bytes charged to capacity */
    uint64_t mtime_ns; /* restart ordering */
    /* After a transient load error (kvt__st_err_transient): lookups MISS until this
     * time (the livelock rule of kvt/tier.h), while the file and the key stay. */
    uint64_t miss_until_ns;
    int32_t pins; /* running loads reading the file */
    uint8_t state;
    bool unlink_pending;
    struct kvt_list lru; /* PUBLISHED only; head = least recently used */
};

enum st_kind { ST_STORE, ST_LOAD, ST_UNLINK };

/* One chunk of a job. key/chunk are read by I/O threads, err written by them;
 * e is the scheduler's. */
struct st_item {
    struct kvt_key key;
    int64_t chunk;
    struct st_entry *e; /* NULL: failed at submit (err set) */
    int err;            /* 0 or a positive errno / ST_ERR_CORRUPT */
};

/* A submitted job (or an internal file-removal batch), split into tasks. */
struct st_job {
    struct kvt_list link;      /* pool.done */
    const struct kvt_job *job; /* NULL for ST_UNLINK */
    enum st_kind kind;
    /* The folder's generation when the job was made: stores write it, loads accept
     * only it (a job outlives no reset unnoticed). Read-only once queued. */
    uint8_t gen[ST_GEN_BYTES];
    bool direct;
    size_t n_items, cap_items;
    struct st_item *items;
    struct st_task *tasks; /* cap_tasks, made with the job: queueing never allocates */
    unsigned cap_tasks;
    /* Loads: room for the report's successful keys (from the front) and the keys
     * whose files went bad (from the back), made at submit so reporting cannot fail. */
    struct kvt_key *result_keys;
    unsigned tasks_left;       /* pool.mu */
    uint64_t start_ns, end_ns; /* pool.mu */
    size_t n_dropped;          /* stores: keys refused for capacity at submit */
    size_t n_skipped;          /* stores: keys already indexed */
    unsigned n_tasks;          /* set at submit */
    /* Removals: the store job whose tasks are held until these files are gone (its
     * room comes from them; on a full file system it would fail otherwise). */
    struct st_job *waiter;
};

struct st_task {
    struct kvt_list fifo, bucket;
    struct st_job *sj;
    size_t begin, end;
    uint64_t bytes; /* queue order (shortest job first) */
    unsigned bucket_idx;
    /* The thread running a load through its ring: next item to submit, items not
     * done yet. */
    size_t next, left;
};

/* Bucket queue: FCFS list plus 32 log2(bytes) buckets (shortest job first). */
struct st_queue {
    struct kvt_list fifo;
    struct kvt_list buckets[ST_BUCKETS];
    uint32_t mask;
    size_t n;
    bool sjf_next; /* loads alternate FCFS and SJF ("ping-pong") */
};

struct st_tier;

/* One chunk read in flight in a read thread's ring (that thread only). */
struct st_rd {
    struct st_task *t; /* NULL: free */
    size_t idx;        /* item in t->sj */
    int fd;
    bool direct;
    uint8_t *hdr; /* ST_BLOCK, aligned */
    struct iovec *iov;
};

struct st_mac; /* storage_mac.c: one thread's GMAC contexts */

struct st_thread {
    pthread_t tid;
    struct st_tier *s;
    struct st_mac *mac;
    bool reader;  /* read threads prefer loads, then removals, then stores */
    uint8_t *mem; /* header buffers (1 + depth of ST_BLOCK), aligned, inside mem */
    uint8_t *hdr;
    /* A file's whole image (header block + row) for one contiguous write, a
     * kvt_calloc_table of wbuf_bytes made at the first store (wbuf_bytes 0 before;
     * wbuf NULL when it failed: header and row are then written from their places). */
    uint8_t *wbuf;
    size_t wbuf_bytes;
    bool started;
    /* Read threads with io_uring: the ring (struct io_uring, storage_io.c only) and
     * depth slots for the reads in flight. */
    void *ring;
    unsigned depth, n_busy;
    struct st_rd *rd;
};

/* Test hook: called under pool.mu each time an I/O thread takes a task off a queue,
 * in the order they are taken. */
typedef void (*kvt__st_take_hook_t)(void *arg, const struct st_thread *th, const struct st_task *t);

struct st_pool {
    pthread_mutex_t mu;
    /* Read and write threads wait on their own variable: a task is only signalled to
     * a class of thread that can take it (a load woken into a write thread would be
     * a lost wakeup). Each is broadcast when paused clears or stopping is set. */
    pthread_cond_t read_cv, write_cv;
    pthread_cond_t idle_cv; /* inflight reached 0 */
    struct st_queue loads, stores, unlinks;
    struct kvt_list done; /* finished st_jobs for get_finished_jobs */
    /* The scheduler's wake-up: an eventfd written as a job joins done (cleared when
     * done is taken), and the jobs that ever joined it (the tier's news). */
    int done_fd;
    uint64_t n_done;
    size_t inflight; /* tasks queued or running */
    bool paused, stopping;
    struct st_thread *threads;
    unsigned n_threads;
    kvt__st_take_hook_t take_hook;
    void *take_hook_arg;
};

struct st_counters {
    uint64_t stored, skipped, loaded, evictions, checksum_fail, errors, enospc, eio, capacity_drops;
    uint64_t mac_fail, old_format, foreign;
    uint64_t stale, reset_drops, fingerprint_drops;
};

struct st_tier {
    struct kvt_tier base;
    /* Fixed after create (read by I/O threads). */
    char *root;
    char *dir; /* namespace folder */
    int dir_fd, lock_fd;
    uint8_t ns[KVT_STORAGE_NS_BYTES];
    /* MAC keys (derived at create from cfg.key or the key file, and the namespace). */
    uint8_t key_hdr[ST_KEY_BYTES], key_row[ST_KEY_BYTES];
    uid_t uid; /* files of another owner are refused and left alone */
    bool fsync;
    bool direct_ok; /* O_DIRECT probe passed */
    bool enable_events;
    unsigned n_read, n_write, n_scan;
    unsigned read_depth;          /* reads in flight per read thread (io_uring) */
    bool no_uring;                /* config: thread pool only */
    bool uring_ok;                /* every read thread has a ring */
    int fault_n[3], fault_err[3]; /* atomics, by enum kvt_storage_fault */
    struct st_pool pool;
    /* Scheduler only. */
    uint8_t gen[ST_GEN_BYTES]; /* the folder's generation (STATE); jobs take a copy */
    char *fingerprint;         /* recorded in STATE, NULL: none (any engine's chunks) */
    bool withheld;             /* the node's fingerprint is not known yet: lookups MISS */
    struct kvt_map index;      /* key -> st_entry */
    struct kvt_list lru;
    uint64_t capacity, used;
    size_t n_published, n_writing, n_doomed;
    size_t n_unreported;
    bool shut_down;
    struct st_job *pending_unlinks; /* evictions of the current call, not yet queued */
    struct st_counters c;
    struct kvt_events events;
    struct kvt_storage_restart_info restart;
    char label[KVT_STAT_LABEL_MAX];
};

/* storage_mac.c: keyed MACs of the chunk files (AES-256-GMAC, OpenSSL). */
/* The tier's two keys from secret (or the key file under root_fd when secret is NULL)
 * and the namespace. 0 or -errno (-EPERM: the key file is not ours or not private). */
int kvt__st_mac_keys(struct st_tier *s, int root_fd, const uint8_t *secret, size_t secret_len);
/* One thread's contexts; NULL when out of memory. */
struct st_mac *kvt__st_mac_new(const struct st_tier *s);
void kvt__st_mac_free(struct st_mac *m);
/* Fills nonce with fresh random bytes. 0 or -errno. */
int kvt__st_mac_nonce(uint8_t nonce[ST_NONCE_BYTES]);
/* len random bytes (getrandom). 0 or -errno. */
int kvt__st_random(uint8_t *buf, size_t len);
/* GMAC of len bytes with the header key (hdr) or the row key under nonce. 0 or -EIO. */
int kvt__st_mac(struct st_mac *m, bool hdr, const uint8_t *nonce, const uint8_t *data, size_t len,
                uint8_t tag[ST_TAG_BYTES]);
/* Constant-time comparison of two tags. */
bool kvt__st_tag_eq(const uint8_t *a, const uint8_t *b);

/* storage_io.c */
size_t kvt__st_name(const struct kvt_key *key, const char *ext, char *buf);
uint64_t kvt__st_file_bytes(uint64_t row_len);
/* Writes the header of a file whose row has tag row_tag under nonce, and its own tag.
 * 0 or -EIO (the MAC failed to compute). */
int kvt__st_hdr_encode(struct st_mac *m, uint8_t *blk, const uint8_t *gen,
                       const struct kvt_key *key, uint64_t row_len, const uint8_t *nonce,
                       const uint8_t *row_tag);
/* 0, ST_ERR_CORRUPT, ST_ERR_MAC (the header's tag), ST_ERR_OLD or ST_ERR_STALE (a
 * valid file of another generation than gen); fills key_p and row_len_p. */
int kvt__st_hdr_decode(struct st_mac *m, uint8_t *blk, const uint8_t *gen, struct kvt_key *key_p,
                       uint64_t *row_len_p);
/* Probes O_DIRECT in dir_fd: 1 supported, 0 not, negative errno if the folder is not
 * writable at all. */
int kvt__st_probe_direct(int dir_fd);

/* How many tasks a job of n items of this kind is split into (at most). */
unsigned kvt__st_max_tasks(const struct st_tier *s, enum st_kind kind, size_t n);
/* Mutex, condition variables, queues; no threads yet. */
void kvt__st_pool_init(struct st_tier *s);
int kvt__st_pool_start(struct st_tier *s);
/* Cancels queued tasks (their items fail with ECANCELED), joins the threads. */
void kvt__st_pool_stop(struct st_tier *s);
void kvt__st_pool_cleanup(struct st_tier *s);
/* Queues a job (split into tasks) or, with no items, posts it as done. With
 * removals (an ST_UNLINK job, or NULL), these are queued first and the job's tasks
 * only when the removals are done. */
void kvt__st_pool_submit(struct st_tier *s, struct st_job *sj);
void kvt__st_pool_submit_after(struct st_tier *s, struct st_job *removals, struct st_job *sj);
/* Moves every finished job to out (a list of st_job.link). */
void kvt__st_pool_take_done(struct st_tier *s, struct kvt_list *out);
void kvt__st_pool_wait_idle(struct st_tier *s);
void kvt__st_pool_pause(struct st_tier *s, bool paused);
/* Test hook (NULL to clear). */
void kvt__st_pool_set_take_hook(struct st_tier *s, kvt__st_take_hook_t hook, void *arg);

/* Warm-restart scan result. */
struct st_found {
    struct kvt_key key;
    uint64_t bytes, mtime_ns;
};
int kvt__st_scan(struct st_tier *s, struct st_found **found_p, size_t *n_p);

#endif

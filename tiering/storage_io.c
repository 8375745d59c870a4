/* SPDX-License-Identifier: Apache-2.0 */
/* The storage tier's back end: the chunk file format, the I/O thread pool and the
 * warm-restart scan (the front end, with the index, is storage_tier.c; the MACs are
 * storage_mac.c).
 *
 * File format 2 (little-endian), one chunk per file "<shard>/<key hex>.kvc":
 *   0 magic "KVTS" | 4 version u16 (2) | 6 key length u16 | 8 payload offset u32 (4096)
 *   12 flags u32 (0) | 16 row length u64 | 24 generation [32] | 56 key [64, zero padded]
 *   120 nonce [12] | 132 zeros [4] | 136 GMAC of the row [16] | 152 GMAC of the whole
 *   4096-byte block with this field zeroed [16] | zeros up to 4096 | the row.
 * The header tag covers the padding too, so a flipped bit anywhere in the file is
 * caught: in the block by the header tag, in the row by the row tag; and since the
 * tags are keyed, so is a file someone else wrote (format 1 had unkeyed XXH3 sums:
 * its files are refused and removed, counted as old format). The payload starts at
 * 4096 so that the same file can be written and read with O_DIRECT or buffered:
 * written as one contiguous image (header block + a copy of the row) from the
 * thread's huge-page buffer, read with one preadv straight into the slot.
 *
 * Generation: the 32 bytes at 24 name the folder's generation when the file was
 * written (the front end's STATE file; before there was one, the namespace id, so
 * the files of earlier versions keep theirs). A reset or a change of the model
 * fingerprint starts a new one: a file of another generation is stale (ST_ERR_STALE),
 * never served, and removed where it is found (at start, at a load), so what a reset
 * dropped stays dropped across a crash or restart that came before its removal.
 *
 * Files and other users: the namespace folder and its shards are 0700 and the files
 * 0600, all of the tier's user. Names are opened relative to the folder fds with
 * O_NOFOLLOW, a chunk's in its shard folder, itself opened O_NOFOLLOW for each use (a
 * shard replaced by a link after the start is refused, not followed elsewhere); a
 * chunk file is checked with fstat once opened: another user's file is
 * refused and left where it is (ST_ERR_FOREIGN; the tier removes only its own files),
 * one of ours that group or others may use is refused and removed.
 *
 * Publishing: write "<key hex>.tmp", optionally fdatasync, rename to ".kvc" (atomic),
 * optionally fsync the folder. A crash leaves at most a .tmp file, removed at start;
 * a torn .kvc (power loss without fsync) fails its MACs and is deleted on read.
 * One tier per namespace folder (flock in the front end), so the names need no
 * per-writer suffix: a store of a key runs only while the index says WRITING.
 *
 * Thread pool (vLLM's DualQueueThreadPool shape): n read and m write threads, one
 * mutex, one condition variable for work and one for idleness. A job is split into
 * tasks: loads evenly over the read threads; stores into one task when the tier is
 * LOCAL (concurrent SSD writes stall reads on the same die) and over the write threads
 * when REMOTE. Queues: loads alternate FCFS and shortest-job-first, stores are
 * shortest-job-first (32 log2-byte buckets, FCFS inside), file removals FCFS. Read
 * threads take loads, then removals, then stores; write threads removals, then stores.
 * A store that evicted files is held until their removal job is done (waiter).
 * Finished jobs go to a done list that only the scheduler thread drains. Each thread
 * has GMAC contexts of its own (struct st_mac).
 *
 * Read threads with io_uring (liburing at build time, the kernel's permission at run
 * time, read_depth > 1): each keeps read_depth chunk reads in flight in a ring of its
 * own and checks one chunk while the next are read (see "read threads with io_uring").
 * Where io_uring is refused (seccomp, io_uring_disabled, old kernels) or turned off,
 * a read thread does one blocking preadv at a time: the thread pool above. Writes are
 * always blocking (a write is open, pwritev, close, rename: little to overlap). */
#include <assert.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include "kvt/alloc.h"
#include "kvt/clock.h"
#include "kvt/common.h"
#include "kvt/hash.h"
#include "kvt/log.h"
#include "kvt/vec.h"
#include "kvt/storage_tier_test.h"
#include "storage_int.h"

#ifdef KVT_HAVE_LIBURING
#include <liburing.h>
#endif

#define MOD "storage"

/* ---- names and format ------------------------------------------------------------ */

size_t kvt__st_name(const struct kvt_key *key, const char *ext, char *buf)
{
    static const char hex[] = "0123456789abcdef";
    unsigned shard = (unsigned)(kvt_key_hash(key) >> 56);
    size_t n = 0, elen = strlen(ext);
    buf[n++] = hex[shard >> 4];
    buf[n++] = hex[shard & 15];
    buf[n++] = '/';
    kvt_key_to_hex(key, buf + n);
    n += 2u * key->len;
    memcpy(buf + n, ext, elen + 1);
    return n + elen;
}

uint64_t kvt__st_file_bytes(uint64_t row_len)
{
    return ST_BLOCK + ((row_len + ST_BLOCK - 1) / ST_BLOCK) * ST_BLOCK;
}

static void put16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}
static void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static void put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static uint16_t get16(const uint8_t *p)
{
    return (uint16_t)(p[0] | p[1] << 8);
}
static uint32_t get32(const uint8_t *p)
{
    uint32_t v = 0;
    for (int i = 3; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}
static uint64_t get64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

int kvt__st_hdr_encode(struct st_mac *m, uint8_t *blk, const uint8_t *gen,
                       const struct kvt_key *key, uint64_t row_len, const uint8_t *nonce,
                       const uint8_t *row_tag)
{
    memset(blk, 0, ST_BLOCK);
    put32(blk + ST_OFF_MAGIC, ST_MAGIC);
    put16(blk + ST_OFF_VERSION, ST_VERSION);
    put16(blk + ST_OFF_KEYLEN, key->len);
    put32(blk + ST_OFF_PAYLOAD, ST_BLOCK);
    put32(blk + ST_OFF_FLAGS, 0);
    put64(blk + ST_OFF_ROWLEN, row_len);
    memcpy(blk + ST_OFF_GEN, gen, ST_GEN_BYTES);
    memcpy(blk + ST_OFF_KEY, key->bytes, key->len);
    memcpy(blk + ST_OFF_NONCE, nonce, ST_NONCE_BYTES);
    memcpy(blk + ST_OFF_ROWTAG, row_tag, ST_TAG_BYTES);
    return kvt__st_mac(m, true, nonce, blk, ST_BLOCK, blk + ST_OFF_HDRTAG);
}

int kvt__st_hdr_decode(struct st_mac *m, uint8_t *blk, const uint8_t *gen, struct kvt_key *key_p,
                       uint64_t *row_len_p)
{
    uint8_t tag[ST_TAG_BYTES], want[ST_TAG_BYTES];
    unsigned klen, version = get16(blk + ST_OFF_VERSION);
    int rc;

    if (get32(blk + ST_OFF_MAGIC) != ST_MAGIC)
        return ST_ERR_CORRUPT;
    if (version == ST_VERSION_OLD)
        return ST_ERR_OLD;
    if (version != ST_VERSION)
        return ST_ERR_CORRUPT;
    memcpy(tag, blk + ST_OFF_HDRTAG, ST_TAG_BYTES);
    memset(blk + ST_OFF_HDRTAG, 0, ST_TAG_BYTES);
    rc = kvt__st_mac(m, true, blk + ST_OFF_NONCE, blk, ST_BLOCK, want);
    memcpy(blk + ST_OFF_HDRTAG, tag, ST_TAG_BYTES);
    if (rc != 0 || !kvt__st_tag_eq(tag, want))
        return ST_ERR_MAC;
    /* Authenticated: what follows is our own writing, checked against this tier. */
    klen = get16(blk + ST_OFF_KEYLEN);
    if (get32(blk + ST_OFF_PAYLOAD) != ST_BLOCK || get32(blk + ST_OFF_FLAGS) != 0 || klen < 1 ||
        klen > KVT_KEY_MAX)
        return ST_ERR_CORRUPT;
    if (memcmp(blk + ST_OFF_GEN, gen, ST_GEN_BYTES) != 0)
        return ST_ERR_STALE; /* ours, of a generation a reset or a model change ended */
    key_p->len = (uint8_t)klen;
    memcpy(key_p->bytes, blk + ST_OFF_KEY, klen);
    *row_len_p = get64(blk + ST_OFF_ROWLEN);
    return 0;
}

int kvt__st_probe_direct(int dir_fd)
{
    static const char name[] = ".probe";
    void *buf = NULL;
    int fd, rc = 1;
    /* O_NONBLOCK: a FIFO left at the name fails (ENXIO) instead of waiting for a reader. */
    fd =
        openat(dir_fd, name,
               O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | O_DIRECT, 0600);
    if (fd >= 0 && posix_memalign(&buf, ST_BLOCK, ST_BLOCK) == 0) {
        memset(buf, 0, ST_BLOCK);
        if (pwrite(fd, buf, ST_BLOCK, 0) != (ssize_t)ST_BLOCK)
            rc = errno == EINVAL ? 0 : -errno;
    } else if (fd >= 0) {
        rc = -ENOMEM;
    } else {
        rc = errno == EINVAL ? 0 : -errno;
    }
    free(buf); /* posix_memalign's own memory: no kvt_ aligned allocator exists */
    if (fd >= 0)
        close(fd);
    if (rc == 0) {
        /* No O_DIRECT: the folder must still take a buffered write. */
        fd = openat(dir_fd, name,
                    O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0600);
        if (fd < 0 || write(fd, "k", 1) != 1)
            rc = -errno;
        if (fd >= 0)
            close(fd);
    }
    unlinkat(dir_fd, name, 0);
    return rc;
}

/* ---- chunk I/O (I/O threads) ------------------------------------------------------ */

/* The errno of an injected fault (a test hook) whose count *n_p is not used up, taking
 * one; else 0. */
static int fault_take(int *n_p, const int *err_p)
{
    int n = __atomic_load_n(n_p, __ATOMIC_ACQUIRE);
    while (n > 0) {
        if (__atomic_compare_exchange_n(n_p, &n, n - 1, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            return __atomic_load_n(err_p, __ATOMIC_RELAXED);
    }
    return 0;
}

static int take_fault(struct st_tier *s, int op)
{
    return fault_take(&s->fault_n[op], &s->fault_err[op]);
}

/* Full pwritev/preadv of iov at off; *done_p < total only at end of file. */
static int full_io(int fd, bool wr, struct iovec *iov, int cnt, size_t *done_p)
{
    size_t done = 0;
    while (cnt > 0) {
        ssize_t n = wr ? pwritev(fd, iov, cnt, (off_t)done) : preadv(fd, iov, cnt, (off_t)done);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return errno;
        }
        if (n == 0) {
            if (wr)
                return EIO;
            break;
        }
        done += (size_t)n;
        while (cnt > 0 && (size_t)n >= iov->iov_len) {
            n -= (ssize_t)iov->iov_len;
            iov++;
            cnt--;
        }
        if (cnt > 0) {
            iov->iov_base = (uint8_t *)iov->iov_base + n;
            iov->iov_len -= (size_t)n;
        }
    }
    *done_p = done;
    return 0;
}

/* The file part of a name kvt__st_name made ("<two hex digits>/<file>"): the name of
 * the file in its shard folder. */
static const char *in_shard(const char *name)
{
    return name + 3;
}

/* The shard folder of name (a name kvt__st_name made, or the shard's own two hex
 * digits), opened without following a symbolic link, for the *at calls on
 * in_shard(name): the shard folders are checked at start, and one replaced by a link
 * later (only the tier's user can) is refused (ELOOP, ENOTDIR), not followed to a
 * folder elsewhere. -1 with errno set. */
static int shard_open(const struct st_tier *s, const char *name)
{
    char shard[3] = {name[0], name[1], '\0'};
    return openat(s->dir_fd, shard, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
}

/* shard_open's error as the tier's: a shard that is not a folder of ours is foreign. */
static int shard_err(const struct st_tier *s, const char *name, int err)
{
    if (err != ELOOP && err != ENOTDIR)
        return err;
    kvt_warn(MOD, "%s/%.2s is not a folder (a symbolic link?): refused, left alone", s->dir, name);
    return ST_ERR_FOREIGN;
}

/* Removes name ("<shard>/<file>") where its shard folder is; an errno, or 0. */
static int unlink_name(struct st_tier *s, const char *name)
{
    int dfd = shard_open(s, name), err = 0;
    if (dfd < 0)
        return errno;
    if (unlinkat(dfd, in_shard(name), 0) != 0)
        err = errno;
    close(dfd);
    return err;
}

/* True when name (in folder dfd) is a regular file of the tier's user. */
static bool own_file(struct st_tier *s, int dfd, const char *name)
{
    struct stat st;
    return fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode) &&
           st.st_uid == s->uid;
}

static bool own_or_absent(struct st_tier *s, int dfd, const char *name)
{
    struct stat st;
    if (fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW) != 0)
        return errno == ENOENT;
    return S_ISREG(st.st_mode) && st.st_uid == s->uid;
}

/* Renames tmp over fin, both in folder dfd. A file already at fin is replaced only
 * when it is ours (a file whose removal failed, forgotten by the index); another
 * user's stays, and the store fails (ST_ERR_FOREIGN). */
static int publish(struct st_tier *s, int dfd, const char *tmp, const char *fin)
{
    if (renameat2(dfd, tmp, dfd, fin, RENAME_NOREPLACE) == 0)
        return 0;
    if (errno == EINVAL) { /* a file system without RENAME_NOREPLACE */
        if (!own_or_absent(s, dfd, fin))
            return ST_ERR_FOREIGN;
        return renameat(dfd, tmp, dfd, fin) == 0 ? 0 : errno;
    }
    if (errno != EEXIST)
        return errno;
    if (!own_file(s, dfd, fin))
        return ST_ERR_FOREIGN;
    return renameat(dfd, tmp, dfd, fin) == 0 ? 0 : errno;
}

/* The thread's buffer for a whole file image (whole 2 MiB pages, so huge ones: a
 * buffer of 4 KiB pages makes each O_DIRECT request a scatter list of 65 pieces),
 * mapped on first use; NULL when it cannot be. */
static uint8_t *write_buffer(struct st_thread *th, size_t bytes)
{
    if (th->wbuf_bytes == 0) {
        th->wbuf_bytes =
            (bytes + KVT_HUGE_PAGE_BYTES - 1) / KVT_HUGE_PAGE_BYTES * KVT_HUGE_PAGE_BYTES;
        th->wbuf = kvt_calloc_table(1, th->wbuf_bytes);
    }
    return th->wbuf;
}

/* Writes the chunk's file as one contiguous request (header block and a copy of the
 * row in the thread's buffer), not as a two-piece pwritev of the header buffer and
 * the slot: on this project's virtio disk files written in two pieces read back at
 * 3.4-3.8 GB/s, the same bytes written in one at 4.3-5.9 (2026-12-06). The copy also
 * fixes the bytes that the MAC covers. */
static int write_chunk(struct st_tier *s, struct st_thread *th, const struct st_job *sj,
                       const struct st_item *it, bool direct)
{
    size_t row = s->base.row_bytes;
    uint8_t *src = s->base.primary_base + (size_t)it->chunk * row;
    uint8_t *img = write_buffer(th, ST_BLOCK + row);
    uint8_t *hdr = img != NULL ? img : th->hdr;
    struct iovec iov[2] = {{hdr, ST_BLOCK}, {src, row}};
    int n_iov = 2;
    char tmp[ST_NAME_MAX], fin[ST_NAME_MAX];
    int dfd, err = take_fault(s, KVT_STORAGE_FAULT_WRITE);
    if (err != 0)
        return err;
    kvt__st_name(&it->key, ".tmp", tmp);
    kvt__st_name(&it->key, ".kvc", fin);
    if (img != NULL) { /* header and row contiguous: one piece */
        memcpy(img + ST_BLOCK, src, row);
        src = img + ST_BLOCK;
        iov[0].iov_len = ST_BLOCK + row;
        n_iov = 1;
    }
    {
        uint8_t nonce[ST_NONCE_BYTES], tag[ST_TAG_BYTES];
        if (kvt__st_mac_nonce(nonce) != 0 ||
            kvt__st_mac(th->mac, false, nonce, src, row, tag) != 0 ||
            kvt__st_hdr_encode(th->mac, hdr, sj->gen, &it->key, row, nonce, tag) != 0)
            return EIO;
    }
    if ((dfd = shard_open(s, tmp)) < 0)
        return shard_err(s, tmp, errno);
    for (bool retried = false;;) {
        int flags = O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC | (direct ? O_DIRECT : 0);
        size_t done = 0;
        int fd = openat(dfd, in_shard(tmp), flags, 0600);
        if (fd < 0) {
            err = errno;
            /* A leftover of ours (a failed removal): removed once. Anything else
             * there is not ours to replace. */
            if (err == EEXIST && !retried && own_file(s, dfd, in_shard(tmp))) {
                unlinkat(dfd, in_shard(tmp), 0);
                retried = true;
                continue;
            }
            if (err == EEXIST || err == ELOOP) {
                close(dfd);
                return ST_ERR_FOREIGN; /* nothing of ours to clean up */
            }
        } else {
            err = full_io(fd, true, iov, n_iov, &done);
            if (err == 0 && s->fsync && fdatasync(fd) != 0)
                err = errno;
            if (close(fd) != 0 && err == 0)
                err = errno;
        }
        if (err == EINVAL && direct) {
            direct = false; /* this file system refuses O_DIRECT after all */
            continue;
        }
        break;
    }
    if (err == 0)
        err = publish(s, dfd, in_shard(tmp), in_shard(fin));
    if (err != 0) {
        unlinkat(dfd, in_shard(tmp), 0);
        close(dfd);
        return err;
    }
    if (s->fsync) {
        err = take_fault(s, KVT_STORAGE_FAULT_SYNC);
        if (err == 0 && fsync(dfd) != 0)
            err = errno;
        if (err != 0) /* not stored: the key leaves the index, so does its file */
            unlinkat(dfd, in_shard(fin), 0);
    }
    close(dfd);
    return err;
}

/* Opens a chunk file for reading without updating its access time: with relatime
 * the first read after a write dirtied the inode, a journalled metadata write for
 * every chunk loaded (6 % of the read threads' time in touch_atime, 2026-12-06).
 * O_NOATIME is refused (EPERM) for files of another owner: then opened plainly.
 * O_NONBLOCK: a FIFO under a chunk's name would block the open until a writer came;
 * opened at once, it is refused by the fstat that follows (preadv ignores the flag
 * on regular files; io_uring does not, see rd_start). */
static int open_noatime(int dir_fd, const char *name, int flags)
{
    int fd = openat(dir_fd, name, flags | O_NONBLOCK | O_NOATIME);
    if (fd < 0 && errno == EPERM)
        fd = openat(dir_fd, name, flags | O_NONBLOCK);
    return fd;
}

/* A chunk file just opened (name, in_shard(name) in folder name_dir_fd): ST_ERR_FOREIGN
 * for another user's file (left alone) or one of ours that group or others may use
 * (removed here: it is ours). */
static int check_opened(struct st_tier *s, int fd, const char *name, int name_dir_fd)
{
    struct stat st;
    if (fstat(fd, &st) != 0)
        return errno;
    if (!S_ISREG(st.st_mode) || st.st_uid != s->uid) {
        kvt_warn(MOD,
                 "%s/%s is not a file of this tier's user (uid %u, mode %04o): refused, "
                 "left alone",
                 s->dir, name, (unsigned)st.st_uid, (unsigned)(st.st_mode & 07777));
        return ST_ERR_FOREIGN;
    }
    if (st.st_mode & 077) {
        kvt_warn(MOD, "%s/%s has mode %04o (group or others may use it): refused, removed", s->dir,
                 name, (unsigned)(st.st_mode & 07777));
        unlinkat(name_dir_fd, in_shard(name), 0);
        return ST_ERR_FOREIGN;
    }
    return 0;
}

/* Opens key's file for a load; falls back to buffered where O_DIRECT is refused. */
static int open_chunk(struct st_tier *s, const struct st_item *it, bool *direct, int *fd_p)
{
    char fin[ST_NAME_MAX];
    int dfd, err;
    kvt__st_name(&it->key, ".kvc", fin);
    if ((dfd = shard_open(s, fin)) < 0)
        return shard_err(s, fin, errno);
    for (;;) {
        int fd = open_noatime(dfd, in_shard(fin),
                              O_RDONLY | O_NOFOLLOW | O_CLOEXEC | (*direct ? O_DIRECT : 0));
        if (fd >= 0) {
            err = check_opened(s, fd, fin, dfd);
            if (err != 0)
                close(fd);
            else
                *fd_p = fd;
            break;
        }
        err = errno;
        if (err == ELOOP) {
            kvt_warn(MOD, "%s/%s is a symbolic link: refused, left alone", s->dir, fin);
            err = ST_ERR_FOREIGN;
            break;
        }
        if (err != EINVAL || !*direct)
            break;
        *direct = false;
    }
    close(dfd);
    return err;
}

/* Checks what a load brought into hdr and the slot (err: the read's own error, 0 when
 * the whole file was read); deletes the file of a failed load, which is never tried
 * again: the index drops the key. Another user's file (ST_ERR_FOREIGN) stays, and so
 * does a file whose load met a transient error (kvt__st_err_transient). */
static int check_loaded(struct st_tier *s, struct st_mac *m, const uint8_t *gen,
                        const struct st_item *it, uint8_t *hdr, int err)
{
    size_t row = s->base.row_bytes;
    const uint8_t *dst = s->base.primary_base + (size_t)it->chunk * row;
    uint8_t tag[ST_TAG_BYTES];
    struct kvt_key key;
    uint64_t row_len = 0;
    if (err == 0)
        err = kvt__st_hdr_decode(m, hdr, gen, &key, &row_len);
    if (err == 0 && (!kvt_key_eq(&key, &it->key) || row_len != row))
        err = ST_ERR_CORRUPT;
    if (err == 0 && (kvt__st_mac(m, false, hdr + ST_OFF_NONCE, dst, row, tag) != 0 ||
                     !kvt__st_tag_eq(tag, hdr + ST_OFF_ROWTAG)))
        err = ST_ERR_MAC;
    if (err != 0 && err != ENOENT && err != ST_ERR_FOREIGN && !kvt__st_err_transient(err)) {
        char fin[ST_NAME_MAX];
        kvt__st_name(&it->key, ".kvc", fin);
        unlink_name(s, fin);
    }
    return err;
}

/* One blocking load of it into hdr and its slot (no fault injection). */
static int read_chunk_io(struct st_tier *s, struct st_mac *m, const uint8_t *gen, uint8_t *hdr,
                         const struct st_item *it, bool direct)
{
    size_t row = s->base.row_bytes;
    uint8_t *dst = s->base.primary_base + (size_t)it->chunk * row;
    int err;
    for (;;) {
        struct iovec iov[2] = {{hdr, ST_BLOCK}, {dst, row}};
        size_t done = 0;
        int fd = -1;
        err = open_chunk(s, it, &direct, &fd);
        if (err != 0)
            break;
        err = full_io(fd, false, iov, 2, &done);
        close(fd);
        if (err == 0 && done != ST_BLOCK + row)
            err = ST_ERR_CORRUPT; /* truncated */
        if (err == EINVAL && direct) {
            direct = false; /* opened, but the read is refused */
            continue;
        }
        break;
    }
    return check_loaded(s, m, gen, it, hdr, err);
}

static int read_chunk(struct st_tier *s, struct st_thread *th, const struct st_job *sj,
                      const struct st_item *it, bool direct)
{
    int err = take_fault(s, KVT_STORAGE_FAULT_READ);
    if (err != 0)
        return check_loaded(s, th->mac, sj->gen, it, th->hdr, err);
    return read_chunk_io(s, th->mac, sj->gen, th->hdr, it, direct);
}

static int unlink_chunk(struct st_tier *s, const struct st_item *it)
{
    char fin[ST_NAME_MAX];
    int err;
    kvt__st_name(&it->key, ".kvc", fin);
    err = unlink_name(s, fin);
    return err == ENOENT ? 0 : err;
}

/* ---- queues (pool.mu) ----------------------------------------------------------- */

static void q_init(struct st_queue *q)
{
    memset(q, 0, sizeof(*q));
    kvt_list_init(&q->fifo);
    for (unsigned i = 0; i < ST_BUCKETS; i++)
        kvt_list_init(&q->buckets[i]);
}

static unsigned bucket_of(uint64_t bytes)
{
    unsigned b = bytes > 1 ? 63u - (unsigned)__builtin_clzll(bytes) : 0;
    return b >= ST_BUCKETS ? ST_BUCKETS - 1 : b;
}

static void q_push(struct st_queue *q, struct st_task *t, uint64_t bytes)
{
    t->bucket_idx = bucket_of(bytes);
    kvt_list_add_tail(&q->fifo, &t->fifo);
    kvt_list_add_tail(&q->buckets[t->bucket_idx], &t->bucket);
    q->mask |= 1u << t->bucket_idx;
    q->n++;
}

static struct st_task *q_pop(struct st_queue *q, bool sjf)
{
    struct st_task *t;
    if (q->n == 0)
        return NULL;
    if (sjf)
        t = kvt_list_entry(q->buckets[__builtin_ctz(q->mask)].next, struct st_task, bucket);
    else
        t = kvt_list_entry(q->fifo.next, struct st_task, fifo);
    kvt_list_del(&t->fifo);
    kvt_list_del(&t->bucket);
    if (kvt_list_empty(&q->buckets[t->bucket_idx]))
        q->mask &= ~(1u << t->bucket_idx);
    q->n--;
    return t;
}

static struct st_task *pick_load(struct st_pool *p)
{
    bool sjf = p->loads.sjf_next;
    if (p->loads.n == 0)
        return NULL;
    p->loads.sjf_next = !sjf;
    return q_pop(&p->loads, sjf);
}

static struct st_task *pick(struct st_pool *p, bool reader)
{
    struct st_task *t = reader ? pick_load(p) : NULL;
    if (t == NULL)
        t = q_pop(&p->unlinks, false);
    if (t == NULL)
        t = q_pop(&p->stores, true);
    return t;
}

static void queue_tasks(struct st_pool *p, struct st_job *sj);

/* pool.mu held: sj is done; the scheduler's loop wakes to report it. */
static void post_done(struct st_pool *p, struct st_job *sj)
{
    uint64_t one = 1;

    kvt_list_add_tail(&p->done, &sj->link);
    __atomic_store_n(&p->n_done, p->n_done + 1, __ATOMIC_RELEASE);
    if (p->done_fd >= 0 && write(p->done_fd, &one, sizeof(one)) < 0) {
        /* EAGAIN only: the counter is full, the loop is awake anyway */
    }
}

/* pool.mu held. */
static void finish_task(struct st_pool *p, struct st_task *t)
{
    struct st_job *sj = t->sj;
    assert(sj->tasks_left > 0 && p->inflight > 0);
    if (--sj->tasks_left == 0) {
        struct st_job *waiter = sj->waiter;
        sj->end_ns = kvt_now_ns();
        sj->waiter = NULL;
        post_done(p, sj);
        if (waiter != NULL)
            queue_tasks(p, waiter);
    }
    if (--p->inflight == 0)
        pthread_cond_broadcast(&p->idle_cv);
}

static void run_task(struct st_tier *s, struct st_thread *th, struct st_task *t)
{
    struct st_job *sj = t->sj;
    for (size_t i = t->begin; i < t->end; i++) {
        struct st_item *it = &sj->items[i];
        switch (sj->kind) {
        case ST_STORE:
            it->err = write_chunk(s, th, sj, it, sj->direct);
            break;
        case ST_LOAD:
            it->err = read_chunk(s, th, sj, it, sj->direct);
            break;
        case ST_UNLINK:
            it->err = unlink_chunk(s, it);
            break;
        }
    }
}

/* pool.mu held: th took t off its queue. */
static void took(struct st_pool *p, struct st_thread *th, struct st_task *t)
{
    if (t->sj->start_ns == 0)
        t->sj->start_ns = kvt_now_ns();
    if (p->take_hook != NULL)
        p->take_hook(p->take_hook_arg, th, t);
}

#ifdef KVT_HAVE_LIBURING
/* ---- read threads with io_uring ----------------------------------------------------
 * A read thread keeps up to depth chunk reads in flight in its own ring: it opens the
 * file (blocking; cheap), queues one readv of header block + row straight into the
 * slot, and checks each chunk (header, MAC of the row) when its read completes,
 * while the others are still being read. So the device never waits for the hashing,
 * as it does when one thread reads and checks in turn. While reads are in flight the
 * thread takes only more loads; removals and stores it takes (blocking) when it has
 * none in flight. A read that does not bring the whole file (short, refused, failed)
 * is done once more the blocking way, which falls back to buffered I/O and reports
 * truncation. */

static struct st_rd *free_rd(struct st_thread *th)
{
    for (unsigned i = 0; i < th->depth; i++) {
        if (th->rd[i].t == NULL)
            return &th->rd[i];
    }
    return NULL;
}

/* Starts the read of item idx of t; false when the item is already done (injected
 * fault, missing file: its err is set). */
static bool rd_start(struct st_tier *s, struct st_thread *th, struct st_task *t, size_t idx)
{
    struct st_item *it = &t->sj->items[idx];
    struct st_rd *rd = free_rd(th);
    struct io_uring_sqe *sqe;
    size_t row = s->base.row_bytes;
    bool direct = t->sj->direct;
    int fd = -1, err;
    assert(rd != NULL);
    err = take_fault(s, KVT_STORAGE_FAULT_READ);
    if (err == 0)
        err = open_chunk(s, it, &direct, &fd);
    if (err == 0) {
        /* A regular file now: blocking again, or io_uring may end its read with EAGAIN
         * (O_NONBLOCK from open_noatime is a request not to wait, to io_uring). */
        int fl = fcntl(fd, F_GETFL);
        if (fl < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0) {
            err = errno;
            close(fd);
        }
    }
    if (err != 0) {
        it->err = check_loaded(s, th->mac, t->sj->gen, it, rd->hdr, err);
        return false;
    }
    sqe = io_uring_get_sqe(th->ring);
    if (sqe == NULL) { /* cannot happen: the ring has depth entries */
        close(fd);
        it->err = read_chunk_io(s, th->mac, t->sj->gen, rd->hdr, it, direct);
        return false;
    }
    rd->t = t;
    rd->idx = idx;
    rd->fd = fd;
    rd->direct = direct;
    rd->iov[0] = (struct iovec){rd->hdr, ST_BLOCK};
    rd->iov[1] = (struct iovec){s->base.primary_base + (size_t)it->chunk * row, row};
    io_uring_prep_readv(sqe, fd, rd->iov, 2, 0);
    io_uring_sqe_set_data(sqe, rd);
    th->n_busy++;
    return true;
}

/* Checks one completed read; returns its task when that was the task's last item. */
static struct st_task *rd_complete(struct st_tier *s, struct st_thread *th,
                                   struct io_uring_cqe *cqe)
{
    struct st_rd *rd = io_uring_cqe_get_data(cqe);
    struct st_task *t = rd->t;
    struct st_item *it = &t->sj->items[rd->idx];
    int res = cqe->res;
    io_uring_cqe_seen(th->ring, cqe);
    close(rd->fd);
    if (res >= 0 && (size_t)res == ST_BLOCK + s->base.row_bytes)
        it->err = check_loaded(s, th->mac, t->sj->gen, it, rd->hdr, 0);
    else
        it->err = read_chunk_io(s, th->mac, t->sj->gen, rd->hdr, it, rd->direct);
    rd->t = NULL;
    th->n_busy--;
    return --t->left == 0 ? t : NULL;
}

static void ring_reader(struct st_thread *th)
{
    struct st_tier *s = th->s;
    struct st_pool *p = &s->pool;
    struct st_task *cur = NULL; /* the load whose items are being submitted */
    struct kvt_list fin;        /* loads all done, to report (st_task.fifo) */
    kvt_list_init(&fin);
    pthread_mutex_lock(&p->mu);
    for (;;) {
        struct io_uring_cqe *cqe;
        bool idle = false; /* found nothing more to submit */
        while (!kvt_list_empty(&fin)) {
            struct st_task *t = kvt_list_entry(fin.next, struct st_task, fifo);
            kvt_list_del(&t->fifo);
            finish_task(p, t);
        }
        if (cur == NULL && th->n_busy < th->depth) {
            struct st_task *t = NULL;
            if (!p->paused)
                t = th->n_busy > 0 ? pick_load(p) : pick(p, true);
            if (t != NULL) {
                took(p, th, t);
                if (t->sj->kind != ST_LOAD) {
                    pthread_mutex_unlock(&p->mu);
                    run_task(s, th, t);
                    pthread_mutex_lock(&p->mu);
                    finish_task(p, t);
                    continue;
                }
                cur = t;
                t->next = t->begin;
                t->left = t->end - t->begin;
            } else {
                idle = true;
            }
        }
        if (cur == NULL && th->n_busy == 0) {
            if (p->stopping)
                break;
            pthread_cond_wait(&p->read_cv, &p->mu);
            continue;
        }
        pthread_mutex_unlock(&p->mu);
        while (cur != NULL && th->n_busy < th->depth) {
            struct st_task *t = cur;
            if (t->next + 1 == t->end)
                cur = NULL;
            if (!rd_start(s, th, t, t->next++) && --t->left == 0)
                kvt_list_add_tail(&fin, &t->fifo);
        }
        if (th->n_busy > 0) {
            /* Wait for a completion unless there is room for a task not looked for yet. */
            bool more = cur == NULL && !idle && th->n_busy < th->depth;
            int rc = io_uring_submit_and_wait(th->ring, more ? 0 : 1);
            if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) {
                kvt_error(MOD, "io_uring submit: %s", strerror(-rc));
                abort(); /* the reads in flight write into slots: cannot walk away */
            }
            while (io_uring_peek_cqe(th->ring, &cqe) == 0) {
                struct st_task *t = rd_complete(s, th, cqe);
                if (t != NULL)
                    kvt_list_add_tail(&fin, &t->fifo);
            }
        }
        pthread_mutex_lock(&p->mu);
    }
    pthread_mutex_unlock(&p->mu);
}

static int ring_init(struct st_thread *th, unsigned depth)
{
    struct io_uring *ring = kvt_calloc(1, sizeof(*ring));
    int rc;
    if (ring == NULL)
        return -ENOMEM;
    rc = io_uring_queue_init(depth, ring, 0);
    if (rc < 0) {
        kvt_free(ring);
        return rc;
    }
    th->ring = ring;
    return 0;
}

static void ring_exit(struct st_thread *th)
{
    if (th->ring != NULL) {
        io_uring_queue_exit(th->ring);
        kvt_free(th->ring);
        th->ring = NULL;
    }
}
#else
static void ring_reader(struct st_thread *th)
{
    (void)th;
    abort(); /* no ring is ever set up without liburing */
}
static int ring_init(struct st_thread *th, unsigned depth)
{
    (void)th;
    (void)depth;
    return -ENOSYS;
}
static void ring_exit(struct st_thread *th)
{
    (void)th;
}
#endif

static void *worker_main(void *arg)
{
    struct st_thread *th = arg;
    struct st_tier *s = th->s;
    struct st_pool *p = &s->pool;
    if (th->ring != NULL) {
        ring_reader(th);
        return NULL;
    }
    pthread_mutex_lock(&p->mu);
    for (;;) {
        struct st_task *t = p->paused ? NULL : pick(p, th->reader);
        if (t == NULL) {
            if (p->stopping)
                break;
            pthread_cond_wait(th->reader ? &p->read_cv : &p->write_cv, &p->mu);
            continue;
        }
        took(p, th, t);
        pthread_mutex_unlock(&p->mu);
        run_task(s, th, t);
        pthread_mutex_lock(&p->mu);
        finish_task(p, t);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

/* ---- pool ------------------------------------------------------------------------- */

/* pool.mu held. */
static void wake_all(struct st_pool *p)
{
    pthread_cond_broadcast(&p->read_cv);
    pthread_cond_broadcast(&p->write_cv);
}

/* pool.mu held: k tasks of this kind were queued. Loads wake read threads only;
 * a store or removal wakes one thread of each class (either can take it; the one
 * that finds nothing sleeps again). */
static void wake(struct st_pool *p, enum st_kind kind, size_t k)
{
    if (kind == ST_LOAD) {
        if (k > 1)
            pthread_cond_broadcast(&p->read_cv);
        else
            pthread_cond_signal(&p->read_cv);
    } else if (k > 1) {
        wake_all(p);
    } else {
        pthread_cond_signal(&p->write_cv);
        pthread_cond_signal(&p->read_cv);
    }
}

void kvt__st_pool_init(struct st_tier *s)
{
    struct st_pool *p = &s->pool;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->read_cv, NULL);
    pthread_cond_init(&p->write_cv, NULL);
    pthread_cond_init(&p->idle_cv, NULL);
    kvt_list_init(&p->done);
    p->done_fd = -1;
    q_init(&p->loads);
    q_init(&p->stores);
    q_init(&p->unlinks);
}

int kvt__st_pool_start(struct st_tier *s)
{
    struct st_pool *p = &s->pool;
    unsigned n = s->n_read + s->n_write;
    bool ring = s->read_depth > 1 && !s->no_uring;
    p->threads = kvt_calloc(n, sizeof(*p->threads));
    if (p->threads == NULL)
        return -ENOMEM;
    s->uring_ok = ring;
    for (unsigned i = 0; i < n; i++) {
        struct st_thread *th = &p->threads[i];
        unsigned depth;
        char name[16];
        int rc;
        th->s = s;
        th->reader = i < s->n_read;
        if (th->reader && ring) {
            rc = ring_init(th, s->read_depth);
            if (rc != 0) {
                /* Kernels without it, seccomp profiles and io_uring_disabled refuse. */
                kvt_info(MOD, "io_uring refused (%s): one blocking read at a time per thread",
                         strerror(-rc));
                ring = s->uring_ok = false;
            }
        }
        depth = th->ring != NULL ? s->read_depth : 0;
        th->mem = kvt_malloc((2 + depth) * ST_BLOCK);
        th->rd = depth > 0 ? kvt_calloc(depth, sizeof(*th->rd) + 2 * sizeof(struct iovec)) : NULL;
        th->mac = kvt__st_mac_new(s);
        if (th->mem == NULL || (depth > 0 && th->rd == NULL) || th->mac == NULL) {
            kvt__st_pool_stop(s);
            return -ENOMEM;
        }
        th->hdr = (uint8_t *)(((uintptr_t)th->mem + ST_BLOCK - 1) & ~(uintptr_t)(ST_BLOCK - 1));
        th->depth = depth;
        for (unsigned d = 0; d < depth; d++) {
            th->rd[d].hdr = th->hdr + (size_t)(1 + d) * ST_BLOCK;
            th->rd[d].iov = (struct iovec *)(void *)(th->rd + depth) + 2 * d;
        }
        rc = pthread_create(&th->tid, NULL, worker_main, th);
        if (rc != 0) {
            kvt_error(MOD, "cannot start I/O thread: %s", strerror(rc));
            kvt__st_pool_stop(s);
            return -rc;
        }
        th->started = true;
        p->n_threads = i + 1;
        snprintf(name, sizeof(name), "kvt-st-%c%u", th->reader ? 'r' : 'w',
                 th->reader ? i : i - s->n_read);
        pthread_setname_np(th->tid, name);
    }
    return 0;
}

void kvt__st_pool_stop(struct st_tier *s)
{
    struct st_pool *p = &s->pool;
    struct st_queue *qs[3] = {&p->loads, &p->stores, &p->unlinks};
    pthread_mutex_lock(&p->mu);
    p->stopping = true;
    p->paused = false;
    /* Queued tasks are cancelled (reported failed); running ones finish. */
    for (int q = 0; q < 3; q++) {
        struct st_task *t;
        while ((t = q_pop(qs[q], false)) != NULL) {
            for (size_t i = t->begin; i < t->end; i++)
                t->sj->items[i].err = ECANCELED;
            finish_task(p, t);
        }
    }
    wake_all(p);
    pthread_mutex_unlock(&p->mu);
    if (p->threads != NULL) {
        for (unsigned i = 0; i < s->n_read + s->n_write; i++) {
            if (p->threads[i].started)
                pthread_join(p->threads[i].tid, NULL);
            p->threads[i].started = false;
        }
    }
}

void kvt__st_pool_cleanup(struct st_tier *s)
{
    struct st_pool *p = &s->pool;
    if (p->threads != NULL) {
        for (unsigned i = 0; i < s->n_read + s->n_write; i++) {
            ring_exit(&p->threads[i]);
            kvt_free(p->threads[i].rd);
            kvt_free(p->threads[i].mem);
            kvt__st_mac_free(p->threads[i].mac);
            kvt_free_table(p->threads[i].wbuf, 1, p->threads[i].wbuf_bytes);
        }
        kvt_free(p->threads);
        p->threads = NULL;
    }
    if (p->done_fd >= 0) {
        close(p->done_fd);
        p->done_fd = -1;
    }
}

unsigned kvt__st_max_tasks(const struct st_tier *s, enum st_kind kind, size_t n)
{
    if (kind == ST_LOAD)
        return (unsigned)KVT_MIN(n, (size_t)s->n_read);
    if (kind == ST_STORE && s->base.locality == KVT_REMOTE)
        return (unsigned)KVT_MIN(n, (size_t)s->n_write);
    return n > 0 ? 1 : 0;
}

/* Splits sj into its tasks, made with the job (no lock, no allocation). */
static void split(struct st_tier *s, struct st_job *sj)
{
    size_t n = sj->n_items, k = kvt__st_max_tasks(s, sj->kind, n);
    sj->n_tasks = (unsigned)k;
    if (n == 0)
        return;
    assert(sj->tasks != NULL && k <= sj->cap_tasks);
    memset(sj->tasks, 0, k * sizeof(*sj->tasks));
    /* divmod split, as vLLM's _batch_tasks: the first n % k tasks get one more. */
    for (size_t i = 0, begin = 0; i < k; i++) {
        struct st_task *t = &sj->tasks[i];
        size_t len = n / k + (i < n % k ? 1 : 0);
        t->sj = sj;
        t->begin = begin;
        t->end = begin + len;
        t->bytes = (uint64_t)len * (s->base.row_bytes ? s->base.row_bytes : 1);
        begin += len;
    }
}

/* pool.mu held: sj's tasks, already counted in inflight, go to their queue (or are
 * cancelled when the pool stops). */
static void queue_tasks(struct st_pool *p, struct st_job *sj)
{
    struct st_queue *q = sj->kind == ST_LOAD    ? &p->loads
                         : sj->kind == ST_STORE ? &p->stores
                                                : &p->unlinks;
    for (unsigned i = 0; i < sj->n_tasks; i++) {
        struct st_task *t = &sj->tasks[i];
        if (p->stopping) {
            for (size_t j = t->begin; j < t->end; j++)
                sj->items[j].err = ECANCELED;
            finish_task(p, t);
        } else {
            q_push(q, t, t->bytes);
        }
    }
    if (!p->stopping)
        wake(p, sj->kind, sj->n_tasks);
}

/* pool.mu held: a job with nothing to do (or submitted after stop) is done at once. */
static bool post_now(struct st_pool *p, struct st_job *sj)
{
    if (sj->n_tasks > 0 && !p->stopping)
        return false;
    for (size_t i = 0; i < sj->n_items; i++)
        sj->items[i].err = ECANCELED;
    sj->start_ns = sj->end_ns = kvt_now_ns();
    post_done(p, sj);
    return true;
}

void kvt__st_pool_submit_after(struct st_tier *s, struct st_job *removals, struct st_job *sj)
{
    struct st_pool *p = &s->pool;
    split(s, sj);
    if (removals != NULL)
        split(s, removals);
    pthread_mutex_lock(&p->mu);
    if (removals != NULL && !post_now(p, removals)) {
        removals->tasks_left = removals->n_tasks;
        p->inflight += removals->n_tasks;
        queue_tasks(p, removals);
    } else {
        removals = NULL;
    }
    if (!post_now(p, sj)) {
        sj->tasks_left = sj->n_tasks;
        p->inflight += sj->n_tasks;
        if (removals != NULL)
            removals->waiter = sj; /* queued by finish_task */
        else
            queue_tasks(p, sj);
    }
    pthread_mutex_unlock(&p->mu);
}

void kvt__st_pool_submit(struct st_tier *s, struct st_job *sj)
{
    kvt__st_pool_submit_after(s, NULL, sj);
}

void kvt__st_pool_take_done(struct st_tier *s, struct kvt_list *out)
{
    struct st_pool *p = &s->pool;
    uint64_t v;
    kvt_list_init(out);
    pthread_mutex_lock(&p->mu);
    if (p->done_fd >= 0 && read(p->done_fd, &v, sizeof(v)) < 0) {
        /* EAGAIN: nothing joined done since the last take */
    }
    if (!kvt_list_empty(&p->done)) {
        out->next = p->done.next;
        out->prev = p->done.prev;
        out->next->prev = out;
        out->prev->next = out;
        kvt_list_init(&p->done);
    }
    pthread_mutex_unlock(&p->mu);
}

void kvt__st_pool_wait_idle(struct st_tier *s)
{
    struct st_pool *p = &s->pool;
    pthread_mutex_lock(&p->mu);
    if (p->paused) {
        p->paused = false;
        wake_all(p);
    }
    while (p->inflight > 0)
        pthread_cond_wait(&p->idle_cv, &p->mu);
    pthread_mutex_unlock(&p->mu);
}

void kvt__st_pool_set_take_hook(struct st_tier *s, kvt__st_take_hook_t hook, void *arg)
{
    struct st_pool *p = &s->pool;
    pthread_mutex_lock(&p->mu);
    p->take_hook = hook;
    p->take_hook_arg = arg;
    pthread_mutex_unlock(&p->mu);
}

void kvt__st_pool_pause(struct st_tier *s, bool paused)
{
    struct st_pool *p = &s->pool;
    pthread_mutex_lock(&p->mu);
    p->paused = paused;
    if (!paused)
        wake_all(p);
    pthread_mutex_unlock(&p->mu);
}

/* ---- warm-restart scan ------------------------------------------------------------ */

/* What the scan saw besides the files it indexed (summed over its threads). */
struct scan_counts {
    size_t tmp_removed, bad_removed, mac_removed, old_removed, foreign, stale_removed, skipped;
};

struct scan {
    struct st_tier *s;
    unsigned next_shard; /* atomic */
    pthread_mutex_t mu;
    struct st_found *found;
    size_t n, cap;
    struct scan_counts c;
    int err;
};

struct scan_local {
    struct st_mac *mac;
    struct st_found *found;
    size_t n, cap;
    struct scan_counts c;
    int err;
};

/* check_file: a file of ours that group or others may use (removed, counted foreign). */
#define ST_SCAN_OPEN_MODE EACCES
#define ST_SCAN_SKIP      EAGAIN /* a transient error: the file stays, unindexed */

static int scan_fault_n, scan_fault_err; /* kvt_storage_scan_inject_fault's */

void kvt_storage_scan_inject_fault(int err, unsigned n)
{
    __atomic_store_n(&scan_fault_err, err, __ATOMIC_RELAXED);
    __atomic_store_n(&scan_fault_n, (int)n, __ATOMIC_RELEASE);
}

static bool ends_with(const char *name, size_t len, const char *ext)
{
    size_t el = strlen(ext);
    return len > el && memcmp(name + len - el, ext, el) == 0;
}

/* 0 and *f filled for a valid chunk file; ST_ERR_CORRUPT, ST_ERR_MAC, ST_ERR_OLD,
 * ST_ERR_STALE or ST_SCAN_OPEN_MODE for one to delete; ST_ERR_FOREIGN for another
 * user's (left); ST_SCAN_SKIP when a transient error kept it from being judged
 * (left, unindexed). */
static int check_file(struct st_tier *s, struct st_mac *m, int shard_fd, unsigned shard,
                      const char *name, size_t len, struct st_found *f)
{
    char stem[2 * KVT_KEY_MAX + 1];
    uint8_t blk[ST_BLOCK];
    struct kvt_key key;
    uint64_t row_len = 0;
    struct stat st;
    int fd, rc = ST_ERR_CORRUPT, fault = fault_take(&scan_fault_n, &scan_fault_err);
    if (fault != 0) {
        fd = -1;
        errno = fault;
    } else {
        fd = open_noatime(shard_fd, name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    }
    if (fd < 0) {
        if (kvt__st_err_transient(errno))
            return ST_SCAN_SKIP; /* out of descriptors or memory: says nothing of the file */
        return errno == ENOENT ? ENOENT : errno == ELOOP ? ST_ERR_FOREIGN : ST_ERR_CORRUPT;
    }
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != s->uid) {
        close(fd);
        return ST_ERR_FOREIGN; /* not ours to judge or remove */
    }
    if (len - 4 <= 2 * KVT_KEY_MAX) {
        char canon[2 * KVT_KEY_MAX + 1];
        bool named;
        memcpy(stem, name, len - 4);
        stem[len - 4] = '\0';
        /* Only the name the tier writes (lowercase hex): kvt_key_from_hex takes either
         * case, and a second name of one key would index the key twice. */
        named = kvt_key_from_hex(&f->key, stem) == 0;
        if (named) {
            kvt_key_to_hex(&f->key, canon);
            named = strcmp(canon, stem) == 0 && (kvt_key_hash(&f->key) >> 56) == shard;
        }
        if (named) {
            ssize_t got = pread(fd, blk, ST_BLOCK, 0);

            if (got == (ssize_t)ST_BLOCK)
                rc = kvt__st_hdr_decode(m, blk, s->gen, &key, &row_len);
            else if (got < 0 && kvt__st_err_transient(errno))
                rc = ST_SCAN_SKIP;
        }
    }
    if (rc == 0 && (st.st_mode & 077))
        rc = ST_SCAN_OPEN_MODE;
    if (rc == 0 &&
        (!kvt_key_eq(&key, &f->key) || row_len == 0 || (uint64_t)st.st_size != ST_BLOCK + row_len))
        rc = ST_ERR_CORRUPT;
    if (rc == 0) {
        f->bytes = kvt__st_file_bytes(row_len);
        f->mtime_ns = (uint64_t)st.st_mtim.tv_sec * 1000000000ull + (uint64_t)st.st_mtim.tv_nsec;
    }
    close(fd);
    return rc;
}

/* Removes a leftover temporary file of ours; another user's is only counted. */
static void remove_tmp(struct st_tier *s, int fd, const char *name, struct scan_counts *c)
{
    struct stat st;
    if (fstatat(fd, name, &st, AT_SYMLINK_NOFOLLOW) != 0)
        return;
    if (!S_ISREG(st.st_mode) || st.st_uid != s->uid)
        c->foreign++;
    else if (unlinkat(fd, name, 0) == 0)
        c->tmp_removed++;
}

static void scan_shard(struct st_tier *s, unsigned shard, struct scan_local *l)
{
    char dname[3];
    int fd;
    DIR *d;
    struct dirent *de;
    snprintf(dname, sizeof(dname), "%02x", shard);
    fd = shard_open(s, dname);
    if (fd < 0) {
        kvt_warn(MOD, "cannot open %s/%s: %s", s->dir, dname, strerror(errno));
        return;
    }
    d = fdopendir(fd);
    if (d == NULL) {
        close(fd);
        return;
    }
    while ((de = readdir(d)) != NULL) {
        const char *name = de->d_name;
        size_t len = strlen(name);
        struct st_found f;
        int rc;
        if (name[0] == '.')
            continue;
        if (ends_with(name, len, ".tmp")) {
            remove_tmp(s, fd, name, &l->c);
            continue;
        }
        if (!ends_with(name, len, ".kvc"))
            continue; /* not ours: left alone */
        if (de->d_type != DT_REG && de->d_type != DT_UNKNOWN) {
            l->c.foreign++; /* a link or a folder under a chunk's name: left alone */
            continue;
        }
        rc = check_file(s, l->mac, fd, shard, name, len, &f);
        if (rc == ENOENT)
            continue;
        if (rc == ST_ERR_FOREIGN) {
            l->c.foreign++;
            continue;
        }
        if (rc == ST_SCAN_SKIP) {
            l->c.skipped++;
            continue;
        }
        if (rc != 0) {
            if (unlinkat(fd, name, 0) != 0)
                continue;
            if (rc == ST_SCAN_OPEN_MODE) {
                l->c.foreign++;
                continue;
            }
            if (rc == ST_ERR_STALE) {
                l->c.stale_removed++;
                continue;
            }
            l->c.bad_removed++;
            l->c.mac_removed += rc == ST_ERR_MAC;
            l->c.old_removed += rc == ST_ERR_OLD;
            continue;
        }
        if (kvt_vec_reserve(l->found, l->cap, l->n + 1, 1024) < 0) {
            l->err = -ENOMEM;
            break;
        }
        l->found[l->n++] = f;
    }
    closedir(d);
}

static void *scan_main(void *arg)
{
    struct scan *sc = arg;
    struct scan_local l = {.mac = kvt__st_mac_new(sc->s)};
    unsigned shard;
    if (l.mac == NULL)
        l.err = -ENOMEM;
    while (l.err == 0 &&
           (shard = __atomic_fetch_add(&sc->next_shard, 1, __ATOMIC_RELAXED)) < ST_SCAN_SHARDS)
        scan_shard(sc->s, shard, &l);
    pthread_mutex_lock(&sc->mu);
    sc->c.tmp_removed += l.c.tmp_removed;
    sc->c.bad_removed += l.c.bad_removed;
    sc->c.mac_removed += l.c.mac_removed;
    sc->c.old_removed += l.c.old_removed;
    sc->c.foreign += l.c.foreign;
    sc->c.stale_removed += l.c.stale_removed;
    sc->c.skipped += l.c.skipped;
    if (l.err != 0) {
        sc->err = l.err;
    } else if (l.n > 0) {
        if (sc->n + l.n > sc->cap) {
            size_t cap = KVT_MAX(sc->n + l.n, 2 * sc->cap);
            struct st_found *nf = kvt_reallocarray(sc->found, cap, sizeof(*nf));
            if (nf == NULL) {
                sc->err = -ENOMEM;
                goto out;
            }
            sc->found = nf;
            sc->cap = cap;
        }
        memcpy(sc->found + sc->n, l.found, l.n * sizeof(*l.found));
        sc->n += l.n;
    }
out:
    pthread_mutex_unlock(&sc->mu);
    kvt_free(l.found);
    kvt__st_mac_free(l.mac);
    return NULL;
}

int kvt__st_scan(struct st_tier *s, struct st_found **found_p, size_t *n_p)
{
    struct scan sc = {.s = s};
    unsigned n_thr = s->n_scan, started = 0;
    pthread_t tids[64];
    if (n_thr > KVT_ARRAY_SIZE(tids))
        n_thr = KVT_ARRAY_SIZE(tids);
    pthread_mutex_init(&sc.mu, NULL);
    for (unsigned i = 1; i < n_thr; i++) {
        if (pthread_create(&tids[started], NULL, scan_main, &sc) != 0)
            break;
        started++;
    }
    scan_main(&sc);
    for (unsigned i = 0; i < started; i++)
        pthread_join(tids[i], NULL);
    pthread_mutex_destroy(&sc.mu);
    s->restart.tmp_removed = sc.c.tmp_removed;
    s->restart.bad_removed = sc.c.bad_removed;
    s->restart.mac_removed = sc.c.mac_removed;
    s->restart.old_removed = sc.c.old_removed;
    s->restart.foreign = sc.c.foreign;
    s->restart.stale_removed = sc.c.stale_removed;
    s->restart.skipped = sc.c.skipped;
    if (sc.err != 0) {
        kvt_free(sc.found);
        return sc.err;
    }
    *found_p = sc.found;
    *n_p = sc.n;
    return 0;
}

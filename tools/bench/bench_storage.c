/* SPDX-License-Identifier: Apache-2.0 */
/* kvtier-bench storage: the storage tier's write and read bandwidth for 256 KiB chunks,
 * side by side with fio doing the same sizes on the same folder in the same run, and
 * the warm-restart index rebuild time for many files.
 *
 *   kvtier-bench storage [--json] [--dir D] [--chunks N] [--rebuild-files N]
 *                        [--inflight J] [--rounds R] [--read-depth D] [--poll-us U]
 *                        [--cold] [--no-fio]
 *
 * Tier: N chunks of 256 KiB stored in jobs of 16 keys with J jobs in flight (the
 * manager's cascade shape), then loaded back the same way; each file is one 4 KiB
 * header + the row, written to a temporary name and renamed, O_DIRECT where the file
 * system takes it; loads verify the header and the XXH3-64 of every row. The driver
 * polls for finished jobs every U microseconds (default 1000: kvtierd's tick).
 * fio: the same N files of 256 KiB in D/fio (create_on_open, one 256 KiB block per
 * file, the same O_DIRECT choice), with as many jobs as the tier has threads that
 * take that kind of work (writes: read + write threads, reads: read threads); for
 * reads also with as many jobs as the tier has reads in flight (read threads x read
 * depth), the stricter reference. Its --output-format=json bandwidth is parsed.
 * R rounds (default 5), each: tier write, fio write, tier read, fio read, with tier
 * and fio swapping places every other round, so that each pair runs back to back on
 * this shared machine; the figures are the medians, the ratios the medians of the
 * rounds' ratios. Rebuild: that many small files (4 KiB rows) written through the
 * tier, the tier closed, then the time to reopen it (restart_info.seconds); --cold
 * drops the page cache first (root). Ratios are tier / fio; the target is >= 0.8 in
 * both directions. */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"
#include "kvt/alloc.h"
#include "kvt/hash.h"
#include "kvt/storage_tier.h"
#include "kvt/tier.h"

#define CHUNK        (256u * 1024u)
#define JOB_KEYS     16
#define MAX_INFLIGHT 64
#define MAX_ROUNDS   15
#define N_READ       4 /* the tier's default read and write threads */
#define N_WRITE      2

struct sb_opts {
    bool json, cold, no_fio;
    const char *dir;
    size_t chunks, rebuild_files;
    unsigned inflight, rounds, read_depth, poll_us;
};

/* Per round: tier write, fio write, tier read, fio read (threads), fio read (depth). */
enum { SB_TW, SB_FW, SB_TR, SB_FR, SB_FRD, SB_N };

struct sb_result {
    double gbs[SB_N][MAX_ROUNDS];
    double med[SB_N];
    double ratio_write, ratio_read, ratio_read_depth; /* medians of the rounds' ratios */
    bool direct, fio_ok, io_uring;
    unsigned fio_jobs, read_depth;
    bool fio_huge; /* fio's buffers on huge pages, as the tier's rows */
    size_t rebuild_files, rebuild_found;
    double rebuild_s, rebuild_create_s;
    size_t load_failures;
};

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void make_key(struct kvt_key *k, uint64_t i)
{
    uint64_t h[4];
    for (int w = 0; w < 4; w++)
        h[w] = kvt_hash64_seed(&i, sizeof(i), (uint64_t)w * 0x9e3779b97f4a7c15ull);
    kvt_key_make(k, h, sizeof(h), 0);
}

/* ---- driving the tier --------------------------------------------------------------- */

struct sb_run {
    struct kvt_tier *t;
    uint8_t *mem; /* the slots; NULL: leave their bytes as they are */
    size_t row;
    struct kvt_job jobs[MAX_INFLIGHT];
    struct kvt_key keys[MAX_INFLIGHT][JOB_KEYS];
    int64_t ids[MAX_INFLIGHT][JOB_KEYS];
    bool busy[MAX_INFLIGHT];
    unsigned n_busy;
    size_t failed_jobs, failed_keys;
};

static void sb_done(void *arg, const struct kvt_job_result *r)
{
    struct sb_run *run = arg;
    unsigned g = (unsigned)(r->job_id - 1) % MAX_INFLIGHT;
    if (!r->success) {
        run->failed_jobs++;
        run->failed_keys += run->jobs[g].n - r->n_successful;
    }
    run->busy[g] = false;
    run->n_busy--;
}

static unsigned poll_us = 1000;

/* Makes the row of chunk i differ from every other chunk's in each 4 KiB block, as
 * KV chunks do and as fio's own blocks do (its scramble_buffers). Stored from slots
 * reused for every 16th job, the rows were 16 copies of 256 contents, and this host's
 * disk read repeated contents back slower (2026-12-06: 4.1-4.3 against 4.2-5.5 GB/s
 * for unique blocks, same files, same reader). */
static void stamp_row(uint8_t *row, size_t len, uint64_t i)
{
    for (size_t off = 0; off + sizeof(uint64_t) <= len; off += 4096) {
        uint64_t v = i << 16 | off >> 12;
        memcpy(row + off, &v, sizeof(v));
    }
}

/* Stores (or loads) keys 0..n-1 in jobs of JOB_KEYS, inflight jobs at once; job group
 * g uses primary slots g*JOB_KEYS... Returns the seconds taken. */
static double sb_pass(struct sb_run *run, bool load, size_t n, unsigned inflight)
{
    static uint64_t seq = 0;
    double t0 = now_s();
    size_t next = 0;
    while (next < n || run->n_busy > 0) {
        for (unsigned g = 0; g < inflight && next < n; g++) {
            struct kvt_job *j = &run->jobs[g];
            size_t m = n - next < JOB_KEYS ? n - next : JOB_KEYS;
            if (run->busy[g])
                continue;
            for (size_t i = 0; i < m; i++) {
                make_key(&run->keys[g][i], next + i);
                run->ids[g][i] = (int64_t)(g * JOB_KEYS + i);
                if (!load && run->mem != NULL)
                    stamp_row(run->mem + (g * JOB_KEYS + i) * run->row, run->row, next + i);
            }
            /* Job ids map back to their group: id - 1 = g (mod MAX_INFLIGHT). */
            *j = (struct kvt_job){.id = (seq++) * MAX_INFLIGHT + g + 1,
                                  .n = m,
                                  .keys = run->keys[g],
                                  .chunk_ids = run->ids[g],
                                  .is_promotion = load};
            run->busy[g] = true;
            run->n_busy++;
            next += m;
            if (load)
                kvt_tier_submit_load(run->t, j);
            else
                kvt_tier_submit_store(run->t, j);
        }
        kvt_tier_get_finished_jobs(run->t, sb_done, run);
        if (run->n_busy == inflight || next == n)
            usleep(poll_us); /* the scheduler's step: poll again at the next tick */
    }
    return now_s() - t0;
}

static int sb_open(const char *root, size_t row, uint8_t *mem, size_t nslots, unsigned depth,
                   struct kvt_tier **t_p)
{
    struct kvt_storage_tier_config c = {
        .root = root, .n_read_threads = N_READ, .n_write_threads = N_WRITE, .read_depth = depth};
    int rc;
    memset(c.namespace_id, 0xbe, sizeof(c.namespace_id));
    rc = kvt_storage_tier_create(&c, t_p);
    if (rc != 0)
        return rc;
    (*t_p)->index = 0;
    (*t_p)->row_bytes = row;
    (*t_p)->primary_base = mem;
    (*t_p)->num_chunks = nslots;
    return 0;
}

static void sb_close(struct kvt_tier *t)
{
    kvt_tier_shutdown(t);
    kvt_tier_destroy(t);
}

static int rm_rf(const char *path)
{
    char cmd[8300];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", path);
    return system(cmd);
}

/* Lets the disk finish what the phases before left it before a timed phase starts:
 * the host's writeback of a virtio disk's last writes and ext4's online discards of
 * the files just deleted. Without it the first phase after the writes paid for them:
 * in 5 of 6 runs on 2026-12-06 the read that came first in a round (tier or fio) was
 * the slower one, by up to 2x. syncfs sends the disk a FLUSH, which the host answers
 * once the image's writes are down; then the device's I/O counters must stay still
 * for 200 ms (10 s at most). Done the same way before the tier's phases and fio's. */
static void settle(const char *dir)
{
    char path[64], prev[512] = "", cur[512];
    struct stat st;
    unsigned still_ms = 0;
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0) {
        (void)syncfs(fd);
        close(fd);
    }
    if (stat(dir, &st) != 0)
        return;
    snprintf(path, sizeof(path), "/sys/dev/block/%u:%u/stat", major(st.st_dev), minor(st.st_dev));
    for (unsigned waited_ms = 0; waited_ms < 10000 && still_ms < 200; waited_ms += 20) {
        FILE *f = fopen(path, "r");
        if (f == NULL)
            return; /* not a block device (tmpfs): nothing to wait for */
        if (fgets(cur, sizeof(cur), f) == NULL)
            cur[0] = '\0';
        fclose(f);
        still_ms = strcmp(cur, prev) == 0 ? still_ms + 20 : 0;
        memcpy(prev, cur, sizeof(prev));
        usleep(20000);
    }
}

/* ---- fio ------------------------------------------------------------------------------ */

/* The "bw_bytes" of the "read" or "write" section of fio's JSON (group_reporting: one
 * job entry). -1 when absent. */
static double fio_bw(const char *json, const char *dir)
{
    char tag[32];
    const char *p;
    snprintf(tag, sizeof(tag), "\"%s\" : {", dir);
    p = strstr(json, tag);
    if (p == NULL)
        return -1;
    p = strstr(p, "\"bw_bytes\" : ");
    if (p == NULL)
        return -1;
    return strtod(p + strlen("\"bw_bytes\" : "), NULL);
}

/* fio's I/O buffers on huge pages, as the tier's rows are: hugetlb pages (fio
 * --mem=shmhuge; it has no transparent huge pages), reserved for the run when the
 * pool has too few free and given back at the end. 4 KiB pages are no fair
 * reference on this host: each 256 KiB O_DIRECT request becomes a scatter list of up
 * to 64 pieces, and fio read 2.3-2.6 GB/s from malloc buffers against 5.8-6.4 GB/s
 * from huge pages (2026-12-06), the tier 1.5-3.0 against 3.6-4.1.
 * How many: each fio job maps its own buffers, iodepth x 256 KiB (1 for psync) in
 * whole huge pages; fio 3.33 asks for more than that (4 jobs at depth 32 failed with
 * 20 pages, ran with 40), so twice that and 2 more, only for the run. */
static long fio_huge_pages(unsigned jobs, unsigned depth)
{
    size_t bytes = (size_t)(depth > 1 ? depth : 1) * CHUNK;
    return (long)jobs * (long)(2 * ((bytes + KVT_HUGE_PAGE_BYTES - 1) / KVT_HUGE_PAGE_BYTES) + 2);
}

static long hugetlb_read(const char *what)
{
    char line[128];
    long v = -1;
    FILE *f = fopen("/proc/meminfo", "r");
    size_t n = strlen(what);
    if (f == NULL)
        return -1;
    while (fgets(line, sizeof(line), f) != NULL) {
        if (strncmp(line, what, n) == 0 && line[n] == ':')
            v = strtol(line + n + 1, NULL, 10);
    }
    fclose(f);
    return v;
}

/* Huge pages free, net of what others reserved. */
static long hugetlb_free(void)
{
    return hugetlb_read("HugePages_Free") - hugetlb_read("HugePages_Rsvd");
}

/* The persistent pool as set (HugePages_Total also counts surplus pages). */
static long hugetlb_pool(void)
{
    long pool = -1;
    FILE *f = fopen("/proc/sys/vm/nr_hugepages", "r");
    if (f != NULL) {
        if (fscanf(f, "%ld", &pool) != 1)
            pool = -1;
        fclose(f);
    }
    return pool;
}

static bool hugetlb_set(long pages)
{
    FILE *f = fopen("/proc/sys/vm/nr_hugepages", "w");
    bool ok = f != NULL && fprintf(f, "%ld\n", pages) > 0;
    if (f != NULL && fclose(f) != 0)
        ok = false;
    return ok;
}

/* Returns the pool size to restore afterwards (-1: nothing to restore); *ok tells
 * whether want pages are free now. */
static long hugetlb_reserve(long want, bool *ok)
{
    long pool = hugetlb_pool(), free_ = hugetlb_free();
    *ok = free_ >= want;
    if (*ok || pool < 0 || free_ < 0)
        return -1;
    if (!hugetlb_set(pool + want - free_))
        return -1; /* not root: fio keeps malloc buffers */
    *ok = hugetlb_free() >= want;
    return pool;
}

/* fio over nfiles files of 256 KiB in dir, jobs jobs each with its own nfiles/jobs
 * files (named kvt.<job>.<file>: the same names for the write and the reads, so the
 * reads take exactly the files the write made). depth 0: psync, one request per job;
 * else io_uring with depth requests in flight per job over as many open files. */
static double run_fio(const char *dir, bool write, size_t nfiles, unsigned jobs, unsigned depth,
                      bool direct, bool huge)
{
    char cmd[8600], engine[96];
    FILE *p;
    char *out = NULL;
    size_t len = 0, cap = 0;
    double bw;
    unsigned per = (unsigned)((nfiles + jobs - 1) / jobs);
    if (depth == 0)
        snprintf(engine, sizeof(engine),
                 "--ioengine=psync --openfiles=1 "
                 "--file_service_type=sequential");
    else
        snprintf(engine, sizeof(engine),
                 "--ioengine=io_uring --iodepth=%u --openfiles=%u "
                 "--file_service_type=roundrobin",
                 depth, depth);
    snprintf(cmd, sizeof(cmd),
             "fio --output-format=json --name=kvt --directory='%s' --rw=%s --bs=256k "
             "--filesize=256k --nrfiles=%u --numjobs=%u %s --mem=%s --direct=%d --thread "
             "--group_reporting %s 2>/dev/null",
             dir, write ? "write" : "read", per, jobs, engine, huge ? "shmhuge" : "malloc",
             direct ? 1 : 0, write ? "--create_on_open=1 --fallocate=none" : "");
    p = popen(cmd, "r");
    if (p == NULL)
        return -1;
    for (;;) {
        size_t n;
        if (cap - len < 4096) {
            char *o = realloc(out, cap = cap ? 2 * cap : 65536);
            if (o == NULL)
                break;
            out = o;
        }
        n = fread(out + len, 1, cap - len - 1, p);
        if (n == 0)
            break;
        len += n;
    }
    if (pclose(p) != 0 || out == NULL) {
        free(out);
        return -1;
    }
    out[len] = '\0';
    bw = fio_bw(out, write ? "write" : "read");
    free(out);
    return bw;
}

/* ---- the benchmark --------------------------------------------------------------------- */

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(const double *v, unsigned n)
{
    double t[MAX_ROUNDS];
    memcpy(t, v, n * sizeof(*t));
    qsort(t, n, sizeof(*t), cmp_double);
    return n % 2 ? t[n / 2] : (t[n / 2 - 1] + t[n / 2]) / 2;
}

/* The median over the rounds of a[i] / b[i]. */
static double median_ratio(const double *a, const double *b, unsigned n)
{
    double q[MAX_ROUNDS];
    for (unsigned i = 0; i < n; i++)
        q[i] = b[i] > 0 ? a[i] / b[i] : 0;
    return median(q, n);
}

/* One round of the tier: store the chunks into a fresh root (gbs[SB_TW]), load them
 * back (gbs[SB_TR]). fio_w/fio_r, when not NULL, run between (tier and fio back to
 * back in each direction). */
struct sb_fio_step {
    const struct sb_opts *o;
    struct sb_result *r;
    unsigned round;
    char dir[4200];
};

static void fio_write_step(struct sb_fio_step *f)
{
    double w;
    rm_rf(f->dir);
    mkdir(f->dir, 0755);
    settle(f->dir);
    w = run_fio(f->dir, true, f->o->chunks, f->r->fio_jobs, 0, f->r->direct, f->r->fio_huge);
    f->r->gbs[SB_FW][f->round] = w * 1e-9;
    if (w <= 0)
        f->r->fio_ok = false;
}

static void fio_read_step(struct sb_fio_step *f)
{
    double rd, rdd;
    settle(f->dir);
    rd = run_fio(f->dir, false, f->o->chunks, f->r->fio_jobs, 0, f->r->direct, f->r->fio_huge);
    settle(f->dir);
    rdd = run_fio(f->dir, false, f->o->chunks, f->r->fio_jobs, f->r->read_depth, f->r->direct,
                  f->r->fio_huge);
    f->r->gbs[SB_FR][f->round] = rd * 1e-9;
    f->r->gbs[SB_FRD][f->round] = rdd * 1e-9;
    if (rd <= 0 || rdd <= 0)
        f->r->fio_ok = false;
}

static int bench_bandwidth(const struct sb_opts *o, struct sb_result *r)
{
    size_t nslots = (size_t)o->inflight * JOB_KEYS;
    uint8_t *mem =
        mmap(NULL, nslots * CHUNK, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    char root[4096];
    struct sb_run *run;
    struct sb_fio_step fs = {.o = o, .r = r};
    double bytes = (double)o->chunks * CHUNK;
    long hugetlb_restore = -1;
    int rc = 0;
    if (mem == MAP_FAILED)
        return -ENOMEM;
    /* The same kind of memory as the primary tier's rows (tiering/primary.c): huge
     * pages where the kernel gives them. */
    (void)madvise(mem, nslots * CHUNK, MADV_HUGEPAGE);
    run = calloc(1, sizeof(*run));
    if (run == NULL) {
        munmap(mem, nslots * CHUNK);
        return -ENOMEM;
    }
    for (size_t i = 0; i < nslots * CHUNK / 8; i++) /* incompressible, not zero pages */
        ((uint64_t *)mem)[i] = kvt_hash64_seed(&i, sizeof(i), 1);
    snprintf(root, sizeof(root), "%s/tier", o->dir);
    snprintf(fs.dir, sizeof(fs.dir), "%s/fio", o->dir);
    run->mem = mem;
    run->row = CHUNK;
    /* As many fio jobs as the tier has read threads, for the write too: the reads must
     * take the files the write made (fio names them by job), and with 6 write jobs and
     * 4 read jobs a third of the files fio read it had laid out just before. */
    r->fio_jobs = N_READ;
    r->fio_ok = !o->no_fio;
    for (unsigned k = 0; k < o->rounds && rc == 0; k++) {
        /* fio first in odd rounds: neither side always runs on the warmer machine. */
        bool fio_first = k % 2 == 1 && !o->no_fio;
        struct kvt_storage_tier_info info;
        double ws, rs;
        fs.round = k;
        rm_rf(root);
        rc = sb_open(root, CHUNK, mem, nslots, o->read_depth, &run->t);
        if (rc != 0) {
            fprintf(stderr, "storage bench: cannot open the tier in %s: %s\n", root, strerror(-rc));
            break;
        }
        kvt_storage_tier_info(run->t, &info);
        r->direct = info.direct_io;
        r->io_uring = info.io_uring;
        r->read_depth = info.read_depth;
        if (k == 0 && r->fio_ok) /* fio's same-depth read needs the tier's depth */
            hugetlb_restore =
                hugetlb_reserve(fio_huge_pages(r->fio_jobs, r->read_depth), &r->fio_huge);
        if (fio_first)
            fio_write_step(&fs);
        run->failed_jobs = 0;
        settle(o->dir);
        ws = sb_pass(run, false, o->chunks, o->inflight);
        if (run->failed_jobs > 0)
            fprintf(stderr, "storage bench: %zu store job(s) failed\n", run->failed_jobs);
        kvt_storage_tier_wait_idle(run->t);
        if (!fio_first && !o->no_fio)
            fio_write_step(&fs);
        if (fio_first)
            fio_read_step(&fs);
        run->failed_keys = 0;
        settle(o->dir);
        rs = sb_pass(run, true, o->chunks, o->inflight);
        r->load_failures += run->failed_keys;
        if (!fio_first && !o->no_fio)
            fio_read_step(&fs);
        sb_close(run->t);
        r->gbs[SB_TW][k] = bytes / ws * 1e-9;
        r->gbs[SB_TR][k] = bytes / rs * 1e-9;
    }
    rm_rf(root);
    if (hugetlb_restore >= 0)
        (void)hugetlb_set(hugetlb_restore);
    if (!o->no_fio) {
        rm_rf(fs.dir);
        if (!r->fio_ok)
            fprintf(stderr, "storage bench: fio failed or is not installed (Debian: fio)\n");
    }
    for (int m = 0; m < SB_N; m++)
        r->med[m] = median(r->gbs[m], o->rounds);
    r->ratio_write = median_ratio(r->gbs[SB_TW], r->gbs[SB_FW], o->rounds);
    r->ratio_read = median_ratio(r->gbs[SB_TR], r->gbs[SB_FR], o->rounds);
    r->ratio_read_depth = median_ratio(r->gbs[SB_TR], r->gbs[SB_FRD], o->rounds);
    free(run);
    munmap(mem, nslots * CHUNK);
    return rc;
}

static int bench_rebuild(const struct sb_opts *o, struct sb_result *r)
{
    enum { ROW = 4096 };
    size_t nslots = (size_t)o->inflight * JOB_KEYS;
    uint8_t *mem = aligned_alloc(4096, nslots * ROW);
    char root[4096];
    struct sb_run *run = calloc(1, sizeof(*run));
    struct kvt_storage_restart_info ri;
    int rc = -ENOMEM;
    if (mem == NULL || run == NULL)
        goto out;
    memset(mem, 0x5a, nslots * ROW);
    snprintf(root, sizeof(root), "%s/rebuild", o->dir);
    rm_rf(root);
    rc = sb_open(root, ROW, mem, nslots, o->read_depth, &run->t);
    if (rc != 0)
        goto out;
    r->rebuild_create_s = sb_pass(run, false, o->rebuild_files, o->inflight);
    sb_close(run->t);
    if (o->cold) {
        sync();
        FILE *f = fopen("/proc/sys/vm/drop_caches", "w");
        if (f == NULL || fputs("3\n", f) < 0)
            fprintf(stderr, "storage bench: cannot drop the page cache (root?): warm rebuild\n");
        if (f != NULL)
            fclose(f);
    }
    rc = sb_open(root, ROW, mem, nslots, o->read_depth, &run->t);
    if (rc != 0)
        goto out;
    kvt_storage_tier_restart_info(run->t, &ri);
    r->rebuild_files = o->rebuild_files;
    r->rebuild_found = ri.files_found;
    r->rebuild_s = ri.seconds;
    sb_close(run->t);
    rm_rf(root);
out:
    free(run);
    free(mem);
    return rc;
}

static void usage(FILE *f)
{
    fprintf(f, "usage: kvtier-bench storage [--json] [--dir D] [--chunks N] [--rebuild-files N]\n"
               "                            [--inflight J] [--rounds R] [--read-depth D]\n"
               "                            [--poll-us U] [--cold] [--no-fio]\n");
}

static int parse(int argc, char **argv, struct sb_opts *o)
{
    static const struct option longopts[] = {
        {"json", no_argument, NULL, 'j'},
        {"dir", required_argument, NULL, 'd'},
        {"chunks", required_argument, NULL, 'n'},
        {"rebuild-files", required_argument, NULL, 'r'},
        {"inflight", required_argument, NULL, 'i'},
        {"rounds", required_argument, NULL, 'R'},
        {"read-depth", required_argument, NULL, 'D'},
        {"poll-us", required_argument, NULL, 'P'},
        {"cold", no_argument, NULL, 'c'},
        {"no-fio", no_argument, NULL, 'F'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    int c;
    char *end;
    unsigned long long v;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
        switch (c) {
        case 'j':
            o->json = true;
            break;
        case 'd':
            o->dir = optarg;
            break;
        case 'c':
            o->cold = true;
            break;
        case 'F':
            o->no_fio = true;
            break;
        case 'n':
        case 'r':
        case 'i':
        case 'R':
        case 'D':
        case 'P':
            errno = 0;
            v = strtoull(optarg, &end, 10);
            if (errno != 0 || *end != '\0' || v == 0 || v > 100000000ull ||
                (c == 'i' && v > MAX_INFLIGHT) || (c == 'R' && v > MAX_ROUNDS) ||
                (c == 'D' && v > 256) || (c == 'P' && v > 1000000)) {
                fprintf(stderr, "kvtier-bench storage: bad value '%s' for --%s\n", optarg,
                        c == 'n'   ? "chunks"
                        : c == 'r' ? "rebuild-files"
                        : c == 'i' ? "inflight"
                        : c == 'R' ? "rounds"
                        : c == 'D' ? "read-depth"
                                   : "poll-us");
                return -EINVAL;
            }
            if (c == 'n')
                o->chunks = (size_t)v;
            else if (c == 'r')
                o->rebuild_files = (size_t)v;
            else if (c == 'i')
                o->inflight = (unsigned)v;
            else if (c == 'R')
                o->rounds = (unsigned)v;
            else if (c == 'D')
                o->read_depth = (unsigned)v;
            else
                o->poll_us = (unsigned)v;
            break;
        case 'h':
            usage(stdout);
            return 1;
        default:
            usage(stderr);
            return -EINVAL;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "kvtier-bench storage: unexpected argument '%s'\n", argv[optind]);
        return -EINVAL;
    }
    return 0;
}

int kvt_bench_storage(int argc, char **argv)
{
    struct sb_opts o = {
        .chunks = 4096, .rebuild_files = 100000, .inflight = 16, .rounds = 5, .poll_us = 1000};
    struct sb_result r = {0};
    char defdir[256];
    bool made = false;
    int rc = parse(argc, argv, &o);
    if (rc != 0)
        return rc > 0 ? 0 : 2;
    poll_us = o.poll_us;
    if (o.dir == NULL) {
        snprintf(defdir, sizeof(defdir), "%s/kvtier-bench-storage.%d",
                 getenv("TMPDIR") ? getenv("TMPDIR") : "/var/tmp", (int)getpid());
        o.dir = defdir;
    }
    if (mkdir(o.dir, 0755) == 0)
        made = true;
    else if (errno != EEXIST) {
        fprintf(stderr, "kvtier-bench storage: cannot create %s: %s\n", o.dir, strerror(errno));
        return 1;
    }
    rc = bench_bandwidth(&o, &r);
    if (rc == 0)
        rc = bench_rebuild(&o, &r);
    if (made)
        rmdir(o.dir);
    if (rc != 0) {
        fprintf(stderr, "kvtier-bench storage: %s\n", strerror(-rc));
        return 1;
    }
    if (o.json) {
        static const char *const names[SB_N] = {"tier_write", "fio_write", "tier_read", "fio_read",
                                                "fio_read_depth"};
        printf("{\"bench\":\"storage\",\"dir\":\"%s\",\"chunk_bytes\":%u,\"chunks\":%zu,"
               "\"inflight_jobs\":%u,\"job_keys\":%d,\"direct_io\":%s,\"io_uring\":%s,"
               "\"read_threads\":%d,\"read_depth\":%u,\"poll_us\":%u,\"rounds\":%u,",
               o.dir, CHUNK, o.chunks, o.inflight, JOB_KEYS, r.direct ? "true" : "false",
               r.io_uring ? "true" : "false", N_READ, r.read_depth, o.poll_us, o.rounds);
        printf("\"fio\":{\"ok\":%s,\"jobs\":%u,\"read_depth\":%u,\"huge_pages\":%s},",
               r.fio_ok ? "true" : "false", r.fio_jobs, r.read_depth,
               r.fio_huge ? "true" : "false");
        printf("\"gbs\":{");
        for (int m = 0; m < SB_N; m++) {
            printf("%s\"%s\":{\"median\":%.3f,\"rounds\":[", m ? "," : "", names[m], r.med[m]);
            for (unsigned k = 0; k < o.rounds; k++)
                printf("%s%.3f", k ? "," : "", r.gbs[m][k]);
            printf("]}");
        }
        printf("},\"load_failures\":%zu,"
               "\"ratio\":{\"write\":%.3f,\"read\":%.3f,\"read_same_depth\":%.3f,\"target\":0.8},"
               "\"rebuild\":{\"files\":%zu,\"found\":%zu,\"seconds\":%.3f,\"cold\":%s,"
               "\"create_seconds\":%.3f}}\n",
               r.load_failures, r.ratio_write, r.ratio_read, r.ratio_read_depth, r.rebuild_files,
               r.rebuild_found, r.rebuild_s, o.cold ? "true" : "false", r.rebuild_create_s);
    } else {
        printf("storage tier, %zu chunks of 256 KiB in %s (%s I/O), %u jobs of %d in flight,\n"
               "  %d read threads x %u reads in flight (%s), %u rounds, poll every %u us\n",
               o.chunks, o.dir, r.direct ? "O_DIRECT" : "buffered", o.inflight, JOB_KEYS, N_READ,
               r.read_depth, r.io_uring ? "io_uring" : "blocking", o.rounds, o.poll_us);
        if (r.fio_ok)
            printf("  rows and fio's buffers on %s\n",
                   r.fio_huge ? "huge pages (fio --mem=shmhuge)"
                              : "DIFFERENT pages: fio's on 4 KiB (no hugetlb pages: root "
                                "reserves them), the tier's huge: not a fair reference");
        printf("  %-22s %s\n", "GB/s per round", "(median)");
        for (int m = 0; m < SB_N; m++) {
            static const char *const labels[SB_N] = {"tier write", "fio write", "tier read",
                                                     "fio read", "fio read, same depth"};
            if (o.no_fio && m != SB_TW && m != SB_TR)
                continue;
            printf("  %-22s", labels[m]);
            for (unsigned k = 0; k < o.rounds; k++)
                printf(" %6.3f", r.gbs[m][k]);
            printf("  (%.3f)", r.med[m]);
            if (m == SB_FW || m == SB_FR)
                printf("  %u jobs, psync", r.fio_jobs);
            else if (m == SB_FRD)
                printf("  %u jobs x %u, io_uring", r.fio_jobs, r.read_depth);
            printf("\n");
        }
        if (r.fio_ok) {
            printf("  ratio tier/fio (median of rounds): write %.2f, read %.2f, read vs same "
                   "depth %.2f\n",
                   r.ratio_write, r.ratio_read, r.ratio_read_depth);
            printf("  target >= 0.80x fio: write %s, read %s (%s at the same depth)\n",
                   r.ratio_write >= 0.8 ? "met" : "NOT met",
                   r.ratio_read >= 0.8 ? "met" : "NOT met",
                   r.ratio_read_depth >= 0.8 ? "met" : "NOT met");
        }
        printf("index rebuild: %zu of %zu files in %.3f s (%s cache; writing them took %.1f s)\n",
               r.rebuild_found, r.rebuild_files, r.rebuild_s, o.cold ? "cold" : "warm",
               r.rebuild_create_s);
        if (r.load_failures > 0)
            printf("  %zu chunk load(s) failed\n", r.load_failures);
    }
    return 0;
}

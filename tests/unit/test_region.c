/* SPDX-License-Identifier: Apache-2.0 */
/* Tests for the shared primary region (tiering/region.c), ported one for one from
 * vLLM's tests/v1/kv_offload/cpu/test_shared_offload_region.py, plus a
 * few of our own for the C contract (geometry checks, joiner timeout, pre-fault).
 *
 * Every region lives in one fresh directory per run, under $KVT_TEST_TMPDIR or
 * /dev/shm, with a unique file name per test; the group teardown fails if any file
 * was left behind. Races use real threads (pthread barrier) and real processes
 * (fork, pipes for the hand-shakes), like vLLM's threading and multiprocessing. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <linux/magic.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "test_util.h"
#include "kvt/alloc.h"
#include "kvt/common.h"
#include "kvt/log.h"
#include "kvt/region.h"

static char *g_dir;
static size_t P; /* the system page size, vLLM's PAGE_SIZE */
static unsigned g_seq;

/* A unique region path in the test directory. */
static void region_path(char *buf, const char *name)
{
    int n = snprintf(buf, PATH_MAX, "%s/%s.%u.mmap", g_dir, name, g_seq++);
    assert_true(n > 0 && n < PATH_MAX);
}

static struct kvt_region_config cfg_of(const char *path, size_t num_chunks, size_t page_bytes,
                                       unsigned num_workers, int rank)
{
    struct kvt_region_config cfg = {
        .path = path,
        .num_chunks = num_chunks,
        .page_bytes = page_bytes,
        .num_workers = num_workers,
        .rank = rank,
        .join_timeout_s = 5.0,
        .populate = true,
    };
    return cfg;
}

/* vLLM's _make_region: the region must open. */
static void make_region(struct kvt_region *r, const char *path, size_t num_chunks,
                        size_t page_bytes, unsigned num_workers, int rank)
{
    struct kvt_region_config cfg = cfg_of(path, num_chunks, page_bytes, num_workers, rank);
    assert_int_equal(kvt_region_open(&cfg, r), 0);
    assert_true(r->open);
}

static bool path_exists(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0;
}

static bool fd_is_open(int fd)
{
    return fcntl(fd, F_GETFD) != -1 || errno != EBADF;
}

/* True if [addr, addr+len) is no longer mapped (mincore fails with ENOMEM). */
static bool is_unmapped(void *addr, size_t len)
{
    unsigned char vec[1];
    return mincore(addr, KVT_MIN(len, P), vec) < 0 && errno == ENOMEM;
}

static bool all_bytes(const uint8_t *p, size_t n, uint8_t v)
{
    for (size_t i = 0; i < n; i++)
        if (p[i] != v)
            return false;
    return true;
}

/* Fills a view's bytes in every row with v. */
static void fill_view(const struct kvt_region_view *v, uint8_t value)
{
    for (size_t c = 0; c < v->rows; c++)
        memset(v->base + c * v->row_stride, value, v->bytes);
}

/* Reads n bytes from fd, waiting at most timeout_ms in total; returns bytes read. */
static size_t read_timeout(int fd, void *buf, size_t n, int timeout_ms)
{
    size_t got = 0;
    while (got < n) {
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        ssize_t k;
        if (poll(&pfd, 1, timeout_ms) <= 0)
            break;
        k = read(fd, (char *)buf + got, n - got);
        if (k <= 0)
            break;
        got += (size_t)k;
    }
    return got;
}

static void write_byte(int fd, char c)
{
    ssize_t k;
    do
        k = write(fd, &c, 1);
    while (k < 0 && errno == EINTR);
}

/* The whole file as it is on the file system (not through any of our mappings). */
static uint8_t *read_file(const char *path, size_t size)
{
    uint8_t *buf = kvt_malloc(size);
    int fd = open(path, O_RDONLY);
    assert_non_null(buf);
    assert_true(fd >= 0);
    assert_int_equal(pread(fd, buf, size, 0), (ssize_t)size);
    close(fd);
    return buf;
}

/* ----- create_next_view: shape, stride and storage offset ----- */

static void test_create_next_view_shape_and_stride(void **state)
{
    char path[PATH_MAX];
    struct kvt_region r;
    struct kvt_region_view v;
    region_path(path, "shape");
    make_region(&r, path, 4, 2 * P, 1, 0);
    assert_int_equal(kvt_region_next_view(&r, P, &v), 0);
    assert_int_equal(v.rows, 4);
    assert_int_equal(v.bytes, P);
    assert_int_equal(v.row_stride, 2 * P); /* num_workers 1: row stride = page_bytes */
    assert_int_equal(r.row_bytes, 2 * P);
    assert_int_equal(r.size, 8 * P);
    kvt_region_cleanup(&r);
}

static void test_create_next_view_storage_offset_rank0(void **state)
{
    char path[PATH_MAX];
    struct kvt_region r;
    struct kvt_region_view v;
    region_path(path, "offset0");
    make_region(&r, path, 4, P, 2, 0);
    assert_int_equal(kvt_region_next_view(&r, P, &v), 0);
    assert_ptr_equal(v.base, r.base);
    assert_int_equal(v.offset, 0);
    kvt_region_cleanup(&r);
}

static void test_create_next_view_storage_offset_rank1(void **state)
{
    char path[PATH_MAX];
    struct kvt_region r0, r1;
    struct kvt_region_view v;
    region_path(path, "offset1");
    make_region(&r0, path, 4, P, 2, 0);
    make_region(&r1, path, 4, P, 2, 1);
    assert_int_equal(kvt_region_next_view(&r1, P, &v), 0);
    assert_ptr_equal(v.base, r1.base + P);
    assert_int_equal(v.offset, P);
    assert_int_equal(v.row_stride, 2 * P);
    kvt_region_cleanup(&r1);
    kvt_region_cleanup(&r0);
}

static void test_create_next_view_row_stride_with_multiple_workers(void **state)
{
    char path[PATH_MAX];
    struct kvt_region r;
    struct kvt_region_view v;
    region_path(path, "stride4");
    make_region(&r, path, 2, P, 4, 0);
    assert_int_equal(kvt_region_next_view(&r, P, &v), 0);
    assert_int_equal(v.row_stride, 4 * P);
    assert_ptr_equal(kvt_region_row(&r, 1), r.base + 4 * P);
    kvt_region_cleanup(&r);
}

/* ----- create_next_view: cursor ----- */

static void test_create_next_view_cursor_advances(void **state)
{
    char path[PATH_MAX];
    struct kvt_region r;
    struct kvt_region_view v;
    region_path(path, "cursor");
    make_region(&r, path, 4, 3 * P, 1, 0);
    assert_int_equal(r.cursor, 0);
    assert_int_equal(kvt_region_next_view(&r, P, &v), 0);
    assert_int_equal(r.cursor, P);
    assert_int_equal(kvt_region_next_view(&r, P, &v), 0);
    assert_int_equal(r.cursor, 2 * P);
    assert_int_equal(v.offset, P);
    assert_int_equal(kvt_region_next_view(&r, P, &v), 0);
    assert_int_equal(r.cursor, 3 * P); /* exactly at the area end */
    kvt_region_cleanup(&r);
}

static void test_create_next_view_exact_fill_succeeds(void **state)
{
    char path[PATH_MAX];
    struct kvt_region r;
    struct kvt_region_view v;
    region_path(path, "exact");
    make_region(&r, path, 4, 2 * P, 1, 0);
    assert_int_equal(kvt_region_next_view(&r, P, &v), 0);
    assert_int_equal(kvt_region_next_view(&r, P, &v), 0); /* fills to the area end */
    assert_int_equal(r.cursor, 2 * P);
    kvt_region_cleanup(&r);
}

/* ----- create_next_view: overflow guard ----- */

static void test_create_next_view_single_overflow_raises(void **state)
{
    char path[PATH_MAX];
    struct kvt_region r;
    struct kvt_region_view v;
    region_path(path, "ovf1");
    make_region(&r, path, 4, P, 1, 0);
    assert_int_equal(kvt_region_next_view(&r, P + 1, &v), -ERANGE);
    kvt_region_cleanup(&r);
}

static void test_create_next_view_cumulative_overflow_raises(void **state)
{
    char path[PATH_MAX];
    struct kvt_region r;
    struct kvt_region_view v;
    region_path(path, "ovf2");
    make_region(&r, path, 4, 2 * P, 1, 0);
    assert_int_equal(kvt_region_next_view(&r, P, &v), 0);
    assert_int_equal(kvt_region_next_view(&r, P, &v), 0);
    assert_int_equal(kvt_region_next_view(&r, 1, &v), -ERANGE); /* one byte too many */
    kvt_region_cleanup(&r);
}

static void test_create_next_view_overflow_does_not_mutate_cursor(void **state)
{
    char path[PATH_MAX];
    struct kvt_region r0, r1;
    struct kvt_region_view v, before;
    region_path(path, "ovf3");
    make_region(&r0, path, 4, P, 2, 0);
    make_region(&r1, path, 4, P, 2, 1);

    memset(&v, 0x5a, sizeof(v));
    before = v;
    assert_int_equal(r0.cursor, 0);
    assert_int_equal(kvt_region_next_view(&r0, P + 1, &v), -ERANGE);
    assert_int_equal(r0.cursor, 0);
    assert_memory_equal(&v, &before, sizeof(v)); /* the output is not written either */

    /* Rank 1's cursor starts at its cell and must not move into rank 0's or past
     * the row on a failed call. */
    assert_int_equal(r1.cursor, P);
    assert_int_equal(kvt_region_next_view(&r1, P + 1, &v), -ERANGE);
    assert_int_equal(r1.cursor, P);
    assert_int_equal(kvt_region_next_view(&r1, (size_t)-1, &v), -ERANGE);
    assert_int_equal(r1.cursor, P);
    assert_int_equal(kvt_region_next_view(&r1, P, &v), 0);
    assert_int_equal(r1.cursor, 2 * P);
    kvt_region_cleanup(&r1);
    kvt_region_cleanup(&r0);
}

/* ----- create_next_view: data and layout ----- */

static void test_create_next_view_write_visible_in_raw_mmap(void **state)
{
    char path[PATH_MAX];
    struct kvt_region r;
    struct kvt_region_view v;
    uint8_t *raw;
    region_path(path, "visible");
    make_region(&r, path, 4, P, 1, 0);
    assert_int_equal(kvt_region_next_view(&r, P, &v), 0);
    memset(v.base + 2 * v.row_stride, 42, v.bytes); /* chunk row 2 */

    /* num_workers 1: row stride = P, chunk 2 is bytes [2P, 3P). */
    assert_true(all_bytes(r.base + 2 * P, P, 42));
    assert_true(all_bytes(r.base, 2 * P, 0));
    assert_true(all_bytes(r.base + 3 * P, P, 0));
    raw = read_file(path, 4 * P); /* the file itself, not our mapping */
    assert_true(all_bytes(raw + 2 * P, P, 42));
    assert_true(all_bytes(raw, 2 * P, 0));
    kvt_free(raw);
    kvt_region_cleanup(&r);
}

static void test_create_next_view_multi_tensor_layout(void **state)
{
    char path[PATH_MAX];
    struct kvt_region r;
    struct kvt_region_view ta, tb;
    region_path(path, "multi");
    make_region(&r, path, 2, 2 * P, 1, 0);
    assert_int_equal(kvt_region_next_view(&r, P, &ta), 0);
    assert_int_equal(kvt_region_next_view(&r, P, &tb), 0);
    fill_view(&ta, 1);
    fill_view(&tb, 2);
    for (size_t c = 0; c < 2; c++) {
        size_t row = c * 2 * P;
        assert_true(all_bytes(r.base + row, P, 1));
        assert_true(all_bytes(r.base + row + P, P, 2));
    }
    kvt_region_cleanup(&r);
}

static void test_create_next_view_multiprocess_slots(void **state)
{
    const unsigned num_workers = 2;
    const size_t num_chunks = 4;
    char path[PATH_MAX], ack = 0;
    int done[2], go[2], status = 0;
    struct kvt_region r;
    struct kvt_region_view v;
    pid_t pid;

    region_path(path, "mpslots");
    /* The parent is rank 0 (creator), the child rank 1 (joiner). */
    make_region(&r, path, num_chunks, P, num_workers, 0);
    assert_true(r.creator);
    assert_int_equal(pipe(done), 0);
    assert_int_equal(pipe(go), 0);
    fflush(NULL);
    pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        struct kvt_region c;
        struct kvt_region_config cfg = cfg_of(path, num_chunks, P, num_workers, 1);
        char b;
        int code = 0;
        close(done[0]);
        close(go[1]);
        if (kvt_region_open(&cfg, &c) != 0 || c.creator)
            code = 1;
        else if (kvt_region_next_view(&c, P, &v) != 0)
            code = 2;
        else
            fill_view(&v, 22);
        write_byte(done[1], code == 0 ? 'o' : 'e');
        if (read_timeout(go[0], &b, 1, 30000) != 1)
            code = 3;
        kvt_region_cleanup(&c);
        _exit(code);
    }
    close(done[1]);
    close(go[0]);

    assert_int_equal(kvt_region_next_view(&r, P, &v), 0);
    fill_view(&v, 11);
    assert_int_equal(read_timeout(done[0], &ack, 1, 30000), 1);
    assert_int_equal(ack, 'o');
    for (size_t c = 0; c < num_chunks; c++) {
        const uint8_t *row = r.base + c * num_workers * P;
        assert_true(all_bytes(row, P, 11));
        assert_true(all_bytes(row + P, P, 22));
    }
    write_byte(go[1], 'g');
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 0);
    assert_true(path_exists(path)); /* the joiner left the file */
    close(done[0]);
    close(go[1]);
    kvt_region_cleanup(&r);
    assert_false(path_exists(path));
}

static void test_create_next_view_worker_isolation(void **state)
{
    const unsigned num_workers = 2;
    const size_t num_chunks = 4;
    char path[PATH_MAX];
    struct kvt_region r0, r1;
    struct kvt_region_view t0, t1;
    region_path(path, "isolation");
    make_region(&r0, path, num_chunks, P, num_workers, 0);
    make_region(&r1, path, num_chunks, P, num_workers, 1);
    assert_int_equal(kvt_region_next_view(&r0, P, &t0), 0);
    assert_int_equal(kvt_region_next_view(&r1, P, &t1), 0);
    fill_view(&t0, 11);
    fill_view(&t1, 22);
    for (size_t c = 0; c < num_chunks; c++) {
        const uint8_t *row = r0.base + c * num_workers * P;
        assert_true(all_bytes(row, P, 11));
        assert_true(all_bytes(row + P, P, 22));
    }
    kvt_region_cleanup(&r1);
    kvt_region_cleanup(&r0);
}

/* ----- constructor: creator and joiner ----- */

static void test_creator_flag_set_on_first_open(void **state)
{
    char path[PATH_MAX];
    struct kvt_region r;
    region_path(path, "creator");
    make_region(&r, path, 4, P, 1, 0);
    assert_true(r.creator);
    kvt_region_cleanup(&r);
}

static void test_insufficient_space_raises_clear_error(void **state)
{
    char path[PATH_MAX], logpath[PATH_MAX], need[64], log[4096];
    struct statvfs st;
    struct kvt_region r;
    struct kvt_region_config cfg;
    const size_t page = 1 << 20;
    unsigned long long avail;
    size_t num_chunks;
    int saved, logfd;
    ssize_t n;

    region_path(path, "nospace");
    region_path(logpath, "nospace-log");
    /* Ask for half again what the file system says is free: only the fstatvfs check
     * can answer -ENOSPC (a sparse ftruncate on tmpfs would succeed). */
    assert_int_equal(statvfs(g_dir, &st), 0);
    avail = (unsigned long long)st.f_bavail * st.f_frsize;
    num_chunks = (size_t)(avail / page) + (size_t)(avail / page) / 2 + 16;
    cfg = cfg_of(path, num_chunks, page, 1, 0);
    cfg.populate = false; /* were the check missing, the file stays sparse: no real fill */

    fflush(stderr);
    saved = dup(STDERR_FILENO);
    logfd = open(logpath, O_CREAT | O_EXCL | O_RDWR, 0600);
    assert_true(saved >= 0 && logfd >= 0);
    dup2(logfd, STDERR_FILENO);
    memset(&r, 0x5a, sizeof(r));
    int rc = kvt_region_open(&cfg, &r);
    fflush(stderr);
    dup2(saved, STDERR_FILENO);
    close(saved);
    n = pread(logfd, log, sizeof(log) - 1, 0);
    close(logfd);
    unlink(logpath);

    assert_int_equal(rc, -ENOSPC);
    assert_true(n > 0);
    log[n] = '\0';
    assert_non_null(strstr(log, "Not enough space"));
    snprintf(need, sizeof(need), "%zu bytes", num_chunks * page);
    assert_non_null(strstr(log, need)); /* the numbers are in the message */
    assert_non_null(strstr(log, path));
    /* The partially created file is gone, so other workers do not block on it. */
    assert_false(path_exists(path));
    assert_false(r.open);
    kvt_region_cleanup(&r); /* a failed open is safe to clean up */
}

static void test_joiner_flag_not_set(void **state)
{
    char path[PATH_MAX];
    struct kvt_region r0, r1;
    region_path(path, "joiner");
    make_region(&r0, path, 4, P, 2, 0);
    make_region(&r1, path, 4, P, 2, 1);
    assert_true(r0.creator);
    assert_false(r1.creator);
    kvt_region_cleanup(&r1);
    kvt_region_cleanup(&r0);
}

static void test_file_exists_after_construction(void **state)
{
    char path[PATH_MAX];
    struct kvt_region r;
    struct stat st;
    region_path(path, "exists");
    make_region(&r, path, 4, P, 1, 0);
    assert_int_equal(stat(path, &st), 0);
    assert_true(S_ISREG(st.st_mode));
    assert_int_equal(st.st_mode & 0777, 0600);
    assert_string_equal(r.path, path);
    kvt_region_cleanup(&r);
}

static void test_file_has_correct_size(void **state)
{
    char path[PATH_MAX];
    struct kvt_region r;
    struct stat st;
    region_path(path, "size");
    make_region(&r, path, 4, P, 1, 0);
    assert_int_equal(stat(path, &st), 0);
    assert_int_equal(st.st_size, 4 * P);
    assert_int_equal(r.size, 4 * P);
    kvt_region_cleanup(&r);
}

/* ----- races ----- */

struct race {
    const char *path;
    unsigned num_workers;
    pthread_barrier_t barrier;
    struct kvt_region *regions;
    int *rcs;
};

struct race_arg {
    struct race *race;
    int rank;
};

static void *race_worker(void *p)
{
    struct race_arg *a = p;
    struct kvt_region_config cfg = cfg_of(a->race->path, 4, P, a->race->num_workers, a->rank);
    pthread_barrier_wait(&a->race->barrier); /* everybody starts at once */
    a->race->rcs[a->rank] = kvt_region_open(&cfg, &a->race->regions[a->rank]);
    return NULL;
}

/* vLLM's _race_construct: num_workers threads race to open the same region. */
static void race_construct(struct race *race, const char *path, unsigned num_workers)
{
    pthread_t tid[16];
    struct race_arg args[16];
    assert_true(num_workers <= 16);
    race->path = path;
    race->num_workers = num_workers;
    race->regions = kvt_calloc(num_workers, sizeof(*race->regions));
    race->rcs = kvt_calloc(num_workers, sizeof(*race->rcs));
    assert_non_null(race->regions);
    assert_non_null(race->rcs);
    assert_int_equal(pthread_barrier_init(&race->barrier, NULL, num_workers), 0);
    for (unsigned i = 0; i < num_workers; i++) {
        args[i].race = race;
        args[i].rank = (int)i;
        assert_int_equal(pthread_create(&tid[i], NULL, race_worker, &args[i]), 0);
    }
    for (unsigned i = 0; i < num_workers; i++)
        pthread_join(tid[i], NULL);
    pthread_barrier_destroy(&race->barrier);
}

static void race_destroy(struct race *race)
{
    for (unsigned i = 0; i < race->num_workers; i++)
        kvt_region_cleanup(&race->regions[i]);
    kvt_free(race->regions);
    kvt_free(race->rcs);
}

static void test_multi_worker_race_exactly_one_creator(void **state)
{
    const unsigned num_workers = 8;
    char path[PATH_MAX];
    struct race race;
    unsigned creators = 0;
    region_path(path, "race8");
    race_construct(&race, path, num_workers);
    for (unsigned i = 0; i < num_workers; i++) {
        assert_int_equal(race.rcs[i], 0);
        assert_true(race.regions[i].open);
        assert_non_null(race.regions[i].base);
        assert_int_equal(race.regions[i].size, 4 * num_workers * P);
        creators += race.regions[i].creator;
    }
    assert_int_equal(creators, 1);
    race_destroy(&race);
    assert_false(path_exists(path));
}

static void test_multi_worker_race_shared_memory_visible(void **state)
{
    const unsigned num_workers = 4;
    char path[PATH_MAX];
    struct race race;
    region_path(path, "race4");
    race_construct(&race, path, num_workers);
    for (unsigned i = 0; i < num_workers; i++)
        assert_int_equal(race.rcs[i], 0);
    race.regions[0].base[0] = 0xab;
    for (unsigned i = 1; i < num_workers; i++) {
        assert_ptr_not_equal(race.regions[i].base, race.regions[0].base); /* own mapping */
        assert_int_equal(race.regions[i].base[0], 0xab);
    }
    race_destroy(&race);
}

/* A child of test_multiprocess_race_construct_and_write: waits for the start signal,
 * races to open, fills its cell of every chunk with rank+1, reports, waits for the
 * parent's check, then verifies every worker's bytes through its own mapping.
 * Exit status: 10 creator, 0 joiner, anything else a failure. */
static void mp_race_child(const char *path, unsigned num_workers, size_t num_chunks, int rank,
                          int start_fd, int done_fd, int go_fd)
{
    struct kvt_region_config cfg = cfg_of(path, num_chunks, P, num_workers, rank);
    struct kvt_region r;
    struct kvt_region_view v;
    char b;
    int code = 0;

    (void)read_timeout(start_fd, &b, 1, 30000); /* EOF: go */
    if (kvt_region_open(&cfg, &r) != 0) {
        write_byte(done_fd, 'e');
        _exit(1);
    }
    if (kvt_region_next_view(&r, P, &v) != 0)
        code = 2;
    else
        fill_view(&v, (uint8_t)(rank + 1));
    write_byte(done_fd, code == 0 ? 'o' : 'e');
    if (read_timeout(go_fd, &b, 1, 30000) != 1)
        code = 3;
    for (size_t c = 0; c < num_chunks && code == 0; c++)
        for (unsigned w = 0; w < num_workers; w++)
            if (!all_bytes(r.base + (c * num_workers + w) * P, P, (uint8_t)(w + 1)))
                code = 4;
    if (code == 0 && r.creator)
        code = 10;
    kvt_region_cleanup(&r);
    _exit(code);
}

static void test_multiprocess_race_construct_and_write(void **state)
{
    enum { NUM_WORKERS = 4 };
    const size_t num_chunks = 3;
    char path[PATH_MAX], acks[NUM_WORKERS];
    int start[2], done[2], go[2];
    pid_t pids[NUM_WORKERS];
    unsigned creators = 0;
    uint8_t *raw;

    region_path(path, "mprace");
    assert_int_equal(pipe(start), 0);
    assert_int_equal(pipe(done), 0);
    assert_int_equal(pipe(go), 0);
    fflush(NULL);
    for (int i = 0; i < NUM_WORKERS; i++) {
        pids[i] = fork();
        assert_true(pids[i] >= 0);
        if (pids[i] == 0) {
            close(start[1]);
            close(done[0]);
            close(go[1]);
            mp_race_child(path, NUM_WORKERS, num_chunks, i, start[0], done[1], go[0]);
        }
    }
    close(start[0]);
    close(done[1]);
    close(go[0]);
    close(start[1]); /* every child sees EOF at once: the race starts */

    assert_int_equal(read_timeout(done[0], acks, NUM_WORKERS, 30000), NUM_WORKERS);
    for (int i = 0; i < NUM_WORKERS; i++)
        assert_int_equal(acks[i], 'o');

    /* The raw file while every worker still holds it open. */
    raw = read_file(path, num_chunks * NUM_WORKERS * P);
    for (size_t c = 0; c < num_chunks; c++)
        for (unsigned w = 0; w < NUM_WORKERS; w++)
            assert_true(all_bytes(raw + (c * NUM_WORKERS + w) * P, P, (uint8_t)(w + 1)));
    kvt_free(raw);

    for (int i = 0; i < NUM_WORKERS; i++)
        write_byte(go[1], 'g');
    for (int i = 0; i < NUM_WORKERS; i++) {
        int status = 0;
        assert_int_equal(waitpid(pids[i], &status, 0), pids[i]);
        assert_true(WIFEXITED(status));
        if (WEXITSTATUS(status) == 10)
            creators++;
        else
            assert_int_equal(WEXITSTATUS(status), 0);
    }
    assert_int_equal(creators, 1);
    close(done[0]);
    close(go[1]);
    assert_false(path_exists(path)); /* the creator unlinked it */
}

/* ----- cleanup ----- */

static void test_cleanup_creator_all_effects(void **state)
{
    char path[PATH_MAX];
    struct kvt_region r;
    uint8_t *base;
    size_t size;
    int fd;
    region_path(path, "cleanc");
    make_region(&r, path, 4, P, 1, 0);
    fd = r.fd;
    base = r.base;
    size = r.size;
    assert_true(fd_is_open(fd));
    kvt_region_cleanup(&r);
    assert_true(is_unmapped(base, size)); /* the mapping is closed */
    assert_false(path_exists(path));      /* the creator removes the file */
    assert_false(fd_is_open(fd));         /* the fd is closed */
    assert_false(r.open);
    assert_null(r.base);
    assert_int_equal(r.fd, -1);
    assert_false(r.creator);
}

static void test_cleanup_non_creator_all_effects(void **state)
{
    char path[PATH_MAX];
    struct kvt_region r0, r1;
    uint8_t *base;
    int fd;
    region_path(path, "cleann");
    make_region(&r0, path, 4, P, 1, 0);
    make_region(&r1, path, 4, P, 1, 0);
    fd = r1.fd;
    base = r1.base;
    kvt_region_cleanup(&r1);
    assert_true(is_unmapped(base, r0.size));
    assert_true(path_exists(path)); /* a non-creator must not remove the file */
    assert_false(fd_is_open(fd));
    assert_true(fd_is_open(r0.fd));
    r0.base[0] = 1; /* the creator's mapping is untouched */
    kvt_region_cleanup(&r0);
    assert_false(path_exists(path));
}

static void test_cleanup_idempotent(void **state)
{
    char path[PATH_MAX];
    struct kvt_region r, zero;
    struct kvt_region_config bad;
    bool stdin_open;
    int fd;
    region_path(path, "idem");
    make_region(&r, path, 4, P, 1, 0);
    kvt_region_cleanup(&r);
    kvt_region_cleanup(&r); /* a no-op */

    /* A second cleanup must not unlink a file that somebody else created since. */
    fd = open(path, O_CREAT | O_EXCL | O_RDWR, 0600);
    assert_true(fd >= 0);
    close(fd);
    kvt_region_cleanup(&r);
    assert_true(path_exists(path));
    assert_int_equal(unlink(path), 0);

    /* A zeroed struct (fd 0!) and a failed open are safe to clean up. */
    stdin_open = fd_is_open(0);
    memset(&zero, 0, sizeof(zero));
    kvt_region_cleanup(&zero);
    assert_int_equal(fd_is_open(0), stdin_open); /* fd 0 was not closed */
    bad = cfg_of(path, 0, P, 1, 0);
    memset(&r, 0x5a, sizeof(r));
    assert_int_equal(kvt_region_open(&bad, &r), -EINVAL);
    kvt_region_cleanup(&r);
    kvt_region_cleanup(NULL);
}

static void test_cleanup_after_create_next_view_releases_mmap(void **state)
{
    char path[PATH_MAX];
    struct kvt_region r;
    struct kvt_region_view v;
    uint8_t *base;
    region_path(path, "cleanv");
    make_region(&r, path, 4, P, 1, 0);
    base = r.base;
    assert_int_equal(kvt_region_next_view(&r, P, &v), 0);
    kvt_region_cleanup(&r);
    assert_true(is_unmapped(base, r.size));
    assert_true(is_unmapped(v.base, v.bytes));
    assert_int_equal(kvt_region_next_view(&r, P, &v), -EINVAL); /* closed */
}

/* ----- wait_for_file_size ----- */

static int open_scratch(const char *name, char *path)
{
    int fd;
    region_path(path, name);
    fd = open(path, O_CREAT | O_EXCL | O_RDWR, 0600);
    assert_true(fd >= 0);
    return fd;
}

static void test_wait_for_file_size_already_large_enough(void **state)
{
    char path[PATH_MAX];
    int fd = open_scratch("ready", path);
    assert_int_equal(ftruncate(fd, (off_t)P), 0);
    /* Already large enough: no wait at all, even with a zero timeout. */
    assert_int_equal(kvt_region_wait_for_size(fd, P, 0.0), 0);
    assert_int_equal(kvt_region_wait_for_size(fd, P - 1, 5.0), 0);
    close(fd);
    unlink(path);
}

struct grow {
    int fd;
    int rc;
};

static void *grow_after_50ms(void *p)
{
    const struct timespec ts = {.tv_sec = 0, .tv_nsec = 50000000L};
    struct grow *g = p;
    nanosleep(&ts, NULL);
    g->rc = ftruncate(g->fd, (off_t)P);
    return NULL;
}

static void test_wait_for_file_size_waits_for_grow(void **state)
{
    char path[PATH_MAX];
    int fd = open_scratch("grow", path);
    struct grow g = {.fd = fd, .rc = -1};
    struct stat st;
    pthread_t tid;
    assert_int_equal(pthread_create(&tid, NULL, grow_after_50ms, &g), 0);
    assert_int_equal(kvt_region_wait_for_size(fd, P, 5.0), 0);
    assert_int_equal(fstat(fd, &st), 0);
    assert_int_equal(st.st_size, P); /* it returned because the file grew */
    pthread_join(tid, NULL);
    assert_int_equal(g.rc, 0);
    close(fd);
    unlink(path);
}

static void test_wait_for_file_size_timeout(void **state)
{
    char path[PATH_MAX];
    int fd = open_scratch("stuck", path);
    assert_int_equal(kvt_region_wait_for_size(fd, P, 0.1), -ETIMEDOUT);
    assert_int_equal(kvt_region_wait_for_size(fd, P, 0.0), -ETIMEDOUT);
    assert_int_equal(kvt_region_wait_for_size(-1, P, 0.1), -EINVAL);
    assert_int_equal(kvt_region_wait_for_size(fd, P, -1.0), -EINVAL);
    close(fd);
    unlink(path);
}

/* ----- ours: the C contract ----- */

/* A joiner whose creator never sizes the file gives up after join_timeout_s, and
 * leaves the file (it is not its to remove). */
static void test_joiner_times_out_when_file_never_sized(void **state)
{
    char path[PATH_MAX];
    struct kvt_region r;
    struct kvt_region_config cfg;
    int fd = open_scratch("stub", path);
    cfg = cfg_of(path, 4, P, 1, 0);
    cfg.join_timeout_s = 0.2;
    assert_int_equal(kvt_region_open(&cfg, &r), -ETIMEDOUT);
    assert_false(r.open);
    assert_false(r.creator);
    assert_true(path_exists(path));
    kvt_region_cleanup(&r);
    assert_true(path_exists(path));
    close(fd);
    unlink(path);
}

/* Geometry and config errors are -EINVAL before the file system is touched. */
static void test_invalid_geometry_rejected(void **state)
{
    char path[PATH_MAX], longpath[PATH_MAX + 8];
    struct kvt_region r;
    struct kvt_region_view v;
    struct kvt_region_config cfg;
    region_path(path, "invalid");

#define EXPECT_EINVAL(mutate)                                                                      \
    do {                                                                                           \
        cfg = cfg_of(path, 4, P, 2, 0);                                                            \
        mutate;                                                                                    \
        assert_int_equal(kvt_region_open(&cfg, &r), -EINVAL);                                      \
        assert_false(r.open);                                                                      \
        assert_false(path_exists(path));                                                           \
    } while (0)
    EXPECT_EINVAL(cfg.num_chunks = 0);
    EXPECT_EINVAL(cfg.page_bytes = 0);
    EXPECT_EINVAL(cfg.num_workers = 0);
    EXPECT_EINVAL(cfg.page_bytes = SIZE_MAX / 2 + 1);                  /* row_bytes overflows */
    EXPECT_EINVAL(cfg.num_chunks = SIZE_MAX / (2 * P) + 1);            /* size overflows */
    EXPECT_EINVAL(cfg.num_chunks = ((size_t)INT64_MAX / (2 * P)) + 1); /* beyond off_t */
    EXPECT_EINVAL(cfg.rank = 2);
    EXPECT_EINVAL(cfg.rank = -2);
    EXPECT_EINVAL(cfg.path = NULL);
    EXPECT_EINVAL(cfg.path = "");
    EXPECT_EINVAL(cfg.join_timeout_s = -1.0);
    EXPECT_EINVAL(cfg.join_timeout_s = __builtin_nan(""));
#undef EXPECT_EINVAL
    assert_int_equal(kvt_region_open(NULL, &r), -EINVAL);
    assert_false(r.open);
    cfg = cfg_of(path, 4, P, 2, 0);
    assert_int_equal(kvt_region_open(&cfg, NULL), -EINVAL);
    assert_false(path_exists(path));

    memset(longpath, 'a', sizeof(longpath) - 1);
    longpath[sizeof(longpath) - 1] = '\0';
    cfg.path = longpath;
    assert_int_equal(kvt_region_open(&cfg, &r), -ENAMETOOLONG);

    /* The node (rank ALL) has no cell: no views. */
    cfg = cfg_of(path, 4, P, 2, KVT_REGION_RANK_ALL);
    assert_int_equal(kvt_region_open(&cfg, &r), 0);
    assert_int_equal(r.cursor, 0);
    assert_int_equal(kvt_region_next_view(&r, P, &v), -EINVAL);
    assert_int_equal(kvt_region_next_view(&r, P, NULL), -EINVAL);
    kvt_region_cleanup(&r);
    assert_false(path_exists(path));
}

/* Page residency of a mapping, one bool per page. */
static void residency(const uint8_t *base, size_t pages, bool *out)
{
    unsigned char vec[64];
    assert_true(pages <= sizeof(vec));
    assert_int_equal(mincore((void *)base, pages * P, vec), 0);
    for (size_t i = 0; i < pages; i++)
        out[i] = vec[i] & 1;
}

/* populate pre-faults exactly the worker's own cells, or everything for rank ALL
 * (vLLM: the MADV_POPULATE_WRITE loop per row, or one call for the scheduler). */
static void test_populate_prefaults_own_cells(void **state)
{
    char path[PATH_MAX];
    struct kvt_region r1, all;
    struct kvt_region_config cfg;
    struct statfs fs;
    bool res[6], on_tmpfs;
    void *probe = mmap(NULL, P, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    assert_true(probe != MAP_FAILED);
    if (madvise(probe, P, 23 /* MADV_POPULATE_WRITE */) < 0 && errno == EINVAL) {
        munmap(probe, P);
        skip(); /* kernel older than 5.14: populate is a no-op by design */
    }
    munmap(probe, P);
    assert_int_equal(statfs(g_dir, &fs), 0);
    on_tmpfs = fs.f_type == TMPFS_MAGIC;

    region_path(path, "populate");
    cfg = cfg_of(path, 3, P, 2, 1);
    assert_int_equal(kvt_region_open(&cfg, &r1), 0);
    residency(r1.base, 6, res);
    for (size_t i = 0; i < 6; i++) {
        if (i % 2 == 1)
            assert_true(res[i]); /* rank 1's cells */
        else if (on_tmpfs)
            assert_false(res[i]); /* and only those (a disk file system reads ahead) */
    }

    cfg.rank = KVT_REGION_RANK_ALL;
    assert_int_equal(kvt_region_open(&cfg, &all), 0);
    assert_false(all.creator);
    residency(all.base, 6, res);
    for (size_t i = 0; i < 6; i++)
        assert_true(res[i]);
    kvt_region_cleanup(&all);
    kvt_region_cleanup(&r1);

    /* populate off: nothing is faulted in. */
    region_path(path, "nopopulate");
    cfg = cfg_of(path, 3, P, 2, KVT_REGION_RANK_ALL);
    cfg.populate = false;
    assert_int_equal(kvt_region_open(&cfg, &all), 0);
    residency(all.base, 6, res);
    for (size_t i = 0; i < 6; i++)
        if (on_tmpfs)
            assert_false(res[i]);
    kvt_region_cleanup(&all);
}

/* The smaps reader: a tmpfs mapping's ShmemPmdMapped, a hugetlbfs mapping (its
 * KernelPageSize) counted whole, a mapping that is not there, and the neighbours'
 * figures not taken. */
static void test_huge_bytes_from_smaps(void **state)
{
    static const char text[] =
        "7f0000000000-7f0000400000 rw-s 00000000 00:1a 11 /dev/shm/other\n"
        "Size:               4096 kB\n"
        "KernelPageSize:        4 kB\n"
        "ShmemPmdMapped:     4096 kB\n"
        "7f1000000000-7f1000800000 rw-s 00000000 00:1a 12 /dev/shm/kvtier-1.mmap\n"
        "Size:               8192 kB\n"
        "KernelPageSize:        4 kB\n"
        "AnonHugePages:         0 kB\n"
        "ShmemPmdMapped:     6144 kB\n"
        "FilePmdMapped:         0 kB\n"
        "VmFlags: rd wr sh mr mw me ms sd hg\n"
        "7f2000000000-7f2000800000 rw-s 00000000 00:2b 13 /dev/hugepages/kvtier-2.mmap\n"
        "Size:               8192 kB\n"
        "KernelPageSize:     2048 kB\n"
        "ShmemPmdMapped:        0 kB\n"
        "7f3000000000-7f3000800000 rw-s 00000000 00:1a 14 /dev/shm/small.mmap\n"
        "KernelPageSize:        4 kB\n"
        "ShmemPmdMapped:        0 kB\n"
        /* one region in two mappings (an mprotect in the middle), then a neighbour */
        "7f5000000000-7f5000400000 rw-s 00000000 00:1a 15 /dev/shm/split.mmap\n"
        "ShmemPmdMapped:     4096 kB\n"
        "7f5000400000-7f5000800000 r--s 00400000 00:1a 15 /dev/shm/split.mmap\n"
        "ShmemPmdMapped:     2048 kB\n"
        "7f5000800000-7f5000a00000 rw-p 00000000 00:00 0\n"
        "AnonHugePages:      2048 kB\n"
        "FilePmdMapped:      2048 kB\n";
    struct {
        uintptr_t base;
        int rc;
        size_t huge;
    } cases[] = {
        {0x7f1000000000, 0, 6u << 20}, {0x7f2000000000, 0, 8u << 20}, {0x7f3000000000, 0, 0},
        {0x7f4000000000, -ENOENT, 0},  {0x7f5000000000, 0, 6u << 20},
    };
    (void)state;
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        FILE *f = fmemopen((void *)text, sizeof(text) - 1, "r");
        size_t huge = 12345;

        assert_non_null(f);
        assert_int_equal(
            kvt_region_huge_bytes_from(f, (const void *)cases[i].base, 8u << 20, &huge),
            cases[i].rc);
        if (cases[i].rc == 0)
            assert_int_equal(huge, cases[i].huge);
        fclose(f);
    }
}

#define HUGE_CHILD_CANNOT 77 /* no shared-memory THP in this kernel, or not root */

/* One tmpfs mount of ours (mode: its options): a populated region on it, and whether
 * its huge bytes are as the mount says. 0, or the number of the check that failed;
 * the mount and the region are gone either way. */
static int huge_on_mount(const char *dir, const char *mode, bool want_none, bool want_some,
                         const char *setting)
{
    char path[PATH_MAX];
    struct kvt_region r;
    struct kvt_region_config cfg;
    size_t huge = 1;
    int rc, bad = 0;

    if (mount("tmpfs", dir, "tmpfs", 0, mode) != 0)
        return 2;
    snprintf(path, sizeof(path), "%s/r.mmap", dir);
    cfg = cfg_of(path, 8, 2u << 20, 1, KVT_REGION_RANK_ALL);
    if (kvt_region_open(&cfg, &r) != 0) {
        bad = 3;
    } else {
        rc = kvt_region_huge_bytes(&r, &huge);
        printf("# region on tmpfs %s (shmem_enabled %s): %zu of %zu bytes on huge pages\n", mode,
               setting, huge, r.size);
        fflush(stdout); /* the child ends with _exit */
        if (rc != 0 || huge > r.size || huge % (2u << 20) != 0)
            bad = 4;
        else if (want_none && huge != 0)
            bad = 5;
        else if (want_some && huge == 0)
            bad = 6;
        kvt_region_cleanup(&r);
    }
    if (umount(dir) != 0 && bad == 0)
        bad = 7;
    return bad;
}

/* In a child with a mount namespace of its own: a region on a tmpfs mounted
 * huge=never has no huge page, one mounted huge=advise has some (the region advises
 * them), unless shmem_enabled denies or forces them for every mount. */
static int huge_child(void)
{
    char dir[] = "/tmp/kvt-huge-XXXXXX", setting[256] = "";
    FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/shmem_enabled", "r");
    bool deny, force;
    int bad;

    if (f == NULL)
        return HUGE_CHILD_CANNOT;
    if (fgets(setting, sizeof(setting), f) == NULL)
        setting[0] = '\0';
    fclose(f);
    setting[strcspn(setting, "\n")] = '\0';
    deny = strstr(setting, "[deny]") != NULL;
    force = strstr(setting, "[force]") != NULL;
    if (unshare(CLONE_NEWNS) != 0 || mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0) {
        int e = errno;

        fprintf(stderr, "huge pages test: no mount namespace of our own: %s\n", strerror(e));
        return e == EPERM ? HUGE_CHILD_CANNOT : 1;
    }
    if (mkdtemp(dir) == NULL)
        return 1;
    bad = huge_on_mount(dir, "size=64m,huge=never", !force, false, setting);
    if (bad == 0)
        bad = huge_on_mount(dir, "size=64m,huge=advise", false, !deny, setting);
    if (rmdir(dir) != 0 && bad == 0)
        bad = 8;
    return bad;
}

static void test_huge_bytes_of_a_region(void **state)
{
    struct kvt_region r = {0};
    size_t huge = 0;
    int st = 0;
    pid_t pid;

    (void)state;
    fflush(stdout);
    pid = fork();
    assert_true(pid >= 0);
    if (pid == 0)
        _exit(huge_child());
    assert_int_equal(waitpid(pid, &st, 0), pid);
    assert_true(WIFEXITED(st));
    if (WEXITSTATUS(st) == HUGE_CHILD_CANNOT)
        skip(); /* said why on stderr: not root, or no shared-memory THP in this kernel */
    if (WEXITSTATUS(st) != 0)
        fail_msg("huge pages child: check %d failed", WEXITSTATUS(st));
    assert_int_equal(kvt_region_huge_bytes(&r, &huge), -EINVAL); /* not open */
}

/* ----- other users (a shared host) ----- */

/* A file at the region's path that is another user's (it made it first, in a
 * folder it can write) is never joined: nothing of it is mapped, it stays as it is. */
static void test_joiner_refuses_other_users_file(void **state)
{
    char path[PATH_MAX];
    struct kvt_region r;
    struct kvt_region_config cfg;
    struct stat st;
    int fd;
    (void)state;
    if (geteuid() != 0) {
        printf("# needs root (chown to another user): skipped\n");
        skip();
    }
    fd = open_scratch("theirs", path);
    assert_int_equal(ftruncate(fd, (off_t)(4 * P)), 0);
    assert_int_equal(pwrite(fd, "theirs", 6, 0), 6);
    assert_int_equal(fchown(fd, 65534, 65534), 0);
    cfg = cfg_of(path, 4, P, 1, 0);
    memset(&r, 0x5a, sizeof(r));
    assert_int_equal(kvt_region_open(&cfg, &r), -EPERM);
    assert_false(r.open);
    kvt_region_cleanup(&r);
    assert_int_equal(fstat(fd, &st), 0);
    assert_int_equal(st.st_uid, 65534);
    assert_int_equal(st.st_size, 4 * P);
    assert_true(path_exists(path));
    close(fd);
    unlink(path);
}

/* Our own file that group or others may use is refused too: KV in it is readable. */
static void test_joiner_refuses_open_mode(void **state)
{
    char path[PATH_MAX];
    struct kvt_region r;
    struct kvt_region_config cfg;
    int fd = open_scratch("mode", path);
    (void)state;
    assert_int_equal(ftruncate(fd, (off_t)(4 * P)), 0);
    assert_int_equal(fchmod(fd, 0644), 0);
    cfg = cfg_of(path, 4, P, 1, 0);
    assert_int_equal(kvt_region_open(&cfg, &r), -EPERM);
    assert_int_equal(fchmod(fd, 0600), 0);
    assert_int_equal(kvt_region_open(&cfg, &r), 0); /* the same file, private: joined */
    assert_false(r.creator);
    kvt_region_cleanup(&r);
    close(fd);
    unlink(path);
}

/* The daemon's open (exclusive) never joins: any existing file is -EEXIST, kept. */
static void test_exclusive_refuses_existing_file(void **state)
{
    char path[PATH_MAX];
    struct kvt_region r;
    struct kvt_region_config cfg;
    int fd = open_scratch("excl", path);
    (void)state;
    assert_int_equal(ftruncate(fd, (off_t)(4 * P)), 0);
    cfg = cfg_of(path, 4, P, 1, KVT_REGION_RANK_ALL);
    cfg.exclusive = true;
    assert_int_equal(kvt_region_open(&cfg, &r), -EEXIST);
    assert_false(r.open);
    assert_true(path_exists(path));
    close(fd);
    unlink(path);
    assert_int_equal(kvt_region_open(&cfg, &r), 0); /* gone: created */
    assert_true(r.creator);
    kvt_region_cleanup(&r);
    assert_false(path_exists(path));
}

/* A link at the region's path is never followed: its target is neither created nor
 * joined. */
static void test_symlink_refused(void **state)
{
    char path[PATH_MAX], target[PATH_MAX];
    struct kvt_region r;
    struct kvt_region_config cfg;
    int fd;
    (void)state;
    region_path(path, "link");
    region_path(target, "target");
    assert_int_equal(symlink(target, path), 0);
    cfg = cfg_of(path, 4, P, 1, 0);
    assert_int_equal(kvt_region_open(&cfg, &r), -ELOOP); /* dangling: not created */
    assert_false(path_exists(target));
    cfg.exclusive = true;
    assert_int_equal(kvt_region_open(&cfg, &r), -EEXIST);
    assert_false(path_exists(target));
    fd = open(target, O_CREAT | O_EXCL | O_RDWR, 0600); /* to an existing file: not joined */
    assert_true(fd >= 0);
    assert_int_equal(ftruncate(fd, (off_t)(4 * P)), 0);
    cfg.exclusive = false;
    assert_int_equal(kvt_region_open(&cfg, &r), -ELOOP);
    close(fd);
    unlink(target);
    unlink(path);
}

/* The creator removes only its own file: one that took its place is left alone. */
static void test_cleanup_leaves_replaced_file(void **state)
{
    char path[PATH_MAX], moved[PATH_MAX];
    struct kvt_region r;
    int fd;
    (void)state;
    region_path(path, "replaced");
    region_path(moved, "moved");
    make_region(&r, path, 4, P, 1, 0);
    assert_true(r.creator);
    assert_int_equal(rename(path, moved), 0);
    fd = open(path, O_CREAT | O_EXCL | O_RDWR, 0600);
    assert_true(fd >= 0);
    kvt_region_cleanup(&r);
    assert_true(path_exists(path)); /* not ours: kept */
    assert_true(path_exists(moved));
    close(fd);
    unlink(path);
    unlink(moved);
}

/* ----- fixture ----- */

static int group_setup(void **state)
{
    struct stat st;
    const char *base = getenv("KVT_TEST_TMPDIR");
    if ((base == NULL || base[0] == '\0') && stat("/dev/shm", &st) == 0 && S_ISDIR(st.st_mode))
        setenv("KVT_TEST_TMPDIR", "/dev/shm", 1);
    P = (size_t)sysconf(_SC_PAGESIZE);
    g_dir = kt_tmpdir("test_region");
    (void)kvt_log_get_level(); /* read the level once, before any thread logs */
    return g_dir == NULL ? -1 : 0;
}

/* Fails if any test left a file behind. */
static int group_teardown(void **state)
{
    DIR *d = opendir(g_dir);
    struct dirent *e;
    int left = 0;
    char p[PATH_MAX + 256];
    while (d != NULL && (e = readdir(d)) != NULL) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
            continue;
        fprintf(stderr, "left behind: %s/%s\n", g_dir, e->d_name);
        snprintf(p, sizeof(p), "%s/%s", g_dir, e->d_name);
        unlink(p);
        left++;
    }
    if (d != NULL)
        closedir(d);
    rmdir(g_dir);
    free(g_dir);
    return left == 0 ? 0 : -1;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_huge_bytes_from_smaps),
        cmocka_unit_test(test_huge_bytes_of_a_region),
        cmocka_unit_test(test_create_next_view_shape_and_stride),
        cmocka_unit_test(test_create_next_view_storage_offset_rank0),
        cmocka_unit_test(test_create_next_view_storage_offset_rank1),
        cmocka_unit_test(test_create_next_view_row_stride_with_multiple_workers),
        cmocka_unit_test(test_create_next_view_cursor_advances),
        cmocka_unit_test(test_create_next_view_exact_fill_succeeds),
        cmocka_unit_test(test_create_next_view_single_overflow_raises),
        cmocka_unit_test(test_create_next_view_cumulative_overflow_raises),
        cmocka_unit_test(test_create_next_view_overflow_does_not_mutate_cursor),
        cmocka_unit_test(test_create_next_view_write_visible_in_raw_mmap),
        cmocka_unit_test(test_create_next_view_multi_tensor_layout),
        cmocka_unit_test(test_create_next_view_multiprocess_slots),
        cmocka_unit_test(test_create_next_view_worker_isolation),
        cmocka_unit_test(test_creator_flag_set_on_first_open),
        cmocka_unit_test(test_insufficient_space_raises_clear_error),
        cmocka_unit_test(test_joiner_flag_not_set),
        cmocka_unit_test(test_file_exists_after_construction),
        cmocka_unit_test(test_file_has_correct_size),
        cmocka_unit_test(test_multi_worker_race_exactly_one_creator),
        cmocka_unit_test(test_multi_worker_race_shared_memory_visible),
        cmocka_unit_test(test_multiprocess_race_construct_and_write),
        cmocka_unit_test(test_cleanup_creator_all_effects),
        cmocka_unit_test(test_cleanup_non_creator_all_effects),
        cmocka_unit_test(test_cleanup_idempotent),
        cmocka_unit_test(test_cleanup_after_create_next_view_releases_mmap),
        cmocka_unit_test(test_wait_for_file_size_already_large_enough),
        cmocka_unit_test(test_wait_for_file_size_waits_for_grow),
        cmocka_unit_test(test_wait_for_file_size_timeout),
        cmocka_unit_test(test_joiner_times_out_when_file_never_sized),
        cmocka_unit_test(test_invalid_geometry_rejected),
        cmocka_unit_test(test_populate_prefaults_own_cells),
        cmocka_unit_test(test_joiner_refuses_other_users_file),
        cmocka_unit_test(test_joiner_refuses_open_mode),
        cmocka_unit_test(test_exclusive_refuses_existing_file),
        cmocka_unit_test(test_symlink_refused),
        cmocka_unit_test(test_cleanup_leaves_replaced_file),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}

/* SPDX-License-Identifier: Apache-2.0 */
/* Process-level tests of the storage tier (issue 7): what needs a real process death
 * or a real file system limit, beyond the unit tests' fault hook.
 *
 * - SIGKILL during write loops, 100 times: a forked child stores chunks in a loop
 *   (with evictions) and is killed at a random moment once it is writing; the tier
 *   is reopened on the folder: no temporary file is left, no file with a bad header
 *   was published, every indexed chunk loads with exactly the bytes it was stored
 *   with.
 * - ENOSPC on a small tmpfs mounted here: the stores that do not fit fail and count,
 *   no temporary file is left, what is stored keeps loading.
 * - A read-only remount while the tier runs, and a read-only root at start.
 *
 * Mounts: the process first moves into a mount namespace of its own (unshare,
 * propagation private), so a tmpfs it mounts is seen by nobody else and disappears
 * when the process exits, however it exits; each test also unmounts in its teardown.
 * Needs root (CAP_SYS_ADMIN): without it the tests fail, they never skip. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "test_util.h"

#include "kvt/hash.h"
#include "kvt/log.h"
#include "kvt/storage_tier.h"
#include "kvt/tier.h"

#define MAX_JOBS 1024
#define MAX_KEYS 8
#define LABEL    "1:storage"

struct result {
    int reported;
    bool success;
    size_t n_successful;
};

struct fx {
    char *root;
    bool mounted;
    struct kvt_storage_tier_config cfg;
    struct kvt_tier *t;
    uint8_t *mem;
    size_t row, nchunks;
    struct kvt_job jobs[MAX_JOBS];
    struct kvt_key keys[MAX_JOBS][MAX_KEYS];
    int64_t chunks[MAX_JOBS][MAX_KEYS];
    struct result res[MAX_JOBS];
    kvt_job_id_t next_id;
    struct kvt_stats stats;
};

static void on_result(void *arg, const struct kvt_job_result *r)
{
    struct fx *f = arg;
    assert_true(r->job_id > 0 && r->job_id < MAX_JOBS);
    f->res[r->job_id].reported++;
    f->res[r->job_id].success = r->success;
    f->res[r->job_id].n_successful = r->n_successful;
}

static void fill_row(uint8_t *dst, size_t len, const struct kvt_key *key)
{
    uint64_t x = kvt_hash64_seed(key->bytes, key->len, 7) | 1;
    for (size_t i = 0; i < len; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        dst[i] = (uint8_t)x;
    }
}

static bool row_is(const uint8_t *row, size_t len, const struct kvt_key *key)
{
    uint8_t *want = malloc(len);
    bool eq;
    assert_non_null(want);
    fill_row(want, len, key);
    eq = memcmp(row, want, len) == 0;
    free(want);
    return eq;
}

static uint8_t *slot(struct fx *f, int64_t c)
{
    assert_true(c >= 0 && (size_t)c < f->nchunks);
    return f->mem + (size_t)c * f->row;
}

static uint64_t rng_next(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static struct fx *fx_new(size_t row, size_t nchunks)
{
    struct fx *f = calloc(1, sizeof(*f));
    size_t bytes = ((row * nchunks + 4095) / 4096) * 4096;
    assert_non_null(f);
    f->root = kt_tmpdir("storage-proc");
    assert_non_null(f->root);
    f->row = row;
    f->nchunks = nchunks;
    f->mem = aligned_alloc(4096, bytes);
    assert_non_null(f->mem);
    memset(f->mem, 0, bytes);
    f->next_id = 1;
    kvt_stats_init(&f->stats);
    f->cfg.root = f->root;
    memset(f->cfg.namespace_id, 0x5a, sizeof(f->cfg.namespace_id));
    return f;
}

static int fx_open(struct fx *f)
{
    int rc = kvt_storage_tier_create(&f->cfg, &f->t);
    if (rc != 0)
        return rc;
    f->t->index = 0;
    f->t->row_bytes = f->row;
    f->t->primary_base = f->mem;
    f->t->num_chunks = f->nchunks;
    return 0;
}

static void fx_close(struct fx *f)
{
    if (f->t != NULL) {
        assert_int_equal(kvt_tier_shutdown(f->t), 0);
        kvt_tier_destroy(f->t);
        f->t = NULL;
    }
}

static void mount_tmpfs(struct fx *f, unsigned kib)
{
    char opts[64];
    snprintf(opts, sizeof(opts), "size=%uk,mode=0755", kib);
    if (mount("tmpfs", f->root, "tmpfs", 0, opts) != 0)
        fail_msg("cannot mount a %u KiB tmpfs at %s: %s (these tests need root)", kib, f->root,
                 strerror(errno));
    f->mounted = true;
}

static void fx_free(struct fx *f)
{
    char cmd[4200];
    fx_close(f);
    if (f->mounted && umount2(f->root, MNT_DETACH) != 0)
        fprintf(stderr, "umount %s: %s\n", f->root, strerror(errno));
    f->mounted = false;
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", f->root);
    if (system(cmd) != 0)
        fprintf(stderr, "cannot remove %s\n", f->root);
    kvt_stats_cleanup(&f->stats);
    free(f->mem);
    free(f->root);
    free(f);
}

/* Per-test fixture state for the teardown (runs even when an assertion fails). */
static int teardown(void **state)
{
    if (*state != NULL)
        fx_free(*state);
    *state = NULL;
    return 0;
}

static kvt_job_id_t submit(struct fx *f, bool load, const int *key_ids, const int64_t *chunks,
                           size_t n)
{
    kvt_job_id_t id = f->next_id++;
    struct kvt_job *j = &f->jobs[id];
    assert_true(id < MAX_JOBS && n <= MAX_KEYS);
    for (size_t i = 0; i < n; i++) {
        f->keys[id][i] = kt_key(key_ids[i]);
        f->chunks[id][i] = chunks[i];
    }
    *j = (struct kvt_job){
        .id = id, .n = n, .keys = f->keys[id], .chunk_ids = f->chunks[id], .is_promotion = load};
    memset(&f->res[id], 0, sizeof(f->res[id]));
    if (load)
        kvt_tier_submit_load(f->t, j);
    else
        kvt_tier_submit_store(f->t, j);
    return id;
}

static struct result *wait_job(struct fx *f, kvt_job_id_t id)
{
    for (int spins = 0; f->res[id].reported == 0; spins++) {
        assert_true(spins < 100);
        kvt_storage_tier_wait_idle(f->t);
        kvt_tier_get_finished_jobs(f->t, on_result, f);
    }
    assert_int_equal(f->res[id].reported, 1);
    return &f->res[id];
}

/* Stores kt_key(k) for each k from slot k (filled with the key's bytes). */
static kvt_job_id_t store_keys(struct fx *f, const int *key_ids, size_t n)
{
    int64_t chunks[MAX_KEYS];
    for (size_t i = 0; i < n; i++) {
        struct kvt_key k = kt_key(key_ids[i]);
        chunks[i] = key_ids[i];
        fill_row(slot(f, chunks[i]), f->row, &k);
    }
    return submit(f, false, key_ids, chunks, n);
}

/* Loads into the slots from `first` on (zeroed first). */
static kvt_job_id_t load_keys(struct fx *f, const int *key_ids, size_t n, int64_t first)
{
    int64_t chunks[MAX_KEYS];
    for (size_t i = 0; i < n; i++) {
        chunks[i] = first + (int64_t)i;
        memset(slot(f, chunks[i]), 0, f->row);
    }
    return submit(f, true, key_ids, chunks, n);
}

static double fx_stat(struct fx *f, const char *name)
{
    assert_int_equal(kvt_tier_get_stats(f->t, &f->stats), 0);
    return kvt_stats_value(&f->stats, name, LABEL);
}

static bool has(struct fx *f, int k)
{
    struct kvt_key key = kt_key(k);
    return kvt_storage_tier_has(f->t, &key);
}

static size_t count_tmp(const char *dir)
{
    char cmd[4300], line[64];
    FILE *p;
    size_t n = 0;
    snprintf(cmd, sizeof(cmd), "find '%s' -name '*.tmp' | wc -l", dir);
    p = popen(cmd, "r");
    assert_non_null(p);
    if (fgets(line, sizeof(line), p) != NULL)
        n = strtoul(line, NULL, 10);
    pclose(p);
    return n;
}

/* ---- SIGKILL during write loops ------------------------------------------------------ */

enum { KILL_ROW = 65536, KILL_KEYS = 200, KILL_CAP_FILES = 48, KILL_ROUNDS = 100 };

/* The child: opens the tier, fills its slots (each key its own slot, filled once, so
 * no slot changes under a write), tells the parent it is writing after its first
 * published job, and stores random keys (evicting) until it is killed. */
static void __attribute__((noreturn)) kill_child(struct fx *f, unsigned seed, int ready_fd)
{
    uint64_t rng = seed * 2654435761u + 1;
    bool told = false;
    alarm(30); /* never outlive the test */
    for (int k = 0; k < KILL_KEYS; k++) {
        struct kvt_key key = kt_key(k);
        fill_row(slot(f, k), f->row, &key);
    }
    if (fx_open(f) != 0)
        _exit(3);
    for (;;) {
        int keys[4];
        int64_t chunks[4];
        for (int i = 0; i < 4; i++)
            chunks[i] = keys[i] = (int)(rng_next(&rng) % KILL_KEYS);
        submit(f, false, keys, chunks, 4);
        if (f->next_id >= MAX_JOBS - 8) {
            kvt_storage_tier_wait_idle(f->t);
            kvt_tier_get_finished_jobs(f->t, on_result, f);
            f->next_id = 1;
        }
        kvt_tier_get_finished_jobs(f->t, on_result, f);
        if (!told && f->res[1].reported) {
            told = write(ready_fd, "w", 1) == 1;
            if (!told)
                _exit(4);
        }
    }
}

static void test_sigkill_during_write_loops(void **state)
{
    struct fx *f = fx_new(KILL_ROW, 2 * KILL_KEYS);
    uint64_t rng = 12345;
    size_t total_tmp = 0, max_found = 0, loaded = 0;
    *state = f;
    f->cfg.capacity_bytes = (uint64_t)KILL_CAP_FILES * (4096 + KILL_ROW);
    for (int round = 0; round < KILL_ROUNDS; round++) {
        struct kvt_storage_restart_info ri;
        struct timespec ts;
        struct pollfd pfd;
        int status, n = 0, pipefd[2];
        char c;
        pid_t pid;
        assert_int_equal(pipe(pipefd), 0);
        pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
            close(pipefd[0]);
            kill_child(f, (unsigned)round + 1, pipefd[1]);
        }
        close(pipefd[1]);
        /* Wait until it writes (30 s at most), then kill it 0..20 ms later. */
        pfd = (struct pollfd){.fd = pipefd[0], .events = POLLIN};
        assert_int_equal(poll(&pfd, 1, 30000), 1);
        assert_int_equal(read(pipefd[0], &c, 1), 1);
        close(pipefd[0]);
        ts.tv_sec = 0;
        ts.tv_nsec = (long)(rng_next(&rng) % 20000) * 1000;
        nanosleep(&ts, NULL);
        assert_int_equal(kill(pid, SIGKILL), 0);
        assert_int_equal(waitpid(pid, &status, 0), pid);
        assert_true(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);

        f->next_id = 1;
        assert_int_equal(fx_open(f), 0);
        kvt_storage_tier_restart_info(f->t, &ri);
        assert_int_equal(ri.bad_removed, 0); /* nothing partial was ever published */
        total_tmp += ri.tmp_removed;
        max_found = ri.files_found > max_found ? ri.files_found : max_found;
        assert_int_equal(count_tmp(kvt_storage_tier_dir(f->t)), 0);
        /* Every indexed chunk loads with its exact bytes, in batches of 8. */
        for (int k0 = 0; k0 < KILL_KEYS; k0 += 8) {
            int keys[8], m = 0;
            for (int k = k0; k < k0 + 8 && k < KILL_KEYS; k++)
                if (has(f, k))
                    keys[m++] = k;
            if (m == 0)
                continue;
            assert_true(wait_job(f, load_keys(f, keys, (size_t)m, KILL_KEYS))->success);
            for (int i = 0; i < m; i++) {
                struct kvt_key key = kt_key(keys[i]);
                assert_true(row_is(slot(f, KILL_KEYS + i), f->row, &key));
            }
            n += m;
        }
        assert_int_equal(n, ri.files_found - ri.evicted);
        loaded += (size_t)n;
        assert_int_equal(fx_stat(f, KVT_M_STORAGE_CHECKSUM_FAIL), 0);
        fx_close(f);
    }
    print_message("sigkill: %d kills, %zu temporary files cleaned, up to %zu files indexed, "
                  "%zu chunks verified\n",
                  KILL_ROUNDS, total_tmp, max_found, loaded);
    /* The kills landed while files were being written, and files were published. */
    assert_true(total_tmp > 0);
    assert_true(max_found > 0);
}

/* ---- a small tmpfs ----------------------------------------------------------------- */

/* 1 MiB holds three files of 4 KiB + 256 KiB: the fourth and fifth fail with ENOSPC. */
static void test_enospc_small_tmpfs(void **state)
{
    struct fx *f = fx_new(262144, 12);
    int keys[5] = {1, 2, 3, 4, 5};
    struct result *r;
    *state = f;
    mount_tmpfs(f, 1024);
    assert_int_equal(fx_open(f), 0);
    assert_true(wait_job(f, store_keys(f, keys, 3))->success);
    r = wait_job(f, store_keys(f, keys + 3, 2));
    assert_false(r->success);
    assert_int_equal(fx_stat(f, KVT_M_STORAGE_ENOSPC), 2);
    assert_int_equal(fx_stat(f, KVT_M_STORAGE_ERRORS), 2);
    assert_int_equal(fx_stat(f, KVT_M_STORAGE_STORED_CHUNKS), 3);
    assert_int_equal(fx_stat(f, KVT_M_STORAGE_USED_BYTES), 3 * (4096 + 262144));
    assert_false(has(f, 4));
    assert_false(has(f, 5));
    assert_int_equal(count_tmp(kvt_storage_tier_dir(f->t)), 0);
    /* It keeps serving what it has. */
    r = wait_job(f, load_keys(f, keys, 3, 6));
    assert_true(r->success);
    for (int i = 0; i < 3; i++) {
        struct kvt_key k = kt_key(keys[i]);
        assert_true(row_is(slot(f, 6 + i), f->row, &k));
    }
    /* With a capacity bound below the file system's size, eviction makes room
     * instead: the tier never runs into ENOSPC. */
    fx_close(f);
    f->cfg.capacity_bytes = 3 * (4096 + 262144);
    assert_int_equal(fx_open(f), 0);
    assert_true(wait_job(f, store_keys(f, keys + 3, 2))->success);
    kvt_storage_tier_wait_idle(f->t);
    assert_true(has(f, 4) && has(f, 5));
    assert_int_equal(fx_stat(f, KVT_M_STORAGE_EVICTIONS), 2);
    assert_int_equal(fx_stat(f, KVT_M_STORAGE_ENOSPC), 2); /* (summed) none since */
}

/* The root is remounted read-only while the tier runs: stores fail and count, loads
 * keep working; after a remount read-write it stores again. A read-only root at
 * start is a configuration error. */
static void test_read_only_root(void **state)
{
    struct fx *f = fx_new(8192, 16);
    int keys[2] = {1, 2};
    struct result *r;
    *state = f;
    mount_tmpfs(f, 4096);
    assert_int_equal(fx_open(f), 0);
    assert_true(wait_job(f, store_keys(f, keys, 2))->success);
    assert_int_equal(mount(NULL, f->root, NULL, MS_REMOUNT | MS_RDONLY, NULL), 0);
    r = wait_job(f, store_keys(f, (int[]){3}, 1));
    assert_false(r->success);
    assert_int_equal(fx_stat(f, KVT_M_STORAGE_ERRORS), 1);
    assert_false(has(f, 3));
    r = wait_job(f, load_keys(f, keys, 2, 8));
    assert_true(r->success);
    {
        struct kvt_tier *t2 = NULL;
        struct kvt_storage_tier_config c = f->cfg;
        memset(c.namespace_id, 0x55, sizeof(c.namespace_id)); /* a new folder */
        assert_int_equal(kvt_storage_tier_create(&c, &t2), -EROFS);
        assert_null(t2);
    }
    assert_int_equal(mount(NULL, f->root, NULL, MS_REMOUNT, NULL), 0);
    assert_true(wait_job(f, store_keys(f, (int[]){3}, 1))->success);
    assert_true(has(f, 3));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_sigkill_during_write_loops, teardown),
        cmocka_unit_test_teardown(test_enospc_small_tmpfs, teardown),
        cmocka_unit_test_teardown(test_read_only_root, teardown),
    };
    /* A mount namespace of our own: our mounts vanish with this process. */
    if (unshare(CLONE_NEWNS) != 0 || mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0) {
        fprintf(stderr,
                "test_storage_process: cannot make a private mount namespace: %s "
                "(needs root)\n",
                strerror(errno));
        return 1;
    }
    if (getenv("KVT_TEST_FILTER") != NULL)
        cmocka_set_test_filter(getenv("KVT_TEST_FILTER"));
    return cmocka_run_group_tests(tests, NULL, NULL);
}

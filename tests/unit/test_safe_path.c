/* SPDX-License-Identifier: Apache-2.0 */
/* Private folders and files on a shared host (common/safe_path.c): what
 * kvt_private_dir_open creates, what it accepts and what it refuses (another user's
 * folder, a folder others may write, a link as the last component, a link of another
 * user on the way, a parent another user could change), kvt_path_split and
 * kvt_private_file_check. "Another user" is uid/gid 65534 (nobody): the tests that
 * give a file to it need root (chown) and are skipped, reported as such, without. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "test_util.h"

#include "kvt/safe_path.h"

#define NOBODY 65534

static char *g_base;

static const struct kvt_dir_policy create_700 = {
    .mode = 0700, .gid = KVT_GROUP_NONE, .create = true};
static const struct kvt_dir_policy open_only = {
    .mode = 0700, .gid = KVT_GROUP_NONE, .create = false};

static char *path_of(const char *rel)
{
    static char buf[8][4096];
    static int next;
    char *b = buf[next++ % 8];
    snprintf(b, sizeof(buf[0]), "%s/%s", g_base, rel);
    return b;
}

static void need_root(void)
{
    if (geteuid() != 0) {
        printf("# needs root (chown to another user): skipped\n");
        skip();
    }
}

/* The fd names the folder at path. */
static void assert_fd_is(int fd, const char *path)
{
    struct stat a, b;
    assert_int_equal(fstat(fd, &a), 0);
    assert_int_equal(stat(path, &b), 0);
    assert_true(a.st_dev == b.st_dev && a.st_ino == b.st_ino);
}

static int open_dir(const char *path, const struct kvt_dir_policy *pol)
{
    int fd = -1, rc = kvt_private_dir_open(path, pol, &fd);
    if (rc == 0) {
        assert_true(fd >= 0);
        assert_fd_is(fd, path);
        close(fd);
    }
    return rc;
}

static void test_creates_missing_folders(void **state)
{
    struct stat st;
    mode_t old = umask(077); /* the last folder's mode does not depend on the umask */
    int fd = -1;
    (void)state;
    assert_int_equal(kvt_private_dir_open(path_of("new/a/b"), &create_700, &fd), 0);
    umask(old);
    assert_fd_is(fd, path_of("new/a/b"));
    assert_int_equal(stat(path_of("new/a/b"), &st), 0);
    assert_int_equal(st.st_mode & 07777, 0700);
    assert_int_equal(st.st_uid, geteuid());
    assert_int_equal(stat(path_of("new/a"), &st), 0);
    assert_true(S_ISDIR(st.st_mode));
    /* The fd is a real directory fd: names inside are opened relative to it. */
    {
        int f = openat(fd, "x", O_CREAT | O_WRONLY | O_NOFOLLOW, 0600);
        assert_true(f >= 0);
        close(f);
        assert_int_equal(access(path_of("new/a/b/x"), F_OK), 0);
    }
    close(fd);
    /* Opening it again: the same folder, nothing changed. */
    assert_int_equal(open_dir(path_of("new/a/b"), &open_only), 0);
    assert_int_equal(open_dir(path_of("new/a/b/"), &open_only), 0);
}

static void test_group_policy(void **state)
{
    const struct kvt_dir_policy pol = {.mode = 0750, .gid = 4242, .create = true};
    struct stat st;
    (void)state;
    need_root();
    assert_int_equal(open_dir(path_of("grp"), &pol), 0);
    assert_int_equal(stat(path_of("grp"), &st), 0);
    assert_int_equal(st.st_mode & 07777, 0750);
    assert_int_equal(st.st_gid, 4242);
}

/* An existing folder is checked, never re-moded: the path may be a system folder. */
static void test_existing_folder_kept_as_is(void **state)
{
    struct stat st;
    (void)state;
    assert_int_equal(mkdir(path_of("open"), 0755), 0);
    assert_int_equal(chmod(path_of("open"), 0755), 0);
    assert_int_equal(open_dir(path_of("open"), &create_700), 0);
    assert_int_equal(stat(path_of("open"), &st), 0);
    assert_int_equal(st.st_mode & 07777, 0755);
}

static void test_missing_without_create(void **state)
{
    (void)state;
    assert_int_equal(open_dir(path_of("absent/x"), &open_only), -ENOENT);
    assert_int_equal(access(path_of("absent"), F_OK), -1);
}

static void test_refuses_writable_folder(void **state)
{
    (void)state;
    assert_int_equal(mkdir(path_of("ww"), 0700), 0);
    assert_int_equal(chmod(path_of("ww"), 0777), 0);
    assert_int_equal(open_dir(path_of("ww"), &create_700), -EPERM);
    assert_int_equal(chmod(path_of("ww"), 01777), 0); /* sticky is no excuse for the last one */
    assert_int_equal(open_dir(path_of("ww"), &create_700), -EPERM);
    assert_int_equal(chmod(path_of("ww"), 0720), 0); /* group-writable */
    assert_int_equal(open_dir(path_of("ww"), &create_700), -EPERM);
}

static void test_refuses_other_users_folder(void **state)
{
    (void)state;
    need_root();
    assert_int_equal(mkdir(path_of("theirs"), 0700), 0);
    assert_int_equal(chown(path_of("theirs"), NOBODY, NOBODY), 0);
    assert_int_equal(open_dir(path_of("theirs"), &create_700), -EPERM);
    /* ... and anything below a parent of theirs, even our own folder. */
    assert_int_equal(mkdir(path_of("theirs/mine"), 0700), 0);
    assert_int_equal(open_dir(path_of("theirs/mine"), &create_700), -EPERM);
}

static void test_parent_rules(void **state)
{
    (void)state;
    /* A parent others may write: refused unless sticky (then others cannot rename
     * our names away). */
    assert_int_equal(mkdir(path_of("pw"), 0700), 0);
    assert_int_equal(chmod(path_of("pw"), 0777), 0);
    assert_int_equal(open_dir(path_of("pw/run"), &create_700), -EPERM);
    assert_int_equal(access(path_of("pw/run"), F_OK), -1); /* nothing created */
    assert_int_equal(chmod(path_of("pw"), 01777), 0);
    assert_int_equal(open_dir(path_of("pw/run"), &create_700), 0);
}

static void test_last_component_link_refused(void **state)
{
    (void)state;
    assert_int_equal(mkdir(path_of("real"), 0700), 0);
    assert_int_equal(symlink(path_of("real"), path_of("link")), 0);
    assert_int_equal(open_dir(path_of("link"), &create_700), -EPERM);
    /* A dangling link is not created through either. */
    assert_int_equal(symlink(path_of("nowhere"), path_of("dangling")), 0);
    assert_int_equal(open_dir(path_of("dangling"), &create_700), -EPERM);
    assert_int_equal(access(path_of("nowhere"), F_OK), -1);
}

/* A link on the way is followed when root or we own it (relative and absolute
 * targets, ".." inside), not when another user does. */
static void test_links_on_the_way(void **state)
{
    int fd = -1;
    (void)state;
    assert_int_equal(mkdir(path_of("t"), 0700), 0);
    assert_int_equal(mkdir(path_of("t/d"), 0700), 0);
    assert_int_equal(symlink("t", path_of("rel")), 0);
    assert_int_equal(symlink(path_of("t"), path_of("abs")), 0);
    assert_int_equal(symlink("../t/d/..", path_of("t/up")), 0);
    assert_int_equal(kvt_private_dir_open(path_of("rel/d"), &open_only, &fd), 0);
    assert_fd_is(fd, path_of("t/d"));
    close(fd);
    assert_int_equal(kvt_private_dir_open(path_of("abs/d"), &open_only, &fd), 0);
    assert_fd_is(fd, path_of("t/d"));
    close(fd);
    assert_int_equal(kvt_private_dir_open(path_of("t/up/d"), &open_only, &fd), 0);
    assert_fd_is(fd, path_of("t/d"));
    close(fd);
    if (geteuid() == 0) {
        assert_int_equal(lchown(path_of("rel"), NOBODY, NOBODY), 0);
        assert_int_equal(open_dir(path_of("rel/d"), &open_only), -EPERM);
    }
}

static void test_relative_path_and_dotdot(void **state)
{
    char cwd[4096];
    int fd = -1;
    (void)state;
    assert_non_null(getcwd(cwd, sizeof(cwd)));
    assert_int_equal(mkdir(path_of("cw"), 0700), 0);
    assert_int_equal(chdir(path_of("cw")), 0);
    assert_int_equal(kvt_private_dir_open("sub/../sub2", &open_only, &fd), -ENOENT);
    assert_int_equal(kvt_private_dir_open("sub2", &create_700, &fd), 0);
    close(fd);
    assert_int_equal(kvt_private_dir_open("./sub2/../sub2", &open_only, &fd), 0);
    assert_int_equal(chdir(cwd), 0);
    assert_fd_is(fd, path_of("cw/sub2"));
    close(fd);
    /* "." and ".." at the end name the folder reached and its parent. */
    assert_int_equal(chdir(path_of("cw/sub2")), 0);
    assert_int_equal(kvt_private_dir_open(".", &open_only, &fd), 0);
    assert_int_equal(chdir(cwd), 0);
    assert_fd_is(fd, path_of("cw/sub2"));
    close(fd);
    assert_int_equal(kvt_private_dir_open(path_of("cw/sub2/.."), &open_only, &fd), 0);
    assert_fd_is(fd, path_of("cw"));
    close(fd);
    assert_int_equal(chmod(path_of("cw"), 0777), 0);
    assert_int_equal(open_dir(path_of("cw/sub2/.."), &open_only), -EPERM);
    assert_int_equal(chmod(path_of("cw"), 0700), 0);
}

static void test_not_a_folder(void **state)
{
    int f = open(path_of("file"), O_CREAT | O_WRONLY, 0600);
    (void)state;
    assert_true(f >= 0);
    close(f);
    assert_int_equal(open_dir(path_of("file"), &create_700), -ENOTDIR);
    assert_int_equal(open_dir(path_of("file/x"), &create_700), -ENOTDIR);
}

static void test_path_split(void **state)
{
    char dir[64], base[32];
    (void)state;
    assert_int_equal(
        kvt_path_split("/run/kvtier/7/primary.mmap", dir, sizeof(dir), base, sizeof(base)), 0);
    assert_string_equal(dir, "/run/kvtier/7");
    assert_string_equal(base, "primary.mmap");
    assert_int_equal(kvt_path_split("/r.mmap", dir, sizeof(dir), base, sizeof(base)), 0);
    assert_string_equal(dir, "/");
    assert_string_equal(base, "r.mmap");
    assert_int_equal(kvt_path_split("r.mmap", dir, sizeof(dir), base, sizeof(base)), 0);
    assert_string_equal(dir, ".");
    assert_int_equal(kvt_path_split("/a//b//", dir, sizeof(dir), base, sizeof(base)), 0);
    assert_string_equal(dir, "/a");
    assert_string_equal(base, "b");
    assert_int_equal(kvt_path_split("/", dir, sizeof(dir), base, sizeof(base)), -EINVAL);
    assert_int_equal(kvt_path_split("", dir, sizeof(dir), base, sizeof(base)), -EINVAL);
    assert_int_equal(kvt_path_split("/a/..", dir, sizeof(dir), base, sizeof(base)), -EINVAL);
    assert_int_equal(kvt_path_split("/a/.", dir, sizeof(dir), base, sizeof(base)), -EINVAL);
    assert_int_equal(kvt_path_split("/a/0123456789012345678901234567890123456789", dir, sizeof(dir),
                                    base, sizeof(base)),
                     -ENAMETOOLONG);
}

static void test_private_file_check(void **state)
{
    struct stat st;
    int fd = open(path_of("f"), O_CREAT | O_RDWR, 0600);
    (void)state;
    assert_true(fd >= 0);
    assert_int_equal(fchmod(fd, 0600), 0);
    assert_int_equal(kvt_private_file_check(fd, "f", 0600, &st), 0);
    assert_true(S_ISREG(st.st_mode));
    assert_int_equal(fchmod(fd, 0644), 0);
    assert_int_equal(kvt_private_file_check(fd, "f", 0600, NULL), -EPERM);
    assert_int_equal(kvt_private_file_check(fd, "f", 0644, NULL), 0);
    if (geteuid() == 0) {
        assert_int_equal(fchmod(fd, 0600), 0);
        assert_int_equal(fchown(fd, NOBODY, NOBODY), 0);
        assert_int_equal(kvt_private_file_check(fd, "f", 0600, NULL), -EPERM);
    }
    close(fd);
    fd = open(g_base, O_RDONLY | O_DIRECTORY);
    assert_int_equal(kvt_private_file_check(fd, "base", 0777, NULL), -EPERM);
    close(fd);
}

static int setup(void **state)
{
    (void)state;
    g_base = kt_tmpdir("safe_path");
    return g_base == NULL ? -1 : 0;
}

static int teardown(void **state)
{
    char cmd[4200];
    (void)state;
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", g_base);
    free(g_base);
    return system(cmd) == 0 ? 0 : -1;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_creates_missing_folders, setup, teardown),
        cmocka_unit_test_setup_teardown(test_group_policy, setup, teardown),
        cmocka_unit_test_setup_teardown(test_existing_folder_kept_as_is, setup, teardown),
        cmocka_unit_test_setup_teardown(test_missing_without_create, setup, teardown),
        cmocka_unit_test_setup_teardown(test_refuses_writable_folder, setup, teardown),
        cmocka_unit_test_setup_teardown(test_refuses_other_users_folder, setup, teardown),
        cmocka_unit_test_setup_teardown(test_parent_rules, setup, teardown),
        cmocka_unit_test_setup_teardown(test_last_component_link_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(test_links_on_the_way, setup, teardown),
        cmocka_unit_test_setup_teardown(test_relative_path_and_dotdot, setup, teardown),
        cmocka_unit_test_setup_teardown(test_not_a_folder, setup, teardown),
        cmocka_unit_test_setup_teardown(test_path_split, setup, teardown),
        cmocka_unit_test_setup_teardown(test_private_file_check, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

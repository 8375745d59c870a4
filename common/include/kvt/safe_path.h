/* SPDX-License-Identifier: Apache-2.0 */
/* Directories and files a process keeps private on a host shared with other users.
 *
 * kvt_private_dir_open walks a path from "/" one component at a time (openat with
 * O_NOFOLLOW), so that nothing on the way can be swapped by another user:
 *   - every directory above the last one must be owned by root or by this process's
 *     effective user, and must not be writable by group or others unless it is sticky
 *     (/tmp, /dev/shm: others may add names there but not rename or remove ours);
 *   - a symbolic link on the way is followed only when root or this user owns it
 *     (it then sits in a directory that passed the rule above); the last component
 *     is never a link;
 *   - the last directory itself must be owned by this user and not be writable by
 *     group or others.
 * With create, missing directories are made: the parents 0755, the last one with the
 * policy's mode and group (set explicitly, so the umask does not matter). A directory
 * that already exists is checked, never re-moded: the path may name a system folder.
 *
 * Every refusal is -EPERM, logged once with the path and the cause; other failures
 * are the negative errno of the call that failed (-ENOENT without create, -EACCES...).
 * The fd returned is O_RDONLY | O_DIRECTORY | O_CLOEXEC: open what lives inside with
 * openat(fd, name, ... | O_NOFOLLOW). */
#ifndef KVT_SAFE_PATH_H
#define KVT_SAFE_PATH_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/stat.h>
#include <sys/types.h>

#define KVT_GROUP_NONE ((gid_t)-1)

struct kvt_dir_policy {
    mode_t mode; /* of the last directory when it is created here (e.g. 0700 or 0750) */
    gid_t gid;   /* its group when created here, or KVT_GROUP_NONE */
    bool create; /* create the last directory and missing parents */
};

/* 0 and *fd_p, or -EPERM (unsafe, logged), or another -errno (logged). */
int kvt_private_dir_open(const char *path, const struct kvt_dir_policy *pol, int *fd_p);

/* Splits path into its folder and last component (trailing slashes dropped): "/a/b"
 * -> "/a", "b"; "b" -> ".", "b". -EINVAL for "", "/" or a last component of "." or
 * "..", -ENAMETOOLONG when a part does not fit. */
int kvt_path_split(const char *path, char *dir, size_t dir_len, char *base, size_t base_len);

/* Checks an open file (fstat on fd): a regular file owned by this process's effective
 * user with no permission bits outside allowed (e.g. 0600). 0, or -EPERM with the
 * cause logged (what names the file in the message). *st_p is filled when not NULL. */
int kvt_private_file_check(int fd, const char *what, mode_t allowed, struct stat *st_p);

#endif

/* SPDX-License-Identifier: Apache-2.0 */
/* Private directories and files on a shared host (see kvt/safe_path.h for the rules).
 *
 * Why a walk of our own and not realpath() + checks: between a check by name and an
 * open by name another user may swap a component (the classic /tmp race). Holding
 * an fd to each directory and opening the next one relative to it with O_NOFOLLOW
 * means every check is made on the object that is then used. The walk keeps the
 * rest of the path in a buffer: a followed link splices its target in front of what
 * is left (an absolute target restarts at "/"), ".." goes to the parent of the
 * directory reached so far, and "shown" is the path as resolved, for messages. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvt/log.h"
#include "kvt/safe_path.h"

#define MOD       "path"
#define MAX_LINKS 40 /* the kernel's own limit on links followed in one lookup */

struct walk {
    char todo[PATH_MAX * 2]; /* what is left to walk */
    char shown[PATH_MAX];    /* what has been walked, resolved */
    int cur;                 /* O_PATH fd of the directory reached */
};

static void shown_push(struct walk *w, const char *comp, size_t len)
{
    size_t n = strlen(w->shown);

    if (n > 1 || (n == 1 && w->shown[0] != '/'))
        n += (size_t)snprintf(w->shown + n, sizeof(w->shown) - n, "/");
    snprintf(w->shown + n, sizeof(w->shown) - n, "%.*s", (int)len, comp);
}

static void shown_pop(struct walk *w)
{
    char *slash = strrchr(w->shown, '/');

    if (slash == NULL || slash == w->shown)
        snprintf(w->shown, sizeof(w->shown), "/");
    else
        *slash = '\0';
}

static int restart_at_root(struct walk *w)
{
    int fd = open("/", O_PATH | O_DIRECTORY | O_CLOEXEC);

    if (fd < 0)
        return -errno;
    if (w->cur >= 0)
        close(w->cur);
    w->cur = fd;
    snprintf(w->shown, sizeof(w->shown), "/");
    return 0;
}

/* A directory above the last one: nobody but root or us may change what is in it,
 * except where the sticky bit keeps others from renaming or removing our names. */
static int check_parent(const char *shown, const struct stat *st)
{
    uid_t me = geteuid();

    if (st->st_uid != 0 && st->st_uid != me) {
        kvt_error(MOD,
                  "%s is owned by uid %u (neither root nor uid %u): its owner could replace "
                  "anything below it; use a path whose every folder root or this user owns",
                  shown, (unsigned)st->st_uid, (unsigned)me);
        return -EPERM;
    }
    if ((st->st_mode & (S_IWGRP | S_IWOTH)) && !(st->st_mode & S_ISVTX)) {
        kvt_error(MOD,
                  "%s is writable by group or others (mode %04o) and not sticky: another user "
                  "could rename what is below it",
                  shown, (unsigned)(st->st_mode & 07777));
        return -EPERM;
    }
    return 0;
}

/* The last directory: ours, and only we may add or remove names in it. */
static int check_last(const char *shown, const struct stat *st)
{
    uid_t me = geteuid();

    if (st->st_uid != me) {
        kvt_error(MOD,
                  "%s is owned by uid %u, not by this process (uid %u): refusing to keep "
                  "private files in it (another user may have created it first; remove it or "
                  "choose another path)",
                  shown, (unsigned)st->st_uid, (unsigned)me);
        return -EPERM;
    }
    if (st->st_mode & (S_IWGRP | S_IWOTH)) {
        kvt_error(MOD,
                  "%s is writable by group or others (mode %04o): refusing to keep private "
                  "files in it (chmod go-w, or choose another path)",
                  shown, (unsigned)(st->st_mode & 07777));
        return -EPERM;
    }
    return 0;
}

/* Gives a directory we just made its mode and group, whatever the umask. */
static int set_mode(int fd, const char *shown, const struct kvt_dir_policy *pol)
{
    if (pol->gid != KVT_GROUP_NONE && fchown(fd, (uid_t)-1, pol->gid) != 0) {
        int rc = -errno;
        kvt_error(MOD, "%s: cannot give it group %u: %s", shown, (unsigned)pol->gid, strerror(-rc));
        return rc;
    }
    if (fchmod(fd, pol->mode) != 0) {
        int rc = -errno;
        kvt_error(MOD, "%s: chmod %04o: %s", shown, (unsigned)pol->mode, strerror(-rc));
        return rc;
    }
    return 0;
}

/* Replaces the component at todo[0..len) by the link's target. */
static int splice_link(struct walk *w, const char *comp, size_t len, char *rest)
{
    char name[NAME_MAX + 1], target[PATH_MAX], tail[sizeof(w->todo)];
    ssize_t n;

    snprintf(name, sizeof(name), "%.*s", (int)len, comp);
    n = readlinkat(w->cur, name, target, sizeof(target) - 1);
    if (n < 0)
        return -errno;
    target[n] = '\0';
    snprintf(tail, sizeof(tail), "%s", rest);
    if ((size_t)snprintf(w->todo, sizeof(w->todo), "%s/%s", target, tail) >= sizeof(w->todo))
        return -ENAMETOOLONG;
    return target[0] == '/' ? restart_at_root(w) : 0;
}

int kvt_private_dir_open(const char *path, const struct kvt_dir_policy *pol, int *fd_p)
{
    struct walk w = {.cur = -1};
    char cwd[PATH_MAX];
    unsigned links = 0;
    struct stat st;
    int rc;

    if (path == NULL || path[0] == '\0' || pol == NULL || fd_p == NULL)
        return -EINVAL;
    if (path[0] != '/' && getcwd(cwd, sizeof(cwd)) == NULL)
        return -errno;
    if ((size_t)snprintf(w.todo, sizeof(w.todo), "%s/%s", path[0] == '/' ? "" : cwd, path) >=
        sizeof(w.todo))
        return -ENAMETOOLONG;
    rc = restart_at_root(&w);
    if (rc < 0)
        return rc;
    if (fstat(w.cur, &st) != 0 || (rc = check_parent("/", &st)) < 0) {
        rc = rc < 0 ? rc : -errno;
        goto out;
    }
    for (char *p = w.todo;;) {
        char name[NAME_MAX + 1], *comp, *rest;
        bool last, made = false;
        size_t len;
        int nfd;

        rc = 0;
        while (*p == '/')
            p++;
        if (*p == '\0') { /* "/" itself: no folder of ours to own */
            kvt_error(MOD, "%s: name the directory itself", path);
            rc = -EINVAL;
            goto out;
        }
        comp = p;
        len = strcspn(p, "/");
        rest = p + len;
        last = rest[strspn(rest, "/")] == '\0';
        p = rest;
        if (len > NAME_MAX) {
            rc = -ENAMETOOLONG;
            goto out;
        }
        snprintf(name, sizeof(name), "%.*s", (int)len, comp);
        if (strcmp(name, ".") == 0 && !last)
            continue;
        if (strcmp(name, "..") == 0 && !last) {
            nfd = openat(w.cur, "..", O_PATH | O_DIRECTORY | O_CLOEXEC);
            if (nfd < 0) {
                rc = -errno;
                goto out;
            }
            close(w.cur);
            w.cur = nfd;
            shown_pop(&w);
            if (fstat(w.cur, &st) != 0) {
                rc = -errno;
                goto out;
            }
            rc = check_parent(w.shown, &st);
            if (rc < 0)
                goto out;
            continue;
        }
        if (strcmp(name, ".") == 0 || strcmp(name, "..") == 0) {
            /* The last folder is the one reached (".", e.g. the working folder of a
             * relative file name) or its parent: checked as the last one. */
            nfd = openat(w.cur, name, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
            if (nfd < 0 || fstat(nfd, &st) != 0) {
                rc = -errno;
                if (nfd >= 0)
                    close(nfd);
                goto out;
            }
            if (name[1] == '.')
                shown_pop(&w);
            rc = check_last(w.shown, &st);
            if (rc < 0) {
                close(nfd);
                goto out;
            }
            *fd_p = nfd;
            goto out;
        }
        shown_push(&w, name, len);
        if (fstatat(w.cur, name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
            rc = -errno;
            if (rc != -ENOENT || !pol->create) {
                kvt_error(MOD, "%s: %s", w.shown, strerror(-rc));
                goto out;
            }
            rc = 0;
            if (mkdirat(w.cur, name, last ? 0700 : 0755) == 0) {
                made = last;
            } else if (errno != EEXIST) {
                rc = -errno;
                kvt_error(MOD, "cannot create %s: %s", w.shown, strerror(-rc));
                goto out;
            }
            if (fstatat(w.cur, name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
                rc = -errno;
                kvt_error(MOD, "%s: %s", w.shown, strerror(-rc));
                goto out;
            }
        }
        if (S_ISLNK(st.st_mode)) {
            if (last) {
                kvt_error(MOD, "%s is a symbolic link: refusing it (name the directory itself)",
                          w.shown);
                rc = -EPERM;
                goto out;
            }
            if (st.st_uid != 0 && st.st_uid != geteuid()) {
                kvt_error(MOD, "%s is a symbolic link owned by uid %u: not following it", w.shown,
                          (unsigned)st.st_uid);
                rc = -EPERM;
                goto out;
            }
            if (++links > MAX_LINKS) {
                rc = -ELOOP;
                kvt_error(MOD, "%s: too many symbolic links", path);
                goto out;
            }
            shown_pop(&w);
            rc = splice_link(&w, comp, len, rest);
            if (rc < 0) {
                kvt_error(MOD, "%s: following a link: %s", path, strerror(-rc));
                goto out;
            }
            p = w.todo;
            continue;
        }
        if (!S_ISDIR(st.st_mode)) {
            kvt_error(MOD, "%s is not a directory", w.shown);
            rc = -ENOTDIR;
            goto out;
        }
        nfd =
            openat(w.cur, name, (last ? O_RDONLY : O_PATH) | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (nfd < 0) {
            rc = -errno;
            kvt_error(MOD, "%s: %s", w.shown, strerror(-rc));
            goto out;
        }
        if (fstat(nfd, &st) != 0) {
            rc = -errno;
            close(nfd);
            goto out;
        }
        if (last && made) {
            rc = set_mode(nfd, w.shown, pol);
            if (rc == 0 && fstat(nfd, &st) != 0)
                rc = -errno;
        }
        if (rc == 0)
            rc = last ? check_last(w.shown, &st) : check_parent(w.shown, &st);
        if (rc < 0) {
            close(nfd);
            goto out;
        }
        if (last) {
            if (made)
                kvt_info(MOD, "created %s (mode %04o)", w.shown, (unsigned)(st.st_mode & 07777));
            *fd_p = nfd;
            goto out;
        }
        close(w.cur);
        w.cur = nfd;
    }
out:
    if (w.cur >= 0)
        close(w.cur);
    return rc;
}

int kvt_path_split(const char *path, char *dir, size_t dir_len, char *base, size_t base_len)
{
    size_t end, start;

    if (path == NULL)
        return -EINVAL;
    end = strlen(path);
    while (end > 1 && path[end - 1] == '/')
        end--;
    start = end;
    while (start > 0 && path[start - 1] != '/')
        start--;
    if (end == start || (end - start == 1 && path[start] == '.') ||
        (end - start == 2 && path[start] == '.' && path[start + 1] == '.'))
        return -EINVAL;
    if (end - start >= base_len)
        return -ENAMETOOLONG;
    memcpy(base, path + start, end - start);
    base[end - start] = '\0';
    if (start == 0) {
        if (dir_len < 2)
            return -ENAMETOOLONG;
        memcpy(dir, ".", 2);
        return 0;
    }
    /* The folder: everything before the last component, without its trailing slashes
     * (but "/" stays "/"). */
    while (start > 1 && path[start - 1] == '/')
        start--;
    if (start >= dir_len)
        return -ENAMETOOLONG;
    memcpy(dir, path, start);
    dir[start] = '\0';
    return 0;
}

int kvt_private_file_check(int fd, const char *what, mode_t allowed, struct stat *st_p)
{
    struct stat st;
    uid_t me = geteuid();

    if (fstat(fd, &st) != 0) {
        int rc = -errno;
        kvt_error(MOD, "%s: fstat: %s", what, strerror(-rc));
        return rc;
    }
    if (!S_ISREG(st.st_mode)) {
        kvt_error(MOD, "%s is not a regular file: refusing it", what);
        return -EPERM;
    }
    if (st.st_uid != me) {
        kvt_error(MOD, "%s is owned by uid %u, not by this process (uid %u): refusing it", what,
                  (unsigned)st.st_uid, (unsigned)me);
        return -EPERM;
    }
    if (st.st_mode & 07777 & ~allowed) {
        kvt_error(MOD, "%s has mode %04o (at most %04o expected): refusing it", what,
                  (unsigned)(st.st_mode & 07777), (unsigned)allowed);
        return -EPERM;
    }
    if (st_p != NULL)
        *st_p = st;
    return 0;
}

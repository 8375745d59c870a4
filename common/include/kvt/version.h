/* SPDX-License-Identifier: Apache-2.0 */
/* The version of kvtier a binary was built from: the project version (CMake's
 * project VERSION) and the git revision of the source tree when it was built.
 * Every program prints kvt_version_string() for --version. The definitions are
 * generated at build time (cmake/KvtVersion.cmake) into the kvt_version library,
 * which only programs link, so a new commit relinks them and nothing else. */
#ifndef KVT_VERSION_H
#define KVT_VERSION_H

/* "0.1.0" */
const char *kvt_version(void);
/* "1a2b3c4d", "1a2b3c4d, dirty" (tracked files changed), what -DKVT_GIT_REVISION
 * gave for a tree without its own .git, or "unknown". */
const char *kvt_git_revision(void);
/* "0.1.0 (git 1a2b3c4d, dirty)": what `<program> --version` prints after its name. */
const char *kvt_version_string(void);

#endif

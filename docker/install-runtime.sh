#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# The runtime image's install step (docker/README.md). The Dockerfile's runtime stage
# runs it on debian:12 with the package the builder made; tests/docker/test_rootfs.sh
# runs the same script in a Debian 12 root made with debootstrap, so the root that
# test starts nodes in is built the way the image is.
#
#   install-runtime.sh KVTIER_DEB
#
# - the user and group kvtier with fixed numbers (KVT_UID, KVT_GID [970]) before the
#   package, whose postinst keeps an existing user: engine containers are given the
#   group by number (compose's group_add), so it must not depend on the order in
#   which useradd happened to run;
# - apt-get install of the package (its Depends: the libraries the programs link)
#   and of what the entrypoint runs: tini (PID 1: reaps, forwards SIGTERM), setpriv
#   (util-linux, in every Debian), curl (the healthcheck), iproute2 (ip, rdma),
#   ibverbs-providers (rxe) and ibverbs-utils (ibv_devinfo) for soft-RoCE, python3
#   for engines that use the Python module, ucx-utils (ucx_info, to diagnose UCX);
# - the folders the entrypoint prepares at each start (volumes mount over them).
# KVT_APT_UPDATE=0 skips `apt-get update`, KVT_APT_CLEAN=0 keeps apt's lists and
# downloads (the test's root shares them with its cache).
set -eu
deb=${1:?usage: install-runtime.sh KVTIER_DEB}
uid=${KVT_UID:-970}
gid=${KVT_GID:-970}

groupadd --system --gid "$gid" kvtier
useradd --system --uid "$uid" --gid kvtier --home-dir /var/lib/kvtier --no-create-home \
    --shell /usr/sbin/nologin --comment "kvtier node daemon" kvtier

export DEBIAN_FRONTEND=noninteractive
[ "${KVT_APT_UPDATE:-1}" = 0 ] || apt-get update -qq
apt-get install -y -q --no-install-recommends "$deb" \
    tini curl iproute2 ibverbs-providers ibverbs-utils python3 ucx-utils
if [ "${KVT_APT_CLEAN:-1}" != 0 ]; then
    apt-get clean
    rm -rf /var/lib/apt/lists/*
fi

# The package's own folders are made by systemd-tmpfiles, which a container lacks.
install -d -m 0750 -o kvtier -g kvtier /run/kvtier
install -d -m 0700 -o kvtier -g kvtier /var/lib/kvtier
# What the image holds, for `docker run ... kvtierd --version` and the test.
kvtierd --version

/* SPDX-License-Identifier: Apache-2.0 */
/* The UCX backend's GID choice over soft-RoCE (kvt__ucx_softroce_gid in
 * transport/ucx/ucx.c), on fake sysfs class/infiniband trees: UCX 1.13's ud_verbs,
 * which wires rc lanes up from worker addresses, connects between two soft-RoCE hosts
 * only over the link-local RoCE v2 GID, so the backend hands UCX that index when every
 * device is soft-RoCE, and nothing otherwise (hardware, a mix, ports that disagree, no
 * such GID). The real tree is checked across two guests by
 * rdma_conformance_ucx_rc_verbs_two_guests. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "test_util.h"

#ifdef KVT_HAVE_UCX
int kvt__ucx_softroce_gid(const char *root);

static void put(const char *root, const char *rel, const char *text)
{
    char path[512], dir[512];

    snprintf(path, sizeof(path), "%s/%s", root, rel);
    /* mkdir -p of the file's folder */
    snprintf(dir, sizeof(dir), "%s", path);
    for (char *p = dir + strlen(root) + 1; *p != '\0'; p++) {
        if (*p != '/')
            continue;
        *p = '\0';
        if (mkdir(dir, 0700) < 0 && errno != EEXIST)
            fail_msg("mkdir %s: %s", dir, strerror(errno));
        *p = '/';
    }
    FILE *f = fopen(path, "w");

    assert_non_null(f);
    fprintf(f, "%s\n", text);
    fclose(f);
}

/* A device: soft-RoCE (a "parent" netdev) or hardware, one port with the GIDs given
 * ("gid|type" each, by index). */
static void device(const char *root, const char *name, bool soft, const char *const *gids, int n)
{
    char rel[256];

    snprintf(rel, sizeof(rel), "%s/node_type", name);
    put(root, rel, "1: CA");
    if (soft) {
        snprintf(rel, sizeof(rel), "%s/parent", name);
        put(root, rel, "eth0");
    }
    for (int i = 0; i < n; i++) {
        char gid[64];
        const char *bar = strchr(gids[i], '|');

        snprintf(gid, sizeof(gid), "%.*s", (int)(bar - gids[i]), gids[i]);
        snprintf(rel, sizeof(rel), "%s/ports/1/gids/%d", name, i);
        put(root, rel, gid);
        snprintf(rel, sizeof(rel), "%s/ports/1/gid_attrs/types/%d", name, i);
        put(root, rel, bar + 1);
    }
}

static const char *const rxe_gids[] = {
    "fe80:0000:0000:0000:5054:00ff:fe77:0001|RoCE v2",
    "0000:0000:0000:0000:0000:ffff:0a4d:0001|RoCE v2",
};

static char *fresh(const char *name)
{
    char *root = kt_tmpdir(name);

    assert_non_null(root);
    return root;
}

static void test_rxe_link_local(void **state)
{
    char *root = fresh("gid_rxe");

    device(root, "rxe0", true, rxe_gids, 2);
    assert_int_equal(kvt__ucx_softroce_gid(root), 0);
    /* The link-local GID at another index: that index. */
    static const char *const later[] = {
        "0000:0000:0000:0000:0000:ffff:0a4d:0001|RoCE v2",
        "fe80:0000:0000:0000:5054:00ff:fe77:0001|RoCE v1",
        "fe80:0000:0000:0000:5054:00ff:fe77:0001|RoCE v2",
    };
    char *r2 = fresh("gid_rxe2");

    device(r2, "rxe0", true, later, 3);
    assert_int_equal(kvt__ucx_softroce_gid(r2), 2);
    free(root);
    free(r2);
}

static void test_not_soft_roce(void **state)
{
    char *hw = fresh("gid_hw"), *mix = fresh("gid_mix"), *none = fresh("gid_none");

    device(hw, "mlx5_0", false, rxe_gids, 2);
    assert_int_equal(kvt__ucx_softroce_gid(hw), -1);
    device(mix, "rxe0", true, rxe_gids, 2);
    device(mix, "mlx5_0", false, rxe_gids, 2);
    assert_int_equal(kvt__ucx_softroce_gid(mix), -1);
    assert_int_equal(kvt__ucx_softroce_gid(none), -1); /* no device */
    char missing[600];

    snprintf(missing, sizeof(missing), "%s/absent", none);
    assert_int_equal(kvt__ucx_softroce_gid(missing), -1);
    free(hw);
    free(mix);
    free(none);
}

static void test_ports_disagree_or_no_gid(void **state)
{
    static const char *const v4only[] = {"0000:0000:0000:0000:0000:ffff:0a4d:0001|RoCE v2"};
    static const char *const swapped[] = {
        "0000:0000:0000:0000:0000:ffff:0a4d:0002|RoCE v2",
        "fe80:0000:0000:0000:5054:00ff:fe77:0002|RoCE v2",
    };
    char *a = fresh("gid_v4"), *b = fresh("gid_disagree");

    device(a, "rxe0", true, v4only, 1);
    assert_int_equal(kvt__ucx_softroce_gid(a), -1);
    device(b, "rxe0", true, rxe_gids, 2);
    device(b, "rxe1", true, swapped, 2);
    assert_int_equal(kvt__ucx_softroce_gid(b), -1);
    free(a);
    free(b);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rxe_link_local),
        cmocka_unit_test(test_not_soft_roce),
        cmocka_unit_test(test_ports_disagree_or_no_gid),
    };

    return cmocka_run_group_tests(tests, NULL, NULL);
}
#else
static void test_no_ucx(void **state)
{
    skip(); /* reported as skipped: the UCX backend is not in this build */
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_no_ucx)};

    return cmocka_run_group_tests(tests, NULL, NULL);
}
#endif

/* SPDX-License-Identifier: Apache-2.0 */
/* The member table: joins, heartbeats, failure detection, restarts, the epoch and the
 * event ring. Time is the explicit now argument (members never reads the clock). */
#include <errno.h>
#include <stdint.h>
#include <string.h>

#include "test_util.h"
#include "kvt/log.h"
#include "kvt/members.h"

#define MS       1000000ull
#define INTERVAL (100 * MS)
#define K        3
#define SELF     50

static struct kvt_members *mk(void)
{
    struct kvt_members *m = NULL;

    assert_int_equal(kvt_members_create(SELF, 7, INTERVAL, K, &m), 0);
    assert_non_null(m);
    return m;
}

/* Takes exactly one pending event and checks it. */
static void expect_event(struct kvt_members *m, enum kvt_member_event_kind kind, uint64_t id,
                         uint64_t inc, uint64_t old_inc)
{
    struct kvt_member_event ev[2];

    assert_int_equal(kvt_members_take_events(m, ev, 2), 1);
    assert_int_equal(ev[0].kind, kind);
    assert_int_equal(ev[0].node_id, id);
    assert_int_equal(ev[0].incarnation, inc);
    assert_int_equal(ev[0].old_incarnation, old_inc);
}

static void expect_no_event(struct kvt_members *m)
{
    struct kvt_member_event ev[1];

    assert_int_equal(kvt_members_take_events(m, ev, 1), 0);
}

static void test_members_join(void **state)
{
    struct kvt_members *m = mk();
    const struct kvt_member *x;

    assert_int_equal(kvt_members_self(m), SELF);
    assert_int_equal(kvt_members_epoch(m), 0);
    assert_int_equal(kvt_members_count(m, KVT_MEMBER_ALIVE), 0);
    assert_null(kvt_members_find(m, 10));
    expect_no_event(m);

    assert_int_equal(kvt_members_heard(m, 10, 3, "10.0.0.1", 7000, 5 * MS), 0);
    expect_event(m, KVT_MEMBER_JOINED, 10, 3, 0);
    assert_int_equal(kvt_members_epoch(m), 1);
    x = kvt_members_find(m, 10);
    assert_non_null(x);
    assert_int_equal(x->node_id, 10);
    assert_int_equal(x->incarnation, 3);
    assert_string_equal(x->addr, "10.0.0.1");
    assert_int_equal(x->port, 7000);
    assert_int_equal(x->state, KVT_MEMBER_ALIVE);
    assert_int_equal(x->last_heard_ns, 5 * MS);
    assert_true(kvt_members_is_live(m, 10, 3));
    assert_false(kvt_members_is_live(m, 10, 2));
    assert_false(kvt_members_is_live(m, 11, 3));
    assert_true(kvt_members_is_live(m, SELF, 7));
    assert_false(kvt_members_is_live(m, SELF, 8));
    assert_int_equal(kvt_members_count(m, KVT_MEMBER_ALIVE), 1);
    assert_int_equal(kvt_members_count(m, KVT_MEMBER_DOWN), 0);

    /* A heartbeat without an address keeps the known one; a new one replaces it. */
    assert_int_equal(kvt_members_heard(m, 10, 3, NULL, 0, 6 * MS), 0);
    assert_string_equal(x->addr, "10.0.0.1");
    assert_int_equal(x->port, 7000);
    assert_int_equal(kvt_members_heard(m, 10, 3, "10.0.0.9", 7001, 7 * MS), 0);
    assert_string_equal(x->addr, "10.0.0.9");
    assert_int_equal(x->port, 7001);
    assert_int_equal(x->last_heard_ns, 7 * MS);
    expect_no_event(m);
    assert_int_equal(kvt_members_epoch(m), 1);
    kvt_members_destroy(m);
}

static void test_members_refuses_self_and_bad_config(void **state)
{
    struct kvt_members *m = mk(), *n = NULL;

    assert_int_equal(kvt_members_heard(m, SELF, 7, "x", 1, 0), -EINVAL);
    assert_int_equal(kvt_members_heard(m, SELF, 9, "x", 1, 0), -EINVAL);
    assert_null(kvt_members_find(m, SELF));
    assert_int_equal(kvt_members_epoch(m), 0);
    expect_no_event(m);
    /* Marking ourselves or a stranger down changes nothing. */
    kvt_members_mark_down(m, SELF);
    kvt_members_mark_down(m, 12345);
    assert_int_equal(kvt_members_epoch(m), 0);
    expect_no_event(m);
    kvt_members_destroy(m);

    assert_int_equal(kvt_members_create(1, 1, 0, K, &n), -EINVAL);
    assert_int_equal(kvt_members_create(1, 1, INTERVAL, 0, &n), -EINVAL);
    assert_int_equal(kvt_members_create(1, 1, UINT64_MAX / 2, 3, &n), -EINVAL);
    assert_null(n);
}

/* Heartbeats every interval keep a member alive forever. */
static void test_members_heartbeat_keeps_alive(void **state)
{
    struct kvt_members *m = mk();

    assert_int_equal(kvt_members_heard(m, 10, 1, "a", 1, 0), 0);
    expect_event(m, KVT_MEMBER_JOINED, 10, 1, 0);
    for (uint64_t t = INTERVAL; t <= 100 * INTERVAL; t += INTERVAL) {
        assert_int_equal(kvt_members_heard(m, 10, 1, NULL, 0, t), 0);
        kvt_members_tick(m, t + INTERVAL / 2);
        assert_true(kvt_members_is_live(m, 10, 1));
    }
    expect_no_event(m);
    assert_int_equal(kvt_members_epoch(m), 1);
    kvt_members_destroy(m);
}

/* Down once more than k intervals passed since last heard, not at exactly k; a
 * clock that went backwards marks nobody down. */
static void test_members_down_after_k_missed(void **state)
{
    struct kvt_members *m = mk();
    const uint64_t t0 = 1000 * MS;

    assert_int_equal(kvt_members_heard(m, 10, 1, "a", 1, t0), 0);
    assert_int_equal(kvt_members_heard(m, 20, 1, "b", 1, t0), 0);
    kvt_members_take_events(m, (struct kvt_member_event[2]){0}, 2);
    assert_int_equal(kvt_members_epoch(m), 2);

    kvt_members_tick(m, t0 - 10 * INTERVAL);
    kvt_members_tick(m, t0 + (K - 1) * INTERVAL);
    assert_int_equal(kvt_members_heard(m, 20, 1, NULL, 0, t0 + (K - 1) * INTERVAL), 0);
    kvt_members_tick(m, t0 + K * INTERVAL);
    assert_true(kvt_members_is_live(m, 10, 1));
    expect_no_event(m);
    assert_int_equal(kvt_members_epoch(m), 2);

    kvt_members_tick(m, t0 + K * INTERVAL + 1);
    assert_false(kvt_members_is_live(m, 10, 1));
    assert_int_equal(kvt_members_find(m, 10)->state, KVT_MEMBER_DOWN);
    assert_true(kvt_members_is_live(m, 20, 1));
    expect_event(m, KVT_MEMBER_DOWN_EV, 10, 1, 0);
    assert_int_equal(kvt_members_epoch(m), 3);
    assert_int_equal(kvt_members_count(m, KVT_MEMBER_ALIVE), 1);
    assert_int_equal(kvt_members_count(m, KVT_MEMBER_DOWN), 1);

    /* Later ticks report 20 (heard later) but not 10 again. */
    kvt_members_tick(m, t0 + 50 * INTERVAL);
    expect_event(m, KVT_MEMBER_DOWN_EV, 20, 1, 0);
    assert_int_equal(kvt_members_epoch(m), 4);
    kvt_members_tick(m, t0 + 60 * INTERVAL);
    expect_no_event(m);
    assert_int_equal(kvt_members_epoch(m), 4);

    /* Heard again with the same incarnation: back, as a JOINED. */
    assert_int_equal(kvt_members_heard(m, 10, 1, NULL, 0, t0 + 61 * INTERVAL), 0);
    expect_event(m, KVT_MEMBER_JOINED, 10, 1, 0);
    assert_int_equal(kvt_members_epoch(m), 5);
    assert_true(kvt_members_is_live(m, 10, 1));
    kvt_members_destroy(m);
}

static void test_members_restart_with_new_incarnation(void **state)
{
    struct kvt_members *m = mk();

    assert_int_equal(kvt_members_heard(m, 10, 4, "a", 1, 0), 0);
    expect_event(m, KVT_MEMBER_JOINED, 10, 4, 0);
    assert_int_equal(kvt_members_heard(m, 10, 9, "a2", 2, MS), 0);
    expect_event(m, KVT_MEMBER_RESTARTED, 10, 9, 4);
    assert_int_equal(kvt_members_epoch(m), 2);
    assert_true(kvt_members_is_live(m, 10, 9));
    assert_false(kvt_members_is_live(m, 10, 4));
    assert_string_equal(kvt_members_find(m, 10)->addr, "a2");
    assert_int_equal(kvt_members_count(m, KVT_MEMBER_ALIVE), 1);

    /* Restarted while down: one RESTARTED, alive again. */
    kvt_members_mark_down(m, 10);
    expect_event(m, KVT_MEMBER_DOWN_EV, 10, 9, 0);
    assert_int_equal(kvt_members_heard(m, 10, 10, NULL, 0, 2 * MS), 0);
    expect_event(m, KVT_MEMBER_RESTARTED, 10, 10, 9);
    assert_int_equal(kvt_members_epoch(m), 4);
    assert_true(kvt_members_is_live(m, 10, 10));
    kvt_members_destroy(m);
}

/* A message from an older life (delayed in the network) is ignored entirely: no
 * event, no epoch change, and it does not count as a heartbeat. */
static void test_members_stale_incarnation_ignored(void **state)
{
    struct kvt_members *m = mk();
    const struct kvt_member *x;

    assert_int_equal(kvt_members_heard(m, 10, 5, "new", 5, 0), 0);
    expect_event(m, KVT_MEMBER_JOINED, 10, 5, 0);
    assert_int_equal(kvt_members_heard(m, 10, 4, "old", 4, K * INTERVAL), -ESTALE);
    expect_no_event(m);
    assert_int_equal(kvt_members_epoch(m), 1);
    x = kvt_members_find(m, 10);
    assert_int_equal(x->incarnation, 5);
    assert_string_equal(x->addr, "new");
    assert_int_equal(x->port, 5);
    assert_int_equal(x->last_heard_ns, 0);
    kvt_members_tick(m, K * INTERVAL + 1);
    expect_event(m, KVT_MEMBER_DOWN_EV, 10, 5, 0);

    /* Nor does it bring a down member back. */
    assert_int_equal(kvt_members_heard(m, 10, 0, NULL, 0, K * INTERVAL + 2), -ESTALE);
    assert_false(kvt_members_is_live(m, 10, 5));
    assert_int_equal(kvt_members_find(m, 10)->state, KVT_MEMBER_DOWN);
    expect_no_event(m);
    kvt_members_destroy(m);
}

static void test_members_mark_down(void **state)
{
    struct kvt_members *m = mk();

    assert_int_equal(kvt_members_heard(m, 10, 1, "a", 1, 0), 0);
    expect_event(m, KVT_MEMBER_JOINED, 10, 1, 0);
    kvt_members_mark_down(m, 10);
    expect_event(m, KVT_MEMBER_DOWN_EV, 10, 1, 0);
    assert_int_equal(kvt_members_epoch(m), 2);
    assert_false(kvt_members_is_live(m, 10, 1));
    /* Twice is once; the failure detector does not report it again either. */
    kvt_members_mark_down(m, 10);
    kvt_members_tick(m, 100 * INTERVAL);
    expect_no_event(m);
    assert_int_equal(kvt_members_epoch(m), 2);
    /* The record stays, down, so the table still knows its incarnation. */
    assert_non_null(kvt_members_find(m, 10));
    assert_int_equal(kvt_members_count(m, KVT_MEMBER_DOWN), 1);
    assert_int_equal(kvt_members_count(m, KVT_MEMBER_ALIVE), 0);
    kvt_members_destroy(m);
}

/* The epoch moves by exactly one for each membership change and for nothing else. */
static void test_members_epoch_bumps_only_on_change(void **state)
{
    struct kvt_members *m = mk();
    struct kvt_member_event ev[16];
    uint64_t t = 0;

    assert_int_equal(kvt_members_heard(m, 10, 1, "a", 1, t), 0); /* joined: 1 */
    assert_int_equal(kvt_members_heard(m, 20, 1, "b", 1, t), 0); /* joined: 2 */
    assert_int_equal(kvt_members_heard(m, 10, 1, "a", 1, t += MS), 0);
    assert_int_equal(kvt_members_heard(m, 10, 1, "z", 9, t += MS), 0); /* address only */
    kvt_members_tick(m, t);
    assert_int_equal(kvt_members_heard(m, 10, 0, NULL, 0, t), -ESTALE);
    assert_int_equal(kvt_members_heard(m, SELF, 1, NULL, 0, t), -EINVAL);
    kvt_members_mark_down(m, 99);
    assert_int_equal(kvt_members_epoch(m), 2);
    assert_int_equal(kvt_members_heard(m, 10, 2, NULL, 0, t), 0); /* restarted: 3 */
    kvt_members_mark_down(m, 20);                                 /* down: 4 */
    kvt_members_mark_down(m, 20);
    assert_int_equal(kvt_members_heard(m, 20, 1, NULL, 0, t), 0); /* back: 5 */
    assert_int_equal(kvt_members_epoch(m), 5);
    /* Taking events is not a change. */
    assert_int_equal(kvt_members_take_events(m, ev, 16), 5);
    assert_int_equal(kvt_members_epoch(m), 5);
    kvt_members_destroy(m);
}

/* Live ids include ours and come sorted whatever the order members were heard in;
 * a short buffer gets the lowest ids. */
static void test_members_live_sorted_with_self(void **state)
{
    static const uint64_t heard[] = {90, 3, 77, 51, 10, 49, 1000};
    struct kvt_members *m = mk();
    uint64_t ids[16];

    assert_int_equal(kvt_members_live(m, ids, 16), 1);
    assert_int_equal(ids[0], SELF);
    assert_int_equal(kvt_members_live(m, ids, 0), 0);
    for (size_t i = 0; i < sizeof(heard) / sizeof(heard[0]); i++)
        assert_int_equal(kvt_members_heard(m, heard[i], 1, NULL, 0, 0), 0);
    kvt_members_mark_down(m, 77);

    static const uint64_t want[] = {3, 10, 49, SELF, 51, 90, 1000};

    memset(ids, 0xff, sizeof(ids));
    assert_int_equal(kvt_members_live(m, ids, 16), 7);
    assert_memory_equal(ids, want, sizeof(want));
    assert_int_equal(ids[7], UINT64_MAX); /* nothing written past the count */

    /* A short buffer: the lowest three, although 90 was heard first. */
    memset(ids, 0xff, sizeof(ids));
    assert_int_equal(kvt_members_live(m, ids, 3), 3);
    assert_memory_equal(ids, want, 3 * sizeof(uint64_t));
    assert_int_equal(ids[3], UINT64_MAX);
    kvt_members_destroy(m);
}

/* The ring keeps the newest KVT_MEMBERS_EVENTS events, in order, and the epoch
 * counts the dropped ones too; drained in pieces it loses nothing. */
static void test_members_event_ring_overflow(void **state)
{
    static struct kvt_member_event ev[KVT_MEMBERS_EVENTS + 8];
    const size_t extra = 5, total = KVT_MEMBERS_EVENTS + extra;
    struct kvt_members *m = mk();
    enum kvt_log_level saved = kvt_log_get_level();

    kvt_log_set_level(KVT_LOG_ERROR); /* a thousand joins and downs */
    /* Event i is JOINED (even i) or DOWN (odd i) of node 10, incarnation 1. */
    for (size_t i = 0; i < total; i++) {
        if (i % 2 == 0)
            assert_int_equal(kvt_members_heard(m, 10, 1, NULL, 0, i), 0);
        else
            kvt_members_mark_down(m, 10);
    }
    kvt_log_set_level(saved);
    assert_int_equal(kvt_members_epoch(m), total);
    assert_int_equal(kvt_members_take_events(m, ev, KVT_MEMBERS_EVENTS + 8), KVT_MEMBERS_EVENTS);
    for (size_t j = 0; j < KVT_MEMBERS_EVENTS; j++) {
        size_t i = j + extra; /* the first `extra` were dropped */

        assert_int_equal(ev[j].kind, i % 2 == 0 ? KVT_MEMBER_JOINED : KVT_MEMBER_DOWN_EV);
        assert_int_equal(ev[j].node_id, 10);
    }
    expect_no_event(m);

    /* Partial drains keep order across the ring's wrap point. */
    for (uint64_t id = 100; id < 110; id++)
        assert_int_equal(kvt_members_heard(m, id, id, NULL, 0, 0), 0);
    assert_int_equal(kvt_members_take_events(m, ev, 4), 4);
    assert_int_equal(ev[0].node_id, 100);
    assert_int_equal(ev[3].node_id, 103);
    assert_int_equal(kvt_members_take_events(m, ev, 0), 0);
    assert_int_equal(kvt_members_take_events(m, ev, 100), 6);
    for (size_t j = 0; j < 6; j++) {
        assert_int_equal(ev[j].kind, KVT_MEMBER_JOINED);
        assert_int_equal(ev[j].node_id, 104 + j);
        assert_int_equal(ev[j].incarnation, 104 + j);
    }
    kvt_members_destroy(m);
}

/* The table holds KVT_MEMBERS_MAX others; one more is refused without an event. */
/* The numbered drops of wire 1.6: the table counts the times it called a life down
 * (what its handshakes name), and hears each drop of our life once per member life;
 * a drop of unknown number, or of a life it does not hold, is always news. */
static void test_members_drops_counted_and_heard_once(void **state)
{
    struct kvt_members *m = mk();

    (void)state;
    assert_int_equal(kvt_members_heard(m, 1, 10, NULL, 0, 0), 0);
    assert_int_equal(kvt_members_find(m, 1)->downs, 0);
    kvt_members_mark_down(m, 1);
    kvt_members_mark_down(m, 1); /* already down: not a second drop */
    assert_int_equal(kvt_members_find(m, 1)->downs, 1);
    assert_int_equal(kvt_members_heard(m, 1, 10, NULL, 0, MS), 0);
    kvt_members_tick(m, MS + (K + 1) * INTERVAL);
    assert_int_equal(kvt_members_find(m, 1)->downs, 2);

    assert_true(kvt_members_heard_drop(m, 1, 10, 1));
    assert_false(kvt_members_heard_drop(m, 1, 10, 1)); /* a second link, the same drop */
    assert_true(kvt_members_heard_drop(m, 1, 10, 3));
    assert_false(kvt_members_heard_drop(m, 1, 10, 2)); /* older than one heard */
    assert_true(kvt_members_heard_drop(m, 1, 10, 0));  /* unnumbered (wire 1.5) */
    assert_true(kvt_members_heard_drop(m, 1, 10, 0));
    assert_true(kvt_members_heard_drop(m, 1, 9, 1)); /* a life not held */
    assert_true(kvt_members_heard_drop(m, 2, 1, 1)); /* a member not known */
    assert_false(kvt_members_heard_drop(m, 1, 10, 3));

    /* A new life counts from zero, both ways. */
    assert_int_equal(kvt_members_heard(m, 1, 11, NULL, 0, 2 * MS), 0);
    assert_int_equal(kvt_members_find(m, 1)->downs, 0);
    assert_true(kvt_members_heard_drop(m, 1, 11, 1));
    assert_false(kvt_members_heard_drop(m, 1, 11, 1));
    kvt_members_destroy(m);
}

static void test_members_table_full(void **state)
{
    struct kvt_members *m = mk();
    static struct kvt_member_event ev[KVT_MEMBERS_MAX];
    static uint64_t ids[KVT_MEMBERS_MAX + 2];
    enum kvt_log_level saved = kvt_log_get_level();

    kvt_log_set_level(KVT_LOG_ERROR);
    for (uint64_t id = 1000; id < 1000 + KVT_MEMBERS_MAX; id++)
        assert_int_equal(kvt_members_heard(m, id, 1, NULL, 0, 0), 0);
    kvt_log_set_level(saved);
    assert_int_equal(kvt_members_take_events(m, ev, KVT_MEMBERS_MAX), KVT_MEMBERS_MAX);
    assert_int_equal(kvt_members_heard(m, 5000, 1, NULL, 0, 0), -ENOSPC);
    assert_null(kvt_members_find(m, 5000));
    expect_no_event(m);
    assert_int_equal(kvt_members_epoch(m), KVT_MEMBERS_MAX);
    /* Known members are still heard. */
    assert_int_equal(kvt_members_heard(m, 1000, 2, NULL, 0, 0), 0);
    expect_event(m, KVT_MEMBER_RESTARTED, 1000, 2, 1);
    assert_int_equal(kvt_members_live(m, ids, KVT_MEMBERS_MAX + 2), KVT_MEMBERS_MAX + 1);
    assert_int_equal(ids[0], SELF);
    assert_int_equal(ids[KVT_MEMBERS_MAX], 1000 + KVT_MEMBERS_MAX - 1);
    kvt_members_destroy(m);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_members_join),
        cmocka_unit_test(test_members_refuses_self_and_bad_config),
        cmocka_unit_test(test_members_heartbeat_keeps_alive),
        cmocka_unit_test(test_members_down_after_k_missed),
        cmocka_unit_test(test_members_restart_with_new_incarnation),
        cmocka_unit_test(test_members_stale_incarnation_ignored),
        cmocka_unit_test(test_members_mark_down),
        cmocka_unit_test(test_members_epoch_bumps_only_on_change),
        cmocka_unit_test(test_members_live_sorted_with_self),
        cmocka_unit_test(test_members_event_ring_overflow),
        cmocka_unit_test(test_members_drops_counted_and_heard_once),
        cmocka_unit_test(test_members_table_full),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

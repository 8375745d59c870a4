/* SPDX-License-Identifier: Apache-2.0 */
/* Test hooks of the network tier (kvt/net_tier.h): what a test needs to play a peer
 * that holds more than the protocol gives it. Not for the node. */
#ifndef KVT_NET_TIER_TEST_H
#define KVT_NET_TIER_TEST_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct kvt_tier;
struct kvt_member_event;

/* The packed handle of t's primary region, as its GRANTs carry it (registering the
 * region first if no GRANT has yet): a test hands it to an authenticated peer that
 * then READs rows it was never granted. 0, or -EIO when the region cannot be
 * registered. */
int kvt__net_tier_test_handle(struct kvt_tier *t, const void **handle_p, size_t *len_p);

/* The grant check the transport applies to READs of t's fence words ([off, off +
 * len), 4 bytes a row): kvt_net_tier_may_read's answer for the rows those words
 * belong to. Loop thread. */
bool kvt__net_tier_test_may_read_fence(struct kvt_tier *t, uint64_t peer_node_id, uint64_t off,
                                       uint64_t len);

/* From now on t's GRANTs carry no fence words, as a holder before wire 1.1 sends
 * them: a test of the puller's fallback to checksums. */
void kvt__net_tier_test_omit_fences(struct kvt_tier *t);

/* Hands t a membership event as its peers would: a test of what the tier does on one
 * that real links produce only in a race (a stalled member, KVT_MEMBER_DROPPED_US). */
void kvt__net_tier_test_member_event(struct kvt_tier *t, const struct kvt_member_event *ev);

#endif

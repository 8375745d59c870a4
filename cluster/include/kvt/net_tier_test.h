/* Test hooks of the network tier (kvt/net_tier.h): what a test needs to play a peer
 * that holds more than the protocol gives it. Not for the node. */
#ifndef KVT_NET_TIER_TEST_H
#define KVT_NET_TIER_TEST_H

#include <stddef.h>

struct kvt_tier;

/* The packed handle of t's primary region, as its GRANTs carry it (registering the
 * region first if no GRANT has yet): a test hands it to an authenticated peer that
 * then READs rows it was never granted. 0, or -EIO when the region cannot be
 * registered. */
int kvt__net_tier_test_handle(struct kvt_tier *t, const void **handle_p, size_t *len_p);

#endif

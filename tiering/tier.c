/* SPDX-License-Identifier: Apache-2.0 */
/* The parts of the secondary-tier contract that every tier shares: initialising
 * the common header and destroying a tier with its back-pressure detector. */
#include <string.h>

#include "kvt/backpressure.h"
#include "kvt/tier.h"

void kvt_tier_init(struct kvt_tier *t, const struct kvt_tier_ops *ops, const char *type, int medium,
                   int locality)
{
    memset(t, 0, sizeof(*t));
    t->ops = ops;
    strncpy(t->type, type, sizeof(t->type) - 1);
    t->medium = medium;
    t->locality = locality;
    t->index = -1;
}

void kvt_tier_destroy(struct kvt_tier *t)
{
    struct kvt_bp *bp;
    if (t == NULL)
        return;
    bp = t->bp;
    t->bp = NULL;
    if (t->ops->destroy)
        t->ops->destroy(t);
    if (bp != NULL)
        kvt_bp_destroy(bp);
}

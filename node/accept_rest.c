/* SPDX-License-Identifier: Apache-2.0 */
/* The rest of a listening socket that cannot accept (accept_rest.h). */
#include <errno.h>
#include <string.h>

#include "accept_rest.h"
#include "kvt/common.h"
#include "kvt/log.h"

#define REST_NS 100000000ull   /* how long the socket leaves the poll set */
#define LOG_NS  10000000000ull /* at most one log line per this */

bool kvt_accept_failed(struct kvt_accept_rest *r, const char *mod, const char *what, int err,
                       uint64_t now)
{
    if (r->logged_ns == 0 || now - r->logged_ns >= LOG_NS) {
        if (r->unlogged > 0)
            kvt_warn(mod, "accept on %s: %s (and %llu more failures in the last %.0f s)", what,
                     strerror(err), (unsigned long long)r->unlogged,
                     (double)(now - r->logged_ns) / 1e9);
        else
            kvt_warn(mod, "accept on %s: %s%s", what, strerror(err),
                     err == EMFILE ? " (raise the open files limit: ulimit -n, LimitNOFILE=)" : "");
        r->logged_ns = now;
        r->unlogged = 0;
    } else {
        r->unlogged++;
    }
    if (!kvt_err_no_resources(err))
        return false;
    r->until = now + REST_NS;
    return true;
}

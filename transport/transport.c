/* The table of built-in transport backends, the configuration defaults and the
 * names of the refusal counters. Each backend's folder defines its ops table; the
 * build defines KVT_HAVE_<BACKEND> for the backends whose libraries were found. */
#include <string.h>

#include "kvt/transport.h"

#ifdef KVT_HAVE_UCX
extern const struct kvt_transport_ops kvt_ucx_transport_ops;
#endif
#ifdef KVT_HAVE_VERBS
extern const struct kvt_transport_ops kvt_verbs_transport_ops;
#endif

static const struct kvt_transport_ops *const backends[] = {
#ifdef KVT_HAVE_UCX
    &kvt_ucx_transport_ops,
#endif
#ifdef KVT_HAVE_VERBS
    &kvt_verbs_transport_ops,
#endif
    NULL,
};

const struct kvt_transport_ops *kvt_transport_find(const char *name)
{
    if (name == NULL)
        return NULL;
    for (size_t i = 0; backends[i] != NULL; i++)
        if (strcmp(backends[i]->name, name) == 0)
            return backends[i];
    return NULL;
}

void kvt_transport_config_defaults(struct kvt_transport_config *cfg)
{
    if (cfg->max_msg_bytes == 0)
        cfg->max_msg_bytes = 64 * 1024;
    if (cfg->recv_credits == 0)
        cfg->recv_credits = 64;
    if (cfg->max_batches == 0)
        cfg->max_batches = 256;
    if (cfg->connect_timeout_ms == 0)
        cfg->connect_timeout_ms = 5000;
    if (cfg->op_timeout_ms == 0)
        cfg->op_timeout_ms = 10000;
    if (cfg->preauth_timeout_ms == 0)
        cfg->preauth_timeout_ms = 10000;
    if (cfg->max_preauth == 0)
        cfg->max_preauth = 64;
}

const char *kvt_tp_refusal_name(unsigned r)
{
    static const char *const names[KVT_TP_N_REFUSALS] = {
        [KVT_TP_READ_UNAUTH] = "read_unauth",
        [KVT_TP_READ_RANGE] = "read_range",
        [KVT_TP_READ_GRANT] = "read_grant",
        [KVT_TP_PREAUTH_CONNS] = "preauth_conns",
        [KVT_TP_PREAUTH_MALFORMED] = "preauth_malformed",
        [KVT_TP_PREAUTH_TIMEOUT] = "preauth_timeout",
        [KVT_TP_UNKNOWN_CONN] = "unknown_conn",
        [KVT_TP_PROTO] = "proto",
    };

    return r < KVT_TP_N_REFUSALS ? names[r] : "?";
}

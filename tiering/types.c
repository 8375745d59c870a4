/* SPDX-License-Identifier: Apache-2.0 */
/* The tiering vocabulary: keys, tier filters, request contexts
 * (reference counted, atomically, since the async-lookup worker holds references),
 * and event lists. */
#include <ctype.h>
#include <errno.h>
#include <string.h>
#include <strings.h>

#include "kvt/alloc.h"
#include "kvt/hash.h"
#include "kvt/types.h"
#include "kvt/vec.h"

int kvt_key_set(struct kvt_key *key, const void *bytes, size_t len)
{
    if (len < 1 || len > KVT_KEY_MAX)
        return -EINVAL;
    key->len = (uint8_t)len;
    memcpy(key->bytes, bytes, len);
    return 0;
}

int kvt_key_make(struct kvt_key *key, const void *hash, size_t hash_len, uint32_t group)
{
    uint8_t buf[KVT_KEY_MAX];
    if (hash_len + 4 > KVT_KEY_MAX)
        return -EINVAL;
    memcpy(buf, hash, hash_len);
    buf[hash_len + 0] = (uint8_t)(group >> 24);
    buf[hash_len + 1] = (uint8_t)(group >> 16);
    buf[hash_len + 2] = (uint8_t)(group >> 8);
    buf[hash_len + 3] = (uint8_t)group;
    return kvt_key_set(key, buf, hash_len + 4);
}

bool kvt_key_eq(const struct kvt_key *a, const struct kvt_key *b)
{
    return a->len == b->len && memcmp(a->bytes, b->bytes, a->len) == 0;
}

uint64_t kvt_key_hash(const struct kvt_key *key)
{
    return kvt_hash64(key->bytes, key->len);
}

void kvt_key_to_hex(const struct kvt_key *key, char *buf)
{
    static const char hex[] = "0123456789abcdef";
    for (size_t i = 0; i < key->len; i++) {
        buf[2 * i] = hex[key->bytes[i] >> 4];
        buf[2 * i + 1] = hex[key->bytes[i] & 15];
    }
    buf[2 * key->len] = '\0';
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    c = (char)tolower((unsigned char)c);
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    return -1;
}

int kvt_key_from_hex(struct kvt_key *key, const char *hex)
{
    size_t len = strlen(hex);
    uint8_t buf[KVT_KEY_MAX];
    if (len % 2 != 0 || len / 2 < 1 || len / 2 > KVT_KEY_MAX)
        return -EINVAL;
    for (size_t i = 0; i < len / 2; i++) {
        int hi = hexval(hex[2 * i]), lo = hexval(hex[2 * i + 1]);
        if (hi < 0 || lo < 0)
            return -EINVAL;
        buf[i] = (uint8_t)(hi << 4 | lo);
    }
    return kvt_key_set(key, buf, len / 2);
}

const char *kvt_lookup_result_name(enum kvt_lookup_result r)
{
    switch (r) {
    case KVT_MISS:
        return "MISS";
    case KVT_HIT:
        return "HIT";
    case KVT_HIT_PENDING:
        return "HIT_PENDING";
    case KVT_RETRY:
        return "RETRY";
    }
    return "?";
}

const struct kvt_tier_filter kvt_filter_all = {
    .all = true, .n = 1, .m = {{.medium = KVT_ANY, .locality = KVT_ANY}}};

static bool axis_matches(int want, int have)
{
    return want == KVT_ANY || have == KVT_ANY || want == have;
}

bool kvt_tier_filter_allows(const struct kvt_tier_filter *f, int medium, int locality)
{
    if (f->all)
        return true;
    for (size_t i = 0; i < f->n; i++) {
        if (axis_matches(f->m[i].medium, medium) && axis_matches(f->m[i].locality, locality))
            return true;
    }
    return false;
}

static int parse_axis(const char *s, const char *a, const char *b, int *out)
{
    if (s == NULL) {
        *out = KVT_ANY;
        return 0;
    }
    if (strcasecmp(s, a) == 0) {
        *out = 0;
        return 0;
    }
    if (strcasecmp(s, b) == 0) {
        *out = 1;
        return 0;
    }
    return -EINVAL;
}

void kvt_tier_filter_parse(struct kvt_tier_filter *f, bool is_list,
                           const struct kvt_tier_filter_entry *entries, size_t n)
{
    *f = (struct kvt_tier_filter){.all = false, .n = 0};
    if (!is_list) {
        *f = kvt_filter_all;
        return;
    }
    for (size_t i = 0; i < n && f->n < KVT_FILTER_MAX_MATCHERS; i++) {
        struct kvt_tier_matcher m;
        if (!entries[i].is_dict ||
            parse_axis(entries[i].medium, "cpu", "storage", &m.medium) != 0 ||
            parse_axis(entries[i].locality, "local", "remote", &m.locality) != 0)
            continue;
        f->m[f->n++] = m;
    }
    if (n > 0 && f->n == 0)
        *f = kvt_filter_all;
}

int kvt_req_ctx_create(const char *req_id, const char *params_json, struct kvt_req_ctx **ctx_p)
{
    size_t len = strlen(req_id);
    struct kvt_req_ctx *ctx;
    if (len < 1 || len > KVT_REQ_ID_MAX)
        return -EINVAL;
    ctx = kvt_calloc(1, sizeof(*ctx));
    if (ctx == NULL)
        return -ENOMEM;
    memcpy(ctx->req_id, req_id, len + 1);
    ctx->req_id_len = len;
    ctx->load_tier_filter = kvt_filter_all;
    if (params_json != NULL) {
        ctx->params = kvt_strdup(params_json);
        if (ctx->params == NULL) {
            kvt_free(ctx);
            return -ENOMEM;
        }
    }
    ctx->refs = 1;
    *ctx_p = ctx;
    return 0;
}

struct kvt_req_ctx *kvt_req_ctx_ref(struct kvt_req_ctx *ctx)
{
    __atomic_fetch_add(&ctx->refs, 1, __ATOMIC_RELAXED);
    return ctx;
}

void kvt_req_ctx_unref(struct kvt_req_ctx *ctx)
{
    if (ctx == NULL || __atomic_sub_fetch(&ctx->refs, 1, __ATOMIC_ACQ_REL) != 0)
        return;
    kvt_free(ctx->params);
    kvt_free(ctx);
}

void kvt_events_init(struct kvt_events *l)
{
    memset(l, 0, sizeof(*l));
}

void kvt_events_cleanup(struct kvt_events *l)
{
    for (size_t i = 0; i < l->n; i++)
        kvt_free(l->ev[i].keys);
    kvt_free(l->ev);
    memset(l, 0, sizeof(*l));
}

static int events_reserve(struct kvt_events *l, size_t extra)
{
    return kvt_vec_reserve(l->ev, l->cap, l->n + extra, 8);
}

int kvt_events_push(struct kvt_events *l, const struct kvt_key *keys, size_t n, int medium,
                    int locality, bool removed)
{
    struct kvt_key *copy;
    if (events_reserve(l, 1) != 0)
        return -ENOMEM;
    copy = kvt_reallocarray(NULL, n ? n : 1, sizeof(*copy));
    if (copy == NULL)
        return -ENOMEM;
    memcpy(copy, keys, n * sizeof(*copy));
    l->ev[l->n++] = (struct kvt_event){
        .keys = copy, .n = n, .medium = medium, .locality = locality, .removed = removed};
    return 0;
}

int kvt_events_splice(struct kvt_events *dst, struct kvt_events *src)
{
    if (src->n == 0)
        return 0;
    if (events_reserve(dst, src->n) != 0)
        return -ENOMEM;
    memcpy(dst->ev + dst->n, src->ev, src->n * sizeof(*src->ev));
    dst->n += src->n;
    src->n = 0;
    return 0;
}

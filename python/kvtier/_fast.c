/* SPDX-License-Identifier: Apache-2.0 */
/* kvtier._fast: the hot calls of libkvtier-client as a CPython extension.
 *
 * vLLM's scheduler calls its offloading manager for every block of every new
 * request on its own thread, so a call into the node from Python must cost little
 * more than the C round trip over the shared-memory ring (about 1 us). Through
 * ctypes each call also pays the foreign-function machinery (argument conversion,
 * array objects for keys and results: 0.3-1 us); here a call takes Python's bytes
 * and lists as they are and packs the keys straight into a buffer on its stack (the
 * heap past 64 keys). The calls: lookup_one, lookup, prepare_store, complete_store,
 * prepare_load, complete_load, touch, on_schedule_end (kvtier.vllm's spec manager)
 * and jobs_step (its secondary tier); the rest stay on ctypes.
 *
 * KeyTable, the secondary tier's lookup state (every key's verdict, generation and
 * requests), is here for the same reason: the tier answers a lookup for every block
 * without the node, so that answer is the Python-level work per block (see its
 * section below).
 *
 * The Conn objects of a kvtier.Client (Client.fast, Client.fast_view()) borrow its C
 * handle (the Python Client owns it, opens and closes it, and closes them with it)
 * and resolve the functions they call with dlsym from the very library ctypes
 * loaded (ctypes' dlopen handle), so both layers always run one library's code on
 * one client - the packaged library, or the one $KVTIER_CLIENT_LIB names (a
 * sanitized development build). That is also why this module links no
 * libkvtier-client of its own.
 *
 * Errors are the ctypes layer's: a negative errno raises the KvtierError class the
 * package hands to Conn (errno positive, the node's reason when it closed the
 * connection); a closed Conn raises KvtierError(EBADF, "client closed"); bad
 * arguments raise TypeError (not bytes, not a list) or ValueError (a key not 1..64
 * bytes, a request id not 1..127 bytes or with a NUL). Nothing is sent then.
 *
 * Threads: a call releases the GIL around the C call, as ctypes does (a node that
 * does not answer must not stall the process's other threads up to the timeout);
 * the C client serializes calls with its own mutex. As with the ctypes layer, the
 * client must not be closed while another thread is inside a call on it.
 *
 * Built with the limited API of Python 3.9 (abi3): one wheel for every CPython
 * from 3.9 on. */
#define Py_LIMITED_API 0x03090000
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include <kvtier/client.h>

#define KVT_FAST_STACK_KEYS 64 /* keys packed without an allocation */

/* o = its replacement (a new reference, may be NULL), the old one released. */
#define Py_SETREF_(o, v)                                                                           \
    do {                                                                                           \
        PyObject *_old = (o);                                                                      \
        (o) = (v);                                                                                 \
        Py_DECREF(_old);                                                                           \
    } while (0)

/* The same, o may be NULL. */
#define Py_XSETREF_(o, v)                                                                          \
    do {                                                                                           \
        PyObject *_old = (o);                                                                      \
        (o) = (v);                                                                                 \
        Py_XDECREF(_old);                                                                          \
    } while (0)

/* The library's functions this module calls, resolved once per Conn. */
struct kvt_fast_fns {
    const char *(*client_error)(const struct kvtier_client *);
    int (*lookup_one)(struct kvtier_client *, const char *, const void *, size_t);
    int (*lookup_packed)(struct kvtier_client *, const char *, const void *, size_t, size_t,
                         unsigned, uint8_t *, size_t *);
    int (*lookup)(struct kvtier_client *, const char *, const struct kvtier_key *, size_t, unsigned,
                  uint8_t *, size_t *);
    int (*prepare_store_packed)(struct kvtier_client *, const char *, const void *, size_t, size_t,
                                uint32_t *, int64_t *, size_t *, void *, size_t, size_t *,
                                size_t *);
    int (*prepare_store)(struct kvtier_client *, const char *, const struct kvtier_key *, size_t,
                         struct kvtier_store_plan *);
    int (*complete_store_packed)(struct kvtier_client *, const char *, const void *, size_t, size_t,
                                 bool);
    int (*complete_store)(struct kvtier_client *, const char *, const struct kvtier_key *, size_t,
                          bool);
    int (*prepare_load_packed)(struct kvtier_client *, const char *, const void *, size_t, size_t,
                               int64_t *);
    int (*prepare_load)(struct kvtier_client *, const char *, const struct kvtier_key *, size_t,
                        int64_t *);
    int (*complete_load_packed)(struct kvtier_client *, const char *, const void *, size_t, size_t);
    int (*complete_load)(struct kvtier_client *, const char *, const struct kvtier_key *, size_t);
    int (*touch_packed)(struct kvtier_client *, const char *, const void *, size_t, size_t);
    int (*touch)(struct kvtier_client *, const char *, const struct kvtier_key *, size_t);
    int (*on_schedule_end)(struct kvtier_client *, const char *const *, size_t, const char *const *,
                           size_t);
    int (*jobs_step)(struct kvtier_client *, const struct kvtier_key *, size_t, uint8_t *,
                     const struct kvtier_job *, size_t, struct kvtier_jobs_done **);
    void (*jobs_done_free)(struct kvtier_jobs_done *);
};

/* One client's fast calls. The Python Client owns c; close() forgets it. Touched
 * only with the GIL held (the C call itself runs without it, on a copy of c). */
struct kvt_fast_conn {
    PyObject_HEAD struct kvtier_client *c; /* borrowed; NULL once closed */
    struct kvt_fast_fns f;
    PyObject *error;   /* the KvtierError class */
    PyObject *results; /* tuple of 4: what a lookup returns for MISS..RETRY */
};

/* A call's keys: packed (one length, back to back) when they all have one length,
 * else as struct kvtier_key. The buffers are the stack's up to KVT_FAST_STACK_KEYS. */
struct kvt_fast_keys {
    size_t n;
    size_t key_len; /* 0: several lengths, keys in karr */
    uint8_t *packed;
    struct kvtier_key *karr;
    void *heap;
    uint8_t stack[KVT_FAST_STACK_KEYS * sizeof(struct kvtier_key)];
};

static PyObject *conn_raise(struct kvt_fast_conn *self, int rc, const char *what)
{
    const char *reason = NULL;
    PyObject *text, *exc;

    if (self->c != NULL)
        reason = self->f.client_error(self->c);
    if (reason == NULL)
        reason = "";
    text = PyUnicode_DecodeUTF8(reason, (Py_ssize_t)strlen(reason), "replace");
    if (text == NULL)
        return NULL;
    exc = PyObject_CallFunction(self->error, "isO", rc, what, text);
    Py_DECREF(text);
    if (exc != NULL) {
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
        Py_DECREF(exc);
    }
    return NULL;
}

/* The client, taken by every call after it converted its arguments and just
 * before the C call: a conversion can run Python code (an iterable's __next__, a
 * row's __index__) that closes the client, which frees the handle taken before. */
static struct kvtier_client *conn_handle(struct kvt_fast_conn *self)
{
    if (self->c == NULL)
        conn_raise(self, -EBADF, "client closed");
    return self->c;
}

/* A request id: None (when allowed) is NULL (the library then answers as it does
 * through ctypes); bytes or str of 1..127 bytes and no NUL. *tmp_p receives a new
 * reference to release (an encoded str) or NULL. */
static int req_arg(PyObject *o, bool allow_none, const char **id_p, PyObject **tmp_p)
{
    char *s;
    Py_ssize_t len;

    *tmp_p = NULL;
    if (o == Py_None && allow_none) {
        *id_p = NULL;
        return 0;
    }
    if (PyUnicode_Check(o)) {
        o = *tmp_p = PyUnicode_AsUTF8String(o);
        if (o == NULL)
            return -1;
    } else if (!PyBytes_Check(o)) {
        PyErr_SetString(PyExc_TypeError, "a request id is bytes or str");
        return -1;
    }
    if (PyBytes_AsStringAndSize(o, &s, &len) < 0)
        goto fail;
    if (len < 1 || len > KVTIER_REQ_ID_MAX || memchr(s, 0, (size_t)len) != NULL) {
        PyErr_SetString(PyExc_ValueError, "a request id is 1..127 bytes (no NUL)");
        goto fail;
    }
    *id_p = s;
    return 0;
fail:
    Py_CLEAR(*tmp_p);
    return -1;
}

/* The items of o as a tuple (a new reference): o itself when it is a tuple, else a
 * copy. Every sequence a call reads is such a tuple: converting an item (a row's
 * __index__, a key's bytes) can run any Python code, which could empty a list under
 * the call and free the items it holds; a tuple keeps its items, in place, for as
 * long as the call holds it. */
static PyObject *as_seq(PyObject *o, const char *what)
{
    if (PyTuple_Check(o)) {
        Py_INCREF(o);
        return o;
    }
    if (PyList_Check(o))
        return PyList_AsTuple(o);
    if (PyBytes_Check(o) || PyUnicode_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s: a list of keys, not one key", what);
        return NULL;
    }
    return PySequence_Tuple(o);
}

/* Item i of a tuple from as_seq (borrowed: the tuple holds it). */
static PyObject *seq_item(PyObject *seq, Py_ssize_t i)
{
    return PyTuple_GetItem(seq, i);
}

/* seq (a tuple from as_seq) with every key as bytes (a new reference): itself when
 * they are (vLLM's keys are), else a new tuple of bytes(k) for bytes-like keys
 * (bytearray, memoryview), as the ctypes layer takes them. TypeError for anything
 * else (a str). */
static PyObject *as_bytes_seq(PyObject *seq)
{
    Py_ssize_t n = PyTuple_Size(seq), i;
    PyObject *out;

    for (i = 0; i < n && PyBytes_Check(seq_item(seq, i)); i++)
        ;
    if (i == n) {
        Py_INCREF(seq);
        return seq;
    }
    if ((out = PyTuple_New(n)) == NULL)
        return NULL;
    for (i = 0; i < n; i++) {
        PyObject *o = seq_item(seq, i);

        if (PyBytes_Check(o)) {
            Py_INCREF(o);
        } else if (PyUnicode_Check(o) || PyLong_Check(o) || (o = PyBytes_FromObject(o)) == NULL) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "key %zd: a key is bytes", i);
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SetItem(out, i, o);
    }
    return out;
}

static void keys_cleanup(struct kvt_fast_keys *k)
{
    PyMem_Free(k->heap);
    k->heap = NULL;
}

/* Packs the keys of seq (a tuple from as_seq of bytes of 1..64 bytes each) into k. */
static int keys_init(struct kvt_fast_keys *k, PyObject *seq)
{
    Py_ssize_t n = PyTuple_Size(seq);
    size_t key_len = 0, need;
    void *buf;

    k->n = (size_t)n;
    k->heap = NULL;
    k->packed = NULL;
    k->karr = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = seq_item(seq, i);
        Py_ssize_t len;

        if (!PyBytes_Check(o)) {
            PyErr_Format(PyExc_TypeError, "key %zd: a key is bytes", i);
            return -1;
        }
        len = PyBytes_Size(o);
        if (len < 1 || len > KVTIER_KEY_MAX) {
            PyErr_Format(PyExc_ValueError, "key %zd: a key is 1..64 bytes", i);
            return -1;
        }
        if (i == 0)
            key_len = (size_t)len;
        else if ((size_t)len != key_len)
            key_len = SIZE_MAX;
    }
    k->key_len = key_len == SIZE_MAX ? 0 : key_len;
    need = k->key_len ? k->n * k->key_len : k->n * sizeof(struct kvtier_key);
    buf = k->stack;
    if (need > sizeof(k->stack)) {
        buf = k->heap = PyMem_Malloc(need);
        if (buf == NULL) {
            PyErr_NoMemory();
            return -1;
        }
    }
    if (k->key_len) {
        k->packed = buf;
        for (size_t i = 0; i < k->n; i++)
            memcpy(k->packed + i * k->key_len, PyBytes_AsString(seq_item(seq, (Py_ssize_t)i)),
                   k->key_len);
    } else {
        k->karr = buf;
        for (size_t i = 0; i < k->n; i++) {
            PyObject *o = seq_item(seq, (Py_ssize_t)i);
            size_t len = (size_t)PyBytes_Size(o);

            k->karr[i].len = (uint8_t)len;
            memcpy(k->karr[i].bytes, PyBytes_AsString(o), len);
            memset(k->karr[i].bytes + len, 0, KVTIER_KEY_MAX - len);
        }
    }
    return 0;
}

/* A call's common arguments: the request id, the keys. On success the caller owns
 * *seq_p, *tmp_p and k (released by args_cleanup). */
struct kvt_fast_args {
    const char *rid;
    PyObject *tmp; /* an encoded str id */
    PyObject *seq;
    struct kvt_fast_keys k;
};

static void args_cleanup(struct kvt_fast_args *a)
{
    keys_cleanup(&a->k);
    Py_CLEAR(a->seq);
    Py_CLEAR(a->tmp);
}

static int args_init(struct kvt_fast_args *a, PyObject *rid, bool rid_none, PyObject *keys,
                     const char *what)
{
    a->tmp = NULL;
    a->seq = NULL;
    a->k.heap = NULL;
    if (req_arg(rid, rid_none, &a->rid, &a->tmp) < 0)
        return -1;
    a->seq = as_seq(keys, what);
    if (a->seq != NULL) {
        PyObject *b = as_bytes_seq(a->seq);

        Py_DECREF(a->seq);
        a->seq = b;
    }
    if (a->seq == NULL || keys_init(&a->k, a->seq) < 0) {
        args_cleanup(a);
        return -1;
    }
    return 0;
}

/* Unpacks a METH_VARARGS tuple of min..max arguments into out (the rest left as
 * they are). */
static int unpack(PyObject *args, const char *name, Py_ssize_t min, Py_ssize_t max, PyObject **out)
{
    Py_ssize_t n = PyTuple_Size(args);

    if (n < min || n > max) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd to %zd arguments (%zd given)", name, min, max,
                     n);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        out[i] = PyTuple_GetItem(args, i);
    return 0;
}

static PyObject *result_of(struct kvt_fast_conn *self, uint8_t r)
{
    PyObject *o;

    if (r > KVTIER_RETRY)
        return PyLong_FromLong(r);
    o = PyTuple_GetItem(self->results, r);
    Py_XINCREF(o);
    return o;
}

/* ---- the calls ---------------------------------------------------------------- */

/* lookup_one(req_id, key) -> the key's result. */
static PyObject *conn_lookup_one(struct kvt_fast_conn *self, PyObject *args)
{
    struct kvtier_client *c;
    PyObject *a[2], *tmp;
    const char *rid;
    char *key;
    Py_ssize_t klen;
    int rc;

    if (unpack(args, "lookup_one", 2, 2, a) < 0)
        return NULL;
    if (!PyBytes_Check(a[1])) {
        PyErr_SetString(PyExc_TypeError, "a key is bytes");
        return NULL;
    }
    if (PyBytes_AsStringAndSize(a[1], &key, &klen) < 0)
        return NULL;
    if (klen < 1 || klen > KVTIER_KEY_MAX) {
        PyErr_SetString(PyExc_ValueError, "a key is 1..64 bytes");
        return NULL;
    }
    if (req_arg(a[0], true, &rid, &tmp) < 0)
        return NULL;
    if ((c = conn_handle(self)) == NULL) {
        Py_XDECREF(tmp);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS rc = self->f.lookup_one(c, rid, key, (size_t)klen);
    Py_END_ALLOW_THREADS Py_XDECREF(tmp);
    if (rc < 0)
        return conn_raise(self, rc, "lookup");
    return result_of(self, (uint8_t)rc);
}

/* lookup(req_id, keys, prefix=False) -> [result]; with prefix it stops after the
 * first MISS or RETRY and the list is that long. */
static PyObject *conn_lookup(struct kvt_fast_conn *self, PyObject *args)
{
    PyObject *a[3] = {NULL, NULL, Py_False}, *out = NULL;
    struct kvtier_client *c;
    struct kvt_fast_args fa;
    uint8_t stack[KVT_FAST_STACK_KEYS], *res = stack;
    size_t done = 0;
    unsigned flags;
    int prefix, rc;

    if (unpack(args, "lookup", 2, 3, a) < 0)
        return NULL;
    if ((prefix = PyObject_IsTrue(a[2])) < 0)
        return NULL;
    flags = prefix ? KVTIER_LOOKUP_PREFIX : 0;
    if (args_init(&fa, a[0], true, a[1], "lookup") < 0)
        return NULL;
    if (fa.k.n > KVT_FAST_STACK_KEYS && (res = PyMem_Malloc(fa.k.n)) == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    if ((c = conn_handle(self)) == NULL)
        goto out;
    Py_BEGIN_ALLOW_THREADS if (fa.k.key_len) rc =
        self->f.lookup_packed(c, fa.rid, fa.k.packed, fa.k.key_len, fa.k.n, flags, res, &done);
    else rc = self->f.lookup(c, fa.rid, fa.k.karr, fa.k.n, flags, res, &done);
    Py_END_ALLOW_THREADS if (rc < 0)
    {
        conn_raise(self, rc, "lookup");
        goto out;
    }
    if (done > fa.k.n)
        done = fa.k.n;
    if ((out = PyList_New((Py_ssize_t)done)) == NULL)
        goto out;
    for (size_t i = 0; i < done; i++) {
        PyObject *r = result_of(self, res[i]);

        if (r == NULL) {
            Py_CLEAR(out);
            goto out;
        }
        PyList_SetItem(out, (Py_ssize_t)i, r);
    }
out:
    if (res != stack)
        PyMem_Free(res);
    args_cleanup(&fa);
    return out;
}

/* prepare_store(req_id, keys) -> (store_index, chunk_ids, evicted): keys[store_index[i]]
 * goes to chunk_ids[i]; evicted, the keys evicted to make room (bytes). */
static PyObject *conn_prepare_store(struct kvt_fast_conn *self, PyObject *args)
{
    PyObject *a[2], *idx_l = NULL, *ids_l = NULL, *ev_l = NULL, *out = NULL;
    struct kvtier_client *c;
    struct kvt_fast_args fa;
    uint32_t *idx = NULL;
    int64_t *ids = NULL;
    uint8_t *ev = NULL;
    size_t n1, ev_cap, n_store = 0, n_ev = 0, ev_bytes = 0;
    int rc;

    if (unpack(args, "prepare_store", 2, 2, a) < 0)
        return NULL;
    if (args_init(&fa, a[0], true, a[1], "prepare_store") < 0)
        return NULL;
    n1 = fa.k.n ? fa.k.n : 1;
    ev_cap = n1 * (KVTIER_KEY_MAX + 1);
    idx = PyMem_Malloc(n1 * sizeof(*idx));
    ids = PyMem_Malloc(n1 * sizeof(*ids));
    ev = PyMem_Malloc(ev_cap);
    if (idx == NULL || ids == NULL || ev == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    if ((c = conn_handle(self)) == NULL)
        goto out;
    Py_BEGIN_ALLOW_THREADS if (fa.k.key_len)
    {
        rc = self->f.prepare_store_packed(c, fa.rid, fa.k.packed, fa.k.key_len, fa.k.n, idx, ids,
                                          &n_store, ev, ev_cap, &n_ev, &ev_bytes);
    }
    else
    {
        /* several lengths: the plan's own evicted keys, packed as the call above */
        struct kvtier_store_plan plan = {.store_index = idx, .chunk_ids = ids};
        struct kvtier_key *evk = malloc(n1 * sizeof(*evk)); /* (no GIL: not PyMem) */

        if (evk == NULL) {
            rc = -ENOMEM;
        } else {
            plan.evicted = evk;
            plan.cap_evicted = n1;
            rc = self->f.prepare_store(c, fa.rid, fa.k.karr, fa.k.n, &plan);
            n_store = plan.n_store;
            n_ev = plan.n_evicted < n1 ? plan.n_evicted : n1;
            for (size_t i = 0; rc == 0 && i < n_ev; i++) {
                ev[ev_bytes] = evk[i].len;
                memcpy(ev + ev_bytes + 1, evk[i].bytes, evk[i].len);
                ev_bytes += 1 + evk[i].len;
            }
            free(evk);
        }
    }
    Py_END_ALLOW_THREADS if (rc < 0)
    {
        conn_raise(self, rc, "prepare_store");
        goto out;
    }
    if (n_store > fa.k.n)
        n_store = fa.k.n;
    idx_l = PyList_New((Py_ssize_t)n_store);
    ids_l = PyList_New((Py_ssize_t)n_store);
    ev_l = PyList_New(0);
    if (idx_l == NULL || ids_l == NULL || ev_l == NULL)
        goto out;
    for (size_t i = 0; i < n_store; i++) {
        PyObject *x = PyLong_FromUnsignedLong(idx[i]), *y = PyLong_FromLongLong(ids[i]);

        if (x == NULL || y == NULL) {
            Py_XDECREF(x);
            Py_XDECREF(y);
            goto out;
        }
        PyList_SetItem(idx_l, (Py_ssize_t)i, x);
        PyList_SetItem(ids_l, (Py_ssize_t)i, y);
    }
    for (size_t i = 0, off = 0; i < n_ev && off < ev_bytes; i++) {
        size_t len = ev[off];
        PyObject *k;

        if (off + 1 + len > ev_bytes)
            break;
        k = PyBytes_FromStringAndSize((const char *)ev + off + 1, (Py_ssize_t)len);
        if (k == NULL || PyList_Append(ev_l, k) < 0) {
            Py_XDECREF(k);
            goto out;
        }
        Py_DECREF(k);
        off += 1 + len;
    }
    out = PyTuple_Pack(3, idx_l, ids_l, ev_l);
out:
    Py_XDECREF(idx_l);
    Py_XDECREF(ids_l);
    Py_XDECREF(ev_l);
    PyMem_Free(idx);
    PyMem_Free(ids);
    PyMem_Free(ev);
    args_cleanup(&fa);
    return out;
}

/* complete_store(req_id, keys, success=True) */
static PyObject *conn_complete_store(struct kvt_fast_conn *self, PyObject *args)
{
    PyObject *a[3] = {NULL, NULL, Py_True};
    struct kvtier_client *c;
    struct kvt_fast_args fa;
    int ok, rc;

    if (unpack(args, "complete_store", 2, 3, a) < 0)
        return NULL;
    if ((ok = PyObject_IsTrue(a[2])) < 0)
        return NULL;
    if (args_init(&fa, a[0], true, a[1], "complete_store") < 0)
        return NULL;
    if ((c = conn_handle(self)) == NULL) {
        args_cleanup(&fa);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS if (fa.k.key_len) rc =
        self->f.complete_store_packed(c, fa.rid, fa.k.packed, fa.k.key_len, fa.k.n, ok);
    else rc = self->f.complete_store(c, fa.rid, fa.k.karr, fa.k.n, ok);
    Py_END_ALLOW_THREADS args_cleanup(&fa);
    if (rc < 0)
        return conn_raise(self, rc, "complete_store");
    Py_RETURN_NONE;
}

/* prepare_load(req_id or None, keys) -> [chunk id], co-indexed with keys. */
static PyObject *conn_prepare_load(struct kvt_fast_conn *self, PyObject *args)
{
    PyObject *a[2], *out = NULL;
    struct kvtier_client *c;
    struct kvt_fast_args fa;
    int64_t stack[KVT_FAST_STACK_KEYS], *ids = stack;
    int rc;

    if (unpack(args, "prepare_load", 2, 2, a) < 0)
        return NULL;
    if (args_init(&fa, a[0], true, a[1], "prepare_load") < 0)
        return NULL;
    if (fa.k.n > KVT_FAST_STACK_KEYS && (ids = PyMem_Malloc(fa.k.n * sizeof(*ids))) == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    if ((c = conn_handle(self)) == NULL)
        goto out;
    Py_BEGIN_ALLOW_THREADS if (fa.k.key_len) rc =
        self->f.prepare_load_packed(c, fa.rid, fa.k.packed, fa.k.key_len, fa.k.n, ids);
    else rc = self->f.prepare_load(c, fa.rid, fa.k.karr, fa.k.n, ids);
    Py_END_ALLOW_THREADS if (rc < 0)
    {
        conn_raise(self, rc, "prepare_load");
        goto out;
    }
    if ((out = PyList_New((Py_ssize_t)fa.k.n)) == NULL)
        goto out;
    for (size_t i = 0; i < fa.k.n; i++) {
        PyObject *x = PyLong_FromLongLong(ids[i]);

        if (x == NULL) {
            Py_CLEAR(out);
            goto out;
        }
        PyList_SetItem(out, (Py_ssize_t)i, x);
    }
out:
    if (ids != stack)
        PyMem_Free(ids);
    args_cleanup(&fa);
    return out;
}

/* complete_load(req_id or None, keys) and touch(req_id or None, keys) */
static PyObject *conn_keys_call(struct kvt_fast_conn *self, PyObject *args, bool load)
{
    const char *what = load ? "complete_load" : "touch";
    PyObject *a[2];
    struct kvtier_client *c;
    struct kvt_fast_args fa;
    int rc;

    if (unpack(args, what, 2, 2, a) < 0)
        return NULL;
    if (args_init(&fa, a[0], true, a[1], what) < 0)
        return NULL;
    if ((c = conn_handle(self)) == NULL) {
        args_cleanup(&fa);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS if (load && fa.k.key_len) rc =
        self->f.complete_load_packed(c, fa.rid, fa.k.packed, fa.k.key_len, fa.k.n);
    else if (load) rc = self->f.complete_load(c, fa.rid, fa.k.karr, fa.k.n);
    else if (fa.k.key_len) rc = self->f.touch_packed(c, fa.rid, fa.k.packed, fa.k.key_len, fa.k.n);
    else rc = self->f.touch(c, fa.rid, fa.k.karr, fa.k.n);
    Py_END_ALLOW_THREADS args_cleanup(&fa);
    if (rc < 0)
        return conn_raise(self, rc, what);
    Py_RETURN_NONE;
}

static PyObject *conn_complete_load(struct kvt_fast_conn *self, PyObject *args)
{
    return conn_keys_call(self, args, true);
}

static PyObject *conn_touch(struct kvt_fast_conn *self, PyObject *args)
{
    return conn_keys_call(self, args, false);
}

/* Request ids of a list, as C strings (the list keeps them; ids[] the caller's). */
static int ids_init(PyObject *o, PyObject **seq_p, PyObject **tmp_p, const char ***ids_p,
                    size_t *n_p)
{
    PyObject *seq, *tmp;
    Py_ssize_t n;
    const char **ids;

    *seq_p = *tmp_p = NULL;
    *ids_p = NULL;
    *n_p = 0;
    if (o == Py_None)
        return 0;
    if ((seq = as_seq(o, "on_schedule_end")) == NULL)
        return -1;
    *seq_p = seq;
    n = PyTuple_Size(seq);
    if (n == 0)
        return 0;
    if ((tmp = *tmp_p = PyList_New(0)) == NULL)
        return -1;
    if ((ids = *ids_p = PyMem_Malloc((size_t)n * sizeof(*ids))) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *enc;

        if (req_arg(seq_item(seq, i), false, &ids[i], &enc) < 0)
            return -1;
        if (enc != NULL) { /* kept alive by tmp until the call is over */
            int r = PyList_Append(tmp, enc);

            Py_DECREF(enc);
            if (r < 0)
                return -1;
        }
    }
    *n_p = (size_t)n;
    return 0;
}

/* on_schedule_end(new=(), preempted=()): request ids, bytes or str. */
static PyObject *conn_on_schedule_end(struct kvt_fast_conn *self, PyObject *args)
{
    PyObject *a[2] = {Py_None, Py_None}, *seq[2] = {NULL, NULL}, *tmp[2] = {NULL, NULL};
    PyObject *out = NULL;
    const char **ids[2] = {NULL, NULL};
    size_t n[2] = {0, 0};
    struct kvtier_client *c;
    int rc;

    if (unpack(args, "on_schedule_end", 0, 2, a) < 0)
        return NULL;
    for (int i = 0; i < 2; i++)
        if (ids_init(a[i], &seq[i], &tmp[i], &ids[i], &n[i]) < 0)
            goto out;
    if ((c = conn_handle(self)) == NULL)
        goto out;
    Py_BEGIN_ALLOW_THREADS rc = self->f.on_schedule_end(c, ids[0], n[0], ids[1], n[1]);
    Py_END_ALLOW_THREADS if (rc < 0)
    {
        conn_raise(self, rc, "on_schedule_end");
        goto out;
    }
    Py_INCREF(Py_None);
    out = Py_None;
out:
    for (int i = 0; i < 2; i++) {
        PyMem_Free(ids[i]);
        Py_XDECREF(tmp[i]);
        Py_XDECREF(seq[i]);
    }
    return out;
}

/* Writes the keys of seq (a tuple from as_seq of bytes, 1..64 bytes each, checked
 * by the caller's keys_init or here) to out as struct kvtier_key. */
static int keys_to_structs(PyObject *seq, Py_ssize_t n, struct kvtier_key *out, Py_ssize_t job)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = seq_item(seq, i);
        Py_ssize_t len = PyBytes_Size(o);

        if (len < 1 || len > KVTIER_KEY_MAX) {
            if (job < 0)
                PyErr_Format(PyExc_ValueError, "key %zd: a key is 1..64 bytes", i);
            else
                PyErr_Format(PyExc_ValueError, "job %zd, key %zd: a key is 1..64 bytes", job, i);
            return -1;
        }
        out[i].len = (uint8_t)len;
        memcpy(out[i].bytes, PyBytes_AsString(o), (size_t)len);
        memset(out[i].bytes + len, 0, KVTIER_KEY_MAX - (size_t)len);
    }
    return 0;
}

/* jobs_step(lookup_keys, jobs) -> (verdicts, done): one engine step (kvtier_jobs_step).
 * jobs: (id, kind, keys, rows) tuples (kvtier.Job); done: (id, ok, key_ok) tuples of
 * the jobs finished since the last call, key_ok a list of bools. */
static PyObject *conn_jobs_step(struct kvt_fast_conn *self, PyObject *args)
{
    PyObject *a[2] = {NULL, NULL}, *lseq = NULL, *jseq = NULL, *keep = NULL, *out = NULL;
    PyObject *vl = NULL, *dl = NULL;
    struct kvtier_client *c;
    struct kvtier_key *lk = NULL, *kk = NULL;
    struct kvtier_job *jobs = NULL;
    struct kvtier_jobs_done *done = NULL;
    int64_t *rows = NULL;
    uint8_t *verdicts = NULL;
    Py_ssize_t nl, nj, total = 0;
    int rc;

    if (unpack(args, "jobs_step", 2, 2, a) < 0)
        return NULL;
    if ((lseq = as_seq(a[0], "jobs_step")) == NULL)
        goto out;
    Py_SETREF_(lseq, as_bytes_seq(lseq));
    if (lseq == NULL || (jseq = as_seq(a[1], "jobs_step")) == NULL)
        goto out;
    nl = PyTuple_Size(lseq);
    nj = PyTuple_Size(jseq);
    /* each job's keys (as bytes) and rows, kept alive in keep: [keys, rows] per job */
    if ((keep = PyList_New(0)) == NULL)
        goto out;
    for (Py_ssize_t j = 0; j < nj; j++) {
        PyObject *job = seq_item(jseq, j), *ks, *rs;
        Py_ssize_t nk, nr;
        int r;

        if (!PyTuple_Check(job) || PyTuple_Size(job) != 4) {
            PyErr_Format(PyExc_TypeError, "job %zd: a Job (id, kind, keys, rows)", j);
            goto out;
        }
        if ((ks = as_seq(PyTuple_GetItem(job, 2), "jobs_step")) == NULL)
            goto out;
        Py_SETREF_(ks, as_bytes_seq(ks));
        if (ks == NULL)
            goto out;
        if ((rs = as_seq(PyTuple_GetItem(job, 3), "jobs_step")) == NULL) {
            Py_DECREF(ks);
            goto out;
        }
        nk = PyTuple_Size(ks);
        nr = PyTuple_Size(rs);
        r = PyList_Append(keep, ks) < 0 || PyList_Append(keep, rs) < 0 ? -1 : 0;
        Py_DECREF(ks);
        Py_DECREF(rs);
        if (r < 0)
            goto out;
        if (nk != nr) {
            PyObject *id = PyTuple_GetItem(job, 0);

            PyErr_Format(PyExc_ValueError, "job %S: %zd keys but %zd rows", id, nk, nr);
            goto out;
        }
        total += nk;
    }
    lk = PyMem_Malloc((size_t)(nl ? nl : 1) * sizeof(*lk));
    verdicts = PyMem_Malloc((size_t)(nl ? nl : 1));
    kk = PyMem_Malloc((size_t)(total ? total : 1) * sizeof(*kk));
    rows = PyMem_Malloc((size_t)(total ? total : 1) * sizeof(*rows));
    jobs = PyMem_Malloc((size_t)(nj ? nj : 1) * sizeof(*jobs));
    if (lk == NULL || verdicts == NULL || kk == NULL || rows == NULL || jobs == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    if (keys_to_structs(lseq, nl, lk, -1) < 0)
        goto out;
    for (Py_ssize_t j = 0, at = 0; j < nj; j++) {
        PyObject *job = seq_item(jseq, j);
        PyObject *ks = PyList_GetItem(keep, 2 * j), *rs = PyList_GetItem(keep, 2 * j + 1);
        Py_ssize_t nk = PyTuple_Size(ks);
        unsigned long long id = PyLong_AsUnsignedLongLong(PyTuple_GetItem(job, 0));
        long kind;

        if (id == (unsigned long long)-1 && PyErr_Occurred())
            goto out;
        kind = PyLong_AsLong(PyTuple_GetItem(job, 1));
        if (kind == -1 && PyErr_Occurred())
            goto out;
        if (kind < INT_MIN || kind > INT_MAX) {
            PyErr_Format(PyExc_ValueError, "job %zd: kind %ld", j, kind);
            goto out;
        }
        if (keys_to_structs(ks, nk, kk + at, j) < 0)
            goto out;
        for (Py_ssize_t i = 0; i < nk; i++) {
            long long r = PyLong_AsLongLong(seq_item(rs, i));

            if (r == -1 && PyErr_Occurred())
                goto out;
            rows[at + i] = r;
        }
        jobs[j] = (struct kvtier_job){
            .id = id, .kind = (int)kind, .keys = kk + at, .rows = rows + at, .n = (size_t)nk};
        at += nk;
    }
    if ((c = conn_handle(self)) == NULL)
        goto out;
    Py_BEGIN_ALLOW_THREADS rc =
        self->f.jobs_step(c, lk, (size_t)nl, verdicts, jobs, (size_t)nj, &done);
    Py_END_ALLOW_THREADS if (rc < 0)
    {
        conn_raise(self, rc, "jobs_step");
        goto out;
    }
    if ((vl = PyList_New(nl)) == NULL || (dl = PyList_New(0)) == NULL)
        goto out;
    for (Py_ssize_t i = 0; i < nl; i++) {
        PyObject *x = PyLong_FromLong(verdicts[i]);

        if (x == NULL)
            goto out;
        PyList_SetItem(vl, i, x);
    }
    for (size_t j = 0; done != NULL && j < done->n; j++) {
        const struct kvtier_job_done *d = &done->job[j];
        PyObject *ok = PyList_New((Py_ssize_t)d->n), *t;

        if (ok == NULL)
            goto out;
        for (size_t i = 0; i < d->n; i++) {
            PyObject *b = d->key_ok[i] ? Py_True : Py_False;

            Py_INCREF(b);
            PyList_SetItem(ok, (Py_ssize_t)i, b);
        }
        t = Py_BuildValue("(KON)", (unsigned long long)d->id, d->ok ? Py_True : Py_False, ok);
        if (t == NULL || PyList_Append(dl, t) < 0) {
            Py_XDECREF(t);
            goto out;
        }
        Py_DECREF(t);
    }
    out = PyTuple_Pack(2, vl, dl);
out:
    if (done != NULL)
        self->f.jobs_done_free(done);
    Py_XDECREF(vl);
    Py_XDECREF(dl);
    PyMem_Free(lk);
    PyMem_Free(verdicts);
    PyMem_Free(kk);
    PyMem_Free(rows);
    PyMem_Free(jobs);
    Py_XDECREF(keep);
    Py_XDECREF(jseq);
    Py_XDECREF(lseq);
    return out;
}

/* ---- KeyTable: the secondary tier's lookup state ------------------------------ */

/* kvtier.vllm's KvtierSecondaryTier answers vLLM's lookups from verdicts it holds,
 * on the scheduler's thread, for every block of every new request. The state of a
 * key (its probe generation, the verdict lookup() answers, whether a probe of it is
 * out, how many live requests looked it up) lives here in one open-addressing
 * table of plain structs, linear probing, deletion by backward shift (no
 * tombstones): no Python object per key beyond the key itself, and lookup(),
 * the verdicts' landing, the marks of finished jobs and a request's end each in
 * one C call. The rules are the tier's (kvtier.vllm._PyKeyTable is the same table
 * in Python, for a package without this module; both are tested against each
 * other). A request's keys are a Python set per request id (dict reqs), kept only
 * to count each request once per key; while a request holds a key, its entry
 * stays (nreq >= 1). Only the scheduler's thread calls a KeyTable (vLLM holds its
 * manager's lock), with the GIL. Keys are bytes; they are hashed by Python (cached
 * in the object) and compared by content. Keys and request ids are kept as plain
 * bytes and str (kt_key, kt_rid), so no operation on the table or its sets and dict
 * runs Python code but the collector's. */

enum { KT_RETRY, KT_HIT, KT_MISS }; /* an entry's verdict: the index into results */

struct kt_slot {
    PyObject *key; /* NULL: empty; owned */
    Py_hash_t hash;
    unsigned long long gen; /* the probe generation a verdict must carry to land */
    Py_ssize_t nreq;        /* live requests whose sets hold the key */
    uint8_t verdict;        /* KT_RETRY until the node's verdict is here */
    uint8_t in_flight;      /* a probe of this generation is out */
};

struct kt_probe {  /* a key first looked up this step, to be asked */
    PyObject *key; /* owned */
    Py_hash_t hash;
    unsigned long long gen;
};

struct kvt_fast_table {
    PyObject_HEAD struct kt_slot *slots;
    size_t cap; /* a power of two; 0 before the first key */
    size_t n;
    unsigned long long next_gen;
    struct kt_probe *step;
    size_t nstep, step_cap;
    PyObject *reqs;     /* dict: request id -> set of keys */
    PyObject *last_rid; /* the last request looked up and its set (lookups come in runs) */
    PyObject *last_set;
    PyObject *results[3]; /* what lookup() returns for RETRY, HIT, MISS */
};

/* key as the table keeps it (a new reference), and its hash: bytes itself, a bytes
 * subclass's content as plain bytes. A subclass's __hash__ and __eq__ are Python
 * code, which would run inside the table's and the request sets' operations, where
 * it could change the table or free a set under the call; bytes' own run none. */
static PyObject *kt_key(PyObject *key, Py_hash_t *hash_p)
{
    if (PyBytes_CheckExact(key)) {
        Py_INCREF(key);
    } else if (PyBytes_Check(key)) {
        key = PyBytes_FromStringAndSize(PyBytes_AsString(key), PyBytes_Size(key));
    } else {
        PyErr_SetString(PyExc_TypeError, "a key is bytes");
        return NULL;
    }
    if (key != NULL)
        *hash_p = PyObject_Hash(key); /* (bytes': cannot fail) */
    return key;
}

/* A request id as the table keeps it (a new reference): str or bytes, a subclass's
 * content as plain str or bytes (for the same reason as kt_key's). */
static PyObject *kt_rid(PyObject *rid)
{
    if (PyUnicode_CheckExact(rid) || PyBytes_CheckExact(rid)) {
        Py_INCREF(rid);
        return rid;
    }
    if (PyUnicode_Check(rid))
        return PyUnicode_FromObject(rid);
    if (PyBytes_Check(rid))
        return PyBytes_FromStringAndSize(PyBytes_AsString(rid), PyBytes_Size(rid));
    PyErr_SetString(PyExc_TypeError, "a request id is str or bytes");
    return NULL;
}

static bool kt_same(PyObject *a, PyObject *b)
{
    Py_ssize_t n;

    if (a == b)
        return true;
    n = PyBytes_Size(a);
    return n == PyBytes_Size(b) && memcmp(PyBytes_AsString(a), PyBytes_AsString(b), (size_t)n) == 0;
}

/* The slot of key, or NULL. Calls no Python code. */
static struct kt_slot *kt_find(struct kvt_fast_table *t, PyObject *key, Py_hash_t hash)
{
    size_t mask = t->cap - 1;

    if (t->cap == 0)
        return NULL;
    for (size_t i = (size_t)hash & mask;; i = (i + 1) & mask) {
        struct kt_slot *s = &t->slots[i];

        if (s->key == NULL)
            return NULL;
        if (s->hash == hash && kt_same(s->key, key))
            return s;
    }
}

static int kt_grow(struct kvt_fast_table *t)
{
    size_t cap = t->cap ? t->cap * 2 : 64;
    struct kt_slot *old = t->slots, *slots;

    if (cap > PY_SSIZE_T_MAX / sizeof(*slots) ||
        (slots = PyMem_Calloc(cap, sizeof(*slots))) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (size_t i = 0; i < t->cap; i++) {
        size_t j;

        if (old[i].key == NULL)
            continue;
        for (j = (size_t)old[i].hash & (cap - 1); slots[j].key != NULL; j = (j + 1) & (cap - 1))
            ;
        slots[j] = old[i];
    }
    t->slots = slots;
    t->cap = cap;
    PyMem_Free(old);
    return 0;
}

/* A new entry for key (not in the table): RETRY, the next generation, no request. */
static struct kt_slot *kt_insert(struct kvt_fast_table *t, PyObject *key, Py_hash_t hash)
{
    size_t i;

    if ((t->n + 1) * 2 > t->cap && kt_grow(t) < 0) /* at most half full */
        return NULL;
    for (i = (size_t)hash & (t->cap - 1); t->slots[i].key != NULL; i = (i + 1) & (t->cap - 1))
        ;
    Py_INCREF(key);
    t->slots[i] =
        (struct kt_slot){.key = key, .hash = hash, .gen = t->next_gen++, .verdict = KT_RETRY};
    t->n++;
    return &t->slots[i];
}

/* Removes s; the entries after it in its run move back so that every entry stays
 * reachable from its home slot. The key is released last (its release runs no
 * code of ours, but the table is whole by then). */
static void kt_delete(struct kvt_fast_table *t, struct kt_slot *s)
{
    size_t mask = t->cap - 1, i = (size_t)(s - t->slots), j = i;
    PyObject *key = s->key;

    for (;;) {
        size_t home;

        j = (j + 1) & mask;
        if (t->slots[j].key == NULL)
            break;
        home = (size_t)t->slots[j].hash & mask;
        /* the entry at j stays when its home lies cyclically in (i, j] */
        if (i <= j ? (i < home && home <= j) : (i < home || home <= j))
            continue;
        t->slots[i] = t->slots[j];
        i = j;
    }
    t->slots[i].key = NULL;
    t->n--;
    Py_DECREF(key);
}

/* The set of keys of request rid (made when absent): a borrowed reference. */
static PyObject *kt_req_set(struct kvt_fast_table *t, PyObject *rid)
{
    PyObject *set;

    if (rid == t->last_rid)
        return t->last_set;
    if ((rid = kt_rid(rid)) == NULL)
        return NULL;
    set = PyDict_GetItemWithError(t->reqs, rid);
    if (set == NULL && !PyErr_Occurred()) {
        PyObject *fresh = PySet_New(NULL);

        /* Making a set may run the collector, whose finalizers may look this request
         * up and make its set first: that one is kept (a second would lose its keys). */
        set = fresh == NULL ? NULL : PyDict_GetItemWithError(t->reqs, rid);
        if (set == NULL && fresh != NULL && !PyErr_Occurred() &&
            PyDict_SetItem(t->reqs, rid, fresh) == 0)
            set = fresh;
        Py_XDECREF(fresh); /* the dict holds the set kept */
    }
    if (set == NULL) {
        Py_DECREF(rid);
        return NULL;
    }
    Py_INCREF(set);
    Py_XSETREF_(t->last_rid, rid);
    Py_XSETREF_(t->last_set, set);
    return set;
}

/* lookup(key, req_id, node_up) -> what the tier answers: the key's verdict; a key
 * not known is asked at the step's end (RETRY meanwhile), or is a MISS while the
 * node is down. The request is counted once per key. */
static PyObject *table_lookup(struct kvt_fast_table *t, PyObject *args)
{
    PyObject *key, *rid, *set, *out = NULL;
    struct kt_slot *s;
    Py_hash_t hash;
    int up, has;

    /* (by hand: PyArg_ParseTuple costs as much as the rest of a known key's lookup) */
    if (PyTuple_Size(args) != 3) {
        PyErr_SetString(PyExc_TypeError, "lookup(key, req_id, node_up)");
        return NULL;
    }
    rid = PyTuple_GetItem(args, 1);
    if ((up = PyObject_IsTrue(PyTuple_GetItem(args, 2))) < 0 ||
        (key = kt_key(PyTuple_GetItem(args, 0), &hash)) == NULL)
        return NULL;
    s = kt_find(t, key, hash);
    if (s == NULL && !up) {
        out = t->results[KT_MISS];
        goto out;
    }
    /* The request's set first: making one may run the collector, so the slot is
     * found again after. */
    if ((set = kt_req_set(t, rid)) == NULL || (has = PySet_Contains(set, key)) < 0)
        goto out;
    s = kt_find(t, key, hash);
    if (s == NULL) {
        if (t->nstep == t->step_cap) {
            size_t cap = t->step_cap ? t->step_cap * 2 : 256;
            struct kt_probe *step = PyMem_Realloc(t->step, cap * sizeof(*step));

            if (step == NULL) {
                PyErr_NoMemory();
                goto out;
            }
            t->step = step;
            t->step_cap = cap;
        }
        if ((s = kt_insert(t, key, hash)) == NULL)
            goto out;
        Py_INCREF(key);
        t->step[t->nstep++] = (struct kt_probe){.key = key, .hash = hash, .gen = s->gen};
    }
    if (!has) {
        if (PySet_Add(set, key) < 0)
            goto out;
        s->nreq++;
    }
    out = t->results[s->verdict];
out:
    Py_XINCREF(out);
    Py_DECREF(key);
    return out;
}

/* request_finished(req_id): the request's keys lose it; a key no request holds
 * and no probe waits for goes. */
static PyObject *table_request_finished(struct kvt_fast_table *t, PyObject *rid)
{
    PyObject *set, *it, *key;
    int r;

    if ((rid = kt_rid(rid)) == NULL)
        return NULL;
    set = PyDict_GetItemWithError(t->reqs, rid);
    if (set == NULL) {
        Py_DECREF(rid);
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_NONE;
    }
    Py_INCREF(set);
    r = PyDict_DelItem(t->reqs, rid);
    Py_DECREF(rid);
    if (r < 0) {
        Py_DECREF(set);
        return NULL;
    }
    if (set == t->last_set) {
        Py_CLEAR(t->last_rid);
        Py_CLEAR(t->last_set);
    }
    if ((it = PyObject_GetIter(set)) == NULL) {
        Py_DECREF(set);
        return NULL;
    }
    while ((key = PyIter_Next(it)) != NULL) {
        Py_hash_t hash = PyObject_Hash(key); /* (cannot fail: the set hashed it) */
        struct kt_slot *s = hash == -1 ? NULL : kt_find(t, key, hash);

        if (s != NULL && --s->nreq <= 0 && !s->in_flight)
            kt_delete(t, s);
        Py_DECREF(key);
    }
    Py_DECREF(it);
    Py_DECREF(set);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

/* mark(keys, present): a store that succeeded makes its keys present (a new
 * generation, so a probe still out cannot land over it; a key no request holds
 * goes instead); a load that failed makes its keys' verdicts MISS (vLLM issue
 * #49176: they are not offered again), except where no verdict is here yet. */
static PyObject *table_mark(struct kvt_fast_table *t, PyObject *args)
{
    PyObject *keys, *it, *key;
    int present;

    if (!PyArg_ParseTuple(args, "Op:mark", &keys, &present) ||
        (it = PyObject_GetIter(keys)) == NULL)
        return NULL;
    while ((key = PyIter_Next(it)) != NULL) {
        struct kt_slot *s;
        Py_hash_t hash;

        PyObject *k = kt_key(key, &hash);

        Py_DECREF(key);
        if (k == NULL)
            break;
        s = kt_find(t, k, hash);
        Py_DECREF(k);
        if (s == NULL)
            continue;
        if (present) {
            if (s->nreq <= 0) {
                kt_delete(t, s);
                continue;
            }
            s->gen = t->next_gen++;
            s->verdict = KT_HIT;
            s->in_flight = 0;
        } else if (s->verdict != KT_RETRY) {
            s->verdict = KT_MISS;
        }
    }
    Py_DECREF(it);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

/* flush() -> (keys, gens): the keys first looked up since the last flush that still
 * wait for their verdict (now in flight), with their generations, to be asked. */
static PyObject *table_flush(struct kvt_fast_table *t, PyObject *unused)
{
    PyObject *keys = PyList_New(0), *gens = PyList_New(0), *out = NULL;
    bool ok = keys != NULL && gens != NULL;
    size_t i;

    for (i = 0; ok && i < t->nstep; i++) {
        struct kt_probe *p = &t->step[i];
        struct kt_slot *s = kt_find(t, p->key, p->hash);
        PyObject *g;

        if (s == NULL || s->gen != p->gen || s->verdict != KT_RETRY)
            continue;
        if ((g = PyLong_FromUnsignedLongLong(p->gen)) == NULL || PyList_Append(keys, p->key) < 0 ||
            PyList_Append(gens, g) < 0)
            ok = false;
        Py_XDECREF(g);
        s->in_flight = ok;
    }
    /* The step's probes are spent either way (as the Python table's), before the
     * tuple is made: making it may run the collector, and a finalizer this table's
     * lookup, whose new probe must stay for the next flush. */
    for (i = 0; i < t->nstep; i++)
        Py_DECREF(t->step[i].key);
    t->nstep = 0;
    if (ok)
        out = PyTuple_Pack(2, keys, gens);
    Py_XDECREF(keys);
    Py_XDECREF(gens);
    return out;
}

/* apply(keys, gens, verdicts) -> (miss, hit, hit_pending, retry): the node's
 * verdicts (kvtier.MISS..RETRY) for keys asked with gens, counted by verdict. One
 * lands where the key is still at that generation: its probe is over, the key
 * goes when no request holds it, else HIT / HIT_PENDING make it HIT and MISS a
 * MISS. RETRY changes nothing (the I/O thread asks again). The lists are checked
 * before anything changes. */
static PyObject *table_apply(struct kvt_fast_table *t, PyObject *args)
{
    PyObject *a[3], *tup[3] = {NULL, NULL, NULL}, *out = NULL;
    Py_ssize_t n, i;
    Py_ssize_t counts[4] = {0, 0, 0, 0};
    long *vs = NULL;
    unsigned long long *gens = NULL;

    if (!PyArg_ParseTuple(args, "O!O!O!:apply", &PyList_Type, &a[0], &PyList_Type, &a[1],
                          &PyList_Type, &a[2]))
        return NULL;
    /* Snapshots, and each verdict and generation converted once: a conversion can
     * run Python code (an __index__), which must change neither the lists read nor a
     * value already checked. */
    for (i = 0; i < 3; i++)
        if ((tup[i] = PyList_AsTuple(a[i])) == NULL)
            goto out;
    n = PyTuple_Size(tup[0]);
    if (PyTuple_Size(tup[1]) != n || PyTuple_Size(tup[2]) != n) {
        PyErr_SetString(PyExc_ValueError, "apply: keys, gens and verdicts differ in length");
        goto out;
    }
    vs = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(*vs));
    gens = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(*gens));
    if (vs == NULL || gens == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    for (i = 0; i < n; i++) {
        vs[i] = PyLong_AsLong(PyTuple_GetItem(tup[2], i));
        if (vs[i] == -1 && PyErr_Occurred())
            goto out;
        if (vs[i] < KVTIER_MISS || vs[i] > KVTIER_RETRY) {
            PyErr_Format(PyExc_ValueError, "apply: verdict %ld", vs[i]);
            goto out;
        }
        if (!PyBytes_Check(PyTuple_GetItem(tup[0], i))) {
            PyErr_SetString(PyExc_TypeError, "apply: a key is bytes");
            goto out;
        }
        gens[i] = PyLong_AsUnsignedLongLong(PyTuple_GetItem(tup[1], i));
        if (gens[i] == (unsigned long long)-1 && PyErr_Occurred())
            goto out;
    }
    for (i = 0; i < n; i++) {
        PyObject *key;
        long v = vs[i];
        struct kt_slot *s;
        Py_hash_t hash;

        counts[v]++;
        if (v == KVTIER_RETRY || (key = kt_key(PyTuple_GetItem(tup[0], i), &hash)) == NULL)
            continue;
        s = kt_find(t, key, hash);
        Py_DECREF(key);
        if (s == NULL || s->gen != gens[i])
            continue;
        s->in_flight = 0;
        if (s->nreq <= 0) {
            kt_delete(t, s);
            continue;
        }
        s->verdict = v == KVTIER_HIT || v == KVTIER_HIT_PENDING ? KT_HIT : KT_MISS;
    }
    if (!PyErr_Occurred())
        out = Py_BuildValue("(nnnn)", counts[KVTIER_MISS], counts[KVTIER_HIT],
                            counts[KVTIER_HIT_PENDING], counts[KVTIER_RETRY]);
out:
    PyMem_Free(vs);
    PyMem_Free(gens);
    for (i = 0; i < 3; i++)
        Py_XDECREF(tup[i]);
    return out;
}

/* node_down(): the node went away: every key still waiting is a MISS, its probe
 * over (a key no request holds goes). */
static PyObject *table_node_down(struct kvt_fast_table *t, PyObject *unused)
{
    /* A deletion moves later entries back into the hole: slot i is looked at again
     * (an entry that wrapped around may be seen twice, which changes nothing). */
    for (size_t i = 0; i < t->cap;) {
        struct kt_slot *s = &t->slots[i];

        if (s->key != NULL && s->verdict == KT_RETRY) {
            s->in_flight = 0;
            s->verdict = KT_MISS;
            if (s->nreq <= 0) {
                kt_delete(t, s);
                continue;
            }
        }
        i++;
    }
    Py_RETURN_NONE;
}

/* state(key) -> None or (gen, verdict, in_flight, nreq): for tests and debugging. */
static PyObject *table_state(struct kvt_fast_table *t, PyObject *key)
{
    struct kt_slot *s;
    Py_hash_t hash;

    if ((key = kt_key(key, &hash)) == NULL)
        return NULL;
    s = kt_find(t, key, hash);
    Py_DECREF(key);
    if (s == NULL)
        Py_RETURN_NONE;
    return Py_BuildValue("(KOOn)", s->gen, t->results[s->verdict],
                         s->in_flight ? Py_True : Py_False, s->nreq);
}

static Py_ssize_t table_len(struct kvt_fast_table *t)
{
    return (Py_ssize_t)t->n;
}

static PyObject *table_get_requests(struct kvt_fast_table *t, void *unused)
{
    return PyLong_FromSsize_t(PyDict_Size(t->reqs));
}

static PyObject *table_get_pending(struct kvt_fast_table *t, void *unused)
{
    return PyLong_FromSize_t(t->nstep);
}

/* KeyTable(retry, hit, miss): the objects lookup() returns for each verdict
 * (vLLM's LookupResult members). */
static PyObject *table_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    struct kvt_fast_table *t;
    PyObject *r[3];

    if ((kwds != NULL && PyDict_Size(kwds) > 0) ||
        !PyArg_ParseTuple(args, "OOO:KeyTable", &r[KT_RETRY], &r[KT_HIT], &r[KT_MISS])) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "KeyTable(retry, hit, miss) takes no keywords");
        return NULL;
    }
    if ((t = (struct kvt_fast_table *)PyType_GenericAlloc(type, 0)) == NULL)
        return NULL;
    if ((t->reqs = PyDict_New()) == NULL) {
        Py_DECREF(t);
        return NULL;
    }
    for (int i = 0; i < 3; i++) {
        Py_INCREF(r[i]);
        t->results[i] = r[i];
    }
    return (PyObject *)t;
}

static void table_dealloc(struct kvt_fast_table *t)
{
    PyTypeObject *tp = Py_TYPE(t);
    freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);

    for (size_t i = 0; i < t->cap; i++)
        Py_XDECREF(t->slots[i].key);
    PyMem_Free(t->slots);
    for (size_t i = 0; i < t->nstep; i++)
        Py_DECREF(t->step[i].key);
    PyMem_Free(t->step);
    Py_XDECREF(t->reqs);
    Py_XDECREF(t->last_rid);
    Py_XDECREF(t->last_set);
    for (int i = 0; i < 3; i++)
        Py_XDECREF(t->results[i]);
    tp_free(t);
    Py_DECREF(tp);
}

static PyMethodDef table_methods[] = {
    {"lookup", (PyCFunction)table_lookup, METH_VARARGS,
     "lookup(key, req_id, node_up) -> the key's verdict (RETRY, HIT or MISS)"},
    {"request_finished", (PyCFunction)table_request_finished, METH_O,
     "request_finished(req_id): the request's keys lose it"},
    {"mark", (PyCFunction)table_mark, METH_VARARGS,
     "mark(keys, present): a successful store's keys (True) or a failed load's (False)"},
    {"flush", (PyCFunction)table_flush, METH_NOARGS,
     "flush() -> (keys, gens): the step's new keys to ask, now in flight"},
    {"apply", (PyCFunction)table_apply, METH_VARARGS,
     "apply(keys, gens, verdicts) -> (miss, hit, hit_pending, retry) counts"},
    {"node_down", (PyCFunction)table_node_down, METH_NOARGS,
     "node_down(): every key still waiting is a MISS"},
    {"state", (PyCFunction)table_state, METH_O,
     "state(key) -> None or (gen, verdict, in_flight, nreq)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef table_getset[] = {
    {"requests", (getter)table_get_requests, NULL, "live requests with keys", NULL},
    {"pending", (getter)table_get_pending, NULL, "keys looked up since the last flush", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot table_slots[] = {
    {Py_tp_new, table_new},
    {Py_tp_dealloc, table_dealloc},
    {Py_tp_methods, table_methods},
    {Py_tp_getset, table_getset},
    {Py_sq_length, table_len},
    {Py_tp_doc, "The lookup state of kvtier.vllm's secondary tier (see kvtier._fast)."},
    {0, NULL},
};

static PyType_Spec table_spec = {
    .name = "kvtier._fast.KeyTable",
    .basicsize = sizeof(struct kvt_fast_table),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = table_slots,
};

/* close(): forgets the client (its owner closes it); every later call raises. */
static PyObject *conn_close(struct kvt_fast_conn *self, PyObject *unused)
{
    (void)unused;
    self->c = NULL;
    Py_RETURN_NONE;
}

static PyObject *conn_get_closed(struct kvt_fast_conn *self, void *unused)
{
    (void)unused;
    return PyBool_FromLong(self->c == NULL);
}

/* ---- the type ------------------------------------------------------------------ */

/* Conn(dl_handle, client, error, results=(0, 1, 2, 3)): dl_handle is the library's
 * dlopen handle (ctypes.CDLL._handle), client the kvtier_client pointer (an int). */
static PyObject *conn_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static const struct {
        const char *name;
        size_t off;
    } syms[] = {
#define SYM(field, name) {name, offsetof(struct kvt_fast_fns, field)}
        SYM(client_error, "kvtier_client_error"),
        SYM(lookup_one, "kvtier_lookup_one"),
        SYM(lookup_packed, "kvtier_lookup_packed"),
        SYM(lookup, "kvtier_lookup"),
        SYM(prepare_store_packed, "kvtier_prepare_store_packed"),
        SYM(prepare_store, "kvtier_prepare_store"),
        SYM(complete_store_packed, "kvtier_complete_store_packed"),
        SYM(complete_store, "kvtier_complete_store"),
        SYM(prepare_load_packed, "kvtier_prepare_load_packed"),
        SYM(prepare_load, "kvtier_prepare_load"),
        SYM(complete_load_packed, "kvtier_complete_load_packed"),
        SYM(complete_load, "kvtier_complete_load"),
        SYM(touch_packed, "kvtier_touch_packed"),
        SYM(touch, "kvtier_touch"),
        SYM(on_schedule_end, "kvtier_on_schedule_end"),
        SYM(jobs_step, "kvtier_jobs_step"),
        SYM(jobs_done_free, "kvtier_jobs_done_free"),
#undef SYM
    };
    PyObject *a[4] = {NULL, NULL, NULL, NULL};
    struct kvt_fast_conn *self;
    void *dl, *c;

    if (kwds != NULL && PyDict_Size(kwds) != 0) {
        PyErr_SetString(PyExc_TypeError, "Conn() takes no keyword arguments");
        return NULL;
    }
    if (unpack(args, "Conn", 3, 4, a) < 0)
        return NULL;
    dl = PyLong_AsVoidPtr(a[0]);
    if (dl == NULL && PyErr_Occurred())
        return NULL;
    c = PyLong_AsVoidPtr(a[1]);
    if (c == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "Conn: no client");
        return NULL;
    }
    if (!PyCallable_Check(a[2])) {
        PyErr_SetString(PyExc_TypeError, "Conn: error must be an exception class");
        return NULL;
    }
    if (a[3] != NULL && (!PyTuple_Check(a[3]) || PyTuple_Size(a[3]) != 4)) {
        PyErr_SetString(PyExc_TypeError, "Conn: results is a tuple of 4");
        return NULL;
    }
    self = (struct kvt_fast_conn *)PyType_GenericAlloc(type, 0);
    if (self == NULL)
        return NULL;
    for (size_t i = 0; i < sizeof(syms) / sizeof(syms[0]); i++) {
        void *fn = dlsym(dl, syms[i].name);

        if (fn == NULL) {
            PyErr_Format(PyExc_OSError, "libkvtier-client has no %s", syms[i].name);
            Py_DECREF(self);
            return NULL;
        }
        memcpy((char *)&self->f + syms[i].off, &fn, sizeof(fn));
    }
    Py_INCREF(a[2]);
    self->error = a[2];
    if (a[3] != NULL) {
        Py_INCREF(a[3]);
        self->results = a[3];
    } else {
        self->results = Py_BuildValue("(iiii)", 0, 1, 2, 3);
        if (self->results == NULL) {
            Py_DECREF(self);
            return NULL;
        }
    }
    self->c = c;
    return (PyObject *)self;
}

static void conn_dealloc(struct kvt_fast_conn *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);

    Py_XDECREF(self->error);
    Py_XDECREF(self->results);
    tp_free(self);
    Py_DECREF(tp);
}

static PyMethodDef conn_methods[] = {
    {"lookup_one", (PyCFunction)conn_lookup_one, METH_VARARGS,
     "lookup_one(req_id, key) -> the key's result"},
    {"lookup", (PyCFunction)conn_lookup, METH_VARARGS,
     "lookup(req_id, keys, prefix=False) -> [result]"},
    {"prepare_store", (PyCFunction)conn_prepare_store, METH_VARARGS,
     "prepare_store(req_id, keys) -> (store_index, chunk_ids, evicted)"},
    {"complete_store", (PyCFunction)conn_complete_store, METH_VARARGS,
     "complete_store(req_id, keys, success=True)"},
    {"prepare_load", (PyCFunction)conn_prepare_load, METH_VARARGS,
     "prepare_load(req_id or None, keys) -> [chunk id]"},
    {"complete_load", (PyCFunction)conn_complete_load, METH_VARARGS,
     "complete_load(req_id or None, keys)"},
    {"touch", (PyCFunction)conn_touch, METH_VARARGS, "touch(req_id or None, keys)"},
    {"on_schedule_end", (PyCFunction)conn_on_schedule_end, METH_VARARGS,
     "on_schedule_end(new=None, preempted=None)"},
    {"jobs_step", (PyCFunction)conn_jobs_step, METH_VARARGS,
     "jobs_step(lookup_keys, jobs) -> (verdicts, [(id, ok, key_ok)])"},
    {"close", (PyCFunction)conn_close, METH_NOARGS, "forget the client (its owner closes it)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef conn_getset[] = {
    {"closed", (getter)conn_get_closed, NULL, "whether close() was called", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot conn_slots[] = {
    {Py_tp_new, conn_new},
    {Py_tp_dealloc, conn_dealloc},
    {Py_tp_methods, conn_methods},
    {Py_tp_getset, conn_getset},
    {Py_tp_doc, "The hot calls of one kvtier client (see kvtier._fast)."},
    {0, NULL},
};

static PyType_Spec conn_spec = {
    .name = "kvtier._fast.Conn",
    .basicsize = sizeof(struct kvt_fast_conn),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = conn_slots,
};

static int fast_exec(PyObject *m)
{
    PyObject *t = PyType_FromSpec(&conn_spec);

    if (t == NULL)
        return -1;
    if (PyModule_AddObject(m, "Conn", t) < 0) {
        Py_DECREF(t);
        return -1;
    }
    if ((t = PyType_FromSpec(&table_spec)) == NULL)
        return -1;
    if (PyModule_AddObject(m, "KeyTable", t) < 0) {
        Py_DECREF(t);
        return -1;
    }
    return 0;
}

static PyModuleDef_Slot fast_slots[] = {
    {Py_mod_exec, fast_exec},
    {0, NULL},
};

static struct PyModuleDef fast_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvtier._fast",
    .m_doc = "The hot calls of libkvtier-client without ctypes (see kvtier.Client.fast).",
    .m_size = 0,
    .m_slots = fast_slots,
};

PyMODINIT_FUNC PyInit__fast(void);

PyMODINIT_FUNC PyInit__fast(void)
{
    return PyModuleDef_Init(&fast_module);
}

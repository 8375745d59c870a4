# SPDX-License-Identifier: Apache-2.0
"""kvtier: drive kvtierd's local engine API from Python (ctypes over libkvtier-client).

Debian's python3 only: no third-party package. The C contract is
<kvtier/client.h>; this module is a thin layer over it:

    import time
    import kvtier
    with kvtier.Client("/run/kvtier/engine.sock", name="my-engine") as c:
        c.on_new_request("req-1")
        keys = [kvtier.make_key(block_hash, 0) for block_hash in hashes]
        # A secondary tier may still be looking (RETRY: the network tier asks the
        # key's home node first, so a key the node has not seen answers RETRY, not
        # MISS) or promoting (HIT_PENDING): ask again after the step ends.
        res = c.lookup("req-1", keys)
        for _ in range(1000):
            if kvtier.RETRY not in res and kvtier.HIT_PENDING not in res:
                break
            c.on_schedule_end()
            time.sleep(0.001)
            res = c.lookup("req-1", keys)
        missing = [k for k, r in zip(keys, res) if r == kvtier.MISS]
        if missing:
            plan = c.prepare_store("req-1", missing)
            for idx, chunk in plan.stores:
                c.row(chunk)[:] = chunk_bytes_of(missing[idx])  # a writable memoryview
            c.complete_store("req-1", missing)
        c.on_schedule_end(new=["req-1"])
        c.on_request_finished("req-1")

(A key still RETRY after that is treated as a MISS: storing it then is harmless,
prepare_store leaves out what the node holds already.)

Errors raise KvtierError (an OSError: .errno is the positive errno, e.g.
errno.ENOSPC for "cannot store"; .reason is the node's own text when it closed the
connection, e.g. why it refused the engine's model fingerprint). The library is the
one installed inside this package (pip install builds it); $KVTIER_CLIENT_LIB, when
set, names another (a development build), and the system's library path is the last
resort. kvtier.__version__ is the loaded library's version, the project's.

The hot calls (lookup, lookup_one, prepare_store, complete_store, prepare_load,
complete_load, touch, on_schedule_end, jobs_step) go through kvtier._fast, a CPython extension
pip builds with the package (limited API: one build for every CPython >= 3.9), on
the library ctypes loaded: the same results and errors for a fraction of ctypes'
cost per call. Client.fast is that extension's object of the client (None only when
the package has none: imported from a source tree, or the Debian package's copy;
$KVTIER_FAST_MODULE, when set, names a built one, as $KVTIER_CLIENT_LIB does the
library; setting Client.fast to None sends the calls through ctypes again). The
other calls stay on ctypes.

An engine declares its model with fingerprint= (any text up to 255 bytes that
changes when the model, dtype, KV layout, block size, parallelism or hash seed do;
kvtier.vllm computes one): a node that serves another model refuses it
(errno.EKEYREJECTED). The node's side: reset() (forget every chunk; EBUSY while an
engine holds pins or stores), has_pending_work(), peers(), get_stats(totals=True).

An engine with its own CPU region (vLLM) attaches it and lets the node move rows
(kvtier.vllm builds on this):

    c.attach_region(fd, offset, rows, stride)
    verdicts, done = c.jobs_step(lookup_keys, [Job(1, JOB_STORE, keys, rows)])
    # done: [JobDone(id, ok, key_ok)] for the jobs finished since the last call
"""

import ctypes
import ctypes.util
import errno as _errno
import os
import sys
from collections import namedtuple

__all__ = [
    "Client", "KvtierError", "make_key", "MISS", "HIT", "HIT_PENDING", "RETRY",
    "CHUNK_LEVEL", "REQUEST_LEVEL", "ANY", "MEDIUM_CPU", "MEDIUM_STORAGE", "LOCAL",
    "REMOTE", "Event", "Stat", "StorePlan", "Job", "JobDone", "JOB_STORE", "JOB_LOAD",
    "COUNTER", "GAUGE", "HISTOGRAM",
    "Peer", "PEER_ALIVE", "PEER_DOWN", "PEER_SELF", "FINGERPRINT_MAX",
]

MISS, HIT, HIT_PENDING, RETRY = 0, 1, 2, 3
RESULT_NAMES = {MISS: "MISS", HIT: "HIT", HIT_PENDING: "HIT_PENDING", RETRY: "RETRY"}
CHUNK_LEVEL, REQUEST_LEVEL = 0, 1
ANY = -1
MEDIUM_CPU, MEDIUM_STORAGE = 0, 1
LOCAL, REMOTE = 0, 1
COUNTER, GAUGE, HISTOGRAM = 0, 1, 2

KEY_MAX = 64
REQ_ID_MAX = 127
FINGERPRINT_MAX = 255
_ERROR_MAX = 1023
_ADDR_MAX = 63
PEER_ALIVE, PEER_DOWN, PEER_SELF = 0, 1, 2
_HIST_BUCKETS = 16
_LOOKUP_PREFIX = 1


class KvtierError(OSError):
    """A failed call: errno is the positive errno the C library returned; reason is
    the node's own text when it closed the connection ("" otherwise)."""

    def __init__(self, rc, what, reason=""):
        code = -rc
        text = "%s: %s" % (what, os.strerror(code))
        if reason:
            text += " (%s)" % reason
        super().__init__(code, text)
        self.reason = reason


Event = namedtuple("Event", "keys medium locality removed")
# bounds: a histogram's finite bucket upper bounds (buckets has one more: +Inf).
Stat = namedtuple("Stat", "name label kind value count sum buckets bounds", defaults=((),))
StorePlan = namedtuple("StorePlan", "stores evicted")  # stores: [(key index, chunk id)]
Peer = namedtuple("Peer", "node_id incarnation addr port state last_heard_ms pulled_bytes "
                         "served_bytes")  # state: PEER_ALIVE / PEER_DOWN / PEER_SELF
Job = namedtuple("Job", "id kind keys rows")  # rows of the attached region, co-indexed
JobDone = namedtuple("JobDone", "id ok key_ok")  # key_ok: a bool per key of the job
JOB_STORE, JOB_LOAD = 0, 1


def make_key(block_hash, group=0):
    """vLLM's make_offload_key: hash || be32(group)."""
    key = bytes(block_hash) + int(group).to_bytes(4, "big")
    if not 1 <= len(key) <= KEY_MAX:
        raise ValueError("a key is 1..64 bytes")
    return key


# ---- the C types ----------------------------------------------------------------

class _Key(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint8), ("bytes", ctypes.c_uint8 * KEY_MAX)]


class _Region(ctypes.Structure):
    _fields_ = [("base", ctypes.POINTER(ctypes.c_uint8)), ("size", ctypes.c_size_t),
                ("num_chunks", ctypes.c_size_t), ("row_bytes", ctypes.c_size_t),
                ("page_bytes", ctypes.c_size_t), ("num_workers", ctypes.c_uint),
                ("ident_dev", ctypes.c_uint64), ("ident_ino", ctypes.c_uint64)]


class _RingStats(ctypes.Structure):
    _fields_ = [("posted", ctypes.c_uint64), ("wakeups", ctypes.c_uint64),
                ("sleeps", ctypes.c_uint64), ("redirects", ctypes.c_uint64),
                ("posted_calls", ctypes.c_uint64)]


class _ConnectOpts(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("timeout_ms", ctypes.c_int)]


class _ConnectEx(ctypes.Structure):
    _fields_ = [("size", ctypes.c_size_t), ("name", ctypes.c_char_p),
                ("timeout_ms", ctypes.c_int), ("fingerprint", ctypes.c_char_p),
                ("error", ctypes.POINTER(ctypes.c_char)), ("error_len", ctypes.c_size_t)]


class _Peer(ctypes.Structure):
    _fields_ = [("node_id", ctypes.c_uint64), ("incarnation", ctypes.c_uint64),
                ("addr", ctypes.c_char * (_ADDR_MAX + 1)), ("port", ctypes.c_uint16),
                ("state", ctypes.c_int), ("last_heard_ms", ctypes.c_uint64),
                ("pulled_bytes", ctypes.c_uint64), ("served_bytes", ctypes.c_uint64)]


class _Peers(ctypes.Structure):
    _fields_ = [("p", ctypes.POINTER(_Peer)), ("n", ctypes.c_size_t)]


class _Matcher(ctypes.Structure):
    _fields_ = [("medium", ctypes.c_int), ("locality", ctypes.c_int)]


class _RequestOpts(ctypes.Structure):
    _fields_ = [("params_json", ctypes.c_char_p), ("load_tiers_all", ctypes.c_bool),
                ("load_tiers", ctypes.POINTER(_Matcher)), ("n_load_tiers", ctypes.c_size_t)]


class _StorePlan(ctypes.Structure):
    _fields_ = [("store_index", ctypes.POINTER(ctypes.c_uint32)),
                ("chunk_ids", ctypes.POINTER(ctypes.c_int64)),
                ("evicted", ctypes.POINTER(_Key)), ("cap_evicted", ctypes.c_size_t),
                ("n_store", ctypes.c_size_t), ("n_evicted", ctypes.c_size_t)]


class _Event(ctypes.Structure):
    _fields_ = [("keys", ctypes.POINTER(_Key)), ("n", ctypes.c_size_t),
                ("medium", ctypes.c_int), ("locality", ctypes.c_int),
                ("removed", ctypes.c_bool)]


class _Events(ctypes.Structure):
    _fields_ = [("ev", ctypes.POINTER(_Event)), ("n", ctypes.c_size_t)]


class _Stat(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char * 96), ("label", ctypes.c_char * 48),
                ("kind", ctypes.c_int), ("value", ctypes.c_double),
                ("count", ctypes.c_uint64), ("sum", ctypes.c_double),
                ("buckets", ctypes.c_uint64 * _HIST_BUCKETS)]


class _HistBounds(ctypes.Structure):
    _fields_ = [("n", ctypes.c_uint32), ("bound", ctypes.c_double * (_HIST_BUCKETS - 1))]


class _Job(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint64), ("kind", ctypes.c_int),
                ("keys", ctypes.POINTER(_Key)), ("rows", ctypes.POINTER(ctypes.c_int64)),
                ("n", ctypes.c_size_t)]


class _JobDone(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint64), ("ok", ctypes.c_bool), ("n", ctypes.c_size_t),
                ("key_ok", ctypes.POINTER(ctypes.c_uint8))]


class _JobsDone(ctypes.Structure):
    _fields_ = [("job", ctypes.POINTER(_JobDone)), ("n", ctypes.c_size_t)]


class _Stats(ctypes.Structure):
    _fields_ = [("s", ctypes.POINTER(_Stat)), ("n", ctypes.c_size_t),
                ("bounds", ctypes.c_double * _HIST_BUCKETS),
                ("stat_bounds", ctypes.POINTER(_HistBounds))]


_P = ctypes.c_void_p
_lib = None


def _load(path=None):
    global _lib
    if _lib is not None and path is None:
        return _lib
    candidates = [path, os.environ.get("KVTIER_CLIENT_LIB"),
                  os.path.join(os.path.dirname(os.path.abspath(__file__)),
                               "libkvtier-client.so"),
                  ctypes.util.find_library("kvtier-client")]
    last = None
    for cand in candidates:
        if not cand:
            continue
        try:
            lib = ctypes.CDLL(cand)
            break
        except OSError as e:
            last = e
    else:
        raise OSError("libkvtier-client not found (pip install kvtier builds it): %s" % last)

    def fn(name, restype, *args):
        f = getattr(lib, name)
        f.restype = restype
        f.argtypes = list(args)

    i, cp, sz = ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t
    kp = ctypes.POINTER(_Key)
    fn("kvtier_connect", i, cp, ctypes.POINTER(_ConnectOpts), ctypes.POINTER(_P))
    fn("kvtier_connect_ex", i, cp, ctypes.POINTER(_ConnectEx), ctypes.POINTER(_P))
    fn("kvtier_client_error", cp, _P)
    fn("kvtier_client_node_fingerprint", cp, _P)
    fn("kvtier_client_node_minor", ctypes.c_uint, _P)
    fn("kvtier_reset", i, _P)
    fn("kvtier_has_pending_work", i, _P, ctypes.POINTER(ctypes.c_bool))
    fn("kvtier_get_peers", i, _P, ctypes.POINTER(ctypes.POINTER(_Peers)))
    fn("kvtier_peers_free", None, ctypes.POINTER(_Peers))
    fn("kvtier_get_stats_totals", i, _P, ctypes.POINTER(ctypes.POINTER(_Stats)))
    fn("kvtier_close", None, _P)
    fn("kvtier_client_region", ctypes.POINTER(_Region), _P)
    fn("kvtier_client_id", ctypes.c_uint64, _P)
    fn("kvtier_client_max_keys", sz, _P)
    fn("kvtier_on_new_request", i, _P, cp, ctypes.POINTER(_RequestOpts),
       ctypes.POINTER(ctypes.c_int))
    fn("kvtier_on_request_finished", i, _P, cp)
    fn("kvtier_lookup", i, _P, cp, kp, sz, ctypes.c_uint, ctypes.POINTER(ctypes.c_uint8),
       ctypes.POINTER(sz))
    fn("kvtier_prepare_store", i, _P, cp, kp, sz, ctypes.POINTER(_StorePlan))
    fn("kvtier_complete_store", i, _P, cp, kp, sz, ctypes.c_bool)
    fn("kvtier_prepare_load", i, _P, cp, kp, sz, ctypes.POINTER(ctypes.c_int64))
    fn("kvtier_complete_load", i, _P, cp, kp, sz)
    fn("kvtier_touch", i, _P, cp, kp, sz)
    fn("kvtier_on_schedule_end", i, _P, ctypes.POINTER(cp), sz, ctypes.POINTER(cp), sz)
    fn("kvtier_take_events", i, _P, ctypes.POINTER(ctypes.POINTER(_Events)))
    fn("kvtier_events_free", None, ctypes.POINTER(_Events))
    fn("kvtier_get_stats", i, _P, ctypes.POINTER(ctypes.POINTER(_Stats)))
    fn("kvtier_stats_free", None, ctypes.POINTER(_Stats))
    fn("kvtier_version", cp)
    fn("kvtier_attach_region", i, _P, i, ctypes.c_uint64, sz, sz, ctypes.POINTER(sz))
    fn("kvtier_jobs_step", i, _P, kp, sz, ctypes.POINTER(ctypes.c_uint8), ctypes.POINTER(_Job),
       sz, ctypes.POINTER(ctypes.POINTER(_JobsDone)))
    fn("kvtier_jobs_done_free", None, ctypes.POINTER(_JobsDone))
    # the shared-memory ring and the packed-key calls (kvtier.vllm's fast path)
    fn("kvtier_client_alive", ctypes.c_bool, _P)
    fn("kvtier_client_has_ring", ctypes.c_bool, _P)
    fn("kvtier_client_set_ring", i, _P, ctypes.c_bool, i)
    fn("kvtier_client_ring_stats", i, _P, ctypes.POINTER(_RingStats))
    fn("kvtier_client_set_posting", i, _P, ctypes.c_bool)
    fn("kvtier_client_drain", i, _P, ctypes.POINTER(ctypes.c_uint64))
    sp = ctypes.POINTER(sz)
    fn("kvtier_lookup_one", i, _P, cp, cp, sz)
    fn("kvtier_lookup_packed", i, _P, cp, cp, sz, sz, ctypes.c_uint,
       ctypes.POINTER(ctypes.c_uint8), sp)
    fn("kvtier_prepare_store_packed", i, _P, cp, cp, sz, sz, ctypes.POINTER(ctypes.c_uint32),
       ctypes.POINTER(ctypes.c_int64), sp, ctypes.c_void_p, sz, sp, sp)
    fn("kvtier_complete_store_packed", i, _P, cp, cp, sz, sz, ctypes.c_bool)
    fn("kvtier_prepare_load_packed", i, _P, cp, cp, sz, sz, ctypes.POINTER(ctypes.c_int64))
    fn("kvtier_complete_load_packed", i, _P, cp, cp, sz, sz)
    fn("kvtier_touch_packed", i, _P, cp, cp, sz, sz)
    _lib = lib
    return lib


def _load_fast():
    """kvtier._fast: $KVTIER_FAST_MODULE's when set (a development build's, as
    $KVTIER_CLIENT_LIB), else the package's own; None when neither is there."""
    path = os.environ.get("KVTIER_FAST_MODULE")
    if path:
        import importlib.machinery
        import importlib.util

        loader = importlib.machinery.ExtensionFileLoader(__name__ + "._fast", path)
        spec = importlib.util.spec_from_file_location(__name__ + "._fast", path, loader=loader)
        mod = importlib.util.module_from_spec(spec)
        loader.exec_module(mod)
        sys.modules[__name__ + "._fast"] = mod
        return mod
    try:
        from kvtier import _fast
    except ImportError:
        return None
    return _fast


_fast = _load_fast()


def __getattr__(name):
    if name == "__version__":
        return _load().kvtier_version().decode()
    raise AttributeError("module 'kvtier' has no attribute %r" % name)


_PAD = bytes(KEY_MAX)


def _keys(keys):
    """keys as a C array of struct kvtier_key, packed in one pass (the vLLM tier
    sends a step's keys through here: no per-key ctypes calls)."""
    keys = [bytes(k) for k in keys]
    n = len(keys)
    for i, k in enumerate(keys):
        if not 1 <= len(k) <= KEY_MAX:
            raise ValueError("key %d: a key is 1..64 bytes" % i)
    if n == 0:
        return (_Key * 1)(), 0
    packed = b"".join([bytes((len(k),)) + k + _PAD[len(k):] for k in keys])
    return (_Key * n).from_buffer_copy(packed), n


def _key_bytes(k):
    return bytes(k.bytes[:k.len])


def _req(req_id):
    if req_id is None:
        return None
    b = req_id.encode() if isinstance(req_id, str) else bytes(req_id)
    if not 1 <= len(b) <= REQ_ID_MAX:
        raise ValueError("a request id is 1..127 bytes")
    return b


def _ids(ids):
    ids = [_req(x) for x in ids]
    arr = (ctypes.c_char_p * max(len(ids), 1))(*ids)
    return arr, len(ids)


class Client:
    """One connection to kvtierd: the region mapped, the manager's calls as methods."""

    def __init__(self, socket_path, name=None, timeout_ms=0, lib=None, fingerprint=None):
        """fingerprint: the engine's model fingerprint (str or bytes, 1..255 bytes), or
        None to declare none (see the module's text)."""
        self._lib = _load(lib)
        self._c = None
        self.fast = None
        self._views = []
        fp = fingerprint.encode() if isinstance(fingerprint, str) else fingerprint
        if fp is not None and not 1 <= len(fp) <= FINGERPRINT_MAX:
            raise ValueError("a fingerprint is 1..%d bytes" % FINGERPRINT_MAX)
        err = ctypes.create_string_buffer(_ERROR_MAX + 1)
        opts = _ConnectEx(ctypes.sizeof(_ConnectEx), name.encode() if name else None,
                          int(timeout_ms), fp, ctypes.cast(err, ctypes.POINTER(ctypes.c_char)),
                          len(err))
        handle = _P()
        rc = self._lib.kvtier_connect_ex(os.fsencode(socket_path), ctypes.byref(opts),
                                         ctypes.byref(handle))
        if rc != 0:
            raise KvtierError(rc, "connect %s" % socket_path,
                              err.value.decode("utf-8", "replace"))
        self._c = handle
        r = self._lib.kvtier_client_region(self._c).contents
        self.num_chunks = r.num_chunks
        self.row_bytes = r.row_bytes
        self.page_bytes = r.page_bytes
        self.num_workers = r.num_workers
        self.region_size = r.size
        buf = (ctypes.c_uint8 * r.size).from_address(ctypes.addressof(r.base.contents))
        self._region = memoryview(buf).cast("B")
        self.client_id = self._lib.kvtier_client_id(self._c)
        self.max_keys = self._lib.kvtier_client_max_keys(self._c)
        # Which region this is: a restarted node has another (its rows mean
        # nothing to a connection to the old one).
        self.region_ident = (r.ident_dev, r.ident_ino)
        # The node's model fingerprint as it said at connect time ("" none), and its
        # protocol minor (0: no reset, has_pending_work or peers).
        self.node_fingerprint = self._lib.kvtier_client_node_fingerprint(self._c).decode(
            "utf-8", "replace")
        self.node_minor = self._lib.kvtier_client_node_minor(self._c)
        # The hot calls without ctypes (see the module's text), on this library.
        # (Setting it to None sends them through ctypes again.)
        self.fast = _fast.Conn(self._lib._handle, self._c.value, KvtierError) if _fast else None

    # -- life cycle
    def close(self):
        """Closes the connection; the daemon releases whatever is left open."""
        if self.fast is not None:
            self.fast.close()  # (every later fast call raises, as the ctypes ones)
        for v in self._views:
            v.close()
        self._views = []
        if self._c is not None:
            try:
                self._region.release()
            except BufferError:
                pass  # views of rows still exist; they must not be used after close
            self._lib.kvtier_close(self._c)
            self._c = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def _check(self, rc, what):
        if rc != 0:
            reason = ""
            if self._c is not None:
                reason = self._lib.kvtier_client_error(self._c).decode("utf-8", "replace")
            raise KvtierError(rc, what, reason)

    def fast_view(self, results=None):
        """An object with the hot calls as kvtier._fast.Conn has them (every one takes
        the request id first, bytes or str or None; errors raise KvtierError):
        lookup_one(rid, key), lookup(rid, keys, prefix), prepare_store(rid, keys) ->
        (store_index, chunk_ids, evicted), complete_store(rid, keys, success),
        prepare_load(rid, keys) -> [chunk id], complete_load(rid, keys),
        touch(rid, keys), on_schedule_end(new, preempted). A lookup's results are
        results[MISS..RETRY] (a tuple of 4; default the ints). A new Conn of the
        extension on this client, closed with it; through ctypes when the extension
        is not there or fast is None (kvtier.vllm's managers call through this)."""
        if self._c is None:
            raise KvtierError(-_errno.EBADF, "client closed")
        if self.fast is None:
            return _CtypesConn(self, results)
        conn = _fast.Conn(self._lib._handle, self._c.value, KvtierError,
                          *(() if results is None else (tuple(results),)))
        self._views.append(conn)
        return conn

    def _handle(self):
        # (a call takes it after it converted its other arguments: a conversion
        # runs Python code - a request id's __bytes__, a flag's __bool__ - which
        # could close this client and free the handle taken before it)
        if self._c is None:
            raise KvtierError(-_errno.EBADF, "client closed")
        return self._c

    def alive(self):
        """False once the node went away or closed this connection (no round trip)."""
        return self._c is not None and bool(self._lib.kvtier_client_alive(self._c))

    # -- the shared-memory ring
    @property
    def has_ring(self):
        """Whether the node gave this connection a shared-memory ring (calls then
        go through shared memory, not the socket)."""
        return bool(self._lib.kvtier_client_has_ring(self._handle()))

    def set_ring(self, enabled, spin_us=-1):
        """Calls through the ring (enabled) or the socket; spin_us: how long a call
        spins on its reply before it sleeps (< 0 keeps it)."""
        enabled, spin_us = bool(enabled), int(spin_us)
        self._check(self._lib.kvtier_client_set_ring(self._handle(), enabled, spin_us), "set_ring")

    def ring_stats(self):
        """{"posted", "wakeups", "sleeps", "redirects"} of the ring's calls."""
        st = _RingStats()
        self._check(self._lib.kvtier_client_ring_stats(self._handle(), ctypes.byref(st)),
                    "ring_stats")
        return {"posted": st.posted, "wakeups": st.wakeups, "sleeps": st.sleeps,
                "redirects": st.redirects, "posted_calls": st.posted_calls}

    def set_posting(self, enabled):
        """With a ring: complete_store, complete_load, touch, on_request_finished and
        on_schedule_end return once they are in the ring (the node runs them in
        order, before anything called after them); drain() says how they went."""
        enabled = bool(enabled)
        self._check(self._lib.kvtier_client_set_posting(self._handle(), enabled), "set_posting")

    def drain(self):
        """Waits for every posted call: how many failed since the last drain (the
        first failure's errno is raised only when the connection broke)."""
        failed = ctypes.c_uint64(0)
        rc = self._lib.kvtier_client_drain(self._handle(), ctypes.byref(failed))
        if rc < 0 and -rc in (_errno.ECONNRESET, _errno.EPIPE, _errno.ETIMEDOUT,
                              _errno.EPROTO):
            raise KvtierError(rc, "drain")
        return failed.value

    @property
    def handle(self):
        """The C client (a void pointer as an int), for callers that use the
        library's functions directly (kvtier.vllm's fast path). Valid until close."""
        return self._handle().value

    @property
    def lib(self):
        return self._lib

    # -- the region
    def row(self, chunk_id):
        """A writable memoryview of chunk chunk_id's row (row_bytes long)."""
        if not 0 <= chunk_id < self.num_chunks:
            raise IndexError("chunk id %d out of 0..%d" % (chunk_id, self.num_chunks - 1))
        off = chunk_id * self.row_bytes
        return self._region[off:off + self.row_bytes]

    def cell(self, chunk_id, worker):
        """Worker worker's cell (page_bytes) of chunk chunk_id's row."""
        if not 0 <= worker < self.num_workers:
            raise IndexError("worker %d out of 0..%d" % (worker, self.num_workers - 1))
        r = self.row(chunk_id)
        return r[worker * self.page_bytes:(worker + 1) * self.page_bytes]

    # -- requests
    def on_new_request(self, req_id, params_json=None, load_tiers=None):
        """Registers a request; load_tiers: None = every tier, else a list of
        (medium, locality) pairs (ANY for either). Returns the offload policy."""
        opts = _RequestOpts(params_json.encode() if params_json is not None else None,
                            True, None, 0)
        keep = None
        if load_tiers is not None:
            load_tiers = list(load_tiers)
            keep = (_Matcher * max(len(load_tiers), 1))(*[_Matcher(m, l) for m, l in load_tiers])
            opts.load_tiers_all = False
            opts.load_tiers = ctypes.cast(keep, ctypes.POINTER(_Matcher))
            opts.n_load_tiers = len(load_tiers)
        policy = ctypes.c_int(0)
        rid = _req(req_id)
        rc = self._lib.kvtier_on_new_request(self._handle(), rid, ctypes.byref(opts),
                                             ctypes.byref(policy))
        self._check(rc, "on_new_request %s" % req_id)
        return policy.value

    def on_request_finished(self, req_id):
        rid = _req(req_id)
        self._check(self._lib.kvtier_on_request_finished(self._handle(), rid),
                    "on_request_finished %s" % req_id)

    def lookup(self, req_id, keys, prefix=False):
        """Results per key (MISS/HIT/HIT_PENDING/RETRY); with prefix=True it stops after
        the first MISS or RETRY and the list is that long."""
        if self.fast is not None:
            return self.fast.lookup(req_id, keys, bool(prefix))
        arr, n = _keys(keys)
        res = (ctypes.c_uint8 * max(n, 1))()
        done = ctypes.c_size_t(0)
        rid, flags = _req(req_id), _LOOKUP_PREFIX if prefix else 0
        rc = self._lib.kvtier_lookup(self._handle(), rid, arr, n, flags, res, ctypes.byref(done))
        self._check(rc, "lookup")
        return list(res[:done.value])

    def lookup_one(self, req_id, key):
        """One key's result (MISS/HIT/HIT_PENDING/RETRY)."""
        if self.fast is not None:
            return self.fast.lookup_one(req_id, key)
        key = bytes(key)
        if not 1 <= len(key) <= KEY_MAX:
            raise ValueError("a key is 1..64 bytes")
        rid = _req(req_id)
        rc = self._lib.kvtier_lookup_one(self._handle(), rid, key, len(key))
        if rc < 0:
            self._check(rc, "lookup")
        return rc

    def prepare_store(self, req_id, keys):
        """A StorePlan: stores = [(index into keys, chunk id)] to write, evicted keys.
        Raises KvtierError with errno ENOSPC when it cannot store."""
        if self.fast is not None:
            idx, ids, evicted = self.fast.prepare_store(req_id, keys)
            return StorePlan(list(zip(idx, ids)), evicted)
        arr, n = _keys(keys)
        idx = (ctypes.c_uint32 * max(n, 1))()
        ids = (ctypes.c_int64 * max(n, 1))()
        ev = (_Key * max(n, 1))()
        plan = _StorePlan(idx, ids, ev, max(n, 1), 0, 0)
        rid = _req(req_id)
        rc = self._lib.kvtier_prepare_store(self._handle(), rid, arr, n,
                                            ctypes.byref(plan))
        self._check(rc, "prepare_store")
        stores = [(idx[i], ids[i]) for i in range(plan.n_store)]
        evicted = [_key_bytes(ev[i]) for i in range(min(plan.n_evicted, max(n, 1)))]
        return StorePlan(stores, evicted)

    def complete_store(self, req_id, keys, success=True):
        if self.fast is not None:
            return self.fast.complete_store(req_id, keys, bool(success))
        arr, n = _keys(keys)
        rid, success = _req(req_id), bool(success)
        self._check(self._lib.kvtier_complete_store(self._handle(), rid, arr, n, success),
                    "complete_store")

    def prepare_load(self, req_id, keys):
        """Pins keys; returns their chunk ids (co-indexed)."""
        if self.fast is not None:
            return self.fast.prepare_load(req_id, keys)
        arr, n = _keys(keys)
        ids = (ctypes.c_int64 * max(n, 1))()
        rid = _req(req_id)
        self._check(self._lib.kvtier_prepare_load(self._handle(), rid, arr, n, ids),
                    "prepare_load")
        return list(ids[:n])

    def complete_load(self, req_id, keys):
        if self.fast is not None:
            return self.fast.complete_load(req_id, keys)
        arr, n = _keys(keys)
        rid = _req(req_id)
        self._check(self._lib.kvtier_complete_load(self._handle(), rid, arr, n),
                    "complete_load")

    def touch(self, keys, req_id=None):
        if self.fast is not None:
            return self.fast.touch(req_id, keys)
        arr, n = _keys(keys)
        rid = _req(req_id)
        self._check(self._lib.kvtier_touch(self._handle(), rid, arr, n), "touch")

    def on_schedule_end(self, new=(), preempted=()):
        if self.fast is not None:
            return self.fast.on_schedule_end(new, preempted)
        a, na = _ids(new)
        b, nb = _ids(preempted)
        self._check(self._lib.kvtier_on_schedule_end(self._handle(), a, na, b, nb),
                    "on_schedule_end")

    # -- events and stats
    def take_events(self):
        """[Event(keys, medium, locality, removed)] since the last take (node-wide)."""
        p = ctypes.POINTER(_Events)()
        self._check(self._lib.kvtier_take_events(self._handle(), ctypes.byref(p)),
                    "take_events")
        try:
            evs = p.contents
            return [Event([_key_bytes(evs.ev[i].keys[k]) for k in range(evs.ev[i].n)],
                          evs.ev[i].medium, evs.ev[i].locality, bool(evs.ev[i].removed))
                    for i in range(evs.n)]
        finally:
            self._lib.kvtier_events_free(p)

    def get_stats(self, totals=False):
        """[Stat(name, label, kind, value, count, sum, buckets, bounds)]: the changes since
        this client's last call, or with totals=True the node's totals since it started
        (what /metrics shows, the node's own series too). A histogram's buckets are per
        bucket (not cumulative), buckets[len(bounds)] above its last bound."""
        p = ctypes.POINTER(_Stats)()
        f = self._lib.kvtier_get_stats_totals if totals else self._lib.kvtier_get_stats
        self._check(f(self._handle(), ctypes.byref(p)), "get_stats")
        try:
            st = p.contents
            out = []
            for i in range(st.n):
                s = st.s[i]
                hb = st.stat_bounds[i] if st.stat_bounds else None
                bounds = tuple(hb.bound[:hb.n]) if hb is not None else ()
                out.append(Stat(s.name.decode(), s.label.decode(), s.kind, s.value, s.count,
                                s.sum, list(s.buckets), bounds))
            return out
        finally:
            self._lib.kvtier_stats_free(p)

    # -- the node
    def reset(self):
        """The node forgets every chunk (its primary, its storage tier's files, its
        records in the cluster's directory). KvtierError EBUSY, nothing changed, while
        an engine holds pins, stores being written or loads waiting."""
        self._check(self._lib.kvtier_reset(self._handle()), "reset")

    def has_pending_work(self):
        """Whether the node has transfers in flight, or this client unreported jobs."""
        out = ctypes.c_bool(False)
        self._check(self._lib.kvtier_has_pending_work(self._handle(), ctypes.byref(out)),
                    "has_pending_work")
        return bool(out.value)

    def peers(self):
        """[Peer]: the node itself (PEER_SELF) first, then every member it has heard of.
        KvtierError EOPNOTSUPP when the node runs no network tier."""
        p = ctypes.POINTER(_Peers)()
        self._check(self._lib.kvtier_get_peers(self._handle(), ctypes.byref(p)), "peers")
        try:
            ps = p.contents
            return [Peer(x.node_id, x.incarnation, x.addr.decode("utf-8", "replace"), x.port,
                         x.state, x.last_heard_ms, x.pulled_bytes, x.served_bytes)
                    for x in (ps.p[i] for i in range(ps.n))]
        finally:
            self._lib.kvtier_peers_free(p)

    # -- an engine's own region and jobs (kvtier.vllm)
    def attach_region(self, fd, offset, rows, stride):
        """Passes the engine's region (fd, rows of stride bytes at offset) to the node,
        which maps it; returns the node's row bytes."""
        out = ctypes.c_size_t(0)
        fd, offset, rows, stride = int(fd), int(offset), int(rows), int(stride)
        self._check(self._lib.kvtier_attach_region(self._handle(), fd, offset, rows, stride,
                                                   ctypes.byref(out)), "attach_region")
        return out.value

    def jobs_step(self, lookup_keys=(), jobs=()):
        """One step: verdicts (MISS/HIT/HIT_PENDING/RETRY) for lookup_keys, submits jobs
        ([Job(id, kind, keys, rows)]) and returns (verdicts, [JobDone]) with the jobs
        finished since the last call."""
        if self.fast is not None:
            verdicts, done = self.fast.jobs_step(lookup_keys, jobs)
            return verdicts, [JobDone(*d) for d in done]
        larr, nl = _keys(lookup_keys)
        verdicts = (ctypes.c_uint8 * max(nl, 1))()
        jobs = list(jobs)
        carr = (_Job * max(len(jobs), 1))()
        keep = []
        for i, job in enumerate(jobs):
            karr, nk = _keys(job.keys)
            rows = list(job.rows)
            if len(rows) != nk:
                raise ValueError("job %d: %d keys but %d rows" % (job.id, nk, len(rows)))
            rarr = (ctypes.c_int64 * max(nk, 1))(*rows)
            keep.append((karr, rarr))
            carr[i] = _Job(int(job.id), int(job.kind), karr, rarr, nk)
        p = ctypes.POINTER(_JobsDone)()
        self._check(self._lib.kvtier_jobs_step(self._handle(), larr, nl, verdicts, carr,
                                               len(jobs), ctypes.byref(p)), "jobs_step")
        try:
            d = p.contents
            done = [JobDone(d.job[i].id, bool(d.job[i].ok),
                            [bool(d.job[i].key_ok[k]) for k in range(d.job[i].n)])
                    for i in range(d.n)]
        finally:
            self._lib.kvtier_jobs_done_free(p)
        return list(verdicts[:nl]), done



class _CtypesConn:
    """Client.fast_view() without the extension: the same calls through ctypes."""

    def __init__(self, client, results):
        self._c = client
        self._res = tuple(results) if results is not None else (MISS, HIT, HIT_PENDING, RETRY)

    def close(self):
        pass

    def lookup_one(self, rid, key):
        return self._res[self._c.lookup_one(rid, key)]

    def lookup(self, rid, keys, prefix=False):
        res = self._res
        return [res[r] for r in self._c.lookup(rid, keys, prefix)]

    def prepare_store(self, rid, keys):
        plan = self._c.prepare_store(rid, keys)
        return [i for i, _ in plan.stores], [c for _, c in plan.stores], plan.evicted

    def complete_store(self, rid, keys, success=True):
        self._c.complete_store(rid, keys, success)

    def prepare_load(self, rid, keys):
        return self._c.prepare_load(rid, keys)

    def complete_load(self, rid, keys):
        self._c.complete_load(rid, keys)

    def touch(self, rid, keys):
        self._c.touch(keys, rid)

    def on_schedule_end(self, new=None, preempted=None):
        self._c.on_schedule_end(new or (), preempted or ())

"""kvtier: drive kvtierd's local engine API from Python (ctypes over libkvtier-client).

Debian's python3 only: no third-party package. The C contract is
<kvtier/client.h>; this module is a thin layer over it:

    import kvtier
    with kvtier.Client("/run/kvtier/engine.sock", name="my-engine") as c:
        c.on_new_request("req-1")
        keys = [kvtier.make_key(block_hash, 0) for block_hash in hashes]
        if c.lookup("req-1", keys) == [kvtier.MISS] * len(keys):
            plan = c.prepare_store("req-1", keys)
            for idx, chunk in plan.stores:
                c.row(chunk)[:] = chunk_bytes_of(keys[idx])   # a writable memoryview
            c.complete_store("req-1", keys)
        c.on_schedule_end(new=["req-1"])
        c.on_request_finished("req-1")

Errors raise KvtierError (an OSError: .errno is the positive errno, e.g.
errno.ENOSPC for "cannot store"). The library is the one installed inside this
package (pip install builds it); $KVTIER_CLIENT_LIB, when set, names another (a
development build), and the system's library path is the last resort.
kvtier.__version__ is the loaded library's version, the project's.

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
from collections import namedtuple

__all__ = [
    "Client", "KvtierError", "make_key", "MISS", "HIT", "HIT_PENDING", "RETRY",
    "CHUNK_LEVEL", "REQUEST_LEVEL", "ANY", "MEDIUM_CPU", "MEDIUM_STORAGE", "LOCAL",
    "REMOTE", "Event", "Stat", "StorePlan", "Job", "JobDone", "JOB_STORE", "JOB_LOAD",
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
_HIST_BUCKETS = 16
_LOOKUP_PREFIX = 1


class KvtierError(OSError):
    """A failed call: errno is the positive errno the C library returned."""

    def __init__(self, rc, what):
        code = -rc
        super().__init__(code, "%s: %s" % (what, os.strerror(code)))


Event = namedtuple("Event", "keys medium locality removed")
Stat = namedtuple("Stat", "name label kind value count sum buckets")
StorePlan = namedtuple("StorePlan", "stores evicted")  # stores: [(key index, chunk id)]
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
                ("bounds", ctypes.c_double * _HIST_BUCKETS)]


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

    def __init__(self, socket_path, name=None, timeout_ms=0, lib=None):
        self._lib = _load(lib)
        self._c = None
        opts = _ConnectOpts(name.encode() if name else None, int(timeout_ms))
        handle = _P()
        rc = self._lib.kvtier_connect(os.fsencode(socket_path), ctypes.byref(opts),
                                      ctypes.byref(handle))
        if rc != 0:
            raise KvtierError(rc, "connect %s" % socket_path)
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

    # -- life cycle
    def close(self):
        """Closes the connection; the daemon releases whatever is left open."""
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
            raise KvtierError(rc, what)

    def _handle(self):
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
        self._check(self._lib.kvtier_client_set_ring(self._handle(), bool(enabled), int(spin_us)),
                    "set_ring")

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
        self._check(self._lib.kvtier_client_set_posting(self._handle(), bool(enabled)),
                    "set_posting")

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
        rc = self._lib.kvtier_on_new_request(self._handle(), _req(req_id), ctypes.byref(opts),
                                             ctypes.byref(policy))
        self._check(rc, "on_new_request %s" % req_id)
        return policy.value

    def on_request_finished(self, req_id):
        self._check(self._lib.kvtier_on_request_finished(self._handle(), _req(req_id)),
                    "on_request_finished %s" % req_id)

    def lookup(self, req_id, keys, prefix=False):
        """Results per key (MISS/HIT/HIT_PENDING/RETRY); with prefix=True it stops after
        the first MISS or RETRY and the list is that long."""
        arr, n = _keys(keys)
        res = (ctypes.c_uint8 * max(n, 1))()
        done = ctypes.c_size_t(0)
        rc = self._lib.kvtier_lookup(self._handle(), _req(req_id), arr, n,
                                     _LOOKUP_PREFIX if prefix else 0, res, ctypes.byref(done))
        self._check(rc, "lookup")
        return list(res[:done.value])

    def prepare_store(self, req_id, keys):
        """A StorePlan: stores = [(index into keys, chunk id)] to write, evicted keys.
        Raises KvtierError with errno ENOSPC when it cannot store."""
        arr, n = _keys(keys)
        idx = (ctypes.c_uint32 * max(n, 1))()
        ids = (ctypes.c_int64 * max(n, 1))()
        ev = (_Key * max(n, 1))()
        plan = _StorePlan(idx, ids, ev, max(n, 1), 0, 0)
        rc = self._lib.kvtier_prepare_store(self._handle(), _req(req_id), arr, n,
                                            ctypes.byref(plan))
        self._check(rc, "prepare_store")
        stores = [(idx[i], ids[i]) for i in range(plan.n_store)]
        evicted = [_key_bytes(ev[i]) for i in range(min(plan.n_evicted, max(n, 1)))]
        return StorePlan(stores, evicted)

    def complete_store(self, req_id, keys, success=True):
        arr, n = _keys(keys)
        self._check(self._lib.kvtier_complete_store(self._handle(), _req(req_id), arr, n,
                                                    bool(success)), "complete_store")

    def prepare_load(self, req_id, keys):
        """Pins keys; returns their chunk ids (co-indexed)."""
        arr, n = _keys(keys)
        ids = (ctypes.c_int64 * max(n, 1))()
        self._check(self._lib.kvtier_prepare_load(self._handle(), _req(req_id), arr, n, ids),
                    "prepare_load")
        return list(ids[:n])

    def complete_load(self, req_id, keys):
        arr, n = _keys(keys)
        self._check(self._lib.kvtier_complete_load(self._handle(), _req(req_id), arr, n),
                    "complete_load")

    def touch(self, keys, req_id=None):
        arr, n = _keys(keys)
        self._check(self._lib.kvtier_touch(self._handle(), _req(req_id), arr, n), "touch")

    def on_schedule_end(self, new=(), preempted=()):
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

    def get_stats(self):
        """[Stat(name, label, kind, value, count, sum, buckets)]."""
        p = ctypes.POINTER(_Stats)()
        self._check(self._lib.kvtier_get_stats(self._handle(), ctypes.byref(p)), "get_stats")
        try:
            st = p.contents
            return [Stat(st.s[i].name.decode(), st.s[i].label.decode(), st.s[i].kind,
                         st.s[i].value, st.s[i].count, st.s[i].sum, list(st.s[i].buckets))
                    for i in range(st.n)]
        finally:
            self._lib.kvtier_stats_free(p)

    # -- an engine's own region and jobs (kvtier.vllm)
    def attach_region(self, fd, offset, rows, stride):
        """Passes the engine's region (fd, rows of stride bytes at offset) to the node,
        which maps it; returns the node's row bytes."""
        out = ctypes.c_size_t(0)
        self._check(self._lib.kvtier_attach_region(self._handle(), int(fd), int(offset),
                                                   int(rows), int(stride), ctypes.byref(out)),
                    "attach_region")
        return out.value

    def jobs_step(self, lookup_keys=(), jobs=()):
        """One step: verdicts (MISS/HIT/HIT_PENDING/RETRY) for lookup_keys, submits jobs
        ([Job(id, kind, keys, rows)]) and returns (verdicts, [JobDone]) with the jobs
        finished since the last call."""
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

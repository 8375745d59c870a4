# SPDX-License-Identifier: Apache-2.0
"""kvtier.vllm: kvtierd as a secondary tier of vLLM's TieringOffloadingManager.

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 8589934592,
        "secondary_tiers": [{"type": "kvtier", "socket": "/run/kvtier/engine.sock"}]}}'

("type": "KvtierSecondaryTier", "module_path": "kvtier.vllm" works without the
package's vllm.general_plugins entry point.)

How it works. At start the tier connects to the node's engine socket and attaches
vLLM's primary region: the fd of the shared file behind primary_kv_view travels
over the socket (SCM_RIGHTS) with its rows and stride, and the node maps it. From
then on rows move in the node: a store job copies the job's rows into the node's
primary (its storage and network tiers then take them as any chunk), a load job
fills the job's rows from the node's primary, storage or a peer.

Threads. Every method vLLM calls runs on its scheduler thread and never touches
the socket: lookup() answers from verdicts already here and collects the keys it
does not know; submit_store() / submit_load() queue the job; on_schedule_end()
hands the step's keys and jobs, in one item, to the tier's I/O thread, which sends
them to the node in one JOBS message and polls (an empty JOBS every poll_ms) while
jobs are out or keys answered RETRY. Its replies come back through a queue that
lookup() and get_finished_jobs() drain. A node that does not answer within
timeout_ms, or goes away, makes every job out fail and every lookup MISS; the I/O
thread reconnects every reconnect_s. The scheduler never waits for the node,
except in drain_jobs() (vLLM's reset_cache), bounded by job_timeout_s.

The model fingerprint. At connect time the tier declares what its chunks are: a
string made from vLLM's offloading config (model_fingerprint(): the model, the KV
dtype and layout, tokens per block and hash, blocks per chunk, bytes per block and
row, the groups, TP/PP/context parallelism unless the layout is parallelism-agnostic,
and PYTHONHASHSEED when it is set). The node serves one model: its
node.model_fingerprint, or the first fingerprint declared; a node of another refuses
the engine (logged with the node's reason, retried every reconnect_s, lookups MISS
meanwhile), so a vLLM of another model or layout never loads another's rows. The
hash seed is there for completeness only: another seed already makes other keys. A
random one (PYTHONHASHSEED unset) is left out, or every restarted vLLM would be
refused by a node that outlived it. Option fingerprint: None computes it, a string
is declared as is, "" declares none.

Resets. vLLM's reset_cache (its /reset_prefix_cache endpoint, sleep, weight updates)
calls drain_jobs() on every secondary tier and keeps their data: vLLM 0.34's
SecondaryTierManager has no reset hook ("persistent stores keep their data across
resets"), so there is nothing to forward and the node keeps its chunks. An operator
who wants them gone - new weights under the same model name, say - runs
`kvtier reset` on the node (or kvtier.Client(...).reset()): it is refused (EBUSY)
while an engine holds pins or stores in flight, which this tier does only inside
one JOBS message, so it succeeds between steps. Afterwards this tier's remembered
verdicts for keys of live requests may be stale: their loads fail and the keys are
then MISS (vLLM issue #49176's rule), as for any chunk the node lost.

Lookups (as vLLM's AsyncLookupManager): a key is asked once per generation; the
node's HIT or HIT_PENDING make it present (a load will wait for the node's
promotion), MISS absent, RETRY is asked again by the I/O thread. A load that fails
forgets the positive verdicts of its failed keys (vLLM issue #49176); a store
that succeeds makes its keys present.
"""

import ctypes
import errno
import hashlib
import json
import logging
import mmap
import os
import queue
import threading
import time
from collections.abc import Collection, Iterable
from typing import Any, ClassVar

import kvtier as _kvt
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadKey,
    OffloadPolicy,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    TierFilter,
)
from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource

logger = logging.getLogger(__name__)

TIER_TYPE = "kvtier"


class KvtierMetrics:
    """The tier's own metric names (vLLM's naming; the manager's per-tier read and
    write bytes and times come from the jobs' transfer_bytes / transfer_time)."""

    VERDICTS = "vllm:kv_offload_kvtier_lookup_verdicts"
    JOB_ROWS = "vllm:kv_offload_kvtier_job_rows"
    NODE_ERRORS = "vllm:kv_offload_kvtier_node_errors"
    NODE_CONNECTED = "vllm:kv_offload_kvtier_node_connected"
    STEP_RTT = "vllm:kv_offload_kvtier_step_rtt_seconds"


_VERDICT_NAMES = {_kvt.MISS: "miss", _kvt.HIT: "hit", _kvt.HIT_PENDING: "hit_pending",
                  _kvt.RETRY: "retry"}


def register() -> None:
    """vllm.general_plugins entry point: {"type": "kvtier", ...} names this tier."""
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    try:
        SecondaryTierFactory.register_tier(TIER_TYPE, __name__, "KvtierSecondaryTier")
    except ValueError:
        pass  # registered already (plugins load once per process, tests more often)


def region_fd_of(view: memoryview, spec=None) -> tuple[int, int]:
    """(fd, offset): a new descriptor of the file that backs every byte of view,
    and where the view starts in it, from /proc/self/maps. A file vLLM has
    unlinked already (its workers do, once all have mapped it) is reopened through
    /proc/self/map_files, or else taken from the spec's own descriptor of it
    (TieringOffloadingSpec keeps the scheduler's region open) when that is the
    same inode. Raises ValueError when the view is not one file's contiguous
    mapping."""
    import numpy as np

    addr = int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
    end = addr + view.nbytes
    first = None
    covered = addr
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            path = parts[5].rstrip("\n") if len(parts) > 5 else ""
            off = int(parts[2], 16)
            if hi <= covered or lo > covered:
                continue
            if first is None:
                first = (parts[0], path, off + (addr - lo), lo, off, int(parts[4]))
            elif path != first[1] or off - first[4] != lo - first[3]:
                raise ValueError("the primary region spans several files")
            covered = hi
            if covered >= end:
                break
    if first is None or covered < end or not first[1].startswith("/"):
        raise ValueError("the primary region is not a mapped file")
    rng, path, offset, inode = first[0], first[1], first[2], first[5]
    tries = [path] if not path.endswith(" (deleted)") else []
    tries.append("/proc/self/map_files/" + rng)
    for p in tries:
        try:
            fd = os.open(p, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            continue
        if os.fstat(fd).st_ino == inode:
            return fd, offset
        os.close(fd)
    sfd = getattr(getattr(spec, "_scheduler_mmap", None), "fd", None)
    if sfd is not None and os.fstat(sfd).st_ino == inode:
        return os.dup(sfd), offset
    raise ValueError("cannot open the file behind the primary region (%s)" % path)


_kvt_NAME_MAX = 63  # an engine's name, in bytes (KVTIER_NAME_MAX)


def _truncate_utf8(text: str, nbytes: int) -> str:
    """text cut to at most nbytes of UTF-8, on a character boundary."""
    return text.encode()[:nbytes].decode("utf-8", "ignore")


def _opt_number(key: str, value, lo, hi, kind=float):
    """A tier option's number (an int or float, or a string of one), lo..hi."""
    try:
        if isinstance(value, bool):
            raise TypeError
        v = kind(float(value)) if kind is int and not isinstance(value, int) else kind(value)
    except (TypeError, ValueError):
        raise ValueError("kvtier tier: %s is a number, not %r" % (key, value)) from None
    if not lo <= v <= hi:  # (NaN fails too)
        raise ValueError("kvtier tier: %s is %s..%s, not %r" % (key, lo, hi, value))
    return v


def _opt_bool(key: str, value) -> bool:
    """A tier option's flag: a bool, 0/1, or "true"/"false" (a JSON string "false"
    must not turn it on)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0", "yes",
                                                            "no", "on", "off"):
        return value.strip().lower() in ("true", "1", "yes", "on")
    raise ValueError("kvtier tier: %s is true or false, not %r" % (key, value))


def model_fingerprint(offloading_spec, row_bytes: int) -> str | None:
    """The fingerprint this tier declares: "vllm:<model>:<dtype>:<32 hex digits>", the
    digits a SHA-256 of everything that makes a chunk's bytes mean something (see the
    module's text). None when the spec carries no offloading config."""
    cfg = getattr(offloading_spec, "config", None)
    model = getattr(cfg, "model", None)
    if cfg is None or model is None:
        return None
    par = getattr(cfg, "parallel", None)
    cache = getattr(cfg, "cache", None)
    desc = {
        "model": str(model.name),
        "dtype": str(model.dtype),
        "layout": str(getattr(cfg, "kv_cache_layout", None)),
        "canonical_layout": bool(getattr(cfg, "canonical_layout", False)),
        "replicated_layout": bool(getattr(cfg, "replicated_layout", False)),
        "tokens_per_hash": getattr(cache, "tokens_per_hash", None),
        "blocks_per_chunk": getattr(cache, "blocks_per_chunk", None),
        "worker_kv_bytes_per_block": getattr(cfg, "worker_kv_bytes_per_block", None),
        "row_bytes": int(row_bytes),
        "groups": [[g.group_id, g.tokens_per_block, len(g.layer_names),
                    g.sliding_window_size_in_chunks] for g in getattr(cfg, "groups", ())],
    }
    if par is not None and not getattr(par, "is_parallelism_agnostic", False):
        desc["parallel"] = [par.tp_size, par.pp_size, par.pcp_size, par.dcp_size]
    if os.environ.get("PYTHONHASHSEED") not in (None, "", "random"):
        desc["hash_seed"] = os.environ["PYTHONHASHSEED"]
    digest = hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:32]
    # (cut in bytes: the node takes 255, and a model's path may not be ASCII)
    return "vllm:%s:%s:%s" % (_truncate_utf8(str(model.name), 160),
                              _truncate_utf8(str(model.dtype), 32), digest)


_RETRY, _HIT, _MISS = LookupResult.RETRY, LookupResult.HIT, LookupResult.MISS
# The ids of the parts of a job sent in several messages (vLLM's job ids count up
# from 0: they never get there).
_PART_BASE = 1 << 62


class _Key:
    """Lookup state of one key in _PyKeyTable: verdict is what lookup() answers,
    RETRY until the node's verdict is here, then HIT or MISS; nreq, how many live
    requests looked it up (their sets say which: a count here, not a set per key, as
    a step looks up thousands of keys)."""

    __slots__ = ("gen", "verdict", "in_flight", "nreq")

    def __init__(self, gen: int, verdict):
        self.gen = gen
        self.verdict = verdict
        self.in_flight = False
        self.nreq = 0


class _PyKeyTable:
    """The tier's lookup state (scheduler thread), in Python: kvtier._fast.KeyTable
    is the same table in C, used when the package has its extension; this one serves
    a package without it. Both keep these rules, and are tested against each other:

    - lookup(key, req_id, node_up): a key not known is a MISS while the node is down,
      else a new entry (RETRY, the next generation) to be asked at the step's end;
      the request is counted once per key (a set of keys per request).
    - flush() -> (keys, gens): the keys first looked up since the last flush that
      still wait for their verdict, now in flight.
    - apply(keys, gens, verdicts) -> counts by verdict (MISS, HIT, HIT_PENDING,
      RETRY): a verdict lands where the key is still at its generation; its probe is
      over, the key goes when no request holds it, else HIT / HIT_PENDING make it
      HIT and MISS a MISS; RETRY changes nothing (asked again).
    - mark(keys, present): a store that succeeded makes its keys HIT at a new
      generation (a probe still out cannot land over it; a key no request holds
      goes); a load that failed makes its keys MISS (vLLM issue #49176), except
      where no verdict is here yet.
    - request_finished(req_id): its keys lose it; one no request holds and no probe
      waits for goes.
    - node_down(): every key still waiting is a MISS, its probe over."""

    def __init__(self, retry, hit, miss):
        self._retry, self._hit, self._miss = retry, hit, miss
        self._keys: dict[OffloadKey, _Key] = {}
        self._req_keys: dict[str, set[OffloadKey]] = {}
        self._last_rid: str | None = None  # lookup()'s last request and its key set
        self._last_keys: set[OffloadKey] | None = None
        self._next_gen = 0
        self._step: list[tuple[OffloadKey, int]] = []

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def requests(self) -> int:
        return len(self._req_keys)

    @property
    def pending(self) -> int:
        return len(self._step)

    def state(self, key):
        st = self._keys.get(key)
        return None if st is None else (st.gen, st.verdict, st.in_flight, st.nreq)

    def lookup(self, key: OffloadKey, rid: str, node_up: bool) -> LookupResult:
        st = self._keys.get(key)
        if st is None:
            if not node_up:
                return self._miss
            st = _Key(self._next_gen, self._retry)
            self._next_gen += 1
            self._keys[key] = st
            self._step.append((key, st.gen))
        # The request's key set: vLLM looks a request's keys up one after another,
        # so the last one is kept at hand.
        if rid == self._last_rid:
            rk = self._last_keys
        else:
            rk = self._req_keys.get(rid)
            if rk is None:
                rk = self._req_keys[rid] = set()
            self._last_rid, self._last_keys = rid, rk
        if key not in rk:
            rk.add(key)
            st.nreq += 1
        return st.verdict

    def request_finished(self, rid: str) -> None:
        keys = self._keys
        if self._last_rid == rid:
            self._last_rid = None
        for key in self._req_keys.pop(rid, ()):
            st = keys.get(key)
            if st is None:
                continue
            st.nreq -= 1
            if st.nreq <= 0 and not st.in_flight:
                del keys[key]

    def mark(self, keys: Iterable[OffloadKey], present: bool) -> None:
        for key in keys:
            st = self._keys.get(key)
            if st is None:
                continue
            if present:
                if st.nreq <= 0:
                    del self._keys[key]
                    continue
                # Newer than any probe out: its late verdict must not land.
                st.gen = self._next_gen
                self._next_gen += 1
                st.verdict, st.in_flight = self._hit, False
            elif st.verdict is not self._retry:
                st.verdict = self._miss  # #49176: a failed load is not offered again

    def flush(self):
        keys, gens = [], []
        for key, gen in self._step:
            st = self._keys.get(key)
            if st is None or st.gen != gen or st.verdict is not self._retry:
                continue
            st.in_flight = True
            keys.append(key)
            gens.append(gen)
        self._step = []
        return keys, gens

    def apply(self, keys, gens, verdicts):
        if not len(keys) == len(gens) == len(verdicts):
            raise ValueError("apply: keys, gens and verdicts differ in length")
        if any(not 0 <= v <= 3 for v in verdicts):
            raise ValueError("apply: a verdict out of range")
        counts = [0, 0, 0, 0]
        table = self._keys
        for key, gen, v in zip(keys, gens, verdicts):
            counts[v] += 1
            if v == _kvt.RETRY:
                continue
            st = table.get(key)
            if st is None or st.gen != gen:
                continue
            st.in_flight = False
            if st.nreq <= 0:
                del table[key]
                continue
            st.verdict = self._hit if v == _kvt.HIT or v == _kvt.HIT_PENDING else self._miss
        return tuple(counts)

    def node_down(self) -> None:
        for key, st in list(self._keys.items()):
            if st.verdict is self._retry:
                st.in_flight = False
                st.verdict = self._miss
                if st.nreq <= 0:
                    del self._keys[key]


def _key_table():
    """A new lookup table: kvtier._fast's when the package has it, else Python's."""
    fast = _kvt._fast
    cls = getattr(fast, "KeyTable", None) if fast is not None else None
    return (cls or _PyKeyTable)(_RETRY, _HIT, _MISS)


class _Job:
    __slots__ = ("job", "kind", "submit")

    def __init__(self, job: TransferJob, kind: int):
        self.job = job
        self.kind = kind
        self.submit = time.monotonic()


class KvtierSecondaryTier(SecondaryTierManager):
    """kvtierd, through its engine socket, as one secondary tier. Options (the tier's
    config keys): socket, name, timeout_ms (one node call), poll_ms (polling while
    jobs are out), job_timeout_s (a job not reported by then fails), reconnect_s,
    request_level (ask vLLM to offload whole requests), enable_kv_events,
    locality ("LOCAL"/"REMOTE"), fingerprint (None: model_fingerprint() of vLLM's
    config; a string: declared as is; "": none)."""

    medium: ClassVar[Medium] = Medium.CPU
    # A hit may come from the node's memory, its storage tier or a peer: none of
    # vLLM's named sources says which (the medium alone would make it HOST), and
    # vLLM's factory sentinel expects an out-of-tree tier to say so.
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(
        self,
        offloading_spec,
        primary_kv_view: memoryview,
        tier_type: str,
        socket: str = "/run/kvtier/engine.sock",
        name: str | None = None,
        timeout_ms: int = 2000,
        poll_ms: float = 1.0,
        job_timeout_s: float = 30.0,
        reconnect_s: float = 2.0,
        request_level: bool = False,
        enable_kv_events: bool = False,
        locality: str | None = None,
        fingerprint: str | None = None,
        backpressure_detector=None,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        # The options are checked here, where vLLM reports a bad one at start: the I/O
        # thread would only fail to connect, for good and silently.
        self.locality = Locality(locality) if locality is not None else Locality.LOCAL
        if not isinstance(socket, (str, bytes, os.PathLike)):
            raise TypeError("kvtier tier: socket is a path, not %r" % (socket,))
        self._socket = os.fsdecode(socket)
        if name is not None and not isinstance(name, str):
            raise TypeError("kvtier tier: name is a string, not %r" % (name,))
        self._name = _truncate_utf8(name or "vllm-%d" % os.getpid(), _kvt_NAME_MAX)
        self._timeout_ms = _opt_number("timeout_ms", timeout_ms, 1, 2**31 - 1, int)
        self._poll_s = max(_opt_number("poll_ms", poll_ms, 0, 3.6e6), 0.05) / 1000.0
        self._job_timeout_s = _opt_number("job_timeout_s", job_timeout_s, 1e-3, 1e9)
        self._reconnect_s = _opt_number("reconnect_s", reconnect_s, 0, 1e9)
        self._request_level = _opt_bool("request_level", request_level)
        events_on = bool(getattr(getattr(offloading_spec, "kv_events_config", None),
                                 "enable_kv_cache_events", False))
        enable_kv_events = _opt_bool("enable_kv_events", enable_kv_events)
        self._events: list[OffloadingEvent] | None = [] if enable_kv_events and events_on else None
        self._rows = primary_kv_view.shape[0] if primary_kv_view.shape else 0
        self._stride = self.block_size_bytes
        if fingerprint is None:
            fingerprint = model_fingerprint(offloading_spec, self._stride)
        if fingerprint is not None and (
                not isinstance(fingerprint, str) or "\0" in fingerprint
                or len(fingerprint.encode()) > _kvt.FINGERPRINT_MAX):
            raise ValueError("kvtier tier: fingerprint is a string of at most %d bytes (no NUL), "
                             "not %r" % (_kvt.FINGERPRINT_MAX, fingerprint))
        self.fingerprint = fingerprint or None
        self._refused = False  # the node refused our fingerprint (logged once)
        # The region's own descriptor, passed at every (re)attach.
        self._region_fd, self._region_off = region_fd_of(primary_kv_view, offloading_spec)

        # ---- scheduler thread -----------------------------------------------------
        self._table = _key_table()  # every key's lookup state (see _PyKeyTable)
        self._step_jobs: list[_kvt.Job] = []
        self._step_touch: list[OffloadKey] = []
        self._jobs: dict[int, _Job] = {}
        self._done: list[JobResult] = []
        self._node_up = False  # as last heard from the I/O thread
        self._stats = OffloadingConnectorStats()

        # ---- between the threads ------------------------------------------------------
        self._to_io: queue.SimpleQueue = queue.SimpleQueue()
        self._from_io: queue.SimpleQueue = queue.SimpleQueue()
        # Set by the I/O thread after each message it posts (but a round's rtt),
        # cleared by the scheduler before it drains: lookup() and
        # get_finished_jobs() drain only when there is news.
        self._news = False
        self._stop = threading.Event()
        self._connected = threading.Event()
        # ---- the I/O thread's: jobs sent in parts (see _io_send) ----------------------
        self._part_of: dict[int, int] = {}  # part id -> its job's id
        self._split: dict[int, tuple] = {}  # job id -> ([(part id, keys)], {part id: JobDone})
        self._next_part = 0
        self._thread = threading.Thread(target=self._io_main, name="kvtier-io-%s" % tier_type,
                                        daemon=True)
        self._thread.start()
        # Give the node one timeout to answer so the first steps see it up; a node
        # that is not there only makes lookups MISS until the I/O thread connects.
        self._connected.wait(self._timeout_ms / 1000.0)
        self._drain_io()

    # ------------------------------------------------------------------ config
    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return ("kvtier_socket",)

    def config_info(self):
        return {"kvtier_socket": self._socket}

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]
                                 ) -> dict[str, OffloadingMetricMetadata]:
        return {
            KvtierMetrics.VERDICTS: OffloadingCounterMetadata(
                documentation="Lookup verdicts the kvtier node sent, by verdict.",
                labelnames=("verdict",)),
            KvtierMetrics.JOB_ROWS: OffloadingCounterMetadata(
                documentation="Rows of kvtier store/load jobs, by direction and outcome.",
                labelnames=("direction", "outcome")),
            KvtierMetrics.NODE_ERRORS: OffloadingCounterMetadata(
                documentation="kvtier node calls that failed (node gone, timeout, refused)."),
            KvtierMetrics.NODE_CONNECTED: OffloadingGaugeMetadata(
                documentation="1 while the kvtier node is connected and the region attached."),
            KvtierMetrics.STEP_RTT: OffloadingHistogramMetadata(
                documentation="Round trip of one JOBS message to the kvtier node, in seconds.",
                buckets=(0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05,
                         0.1, 0.5, 1.0)),
        }

    # ------------------------------------------------------------------ requests
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        if self._request_level:
            return RequestOffloadingContext(policy=OffloadPolicy.REQUEST_LEVEL)
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._table.request_finished(req_context.req_id)

    # ------------------------------------------------------------------ lookups
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if self._news:
            self._drain_io()
        return self._table.lookup(key, req_context.req_id, self._node_up)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext | None = None) -> None:
        """Records an access in the node's cache policy (sent with the step)."""
        self._step_touch.extend(keys)

    # ------------------------------------------------------------------ jobs
    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, _kvt.JOB_STORE)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, _kvt.JOB_LOAD)

    def _submit(self, job: TransferJob, kind: int) -> None:
        keys = list(job.keys)
        ids = job.chunk_ids
        rows = ids.tolist() if hasattr(ids, "tolist") else [int(c) for c in ids]
        self._jobs[job.job_id] = _Job(job, kind)
        if not self._node_up:
            self._fail(job.job_id)
            return
        if len(rows) != len(keys) or (rows and (min(rows) < 0 or max(rows) >= self._rows)):
            # (the node would refuse the step's whole message, every job in it)
            logger.error("kvtier: job %s names %d keys and rows %s..%s of vLLM's %d: it fails",
                         job.job_id, len(keys), min(rows, default=None),
                         max(rows, default=None), self._rows)
            self._fail(job.job_id)
            return
        self._step_jobs.append(_kvt.Job(job.job_id, kind, keys, rows))

    def _fail(self, job_id: int) -> None:
        self._finish(job_id, False, None)

    def _finish(self, job_id: int, ok: bool, key_ok: list[bool] | None,
                rows: dict | None = None) -> None:
        """Reports a job's end once (a late report after a timeout is dropped). rows,
        when given, gathers the job rows' counter by (direction, outcome) for the
        caller to count once for a batch of jobs; else they are counted here."""
        info = self._jobs.pop(job_id, None)
        if info is None:
            return  # reported already (a late report after a timeout)
        job = info.job
        keys = list(job.keys)
        now = time.monotonic()
        load = info.kind == _kvt.JOB_LOAD
        direction = "load" if load else "store"
        good = keys if ok else [k for k, o in zip(keys, key_ok or ()) if o]
        counts = {} if rows is None else rows
        counts[direction, "ok"] = counts.get((direction, "ok"), 0) + len(good)
        if len(good) < len(keys):
            counts[direction, "failed"] = (counts.get((direction, "failed"), 0)
                                           + len(keys) - len(good))
        if rows is None:
            self._count_rows(counts)
        if load:
            if not ok:
                bad = set(keys).difference(good)
                self._table.mark(bad, False)
            self._done.append(JobResult(
                job_id=job_id, success=ok,
                successful_keys=tuple(good) if (not ok and good) else None,
                transfer_time=now - info.submit,
                transfer_bytes=len(good) * self._stride))
        else:
            if ok:
                self._table.mark(keys, True)
                if self._events is not None and keys:
                    self._events.append(OffloadingEvent(
                        keys=keys, medium=self.medium, removed=False,
                        locality=self.locality, req_context=job.req_context))
            self._done.append(JobResult(job_id=job_id, success=ok,
                                        transfer_time=now - info.submit,
                                        transfer_bytes=len(good) * self._stride))

    def _count_rows(self, counts: dict) -> None:
        for labels, n in counts.items():
            self._stats.increase_counter(KvtierMetrics.JOB_ROWS, n, labels)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        # (vLLM asks once per prepare_store too: the queue is read only when the
        # I/O thread has posted a report since)
        if self._news:
            self._drain_io()
        done, self._done = self._done, []
        return done

    def has_pending_work(self) -> bool:
        return bool(self._jobs) or bool(self._step_jobs)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._drain_io()
        self._flush_step()

    def _flush_step(self) -> None:
        keys, gens = self._table.flush()
        if keys or self._step_jobs or self._step_touch:
            self._to_io.put(("step", keys, gens, self._step_jobs, self._step_touch))
            self._step_jobs, self._step_touch = [], []

    def drain_jobs(self) -> None:
        """Blocks until every job submitted is reported (the I/O thread fails the
        ones the node does not report within job_timeout_s)."""
        self._flush_step()
        deadline = time.monotonic() + self._job_timeout_s + self._timeout_ms / 1000.0 + 5.0
        while self._jobs and time.monotonic() < deadline:
            self._drain_io()
            if self._jobs:
                time.sleep(self._poll_s)
        for job_id in list(self._jobs):  # (the I/O thread is stuck: give up on them)
            self._fail(job_id)

    # ------------------------------------------------------------------ events, stats
    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._events:
            ev, self._events = self._events, []
            yield from ev

    def get_stats(self) -> OffloadingConnectorStats | None:
        self._drain_io()
        self._stats.set_gauge(KvtierMetrics.NODE_CONNECTED, 1 if self._node_up else 0)
        st, self._stats = self._stats, OffloadingConnectorStats()
        return st

    def shutdown(self) -> None:
        self._stop.set()
        self._to_io.put(None)
        self._thread.join(timeout=self._timeout_ms / 1000.0 + 5.0)
        self._drain_io()
        # From now on the tier answers as for a node gone: lookups MISS, jobs fail at
        # once (nothing would send them: they stayed pending and keys RETRY for good).
        self._node_up = False
        self._node_down()
        for job_id in list(self._jobs):
            self._fail(job_id)
        if self._region_fd >= 0 and not self._thread.is_alive():
            # (an I/O thread still stuck in a call may yet attach it: then it stays open,
            # lest the number name another file by then)
            os.close(self._region_fd)
            self._region_fd = -1

    # ------------------------------------------------------------------ from the I/O thread
    def _drain_io(self) -> None:
        self._news = False
        q = self._from_io
        while not q.empty():  # (the scheduler is the queue's only reader)
            msg = q.get_nowait()
            what = msg[0]
            if what == "verdicts":
                counts = list(self._table.apply(msg[1], msg[2], msg[3]))
                counts[_kvt.RETRY] = msg[4] if len(msg) > 4 else 0  # keys asked again
                for v, c in enumerate(counts):
                    if c:
                        self._stats.increase_counter(KvtierMetrics.VERDICTS, c,
                                                     (_VERDICT_NAMES[v],))
            elif what == "done":
                rows: dict = {}
                for d in msg[1]:
                    self._finish(d.id, d.ok, d.key_ok, rows)
                self._count_rows(rows)
            elif what == "rtt":
                self._stats.observe_histogram(KvtierMetrics.STEP_RTT, msg[1])
            elif what == "up":
                self._node_up = msg[1] and not self._stop.is_set()
                if not msg[1]:
                    self._node_down()
            elif what == "error":
                self._stats.increase_counter(KvtierMetrics.NODE_ERRORS, 1)

    def _node_down(self) -> None:
        """The step's jobs not handed over yet fail; every key not answered is a
        MISS. (Jobs the I/O thread has are its to report: it fails them itself, or,
        once reconnected, sends them and reports what the node says, so no job is
        failed here while the node may still copy its rows.)"""
        for job in self._step_jobs:
            self._fail(job.id)
        self._step_jobs = []
        self._table.node_down()

    # ------------------------------------------------------------------ the I/O thread
    def _io_connect(self):
        try:
            c = _kvt.Client(self._socket, name=self._name, timeout_ms=self._timeout_ms,
                            fingerprint=self.fingerprint)
        except _kvt.KvtierError as e:
            if e.errno == errno.EKEYREJECTED and not self._refused:
                self._refused = True
                logger.error("kvtier: the node at %s refused this engine's model fingerprint "
                             "%s: %s", self._socket, self.fingerprint, e.reason or e)
            raise
        self._refused = False
        try:
            row = c.attach_region(self._region_fd, self._region_off, self._rows, self._stride)
        except _kvt.KvtierError as e:
            c.close()
            if e.errno == errno.EINVAL:
                logger.error("kvtier: the node at %s refused vLLM's region (%d rows of %d "
                             "bytes): its chunk size must equal vLLM's row stride",
                             self._socket, self._rows, self._stride)
            raise
        logger.info("kvtier: attached %d rows of %d bytes to the node at %s (model fingerprint "
                    "%s)", self._rows, row, self._socket, self.fingerprint or "none declared")
        return c

    def _io_main(self) -> None:
        client = None
        next_try = 0.0
        retry: dict[OffloadKey, int] = {}  # keys the node answered RETRY -> their gens
        out: dict[int, float] = {}  # job id -> submitted at
        def post(msg, news=True):
            self._from_io.put(msg)
            if news:  # (a round's rtt alone waits for the next drain)
                self._news = True
        while not self._stop.is_set():
            busy = bool(out or retry)
            try:
                item = self._to_io.get(timeout=self._poll_s if busy else 0.05)
            except queue.Empty:
                item = False
            items = [] if item is False else [item]
            while True:
                try:
                    items.append(self._to_io.get_nowait())
                except queue.Empty:
                    break
            if None in items:
                break
            keys: list[OffloadKey] = list(retry)  # the keys to ask, and their gens
            gens: list[int] = list(retry.values())
            jobs: list[_kvt.Job] = []
            touch: list[OffloadKey] = []
            for _, k, g, j, t in items:
                keys.extend(k)
                gens.extend(g)
                jobs.extend(j)
                touch.extend(t)
            if client is None:
                now = time.monotonic()
                if now >= next_try:
                    try:
                        client = self._io_connect()
                        post(("up", True))
                        self._connected.set()
                    except (OSError, _kvt.KvtierError) as e:
                        next_try = now + self._reconnect_s
                        logger.debug("kvtier: no node at %s: %s", self._socket, e)
                    except Exception:  # noqa: BLE001 - the thread must not die
                        next_try = now + self._reconnect_s
                        logger.exception("kvtier: connecting to the node at %s failed",
                                         self._socket)
                if client is None:
                    # Nothing can run: the scheduler fails these jobs and answers
                    # MISS when it hears the node is down.
                    if keys or jobs:
                        post(("verdicts", keys, gens, [_kvt.MISS] * len(keys)))
                        post(("done", [_kvt.JobDone(j.id, False, [False] * len(j.keys))
                                       for j in jobs]))
                    retry.clear()
                    continue
            try:
                if touch and not _keys_ok(touch):
                    touch = [k for k in touch if _key_ok(k)]
                if touch:
                    client.touch(touch[:client.max_keys])
                t0 = time.monotonic()
                verdicts, done = self._io_send(client, keys, jobs)
                post(("rtt", time.monotonic() - t0), False)
            except Exception as e:  # noqa: BLE001 - the thread must not die: as a node gone
                if isinstance(e, OSError):
                    logger.warning("kvtier: node at %s: %s; its jobs fail, lookups miss",
                                   self._socket, e)
                else:
                    logger.exception("kvtier: a step for the node at %s failed; its jobs fail, "
                                     "lookups miss", self._socket)
                post(("error",))
                client.close()
                client = None
                self._io_forget_parts()
                next_try = time.monotonic() + self._reconnect_s
                post(("done", [_kvt.JobDone(j.id, False, [False] * len(j.keys)) for j in jobs]
                      + [_kvt.JobDone(i, False, []) for i in out]))
                out.clear()
                retry.clear()
                post(("up", False))
                continue
            now = time.monotonic()
            for j in jobs:
                out[j.id] = now
            retry.clear()
            if _kvt.RETRY in verdicts:
                for k, g, v in zip(keys, gens, verdicts):
                    if v == _kvt.RETRY:
                        retry[k] = g  # asked again next round; the scheduler only counts it
            if keys:
                post(("verdicts", keys, gens, verdicts, len(retry)))
            if done:
                for d in done:
                    out.pop(d.id, None)
                post(("done", done))
            late = [i for i, t in out.items() if now - t > self._job_timeout_s]
            if late:
                # The node holds them too long: they fail here, and the connection
                # goes (the node drops a gone client's jobs), so no late copy lands
                # in rows vLLM has reused.
                logger.warning("kvtier: %d jobs not done in %.0f s; reconnecting", len(late),
                               self._job_timeout_s)
                client.close()
                client = None
                self._io_forget_parts()
                post(("done", [_kvt.JobDone(i, False, []) for i in out]))
                out.clear()
                retry.clear()
                post(("up", False))
        if client is not None:
            client.close()

    def _io_send(self, client, keys, jobs):
        """One step's lookups and jobs, in as few JOBS messages as the node's key
        limit allows (one in the common case). A job of more keys than one message
        takes goes in parts (ids of the tier's own, _PART_BASE and up), reported as
        one job once every part is (_io_merge). A lookup key that is not 1..64 bytes
        is answered MISS here and a job with such a key fails here: the node is
        never sent them (the library would refuse the whole message)."""
        cap = max(int(client.max_keys), 1)
        verdicts: list[int] = []
        done: list = []
        if keys and not _keys_ok(keys):
            good = [_key_ok(k) for k in keys]
            v, d = self._io_send(client, [k for k, g in zip(keys, good) if g], jobs)
            it = iter(v)
            return [next(it) if g else _kvt.MISS for g in good], d
        parts = []
        for j in jobs:
            n = len(j.keys)
            if not _keys_ok(j.keys):
                done.append(_kvt.JobDone(j.id, False, [False] * n))
            elif n <= cap:
                parts.append(j)
            else:
                split = []
                for at in range(0, n, cap):
                    pid = _PART_BASE + self._next_part
                    self._next_part = (self._next_part + 1) % _PART_BASE
                    self._part_of[pid] = j.id
                    split.append((pid, min(cap, n - at)))
                    parts.append(_kvt.Job(pid, j.kind, j.keys[at:at + cap], j.rows[at:at + cap]))
                self._split[j.id] = (split, {})
        jobs = parts
        ki = 0
        ji = 0
        while True:
            lk = keys[ki:ki + cap] if ki or len(keys) > cap else keys
            ki += len(lk)
            batch, n = [], 0
            while ji < len(jobs) and len(batch) < cap and (not batch or
                                                          n + len(jobs[ji].keys) <= cap):
                batch.append(jobs[ji])
                n += len(jobs[ji].keys)
                ji += 1
            v, d = client.jobs_step(lk, batch)
            verdicts.extend(v)
            done.extend(d)
            if ki >= len(keys) and ji >= len(jobs):
                return verdicts, self._io_merge(done)

    def _io_merge(self, done):
        """done with the parts of split jobs replaced by their job, once all its parts
        are in (ok when every part is; key_ok theirs, in order)."""
        if not self._part_of:
            return done
        out = []
        for d in done:
            job_id = self._part_of.pop(d.id, None)
            if job_id is None:
                out.append(d)
                continue
            split, got = self._split[job_id]
            got[d.id] = d
            if len(got) < len(split):
                continue
            del self._split[job_id]
            key_ok: list[bool] = []
            for pid, n in split:
                ok = list(got[pid].key_ok)[:n]
                key_ok.extend(ok + [False] * (n - len(ok)))
            out.append(_kvt.JobDone(job_id, all(got[pid].ok for pid, _ in split), key_ok))
        return out

    def _io_forget_parts(self) -> None:
        """The connection went: its jobs are failed whole, their parts forgotten."""
        self._part_of.clear()
        self._split.clear()


def _key_ok(k) -> bool:
    try:
        return 1 <= len(k) <= _kvt.KEY_MAX
    except TypeError:
        return False


def _keys_ok(keys) -> bool:
    """Whether every key is 1..64 bytes long (at C speed)."""
    try:
        lens = list(map(len, keys))
    except TypeError:
        return False
    return not lens or (min(lens) >= 1 and max(lens) <= _kvt.KEY_MAX)


# ==================================================================================
# kvtier as vLLM's CPU tier itself: KvtierOffloadingSpec
# ==================================================================================
#
#   --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
#     "kv_connector_extra_config": {"spec_name": "KvtierOffloadingSpec",
#       "spec_module_path": "kvtier.vllm", "kvtier_socket": "/run/kvtier/engine.sock"}}'
#
# Here the node's primary is vLLM's CPU tier: no region of vLLM's own, no copy
# between two CPU regions. Scheduler side, every OffloadingManager call is one call
# to the node, through the shared-memory ring libkvtier-client sets up at connect
# (a lookup is a few microseconds, no system call while the node is busy); the
# node's cache policies are vLLM's chunk-era LRU and ARC. Worker side, vLLM's own
# CPU<->GPU transfer handlers (CPUOffloadingWorker) copy between the GPU and the
# node's region, which every worker maps through its own connection: rows laid
# out as vLLM's SharedOffloadRegion lays them out (one cell of cpu_page_size bytes
# per worker, in rank order), so no copy code of ours is on the GPU path.
#
# One node request carries at most the node's max_keys keys (4096): a call of more
# (a long prompt's prepare_load, prepare_store, their completions, touch) goes to
# the node in parts of at most max_keys keys, in order, and vLLM sees one call; a
# call of at most max_keys keys is one node call, as ever (see docs/vllm.md).
#
# Geometry: the node's row (primary.row_bytes) must be vLLM's kv_bytes_per_chunk
# (one chunk of every worker, rounded up to the page) and primary.workers the world
# size; the spec checks both when it attaches and says what to set otherwise.
#
# A node that goes away: lookups answer MISS, stores are refused (None), loads
# prepared meanwhile carry no region and fail in the workers, completions of
# transfers prepared against the old node are dropped; every later call tries to
# reconnect (at most every reconnect_s), re-registers the live requests and goes on
# with the new node (workers re-attach when they see a load or store for its
# region). Request ids are prefixed with the engine's id: the node is shared by
# every engine on the host.

_LOOKUP_RESULTS = (LookupResult.MISS, LookupResult.HIT, LookupResult.HIT_PENDING,
                   LookupResult.RETRY)
_SCAN_MAX = 64  # keys one lookup scan asks the node for
_GONE = (errno.ECONNRESET, errno.EPIPE, errno.ETIMEDOUT, errno.EPROTO, errno.EBADF,
         errno.ENOTCONN)


class KvtierGeometryError(ValueError):
    """The node's rows do not fit the model: what to configure is in the message."""


def _round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def _node_metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """The node's metrics that get_stats forwards (vLLM's names)."""
    g, c, h = OffloadingGaugeMetadata, OffloadingCounterMetadata, OffloadingHistogramMetadata
    return {
        "vllm:kv_offload_cpu_cache_usage_perc": g(
            documentation="Fraction of the kvtier node's primary pinned by transfers."),
        "vllm:kv_offload_cpu_cache_write_usage_perc": g(
            documentation="Fraction of the kvtier node's primary pinned by stores."),
        "vllm:kv_offload_cpu_cache_read_usage_perc": g(
            documentation="Fraction of the kvtier node's primary pinned by loads."),
        "vllm:kv_offload_cpu_allocation_size": h(
            documentation="Chunks asked for by each prepare_store to the kvtier node.",
            buckets=(1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144)),
        KvtierMetrics.NODE_CONNECTED: g(
            documentation="1 while the kvtier node is connected."),
        KvtierMetrics.NODE_ERRORS: c(
            documentation="kvtier node calls that failed (node gone, timeout, refused)."),
    }


class KvtierOffloadingSpec(OffloadingSpec):
    """vLLM's offloading spec over a kvtier node. kv_connector_extra_config keys:
    kvtier_socket (the node's engine socket, default /run/kvtier/engine.sock),
    kvtier_name (the engine's name in the node's logs), kvtier_timeout_ms (one call,
    default 2000), kvtier_connect_timeout_s (how long the first attach waits for the
    node, default 30), kvtier_reconnect_s (default 1.0), kvtier_ring_spin_us (how
    long a call spins before sleeping, default the library's 20)."""

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]
                                 ) -> dict[str, OffloadingMetricMetadata]:
        return _node_metric_definitions()

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        return ("kvtier_socket", "kvtier_num_chunks", "kvtier_row_bytes")

    def __init__(self, config):
        super().__init__(config)
        ex = self.extra_config
        self.socket = ex.get("kvtier_socket", ex.get("socket", "/run/kvtier/engine.sock"))
        self.kvtier_name = ex.get("kvtier_name")
        self.timeout_ms = int(ex.get("kvtier_timeout_ms", 2000))
        self.connect_timeout_s = float(ex.get("kvtier_connect_timeout_s", 30.0))
        self.reconnect_s = float(ex.get("kvtier_reconnect_s", 1.0))
        self.ring_spin_us = int(ex.get("kvtier_ring_spin_us", -1))
        self.world_size = max(int(config.parallel.world_size), 1)
        # vLLM's geometry, as CPUOffloadingSpec computes it (one copy per worker)
        self.cpu_page_size_per_worker = 0
        self.kv_bytes_per_chunk = 0
        if config.worker_kv_bytes_per_block > 0:
            chunk = config.worker_kv_bytes_per_block * self.world_size * self.blocks_per_chunk
            self.cpu_page_size_per_worker = chunk // self.world_size
            self.kv_bytes_per_chunk = _round_up(chunk, mmap.PAGESIZE)
        self.num_chunks = 0  # the node's, once attached
        # Request ids are node-wide: this engine's prefix keeps them apart.
        self.req_prefix = ("%s/" % config.engine_id)[-48:]
        self._manager = None
        self._worker = None

    def connect(self, role: str):
        """A client of the node whose geometry fits the model (waits up to
        connect_timeout_s for the node); raises KvtierGeometryError otherwise."""
        deadline = time.monotonic() + self.connect_timeout_s
        name = (self.kvtier_name or "vllm-%s" % self.config.engine_id)[:50] + "-" + role
        while True:
            try:
                c = _kvt.Client(self.socket, name=name[:63], timeout_ms=self.timeout_ms)
                break
            except _kvt.KvtierError as e:
                if e.errno not in (errno.ENOENT, errno.ECONNREFUSED) or \
                        time.monotonic() >= deadline:
                    raise
                time.sleep(0.05)
        try:
            self.check_geometry(c)
        except KvtierGeometryError:
            c.close()
            raise
        if self.ring_spin_us >= 0 and c.has_ring:
            c.set_ring(True, self.ring_spin_us)
        self.num_chunks = c.num_chunks
        return c

    def check_geometry(self, c) -> None:
        if self.kv_bytes_per_chunk == 0:
            return  # the scheduler of a model whose size is not known here
        want_row, want_workers = self.kv_bytes_per_chunk, self.world_size
        if (c.row_bytes != want_row or c.num_workers != want_workers
                or self.cpu_page_size_per_worker > c.page_bytes):
            raise KvtierGeometryError(
                "kvtier node at %s has rows of %d bytes for %d worker(s) (%d bytes each); "
                "this model needs rows of %d bytes (kv_bytes_per_chunk: %d blocks per chunk "
                "on %d worker(s), %d bytes per worker, rounded up to the page) for %d "
                "worker(s): start the node with primary.row_bytes=%d and primary.workers=%d"
                % (self.socket, c.row_bytes, c.num_workers, c.page_bytes, want_row,
                   self.blocks_per_chunk, want_workers, self.cpu_page_size_per_worker,
                   want_workers, want_row, want_workers))

    def get_manager(self) -> "KvtierOffloadingManager":
        if self._manager is None:
            self._manager = KvtierOffloadingManager(self)
        return self._manager

    def get_worker(self, kv_caches) -> "KvtierOffloadingWorker":
        if self._worker is None:
            self._worker = KvtierOffloadingWorker(self, kv_caches)
        return self._worker


class _Parts:
    """A prepare_store made in several node calls (more keys than max_keys): its
    node generation and how many of keys_to_store each call planned, in order, so
    that complete_store completes them call for call (the node counts a request's
    prepared stores per call)."""

    __slots__ = ("gen", "sizes")

    def __init__(self, gen: int, sizes: list[int]):
        self.gen = gen
        self.sizes = sizes


class _Void:
    """A prepare_load that pinned nothing (it failed, or the node was away): its
    complete_load is dropped. Named by vLLM's request id, so that it is told apart
    from another request's load of the same keys."""

    __slots__ = ("req_id",)

    def __init__(self, req_id: str):
        self.req_id = req_id


class KvtierCPULoadStoreSpec(CPULoadStoreSpec):
    """vLLM's CPULoadStoreSpec (chunk ids) with the node region they are rows of:
    its (device, inode), or None when the node was unreachable as the transfer was
    prepared (the transfer then fails in the workers)."""

    def __init__(self, block_ids, region):
        super().__init__(block_ids)
        self.region = region


class KvtierOffloadingManager(OffloadingManager):
    """The scheduler's OffloadingManager: each call is one call to the node (see
    KvtierOffloadingSpec), or one per part of at most the node's max_keys keys, in
    order, for a call of more keys. Single-threaded, as vLLM's CPU manager (its lock is
    the default no-op): the C client's own mutex covers a second thread."""

    def __init__(self, spec: KvtierOffloadingSpec):
        self._spec = spec
        self._prefix = spec.req_prefix
        self._events_on = bool(spec.kv_events_config.enable_kv_cache_events)
        self._reqs: dict[str, ReqContext] = {}  # live: re-registered after a reconnect
        self._rids: dict[str, bytes] = {}  # vLLM's id -> the node's
        self._gen = 0  # bumped at every (re)connect: transfers of older gens are void
        # packed keys -> gens (_Void: pinned nothing), per prepare_load
        self._loads: dict[bytes, list] = {}
        # packed keys_to_store -> gens (_Parts: prepared in several calls)
        self._stores: dict[bytes, list] = {}
        self._next_try = 0.0
        self._errors = 0
        self._client = None
        self._region = None
        # The last scan's answers (key -> result) for request _pf_ctx; any other
        # call drops them (_pf_ctx = None): they may have changed.
        self._pf: dict = {}
        self._pf_ctx = None
        self._epoch = 0  # bumped by every call but lookup: a scan lasts within one
        self._scan_ctx = None  # the request whose keys _scan_keys lists
        self._scan_len = 0
        self._scan_keys: list = []
        self._scan_idx: dict = {}
        self._scan_last = -1  # position of the last key looked up in this scan
        self._scan_epoch = -1
        self._attach(spec.connect("scheduler"))

    # ---------------------------------------------------------------- connection
    def _attach(self, client) -> None:
        self._client = client
        self._h = client.handle
        self._region = client.region_ident
        self._gen += 1
        self._max_keys = max(int(client.max_keys), 1)
        # The hot calls through kvtier._fast (the package's CPython extension): bytes
        # and lists as they are, no ctypes arrays; a lookup answers vLLM's
        # LookupResult itself. Failures raise KvtierError.
        f = client.fast_view(_LOOKUP_RESULTS)
        self._f = f
        self._lookup_one = f.lookup_one
        self._lookup_many = f.lookup
        self._prepare_store = f.prepare_store
        self._complete_store = f.complete_store
        self._prepare_load = f.prepare_load
        self._complete_load = f.complete_load
        self._touch = f.touch
        self._schedule_end = f.on_schedule_end
        # The calls vLLM expects nothing back from are posted: the node runs them
        # in order before the next call, which does not wait for them.
        if client.has_ring:
            client.set_posting(True)
        # (_loads and _stores keep the prepares made against the connection before:
        # their generation drops their completions. Cleared, a completion of an old
        # load would take the record of a new load of the same keys and release its
        # pins on this connection while its copy still runs.)
        self._pf_ctx = None
        self._epoch += 1
        self._down = False

    def _lost(self, rc: int, what: str) -> None:
        """A call failed: a node gone (or out of step) makes this client down."""
        self._errors += 1
        if -rc in _GONE and not self._down:
            logger.warning("kvtier: node at %s: %s: %s; lookups miss and stores are "
                           "refused until it is back", self._spec.socket, what,
                           os.strerror(-rc))
            self._down = True
            self._next_try = 0.0

    def _revive(self) -> bool:
        """When down: tries to reconnect (at most every reconnect_s). True if up.
        Never after shutdown()."""
        if not self._down:
            return True
        if self._client is None:
            return False  # shut down: calls answer as for a node gone, for good
        now = time.monotonic()
        if now < self._next_try:
            return False
        self._next_try = now + self._spec.reconnect_s
        try:
            c = _kvt.Client(self._spec.socket, name=self._client_name(), timeout_ms=
                            self._spec.timeout_ms)
        except _kvt.KvtierError:
            return False
        try:
            self._spec.check_geometry(c)
        except KvtierGeometryError as e:
            logger.error("kvtier: %s", e)
            c.close()
            return False
        if self._spec.ring_spin_us >= 0 and c.has_ring:
            c.set_ring(True, self._spec.ring_spin_us)
        old = self._client
        self._attach(c)
        old.close()
        for ctx in list(self._reqs.values()):
            try:
                self._register(ctx)
            except _kvt.KvtierError as e:
                logger.warning("kvtier: request %s not registered again: %s", ctx.req_id, e)
        logger.info("kvtier: node at %s is back (region %s)", self._spec.socket, self._region)
        return True

    def _client_name(self) -> str:
        return ((self._spec.kvtier_name or "vllm-%s" % self._spec.config.engine_id)[:50]
                + "-scheduler")[:63]

    def _rid(self, req_context: ReqContext) -> bytes:
        rid = self._rids.get(req_context.req_id)
        if rid is None:
            rid = (self._prefix + req_context.req_id).encode()
            if len(rid) > _kvt.REQ_ID_MAX:
                rid = (self._prefix + hashlib.sha1(req_context.req_id.encode()).hexdigest()
                       ).encode()
            self._rids[req_context.req_id] = rid
        return rid

    # ---------------------------------------------------------------- requests
    def _register(self, ctx: ReqContext) -> int:
        params = ctx.kv_transfer_params
        tiers = None
        filt = ctx.load_tier_filter
        if filt is not TierFilter.ALL:
            tiers = [(_MEDIUM_IDS.get(m.medium, _kvt.ANY), _LOCALITY_IDS.get(m.locality, _kvt.ANY))
                     for m in filt.matchers]
        return self._client.on_new_request(
            self._rid(ctx).decode(), json.dumps(params) if params else None, tiers)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._pf_ctx = None
        self._epoch += 1
        self._reqs[req_context.req_id] = req_context
        if self._down and not self._revive():
            return RequestOffloadingContext()
        try:
            policy = self._register(req_context)
        except _kvt.KvtierError as e:
            if e.errno in _GONE:
                self._lost(-e.errno, "on_new_request")
                return RequestOffloadingContext()
            raise
        if policy == _kvt.REQUEST_LEVEL:
            return RequestOffloadingContext(policy=OffloadPolicy.REQUEST_LEVEL)
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._pf_ctx = None
        self._epoch += 1
        if self._scan_ctx is req_context:
            self._scan_ctx = None
        if self._reqs.pop(req_context.req_id, None) is None:
            return
        if self._down:
            self._rids.pop(req_context.req_id, None)
            return
        try:
            self._client.on_request_finished(self._rid(req_context).decode())
        except _kvt.KvtierError as e:
            self._lost(-e.errno, "on_request_finished")
        self._rids.pop(req_context.req_id, None)

    # ---------------------------------------------------------------- lookups
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if self._pf_ctx is req_context:
            r = self._pf.get(key)
            if r is not None:
                return r
        rid = self._rids.get(req_context.req_id)
        if rid is None:
            rid = self._rid(req_context)
        # vLLM's scheduler records every key's position in the request before it
        # looks them up, from the first on, until a miss: a lookup that starts such
        # a scan asks for the keys after it too, in one call (see _scan).
        positions = req_context._offload_key_positions
        if len(positions) > 1:
            r = self._scan(key, req_context, rid, positions)
            if r is not None:
                return r
        try:
            return self._lookup_one(rid, key)
        except _kvt.KvtierError as e:
            self._lost(-e.errno, "lookup")
        if self._down and self._revive():
            return self.lookup(key, req_context)
        return LookupResult.MISS

    def _scan(self, key, req_context, rid, positions) -> LookupResult | None:
        """A forward prefix scan of a request's keys (as vLLM's maximal prefix
        lookup makes one): key and the keys after it in the request (same KV-cache
        group, by position) are looked up in one node call that stops after the
        first MISS or RETRY (KVTIER_LOOKUP_PREFIX), so the node sees the keys vLLM
        would ask for; their answers serve vLLM's next lookups of this request
        until any other call (which may change them) is made. A backward scan
        (sliding windows) is left to one call per key. None: not a scan."""
        pos = positions.get(key)
        if pos is None:
            return None
        if self._scan_ctx is not req_context or self._scan_len != len(positions):
            self._scan_ctx = req_context
            self._scan_len = len(positions)
            self._scan_keys = list(positions)
            self._scan_idx = {k: i for i, k in enumerate(self._scan_keys)}
            self._scan_last = -1
        if self._scan_epoch != self._epoch:
            self._scan_epoch = self._epoch
            self._scan_last = -1
        last, self._scan_last = self._scan_last, pos
        if pos < last:
            return None  # backwards: one key at a time
        i = self._scan_idx[key]
        group = key[-4:]
        batch = [key]
        for k in self._scan_keys[i + 1:i + _SCAN_MAX]:
            if k[-4:] != group or positions[k] <= pos:
                break
            batch.append(k)
            pos = positions[k]
        if len(batch) == 1:
            return None
        try:
            res = self._lookup_many(rid, batch, True)
        except _kvt.KvtierError:
            return None  # (one key at a time tells the rest)
        self._pf = dict(zip(batch, res))
        self._pf_ctx = req_context
        return self._pf.get(key)

    def get_load_source(self, key: OffloadKey, req_context: ReqContext):
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        return CacheHitSource.HOST

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext | None = None) -> None:
        self._pf_ctx = None
        self._epoch += 1
        keys = keys if isinstance(keys, (list, tuple)) else list(keys)
        if not keys or self._down:
            return
        rid = self._rid(req_context) if req_context is not None else None
        try:
            if len(keys) <= self._max_keys:
                self._touch(rid, keys)
            else:
                self._touch_parts(rid, keys)
        except _kvt.KvtierError as e:
            self._lost(-e.errno, "touch")

    def _touch_parts(self, rid, keys) -> None:
        """A touch of more than max_keys keys, as one node call would apply it: the
        node takes each key once (where first named), by KV-cache group (stable),
        and its policies walk them from the last to the first (the first ends most
        recent); so the keys are put in that order here and the parts sent last
        first, their walks making one."""
        keys = list(dict.fromkeys(keys))
        if len({k[-4:] for k in keys}) > 1:
            keys.sort(key=lambda k: int.from_bytes(k[-4:], "big"))  # the node's group
        cap = self._max_keys
        for lo in reversed(range(0, len(keys), cap)):
            self._touch(rid, keys[lo:lo + cap])

    # ---------------------------------------------------------------- loads
    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext):
        self._pf_ctx = None
        self._epoch += 1
        keys = keys if isinstance(keys, (list, tuple)) else list(keys)
        n = len(keys)
        if n == 0:
            return KvtierCPULoadStoreSpec([], self._region)
        if self._down and not self._revive():
            return self._load_failed(keys, req_context)  # fails in the workers
        rid = self._rids.get(req_context.req_id) or self._rid(req_context)
        if n > self._max_keys:
            return self._prepare_load_parts(rid, keys, req_context)
        try:
            ids = self._prepare_load(rid, keys)
        except _kvt.KvtierError as e:
            self._lost(-e.errno, "prepare_load")
            # (vLLM asserts the keys were HIT: a node that refuses them now has
            # lost them; the workers fail this load and vLLM recomputes)
            return self._load_failed(keys, req_context)
        self._note_prepared(self._loads, b"".join(keys))
        return KvtierCPULoadStoreSpec(ids, self._region)

    def _prepare_load_parts(self, rid, keys, req_context):
        """prepare_load of more than max_keys keys: a node call per part, in order,
        each pinning its keys; the ids of all, in key order. A part that fails
        releases the parts before it (nothing stays pinned) and the load fails as
        one call's would: no region, a miss in the workers, never wrong bytes."""
        cap = self._max_keys
        ids = []
        for lo in range(0, len(keys), cap):
            try:
                ids += self._prepare_load(rid, keys[lo:lo + cap])
            except _kvt.KvtierError as e:
                self._lost(-e.errno, "prepare_load")
                if lo and not self._down:  # (a node gone took its pins with it)
                    try:
                        self._complete_load_parts(keys[:lo])
                    except _kvt.KvtierError as e2:
                        self._lost(-e2.errno, "complete_load")
                return self._load_failed(keys, req_context)
        self._note_prepared(self._loads, b"".join(keys))
        return KvtierCPULoadStoreSpec(ids, self._region)

    def _load_failed(self, keys, req_context):
        """A load that pinned nothing: its spec has no region (the workers fail it,
        vLLM recomputes) and its complete_load is dropped (it would release pins
        another load of the same keys holds)."""
        packed = b"".join(keys)
        void = _Void(req_context.req_id)
        gens = self._loads.get(packed)
        if gens is None:
            self._loads[packed] = [void]
        else:
            gens.append(void)
        return KvtierCPULoadStoreSpec([0] * len(keys), None)

    def _note_prepared(self, prepared, packed) -> None:
        """Records a prepare of these keys against this node generation (taken back,
        oldest first, by _from_this_node)."""
        gens = prepared.get(packed)
        if gens is None:
            prepared[packed] = [self._gen]
        else:
            gens.append(self._gen)

    def _from_this_node(self, prepared, packed, req_context=None) -> bool:
        """Takes a prepare of these keys from prepared (_take_prepared); False when it
        was made against a node that is gone (a restart since) or pinned nothing
        (_Void)."""
        gen = self._take_prepared(prepared, packed, req_context)
        return gen is None or gen == self._gen

    def _take_prepared(self, prepared, packed, req_context=None):
        """Takes a prepare of these keys from prepared: its entry (a node generation,
        _Parts or _Void; of several, _take_of's), None when none was recorded."""
        gens = prepared.get(packed)
        if not gens:
            return None
        if len(gens) == 1:
            del prepared[packed]
            return gens[0]
        return self._take_of(gens, req_context)

    @staticmethod
    def _take_of(gens, req_context):
        """Of several prepares of the same keys: the void one of req_context's
        request, else the oldest that is not void, else the oldest."""
        at = 0
        if any(g.__class__ is _Void for g in gens):
            rid = req_context.req_id if req_context is not None else None
            mine = [i for i, g in enumerate(gens) if g.__class__ is _Void and g.req_id == rid]
            if mine:
                at = mine[0]
            else:
                at = next((i for i, g in enumerate(gens) if g.__class__ is not _Void), 0)
        return gens.pop(at)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._pf_ctx = None
        self._epoch += 1
        keys = keys if isinstance(keys, (list, tuple)) else list(keys)
        if not keys:
            return
        if not self._from_this_node(self._loads, b"".join(keys), req_context) or self._down:
            return  # pinned on a node that is gone, or not pinned
        # (no request id: the node scopes pins by client, and the request may be
        # finished already)
        try:
            if len(keys) <= self._max_keys:
                self._complete_load(None, keys)
            else:
                self._complete_load_parts(keys)
        except _kvt.KvtierError as e:
            self._lost(-e.errno, "complete_load")

    def _complete_load_parts(self, keys) -> None:
        """Releases the pins of keys, max_keys at a time (the node counts pins per
        key: any split releases each once)."""
        cap = self._max_keys
        for lo in range(0, len(keys), cap):
            self._complete_load(None, keys[lo:lo + cap])

    # ---------------------------------------------------------------- stores
    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext):
        self._pf_ctx = None
        self._epoch += 1
        keys = keys if isinstance(keys, (list, tuple)) else list(keys)
        n = len(keys)
        if self._down and not self._revive():
            return None
        if n == 0:
            return PrepareStoreOutput(keys_to_store=[],
                                      store_spec=KvtierCPULoadStoreSpec([], self._region),
                                      evicted_keys=[])
        rid = self._rids.get(req_context.req_id) or self._rid(req_context)
        if n > self._max_keys:
            return self._prepare_store_parts(rid, keys)
        try:
            idx, ids, evicted = self._prepare_store(rid, keys)
        except _kvt.KvtierError as e:
            if e.errno != errno.ENOSPC:
                self._lost(-e.errno, "prepare_store")
            return None
        to_store = [keys[i] for i in idx]
        if to_store:
            self._note_prepared(self._stores, b"".join(to_store))
        return PrepareStoreOutput(keys_to_store=to_store,
                                  store_spec=KvtierCPULoadStoreSpec(ids, self._region),
                                  evicted_keys=evicted)

    def _prepare_store_parts(self, rid, keys):
        """prepare_store of more than max_keys keys: a node call per part, in order;
        the union of their plans (keys_to_store, their chunk ids in that order, the
        keys evicted). A part refused (no room: ENOSPC) ends it: the parts before
        stand and are returned, so that vLLM stores exactly their keys (None when
        they planned nothing, as one call refused). Unlike one call, which is all or
        nothing: each part protects only its own present keys from its evictions,
        and ARC adapts to each part's store misses (docs/vllm.md)."""
        cap = self._max_keys
        to_store, ids, evicted, sizes = [], [], [], []
        for lo in range(0, len(keys), cap):
            part = keys[lo:lo + cap]
            try:
                idx, pids, ev = self._prepare_store(rid, part)
            except _kvt.KvtierError as e:
                if e.errno != errno.ENOSPC:
                    self._lost(-e.errno, "prepare_store")
                if not to_store or self._down:
                    return None  # (a node gone took the parts before with it)
                break
            if idx:
                to_store += [part[i] for i in idx]
                ids += pids
                sizes.append(len(idx))
            evicted += ev
        if to_store:
            packed = b"".join(to_store)
            if len(sizes) == 1:
                self._note_prepared(self._stores, packed)
            else:
                self._stores.setdefault(packed, []).append(_Parts(self._gen, sizes))
        return PrepareStoreOutput(keys_to_store=to_store,
                                  store_spec=KvtierCPULoadStoreSpec(ids, self._region),
                                  evicted_keys=evicted)

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext,
                       success: bool = True) -> None:
        self._pf_ctx = None
        self._epoch += 1
        keys = keys if isinstance(keys, (list, tuple)) else list(keys)
        if not keys:
            return
        gen = self._take_prepared(self._stores, b"".join(keys))
        sizes = None
        if gen is not None and gen != self._gen:
            if gen.__class__ is not _Parts or gen.gen != self._gen:
                return  # prepared on a node that is gone
            sizes = gen.sizes
        if self._down:
            return
        rid = self._rids.get(req_context.req_id) or self._rid(req_context)
        try:
            if sizes is None and len(keys) <= self._max_keys:
                self._complete_store(rid, keys, success)
            else:
                self._complete_store_parts(rid, keys, success, sizes)
        except _kvt.KvtierError as e:
            self._lost(-e.errno, "complete_store")

    def _complete_store_parts(self, rid, keys, success, sizes) -> None:
        """complete_store call for call with the prepare_store parts that planned
        the keys (sizes: how many each planned); without sizes (a store prepared in
        one call, or not recorded), max_keys at a time."""
        if sizes is None or sum(sizes) != len(keys):
            cap = self._max_keys
            sizes = [min(cap, len(keys) - lo) for lo in range(0, len(keys), cap)]
        lo = 0
        for size in sizes:
            self._complete_store(rid, keys[lo:lo + size], success)
            lo += size

    # ---------------------------------------------------------------- steps
    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._pf_ctx = None
        self._epoch += 1
        if self._down and not self._revive():
            return
        new, pre = context.new_req_ids, context.preempted_req_ids
        try:
            self._schedule_end([self._rid_of(r) for r in new] if new else None,
                               [self._rid_of(r) for r in pre] if pre else None)
        except _kvt.KvtierError as e:
            self._lost(-e.errno, "on_schedule_end")

    def _rid_of(self, req_id: str) -> bytes:
        rid = self._rids.get(req_id)
        return rid if rid is not None else (self._prefix + req_id)[-_kvt.REQ_ID_MAX:].encode()

    def has_pending_work(self) -> bool:
        return False

    # ---------------------------------------------------------------- events, stats
    def take_events(self) -> Iterable[OffloadingEvent]:
        if not self._events_on or self._down:
            return
        try:
            events = self._client.take_events()
        except _kvt.KvtierError as e:
            self._lost(-e.errno, "take_events")
            return
        for ev in events:
            yield OffloadingEvent(
                keys=[OffloadKey(k) for k in ev.keys],
                medium=Medium.STORAGE if ev.medium == _kvt.MEDIUM_STORAGE else Medium.CPU,
                removed=ev.removed,
                locality=None if ev.locality == _kvt.ANY else (
                    Locality.REMOTE if ev.locality == _kvt.REMOTE else Locality.LOCAL))

    def get_stats(self) -> OffloadingConnectorStats | None:
        st = OffloadingConnectorStats()
        st.set_gauge(KvtierMetrics.NODE_CONNECTED, 0 if self._down else 1)
        if self._errors:
            st.increase_counter(KvtierMetrics.NODE_ERRORS, self._errors)
            self._errors = 0
        if self._down:
            return st
        try:
            failed = self._client.drain()  # (posted calls that failed)
            if failed:
                st.increase_counter(KvtierMetrics.NODE_ERRORS, failed)
            stats = self._client.get_stats()
        except _kvt.KvtierError as e:
            self._lost(-e.errno, "get_stats")
            return st
        known = _node_metric_definitions()
        for s in stats:
            if s.name not in known or s.label:
                continue
            if s.kind == _kvt.GAUGE:
                st.set_gauge(s.name, s.value)
            elif s.kind == _kvt.COUNTER:
                st.increase_counter(s.name, s.value)
            elif s.count:
                # the node keeps buckets, not samples: count samples of the mean
                # (count and sum exact, as vLLM's logger reduces them)
                for _ in range(int(s.count)):
                    st.observe_histogram(s.name, s.sum / s.count)
        return st

    def config_info(self):
        c = self._client
        return [{"kvtier_socket": self._spec.socket, "kvtier_num_chunks": c.num_chunks,
                 "kvtier_row_bytes": c.row_bytes}]

    # ---------------------------------------------------------------- reset, shutdown
    def reset_cache(self) -> None:
        """vLLM drops every transfer in flight at a reset: so does this manager
        (a new connection: the node releases the old one's pins and stores), then
        asks the node to forget its chunks when the node can (kvtier_reset)."""
        self._pf_ctx = None
        self._epoch += 1
        if self._down and not self._revive():
            return
        try:
            c = self._spec.connect("scheduler")
        except (OSError, _kvt.KvtierError) as e:
            self._lost(-getattr(e, "errno", errno.ECONNRESET) or -errno.ECONNRESET, "reset_cache")
            return
        old = self._client
        self._attach(c)
        old.close()
        for ctx in list(self._reqs.values()):
            try:
                self._register(ctx)
            except _kvt.KvtierError:
                pass
        reset = getattr(c.lib, "kvtier_reset", None)
        if reset is None:
            logger.error("kvtier: this libkvtier-client cannot ask the node to reset; its "
                         "chunks stay (transfers in flight were dropped)")
            return
        reset.restype = ctypes.c_int
        reset.argtypes = [ctypes.c_void_p]
        rc = reset(self._h)
        if rc < 0:
            logger.warning("kvtier: the node did not reset its cache: %s", os.strerror(-rc))

    def shutdown(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
            self._down = True


_MEDIUM_IDS = {Medium.CPU: _kvt.MEDIUM_CPU, Medium.STORAGE: _kvt.MEDIUM_STORAGE, None: _kvt.ANY}
_LOCALITY_IDS = {Locality.LOCAL: _kvt.LOCAL, Locality.REMOTE: _kvt.REMOTE, None: _kvt.ANY}


# ---------------------------------------------------------------- worker side

def _node_region_cls():
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    class NodeRegion(SharedOffloadRegion):
        """The node's region as vLLM's SharedOffloadRegion: this worker's views are
        made by SharedOffloadRegion's own methods (create_next_worker_view: cells of
        cpu_page_size bytes in rank order, rows of kv_bytes_per_chunk), over the
        mapping of this worker's connection instead of a /dev/shm file of vLLM's.
        cleanup() closes the connection (vLLM calls it once its copies are done)."""

        def __init__(self, client, rank: int, cpu_page_size: int):  # noqa: super() not called
            import torch

            self._client = client
            self.page_size = mmap.PAGESIZE
            self.num_chunks = client.num_chunks
            self._row_stride = client.row_bytes
            self.total_size_bytes = client.num_chunks * client.row_bytes
            self.cpu_page_size = cpu_page_size
            self.mmap_path = "kvtier:%s" % (client.region_ident,)
            self._segments = [(self.mmap_path, 0, self.total_size_bytes)]
            self._creator = False
            self.rank = rank
            self._worker_offset = rank * cpu_page_size
            self._worker_area_end = (rank + 1) * cpu_page_size
            self.fd = None
            self.mmap_obj = None
            self._base = torch.frombuffer(client._region, dtype=torch.int8)
            self._views = []
            self._canonical_offset = 0
            self.is_pinned = False
            self.pinned_addresses = []

        def cleanup(self) -> None:
            super().cleanup()
            if self._client is not None:
                self._client.close()
                self._client = None

    return NodeRegion


class KvtierOffloadingWorker(OffloadingWorker):
    """The worker side: vLLM's CPUOffloadingWorker (its transfer handlers, its
    streams, its copy kernels) over the node's region. A transfer whose spec names
    another region than the one mapped here (a restarted node) makes this worker
    attach again; one that names no region, or one no longer there, fails. The
    CPUOffloadingWorker of an older region stays until its transfers are reported."""

    def __init__(self, spec: KvtierOffloadingSpec, kv_caches):
        self._spec = spec
        self._kv_caches = kv_caches
        self._rank = int(spec.config.parallel.rank)
        self._failed: list[int] = []
        self._inner = None
        self._client = None
        self._region = None
        self._gone: set = set()  # regions of nodes that went away
        self._jobs: dict[int, Any] = {}  # job id -> the CPUOffloadingWorker it went to
        self._old: list = []  # workers of older regions with jobs out
        self._next_try = 0.0
        self._attach(spec.connect("worker%d" % self._rank))

    def _attach(self, client) -> None:
        from vllm.v1.kv_offload.cpu.gpu_worker import CPUOffloadingWorker

        page = self._spec.cpu_page_size_per_worker or client.page_bytes
        region = _node_region_cls()(client, self._rank, page)
        try:
            inner = CPUOffloadingWorker(kv_caches=self._kv_caches,
                                        blocks_per_chunk=self._spec.blocks_per_chunk,
                                        num_cpu_chunks=client.num_chunks, mmap_region=region)
        except Exception:
            region.cleanup()
            raise
        old = self._inner
        self._inner = inner
        self._client = client
        self._region = client.region_ident
        if old is not None:
            if any(w is old for w in self._jobs.values()):
                self._old.append(old)
            else:
                old.shutdown()

    def _ready_for(self, spec_) -> bool:
        """Whether a transfer of spec_ can run: it names the region mapped here and
        the node still holds it. A region found gone stays gone; learning that, the
        worker attaches the node's current region for the transfers to come."""
        want = getattr(spec_, "region", None)
        if want is None or want in self._gone:
            return False
        if want == self._region and self._client.alive():
            return True
        now = time.monotonic()
        if now < self._next_try:
            return False  # (the node was unreachable a moment ago)
        try:
            c = _kvt.Client(self._spec.socket, name="vllm-worker%d" % self._rank,
                            timeout_ms=self._spec.timeout_ms)
        except _kvt.KvtierError:
            self._next_try = now + self._spec.reconnect_s
            return False
        if c.region_ident != want:
            self._gone.add(want)  # the node has another region now
            if len(self._gone) > 64:
                self._gone.pop()
        if c.region_ident == self._region and self._client.alive():
            c.close()
            return False
        if self._region is not None and self._region != c.region_ident:
            self._gone.add(self._region)
        try:
            self._spec.check_geometry(c)
            self._attach(c)
        except Exception as e:  # noqa: BLE001 - the transfer fails, logged
            logger.error("kvtier: worker %d cannot attach the node again: %s", self._rank, e)
            return False
        logger.info("kvtier: worker %d attached the node's region %s", self._rank, self._region)
        return want == self._region

    def submit_store(self, job_id, device_ptrs, dst_spec) -> bool:
        if not self._ready_for(dst_spec):
            self._failed.append(job_id)
            return True
        self._jobs[job_id] = self._inner
        return self._inner.submit_store(job_id, device_ptrs, dst_spec)

    def submit_load(self, job_id, src_spec, device_ptrs, expedited=False) -> bool:
        if not self._ready_for(src_spec):
            self._failed.append(job_id)
            return True
        self._jobs[job_id] = self._inner
        return self._inner.submit_load(job_id, src_spec, device_ptrs, expedited)

    def get_finished(self) -> list:
        out = [TransferResult(job_id=j, success=False) for j in self._failed]
        self._failed = []
        for w in [self._inner] + self._old:
            for r in w.get_finished():
                self._jobs.pop(r.job_id, None)
                out.append(r)
        if self._old:
            busy = set(map(id, self._jobs.values()))
            for w in [w for w in self._old if id(w) not in busy]:
                w.shutdown()  # its region's connection closes with it
            self._old = [w for w in self._old if id(w) in busy]
        return out

    def wait(self, job_ids) -> None:
        for w in self._old:
            w.wait(job_ids)
        self._inner.wait(job_ids)

    def shutdown(self) -> None:
        for w in self._old:
            w.shutdown()
        self._old = []
        if self._inner is not None:
            self._inner.shutdown()
            self._inner = None

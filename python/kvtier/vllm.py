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

import errno
import hashlib
import json
import logging
import mmap
import os
import queue
import threading
import time
from collections.abc import Iterable
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
    OffloadingMetricMetadata,
    OffloadKey,
    OffloadPolicy,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
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
    return "vllm:%s:%s:%s" % (str(model.name)[:160], str(model.dtype)[:32], digest)


class _Key:
    """Lookup state of one key (scheduler thread)."""

    __slots__ = ("gen", "result", "in_flight", "reqs")

    def __init__(self, gen: int):
        self.gen = gen
        self.result: bool | None = None
        self.in_flight = False
        self.reqs: set[str] = set()


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
        self.locality = Locality(locality) if locality is not None else Locality.LOCAL
        self._socket = socket
        self._name = (name or "vllm-%d" % os.getpid())[:63]
        self._timeout_ms = int(timeout_ms)
        self._poll_s = max(float(poll_ms), 0.05) / 1000.0
        self._job_timeout_s = float(job_timeout_s)
        self._reconnect_s = float(reconnect_s)
        self._request_level = bool(request_level)
        events_on = bool(getattr(getattr(offloading_spec, "kv_events_config", None),
                                 "enable_kv_cache_events", False))
        self._events: list[OffloadingEvent] | None = [] if enable_kv_events and events_on else None
        self._rows = primary_kv_view.shape[0] if primary_kv_view.shape else 0
        self._stride = self.block_size_bytes
        if fingerprint is None:
            fingerprint = model_fingerprint(offloading_spec, self._stride)
        self.fingerprint = fingerprint or None
        self._refused = False  # the node refused our fingerprint (logged once)
        # The region's own descriptor, passed at every (re)attach.
        self._region_fd, self._region_off = region_fd_of(primary_kv_view, offloading_spec)

        # ---- scheduler thread -----------------------------------------------------
        self._keys: dict[OffloadKey, _Key] = {}
        self._req_keys: dict[str, set[OffloadKey]] = {}
        self._next_gen = 0
        self._step_keys: list[tuple[OffloadKey, int]] = []
        self._step_jobs: list[_kvt.Job] = []
        self._step_touch: list[OffloadKey] = []
        self._jobs: dict[int, _Job] = {}
        self._done: list[JobResult] = []
        self._node_up = False  # as last heard from the I/O thread
        self._stats = OffloadingConnectorStats()

        # ---- between the threads ------------------------------------------------------
        self._to_io: queue.SimpleQueue = queue.SimpleQueue()
        self._from_io: queue.SimpleQueue = queue.SimpleQueue()
        # Set by the I/O thread after each message it posts, cleared by the
        # scheduler before it drains: a lookup drains only when there is news.
        self._news = False
        self._stop = threading.Event()
        self._connected = threading.Event()
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
        rid = req_context.req_id
        for key in self._req_keys.pop(rid, ()):
            st = self._keys.get(key)
            if st is None:
                continue
            st.reqs.discard(rid)
            if not st.reqs and not st.in_flight:
                del self._keys[key]

    # ------------------------------------------------------------------ lookups
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if self._news:
            self._drain_io()
        st = self._keys.get(key)
        if st is None:
            if not self._node_up:
                return LookupResult.MISS
            st = _Key(self._next_gen)
            self._next_gen += 1
            self._keys[key] = st
            self._step_keys.append((key, st.gen))
        rid = req_context.req_id
        st.reqs.add(rid)
        self._req_keys.setdefault(rid, set()).add(key)
        if st.result is None:
            return LookupResult.RETRY
        return LookupResult.HIT if st.result else LookupResult.MISS

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext | None = None) -> None:
        """Records an access in the node's cache policy (sent with the step)."""
        self._step_touch.extend(keys)

    def _mark(self, keys: Iterable[OffloadKey], present: bool) -> None:
        for key in keys:
            st = self._keys.get(key)
            if st is None:
                continue
            if present:
                if not st.reqs:
                    del self._keys[key]
                    continue
                # Newer than any probe out: its late verdict must not land.
                st.gen = self._next_gen
                self._next_gen += 1
                st.result, st.in_flight = True, False
            elif st.result is not None:
                st.result = False  # #49176: a failed load is not offered again

    # ------------------------------------------------------------------ jobs
    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, _kvt.JOB_STORE)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, _kvt.JOB_LOAD)

    def _submit(self, job: TransferJob, kind: int) -> None:
        keys = list(job.keys)
        rows = [int(c) for c in job.chunk_ids]
        self._jobs[job.job_id] = _Job(job, kind)
        if not self._node_up:
            self._fail(job.job_id)
            return
        self._step_jobs.append(_kvt.Job(job.job_id, kind, keys, rows))

    def _fail(self, job_id: int) -> None:
        self._finish(job_id, False, None)

    def _finish(self, job_id: int, ok: bool, key_ok: list[bool] | None) -> None:
        info = self._jobs.pop(job_id, None)
        if info is None:
            return  # reported already (a late report after a timeout)
        job = info.job
        keys = list(job.keys)
        now = time.monotonic()
        direction = "load" if info.kind == _kvt.JOB_LOAD else "store"
        good = keys if ok else [k for k, o in zip(keys, key_ok or ()) if o]
        self._stats.increase_counter(KvtierMetrics.JOB_ROWS, len(good), (direction, "ok"))
        if len(good) < len(keys):
            self._stats.increase_counter(KvtierMetrics.JOB_ROWS, len(keys) - len(good),
                                         (direction, "failed"))
        if info.kind == _kvt.JOB_LOAD:
            if not ok:
                bad = set(keys).difference(good)
                self._mark(bad, False)
            self._done.append(JobResult(
                job_id=job_id, success=ok,
                successful_keys=tuple(good) if (not ok and good) else None,
                transfer_time=now - info.submit,
                transfer_bytes=len(good) * self._stride))
        else:
            if ok:
                self._mark(keys, True)
                if self._events is not None and keys:
                    self._events.append(OffloadingEvent(
                        keys=keys, medium=self.medium, removed=False,
                        locality=self.locality, req_context=job.req_context))
            self._done.append(JobResult(job_id=job_id, success=ok,
                                        transfer_time=now - info.submit,
                                        transfer_bytes=len(good) * self._stride))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        self._drain_io()
        done, self._done = self._done, []
        return done

    def has_pending_work(self) -> bool:
        return bool(self._jobs) or bool(self._step_jobs)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._drain_io()
        self._flush_step()

    def _flush_step(self) -> None:
        keys = []
        for key, gen in self._step_keys:
            st = self._keys.get(key)
            if st is None or st.gen != gen or st.result is not None:
                continue
            st.in_flight = True
            keys.append((key, gen))
        self._step_keys = []
        if keys or self._step_jobs or self._step_touch:
            self._to_io.put(("step", keys, self._step_jobs, self._step_touch))
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
        for job_id in list(self._jobs):
            self._fail(job_id)
        if self._region_fd >= 0:
            os.close(self._region_fd)
            self._region_fd = -1

    # ------------------------------------------------------------------ from the I/O thread
    def _drain_io(self) -> None:
        self._news = False
        while True:
            try:
                msg = self._from_io.get_nowait()
            except queue.Empty:
                return
            what = msg[0]
            if what == "verdicts":
                counts = [0, 0, 0, msg[2] if len(msg) > 2 else 0]
                keys = self._keys
                for key, gen, v in msg[1]:
                    counts[v] += 1
                    st = keys.get(key)
                    if st is None or st.gen != gen:
                        continue
                    st.in_flight = False
                    if not st.reqs:
                        del self._keys[key]
                        continue
                    st.result = v in (_kvt.HIT, _kvt.HIT_PENDING)
                for v, c in enumerate(counts):
                    if c:
                        self._stats.increase_counter(KvtierMetrics.VERDICTS, c,
                                                     (_VERDICT_NAMES[v],))
            elif what == "done":
                for d in msg[1]:
                    self._finish(d.id, d.ok, d.key_ok)
            elif what == "rtt":
                self._stats.observe_histogram(KvtierMetrics.STEP_RTT, msg[1])
            elif what == "up":
                self._node_up = msg[1]
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
        for key, st in list(self._keys.items()):
            if st.result is None:
                st.in_flight = False
                st.result = False
                if not st.reqs:
                    del self._keys[key]

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
        retry: dict[OffloadKey, int] = {}  # keys the node answered RETRY
        out: dict[int, float] = {}  # job id -> submitted at
        def post(msg):
            self._from_io.put(msg)
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
            keys: list[tuple[OffloadKey, int]] = [(k, g) for k, g in retry.items()]
            jobs: list[_kvt.Job] = []
            touch: list[OffloadKey] = []
            for _, k, j, t in items:
                keys.extend(k)
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
                if client is None:
                    # Nothing can run: the scheduler fails these jobs and answers
                    # MISS when it hears the node is down.
                    if keys or jobs:
                        post(("verdicts", [(k, g, _kvt.MISS) for k, g in keys]))
                        post(("done", [_kvt.JobDone(j.id, False, [False] * len(j.keys))
                                       for j in jobs]))
                    retry.clear()
                    continue
            try:
                if touch:
                    client.touch(touch[:client.max_keys])
                t0 = time.monotonic()
                verdicts, done = self._io_send(client, keys, jobs)
                post(("rtt", time.monotonic() - t0))
            except (OSError, _kvt.KvtierError) as e:
                logger.warning("kvtier: node at %s: %s; its jobs fail, lookups miss", self._socket,
                               e)
                post(("error",))
                client.close()
                client = None
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
            answered = []
            for kg, v in zip(keys, verdicts):
                if v == _kvt.RETRY:
                    retry[kg[0]] = kg[1]  # asked again next round; the scheduler
                else:  # only counts these
                    answered.append((kg[0], kg[1], v))
            if answered or retry:
                post(("verdicts", answered, len(retry)))
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
                post(("done", [_kvt.JobDone(i, False, []) for i in out]))
                out.clear()
                retry.clear()
                post(("up", False))
        if client is not None:
            client.close()

    def _io_send(self, client, keys, jobs):
        """One step's lookups and jobs, in as few JOBS messages as the node's key
        limit allows (one in the common case)."""
        cap = max(int(client.max_keys), 1)
        verdicts: list[int] = []
        done: list = []
        ki = 0
        ji = 0
        while True:
            lk = [k for k, _ in keys[ki:ki + cap]]
            ki += len(lk)
            batch, n = [], 0
            while ji < len(jobs) and (not batch or n + len(jobs[ji].keys) <= cap):
                if len(jobs[ji].keys) > cap:  # too large for any message: fails
                    done.append(_kvt.JobDone(jobs[ji].id, False, [False] * len(jobs[ji].keys)))
                    ji += 1
                    continue
                batch.append(jobs[ji])
                n += len(jobs[ji].keys)
                ji += 1
            v, d = client.jobs_step(lk, batch)
            verdicts.extend(v)
            done.extend(d)
            if ki >= len(keys) and ji >= len(jobs):
                return verdicts, done

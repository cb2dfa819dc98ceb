"""Where this rank's communication time goes, from torch's own entry points (no re-implemented collectives).

``Tracker`` is one rank's measurement state: the clock (``workers.timeline``), the record of the current step
(``None`` on steps that are not measured: then the hooks only keep the "where am I" state current), the
``RankState`` that hang diagnosis reads (``workers.diagnostics``) and the classification of process groups.

Hooks (installed by ``Tracker.install``, removed by ``uninstall``; one tracker per process at a time):

- ``torch.distributed`` collectives (``all_reduce``, ``all_gather_single``, ``reduce_scatter_single``,
  ``broadcast``, ...; FSDP2, ZeRO-1, HSDP, the gradient-norm reductions call these): the call is a wait; an
  async call returns a ``dist.Work`` subclass whose ``wait()`` is timed (``isinstance`` checks still pass).
- DTensor / tensor parallel: the functional collectives (``torch.distributed._functional_collectives``:
  ``all_reduce``, ``all_gather_single``, ``reduce_scatter_single``, ...) are timed from issue, and their
  ``wait_tensor`` (when the ``AsyncCollectiveTensor`` is first used) is the wait.
- DDP: the registered comm hook (``timed_ddp_hook``) times each bucket from launch to completion; the wait is
  the end of backward after the last bucket launch (``Tracker.after_backward``).
- Pipelining: the schedule's P2P actions (``schedules._batch_p2p`` / ``_wait_batch_p2p``): each wait with a
  receive is a recv wait (transfer + bubble), else a send wait; the stages' ``forward_one_chunk`` /
  ``backward_one_chunk`` / ``backward_weight_one_chunk`` give the pipeline timeline and the micro-batch in the
  "where am I" state.

A process group's kind (tp | pp | dp) follows from its ranks: the mesh dims (``pp``, ``dp_replicate``,
``dp_shard``, ``tp``) along which they differ. Groups across several kinds, and the loop's own reporting
collectives (run with ``paused()``), are not counted as tp/pp/dp communication.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from workers.metrics import CROSS_GROUP
from workers.parallel_dims import MESH_DIM_NAMES, ParallelDims
from workers.timeline import CpuClock, CudaClock, LinkModel, StepRecord, Wait

log = logging.getLogger(__name__)

_DIST_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter_tensor",
    "reduce_scatter",
    "reduce_scatter_single",
    "_all_gather_base",
    "_reduce_scatter_base",
    "broadcast",
    "all_to_all_single",
    "all_to_all",
    "all_reduce_coalesced",
    "reduce",
    "gather",
    "scatter",
    "barrier",
    "_broadcast_coalesced",  # DDP's buffer sync in forward
)
_FUNCOL = (
    "all_reduce",
    "all_gather_single",
    "reduce_scatter_single",
    "all_gather_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "all_gather_tensor_autograd",
    "reduce_scatter_tensor_autograd",
    "all_gather_single_autograd",
    "reduce_scatter_single_autograd",
    "all_to_all_single_autograd",
    "broadcast",
)

_ACTIVE: Tracker | None = None


def active() -> Tracker | None:
    return _ACTIVE


class Tracker:
    """One rank's measurement state. The loop drives it: ``begin_step`` -> phases -> ``end_step``."""

    def __init__(
        self, *, clock: CpuClock | CudaClock, state: Any, dims: ParallelDims | None, link: LinkModel | None = None
    ) -> None:
        self.clock = clock
        self.state = state
        self.dims = dims
        self.link = link or LinkModel()
        self.rec: StepRecord | None = None
        self.chunks_on = False  # record pipeline chunk marks (profiling)
        self._paused = 0
        self._phase: tuple[str, Any] | None = None
        self._kinds: dict[Any, tuple[str | None, str]] = {}
        self._pending: dict[int, tuple[str, str | None, str, Any, StepRecord | None]] = {}
        self._orig: list[tuple[Any, str, Any]] = []

    # ------------------------------------------------------------------------------------- the loop's API
    def begin_step(self, step: int, start: Any, *, record: bool) -> None:
        self.rec = StepRecord(step=step, start=start) if record else None
        self._pending.clear()
        self.state.step = step

    def end_step(self, end: Any) -> StepRecord | None:
        rec, self.rec = self.rec, None
        if rec is not None:
            rec.end = end
        return rec

    def begin_phase(self, name: str) -> None:
        self.state.set_phase(name)
        if self.rec is not None:
            self._phase = (name, self.clock.mark())

    def end_phase(self) -> None:
        if self.rec is not None and self._phase is not None:
            name, t0 = self._phase
            self.rec.phases.append((name, t0, self.clock.mark()))
        self._phase = None

    def after_backward(self) -> None:
        """Called right after a backward returns: DDP's wait for its buckets ends here."""
        st = self.state
        if st.collective == "ddp all_reduce":
            st.clear_collective()
        rec = self.rec
        if rec is not None and rec.ddp_issue is not None:
            rec.waits.append(Wait("dp", "ddp", rec.ddp_issue, self.clock.mark()))
            rec.ddp_issue = None

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Collectives inside are not measured (the loop's own reporting, checkpoints)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    # ---------------------------------------------------------------------------------- classification
    def kind_of_ranks(self, ranks: list[int]) -> tuple[str | None, str]:
        if self.dims is None or len(ranks) < 2:
            return None, "self"
        coords = [self.dims._coords(r) for r in ranks]
        varying = [n for i, n in enumerate(MESH_DIM_NAMES) if len({c[i] for c in coords}) > 1]
        label = "+".join(varying) or "self"
        if varying == ["tp"]:
            return "tp", label
        if varying == ["pp"]:
            return "pp", label
        if varying and set(varying) <= {"dp_replicate", "dp_shard"}:
            return "dp", label
        return None, label

    def kind_of_group(self, group: Any) -> tuple[str | None, str]:
        try:
            hit = self._kinds.get(group)
        except TypeError:  # unhashable
            hit = None
        if hit is not None:
            return hit
        try:
            pg = group if group is not None else dist.distributed_c10d._get_default_group()
            out = self.kind_of_ranks(dist.get_process_group_ranks(pg))
        except Exception:  # a group this rank is not in, or torch internals moved
            out = (None, "unknown")
        with contextlib.suppress(TypeError):
            self._kinds[group] = out
        return out

    def kind_of_funcol_group(self, group: Any, tag: str) -> tuple[str | None, str]:
        key = ("funcol", group, tag) if not isinstance(group, list) else None
        hit = self._kinds.get(key) if key is not None else None
        if hit is not None:
            return hit
        try:
            from torch.distributed import _functional_collectives as funcol

            name = funcol._resolve_group_name(group, tag)
            pg = dist.distributed_c10d._resolve_process_group(name)
            out = self.kind_of_ranks(dist.get_process_group_ranks(pg))
        except Exception:
            out = (None, "unknown")
        if key is not None:
            self._kinds[key] = out
        return out

    # ------------------------------------------------------------------------------------------ install
    def install(self, *, pipeline: bool = True) -> Tracker:
        """Patch the collectives; ``pipeline``: also torch's pipeline schedules (importing them costs a starting
        worker 0.3-0.5 s, so a run without pp passes False)."""
        global _ACTIVE
        if _ACTIVE is not None and _ACTIVE is not self:
            _ACTIVE.uninstall()
        _ACTIVE = self
        for name in _DIST_COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is not None:
                self._patch(dist, name, _wrap_dist(name, fn))
        try:
            from torch.distributed import _functional_collectives as funcol

            for name in _FUNCOL:
                fn = getattr(funcol, name, None)
                if fn is not None:
                    self._patch(funcol, name, _wrap_funcol(name, fn))
            self._patch(funcol, "wait_tensor", _wrap_wait_tensor(funcol.wait_tensor))
        except ImportError:  # pragma: no cover - torch without functional collectives
            log.warning("torch.distributed._functional_collectives missing: tensor-parallel time is not measured")
        if not pipeline:
            return self
        try:
            from torch.distributed.pipelining import schedules

            self._patch(schedules, "_batch_p2p", _wrap_batch_p2p(schedules._batch_p2p))
            self._patch(schedules, "_wait_batch_p2p", _wrap_wait_batch_p2p(schedules._wait_batch_p2p))
        except (ImportError, AttributeError):
            log.warning("torch.distributed.pipelining internals moved: pipeline send/recv time is not measured")
        return self

    def _patch(self, obj: Any, name: str, new: Any) -> None:
        self._orig.append((obj, name, getattr(obj, name)))
        setattr(obj, name, new)

    def uninstall(self) -> None:
        global _ACTIVE
        for obj, name, fn in reversed(self._orig):
            setattr(obj, name, fn)
        self._orig.clear()
        if _ACTIVE is self:
            _ACTIVE = None

    def wrap_stage(self, stage: Any) -> None:
        """Time a PipelineStage's chunks and keep the micro-batch in the rank state."""
        for meth, action in (
            ("forward_one_chunk", "F"),
            ("backward_one_chunk", "B"),
            ("backward_weight_one_chunk", "W"),
        ):
            fn = getattr(stage, meth, None)
            if fn is not None:
                setattr(stage, meth, _wrap_chunk(self, stage, fn, action))


# ---------------------------------------------------------------------------------------------- wrappers
def _arg_index(fn: Any, name: str) -> int:
    try:
        return list(inspect.signature(fn).parameters).index(name)
    except (ValueError, TypeError):
        return 10_000


class _TimedWork(dist.Work):
    """An async collective's Work whose ``wait()`` is timed and shown in the rank state."""

    def __init__(self, inner: Any, tr: Tracker, name: str, kind: str | None, label: str, issue: Any, rec: Any):
        super().__init__()
        self._inner, self._tr, self._name, self._kind, self._label = inner, tr, name, kind, label
        self._issue, self._rec = issue, rec

    def wait(self, timeout: Any = None) -> bool:
        tr = self._tr
        tr.state.set_collective(self._name, self._label)
        rec = tr.rec
        t0 = tr.clock.mark() if rec is not None else None
        try:
            out = self._inner.wait() if timeout is None else self._inner.wait(timeout)
        finally:
            tr.state.clear_collective()
        if rec is not None and self._kind is not None:
            t1 = tr.clock.mark()
            rec.waits.append(Wait(self._kind, "coll", t0, t1))
            if rec is self._rec:
                rec.inflight.append((self._kind, self._issue, t1))
        return out

    def is_completed(self) -> bool:
        return self._inner.is_completed()

    def is_success(self) -> bool:
        return self._inner.is_success()

    def exception(self) -> Any:
        return self._inner.exception()

    def source_rank(self) -> int:
        return self._inner.source_rank()

    def result(self) -> Any:
        return self._inner.result()

    def synchronize(self) -> None:
        self._inner.synchronize()

    def get_future(self) -> Any:
        return self._inner.get_future()


def _wrap_dist(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    gname = "process_group" if name == "_broadcast_coalesced" else "group"
    gi, ai = _arg_index(fn, gname), _arg_index(fn, "async_op")
    if name == "_broadcast_coalesced":
        gi = 0  # a pybind function: (process_group, tensors, buffer_size, src)

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        tr = _ACTIVE
        if tr is None or tr._paused:
            return fn(*args, **kwargs)
        group = kwargs[gname] if gname in kwargs else (args[gi] if len(args) > gi else None)
        async_op = kwargs["async_op"] if "async_op" in kwargs else (args[ai] if len(args) > ai else False)
        kind, label = tr.kind_of_group(group)
        rec = tr.rec
        tr.state.set_collective(name, label)
        tr._paused += 1
        try:
            t0 = tr.clock.mark() if rec is not None else None
            work = fn(*args, **kwargs)
        finally:
            tr._paused -= 1
            tr.state.clear_collective()
        if rec is not None and kind is not None:
            t1 = tr.clock.mark()
            rec.waits.append(Wait(kind, "coll", t0, t1))
            if not (async_op and work is not None):
                rec.inflight.append((kind, t0, t1))
        if async_op and isinstance(work, dist.Work) and not isinstance(work, _TimedWork):
            return _TimedWork(work, tr, name, kind, label, t0, rec)
        return work

    return wrapped


def _wrap_funcol(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    gi, ti = _arg_index(fn, "group"), _arg_index(fn, "tag")

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        tr = _ACTIVE
        if tr is None or tr._paused:
            return fn(*args, **kwargs)
        group = kwargs["group"] if "group" in kwargs else (args[gi] if len(args) > gi else None)
        tag = kwargs["tag"] if "tag" in kwargs else (args[ti] if len(args) > ti else "")
        kind, label = tr.kind_of_funcol_group(group, tag)
        rec = tr.rec
        tr.state.set_collective(name, label)
        tr._paused += 1
        try:
            t0 = tr.clock.mark() if rec is not None else None
            out = fn(*args, **kwargs)
        finally:
            tr._paused -= 1
            tr.state.clear_collective()
        if rec is not None and kind is not None:
            t1 = tr.clock.mark()
            rec.waits.append(Wait(kind, "coll", t0, t1))  # the issue (and any wait inside it)
            rec.inflight.append((kind, t0, t1))
        elem = getattr(out, "elem", out)
        if isinstance(elem, torch.Tensor):
            # keyed by storage: DTensor often waits on a view of the output (c10d keys its works the same way)
            tr._pending[_storage_key(elem)] = (name, kind, label, t0, rec)
        return out

    return wrapped


def _storage_key(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without storage (meta, some subclasses)
        return id(t)


def _wrap_wait_tensor(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapped(tensor: Any) -> Any:
        tr = _ACTIVE
        p = tr._pending.pop(_storage_key(tensor), None) if tr is not None and tr._pending else None
        if tr is None or p is None:
            return fn(tensor)
        name, kind, label, issue, issue_rec = p
        rec = tr.rec
        tr.state.set_collective(name, label)
        t0 = tr.clock.mark() if rec is not None else None
        try:
            out = fn(tensor)
        finally:
            tr.state.clear_collective()
        if rec is not None and kind is not None:
            t1 = tr.clock.mark()
            rec.waits.append(Wait(kind, "coll", t0, t1))
            rec.inflight.append((kind, issue if issue_rec is rec else t0, t1))
        return out

    return wrapped


class _P2PWorks(list):
    """The works of one pipeline P2P action, with what it moves."""

    desc: str = ""
    recv_bytes: int = 0
    send_bytes: int = 0
    peers: tuple[int, ...] = ()


def _wrap_batch_p2p(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapped(p2p_ops: list[Any], desc: str | None = None) -> Any:
        tr = _ACTIVE
        if tr is None or not p2p_ops:
            return fn(p2p_ops, desc)
        rec = tr.rec
        t0 = tr.clock.mark() if rec is not None else None
        works = fn(p2p_ops, desc)  # on gloo a send can block here until the peer reads it
        out = _P2PWorks(works)
        out.desc = desc or "p2p"
        for op in p2p_ops:
            n = op.tensor.numel() * op.tensor.element_size()
            if getattr(op.op, "__name__", "") == "irecv":
                out.recv_bytes += n
            else:
                out.send_bytes += n
            if rec is not None:
                rec.p2p_bytes.append(n)
        out.peers = tuple(sorted({int(op.peer) for op in p2p_ops}))
        if rec is not None:
            what, n = ("recv", out.recv_bytes) if out.recv_bytes else ("send", out.send_bytes)
            rec.waits.append(Wait("pp", what, t0, tr.clock.mark(), n))
        return out

    return wrapped


def _wrap_wait_batch_p2p(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapped(work: Any) -> Any:
        tr = _ACTIVE
        if tr is None or not isinstance(work, _P2PWorks) or not work:
            return fn(work)
        rec = tr.rec
        peers = ",".join(str(p) for p in work.peers)
        tr.state.set_collective(f"pp {work.desc}", f"pp (peer rank {peers})")
        t0 = tr.clock.mark() if rec is not None else None
        try:
            out = fn(work)
        finally:
            tr.state.clear_collective()
        if rec is not None:
            what, n = ("recv", work.recv_bytes) if work.recv_bytes else ("send", work.send_bytes)
            rec.waits.append(Wait("pp", what, t0, tr.clock.mark(), n))
        return out

    return wrapped


def _wrap_chunk(tr: Tracker, stage: Any, fn: Callable[..., Any], action: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapped(chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        st = tr.state
        st.pp_stage, st.pp_microbatch, st.pp_action = stage.stage_index, int(chunk_id), action
        rec = tr.rec if tr.chunks_on else None
        t0 = tr.clock.mark() if rec is not None else None
        out = fn(chunk_id, *args, **kwargs)
        if rec is not None:
            rec.chunks.append((stage.stage_index, int(chunk_id), action, t0, tr.clock.mark()))
        return out

    return wrapped


def timed_ddp_hook(hook: Callable[..., Any]) -> Callable[..., Any]:
    """A DDP comm hook timed per bucket (launch -> completion); the hook's own collectives are not counted
    again by the ``torch.distributed`` wrappers."""

    # (no annotations: DDP checks the hook's signature and would refuse ``bucket: Any``)
    def wrapped(state, bucket):
        buf = bucket.buffer()
        CROSS_GROUP.send(buf.numel() * buf.element_size())
        tr = _ACTIVE
        if tr is None:
            return hook(state, bucket)
        rec = tr.rec
        issue = tr.clock.mark() if rec is not None else None
        pg = state if isinstance(state, dist.ProcessGroup) else getattr(state, "process_group", None)
        tr.state.set_collective("ddp all_reduce", tr.kind_of_group(pg)[1])
        tr._paused += 1
        try:
            fut = hook(state, bucket)
        finally:
            tr._paused -= 1
        if rec is not None:
            rec.ddp_issue = issue
            slot = len(rec.ddp_inflight)
            rec.ddp_inflight.append((issue, None))
            if not tr.clock.is_cuda:

                def done(_f: Any, rec: StepRecord = rec, slot: int = slot, issue: Any = issue) -> None:
                    rec.ddp_inflight[slot] = (issue, time.perf_counter())

                fut.add_done_callback(done)
        return fut

    return wrapped


# ----------------------------------------------------------------------------------- pipeline link speed
def measure_p2p_link(pp_group: Any, device: torch.device, *, reps: int = 8) -> LinkModel:
    """Latency and bandwidth of this rank's pipeline links: ping-pong with each neighbour, 1 KiB and 4 MiB
    messages, the fastest of ``reps`` one-way times (what the link can do; waiting for a busy or descheduled
    peer is not transfer). Collective over the pipeline group; a few tens of ms."""
    ranks = dist.get_process_group_ranks(pp_group)
    me = ranks.index(dist.get_rank())
    small = torch.zeros(256, dtype=torch.float32, device=device)
    big = torch.zeros(1 << 20, dtype=torch.float32, device=device)
    lat: list[float] = []
    per_byte: list[float] = []
    for parity in (0, 1):
        partner = None
        if me % 2 == parity and me + 1 < len(ranks):
            partner, first = ranks[me + 1], True
        elif me % 2 != parity and me >= 1:
            partner, first = ranks[me - 1], False
        if partner is None:
            continue
        for buf, out in ((small, lat), (big, per_byte)):
            times = []
            for _ in range(reps + 1):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                if first:
                    dist.send(buf, dst=partner, group=pp_group)
                    dist.recv(buf, src=partner, group=pp_group)
                else:
                    dist.recv(buf, src=partner, group=pp_group)
                    dist.send(buf, dst=partner, group=pp_group)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times.append((time.perf_counter() - t0) / 2)
            out.append(min(times[1:]))
    if not lat:
        return LinkModel()
    alpha = statistics.mean(lat)
    t_big = statistics.mean(per_byte)
    nbytes = big.numel() * big.element_size()
    bw = nbytes / max(t_big - alpha, 1e-9)
    log.info("pipeline link: latency %.1f us, %.2f GB/s", alpha * 1e6, bw / 1e9)
    return LinkModel(latency_s=alpha, bandwidth_bytes_per_s=bw)

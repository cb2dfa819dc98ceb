"""What one rank measures inside a step, and the step-time breakdown computed from it.

The training thread takes *marks* at explicit synchronisation points: the step's start (the previous step's end),
phase boundaries (``data``, ``compute`` = forward/backward or the pipeline schedule, ``optimizer`` = clipping,
optimizer and scheduler), and before/after every wait for communication (``workers.comm_hooks`` does the latter
from torch's own hooks). A mark is a ``time.perf_counter()`` float on CPU and a ``torch.cuda.Event`` recorded on
the current stream on GPU, so on GPUs a wait's length is how long the compute stream stalled on it; events are
only read when the ranks report (one ``synchronize`` per report), never per step.

From one step's marks (``StepRecord``) ``breakdown`` computes, per rank, the terms of
``api.spec.metrics.MeasuredStepTime``:

- ``<kind>_comm_exposed``: the summed length of the waits on that kind's process groups (the training thread is
  single-threaded, so waits never overlap); ``<kind>_comm``: the merged in-flight intervals (issue -> end);
- pipeline P2P: a wait on a receive or a send (on gloo a send completes when the peer receives) is transfer
  (``pp_comm``, estimated as latency + bytes / bandwidth of the link, measured once at start-up) plus waiting for
  the neighbour to be ready (``pp_bubble``); the pipeline-group reduction of the gradient norm (all stages meet
  there) is bubble beyond its latency;
- ``compute`` / ``optimizer`` / ``data_wait``: the phase's length minus the waits inside it;
- ``other``: the rest of the loop period (reporting, checkpoints, logging, profiler, anything between phases).

So the parts add up to ``total`` (the loop period) up to rounding; a wait outside the step, or one counted twice,
breaks the sum (the tests check it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from api.spec.metrics import BREAKDOWN_TERMS

KINDS = ("tp", "pp", "dp")
PHASES = ("data", "compute", "optimizer")
PHASE_TERM = {"data": "data_wait", "compute": "compute", "optimizer": "optimizer"}


# --------------------------------------------------------------------------------------------- clocks
class CpuClock:
    """Marks are ``perf_counter`` seconds (CLOCK_MONOTONIC: one time base for every process of a host)."""

    is_cuda = False

    def mark(self) -> float:
        return time.perf_counter()

    def synchronize(self, last: Any) -> None:
        return None

    def seconds(self, origin: Any, marks: list[Any]) -> list[float]:
        return [m - origin for m in marks]


class CudaClock:
    """Marks are CUDA events on the current stream; read after ``synchronize(last)``."""

    is_cuda = True

    def __init__(self) -> None:
        import torch

        self._torch = torch

    def mark(self) -> Any:
        ev = self._torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def synchronize(self, last: Any) -> None:
        if last is not None:
            last.synchronize()

    def seconds(self, origin: Any, marks: list[Any]) -> list[float]:
        return [origin.elapsed_time(m) / 1e3 for m in marks]


def make_clock(device_type: str) -> CpuClock | CudaClock:
    return CudaClock() if device_type == "cuda" else CpuClock()


# ------------------------------------------------------------------------------------------ a step's marks
@dataclass(slots=True)
class Wait:
    """The training thread blocked from ``t0`` to ``t1`` on communication of ``kind`` (tp | pp | dp).

    ``what``: "coll" (a collective), "recv" / "send" (pipeline P2P; bytes received / sent), "ddp" (the end of
    backward waiting for DDP's gradient buckets)."""

    kind: str
    what: str
    t0: Any
    t1: Any
    nbytes: int = 0


@dataclass(slots=True)
class StepRecord:
    step: int
    start: Any  # the previous step's end mark
    end: Any = None
    phases: list[tuple[str, Any, Any]] = field(default_factory=list)
    waits: list[Wait] = field(default_factory=list)
    inflight: list[tuple[str, Any, Any]] = field(default_factory=list)  # (kind, issue, end)
    p2p_bytes: list[int] = field(default_factory=list)  # sizes of this rank's pipeline sends and receives
    chunks: list[tuple[int, int, str, Any, Any]] = field(default_factory=list)  # (stage, micro-batch, F|B|W, t0, t1)
    ddp_issue: Any = None  # the last DDP bucket launch of the step
    ddp_inflight: list[tuple[Any, float | None]] = field(default_factory=list)  # (issue mark, CPU completion time)


@dataclass
class LinkModel:
    """Point-to-point transfer time of the pipeline link: latency_s + nbytes / bandwidth_bytes_per_s."""

    latency_s: float = 0.0
    bandwidth_bytes_per_s: float = float("inf")

    def transfer_s(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s


def _union(intervals: list[tuple[float, float]]) -> float:
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None and cur_s is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None and cur_s is not None:
        total += cur_e - cur_s
    return total


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def resolve(rec: StepRecord, clock: CpuClock | CudaClock) -> dict[str, Any]:
    """The record's marks as seconds from the step start (events must be complete on GPU)."""
    marks: list[Any] = [rec.end]
    for _, a, b in rec.phases:
        marks += [a, b]
    for w in rec.waits:
        marks += [w.t0, w.t1]
    for _, a, b in rec.inflight:
        marks += [a, b]
    for *_, a, b in rec.chunks:
        marks += [a, b]
    for issue, _ in rec.ddp_inflight:
        marks.append(issue)
    secs = iter(clock.seconds(rec.start, marks))
    out: dict[str, Any] = {"total": next(secs)}
    out["phases"] = [(name, next(secs), next(secs)) for name, _, _ in rec.phases]
    out["waits"] = [(w.kind, w.what, next(secs), next(secs), w.nbytes) for w in rec.waits]
    out["inflight"] = [(k, next(secs), next(secs)) for k, _, _ in rec.inflight]
    out["chunks"] = [(s, mb, a, next(secs), next(secs)) for s, mb, a, _, _ in rec.chunks]
    ddp = []
    origin_cpu = rec.start if not clock.is_cuda else None
    for _, done in rec.ddp_inflight:
        issue = next(secs)
        end = (done - origin_cpu) if (done is not None and origin_cpu is not None) else None
        ddp.append((issue, end))
    out["ddp"] = ddp
    out["p2p_bytes"] = list(rec.p2p_bytes)
    return out


def breakdown(r: dict[str, Any], link: LinkModel | None = None) -> dict[str, float]:
    """Per-rank terms (seconds, keys ``api.spec.metrics.BREAKDOWN_TERMS``) of one resolved step."""
    link = link or LinkModel()
    total = float(r["total"])
    out = dict.fromkeys(BREAKDOWN_TERMS, 0.0)
    out["total"] = total
    exposed = dict.fromkeys(KINDS, 0.0)
    bubble = 0.0
    inflight: dict[str, list[tuple[float, float]]] = {k: [] for k in KINDS}
    pp_transfer_total = 0.0
    waits: list[tuple[float, float]] = []
    for kind, _what, a, b, nbytes in r["waits"]:
        a, b = max(0.0, a), min(total, b)
        if b <= a:
            continue
        w = b - a
        waits.append((a, b))
        if kind == "pp":
            # waiting for a neighbour (to send, to receive, or to reach the same collective): the transfer
            # (latency + bytes / bandwidth) is communication, the rest is bubble
            transfer = min(w, link.transfer_s(nbytes))
            exposed["pp"] += transfer
            bubble += w - transfer
        else:
            exposed[kind] += w
    for kind, a, b in r["inflight"]:
        if kind in inflight and b > a:
            inflight[kind].append((max(0.0, a), min(total, b)))
    for issue, end in r["ddp"]:
        if end is not None and end > issue:
            inflight["dp"].append((issue, min(total, end)))
    pp_transfer_total = sum(link.transfer_s(n) for n in r["p2p_bytes"])
    for kind in KINDS:
        t = _union(inflight[kind])
        if kind == "pp":
            t = pp_transfer_total
        out[f"{kind}_comm_exposed"] = exposed[kind]
        out[f"{kind}_comm"] = max(t, exposed[kind])
    out["pp_bubble"] = bubble
    in_phases = 0.0
    for name, a, b in r["phases"]:
        a, b = max(0.0, a), min(total, b)
        if b <= a:
            continue
        blocked = sum(_overlap(a, b, w0, w1) for w0, w1 in waits)
        out[PHASE_TERM[name]] += (b - a) - blocked
        in_phases += b - a
    blocked_outside = sum(w1 - w0 for w0, w1 in waits) - sum(
        _overlap(a, b, w0, w1) for _, a, b in r["phases"] for w0, w1 in waits
    )
    out["other"] = max(0.0, total - in_phases - blocked_outside)
    return out


def pipeline_events(r: dict[str, Any], *, rank: int, origin_us: float) -> list[dict[str, Any]]:
    """Chrome-trace events (``ph: X``) of the pipeline chunks of one resolved step: one track per stage."""
    out = []
    for stage, mb, action, a, b in r["chunks"]:
        out.append(
            {
                "name": f"{action}{mb}",
                "cat": "pipeline",
                "ph": "X",
                "pid": rank,
                "tid": f"stage {stage}",
                "ts": origin_us + a * 1e6,
                "dur": max(0.0, b - a) * 1e6,
                "args": {"stage": stage, "microbatch": mb, "action": action, "step": r.get("step")},
            }
        )
    for kind, what, a, b, nbytes in r["waits"]:
        if kind == "pp":
            out.append(
                {
                    "name": f"pp {what}",
                    "cat": "pipeline-wait",
                    "ph": "X",
                    "pid": rank,
                    "tid": "waits",
                    "ts": origin_us + a * 1e6,
                    "dur": max(0.0, b - a) * 1e6,
                    "args": {"bytes": nbytes, "step": r.get("step")},
                }
            )
    return out

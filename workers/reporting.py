"""Per-step measurements kept locally, combined across ranks once per report interval, sent as rows by rank 0.

What each rank keeps per step (no device sync, no collective): the end-of-step mark (``workers.timeline``
clock: ``perf_counter`` on CPU, a CUDA event on GPU), the wall-clock time, the loss and gradient norm as device
tensors, the learning rate, and on measured steps (``spec.metrics.breakdown_every_steps``) the step's
``StepRecord``.

At a report (``Reporter.report``; at the first step, then every ~``spec.metrics.report_every_s`` seconds, at most
``max_steps_per_report`` steps apart, and always at checkpoint steps and the last step), every rank:

1. reads its step periods (one ``synchronize`` of the last event on GPU), computes its per-step breakdowns,
   reads its peak memory since the previous report (GPU: ``max_memory_allocated`` / ``max_memory_reserved``;
   CPU: VmHWM of the process) and resets it (CPU: ``/proc/self/clear_refs``, no allocator trimming);
2. joins ONE ``all_gather`` of a float64 vector: per step [loss share, period, 12 breakdown terms or NaN],
   then [peak bytes, peak reserved bytes, stop vote, profile request];
3. derives the next report step from the gathered periods (the same numbers on every rank, so the ranks agree
   without another message), and whether to stop or to start a profile.

Rank 0 then calls ``sink(row)`` once per step of the interval, in step order (keys: ``api.spec.metrics
.MetricRow``): ``step, loss, tokens_per_s, step_time_s, mfu, peak_memory_bytes, peak_memory_bytes_per_rank,
[peak_memory_reserved_bytes_per_rank], grad_norm, lr, time`` and, on measured steps, ``comm_fraction``,
``breakdown`` (mean over ranks, term -> seconds) and ``breakdown_per_rank`` (term -> list over ranks). It logs
one INFO line per report.

``step_time_s`` is rank 0's full loop period (end of the previous step to the end of this one), so the
reporting, logging and checkpoint work of one step is part of the next step's time, and the step times add up
to the wall time of the loop (only the final report is outside).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from api.spec import BREAKDOWN_TERMS, Plan, RunSpec
from workers.comm_hooks import Tracker
from workers.metrics import peak_memory, reset_peak_memory
from workers.preemption import PREEMPT_VOTE
from workers.timeline import StepRecord, breakdown, resolve

log = logging.getLogger(__name__)

N_TERMS = len(BREAKDOWN_TERMS)
PER_STEP = 2 + N_TERMS  # loss share, period, breakdown terms
TRAILER = 4  # peak bytes, peak reserved bytes, stop vote, profile request (steps)


@dataclass(slots=True)
class _Local:
    step: int
    end: Any
    unix: float
    loss: torch.Tensor | float
    grad_norm: torch.Tensor | float
    lr: float
    rec: StepRecord | None
    extra: dict[str, Any]


class Reporter:
    def __init__(
        self,
        *,
        spec: RunSpec,
        plan: Plan,
        tracker: Tracker,
        device: torch.device,
        dp_size: int,
        flops_per_token: float,
        peak_flops: float,
        sink: Callable[[dict[str, Any]], None] | None,
        first_step: int,
        last_step: int,
    ) -> None:
        self.spec, self.plan, self.tracker, self.device = spec, plan, tracker, device
        self.clock = tracker.clock
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.dp_size = dp_size
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.sink = sink
        self.last_step = last_step
        self.next_report = first_step
        self.pending: list[_Local] = []
        self.prev_end: Any = None
        self.stop_agreed = False
        self.preempted_ranks: list[int] = []  # ranks that voted PREEMPT_VOTE (a preemption notice)
        self.profile_request = 0  # agreed number of steps to profile, from the next step on
        self.peaks = [0] * self.world
        # summary (rank 0)
        self.losses: list[float] = []
        self.rows = 0
        self.sum_tokens_per_s = 0.0
        self.sum_mfu = 0.0
        self.timed = 0
        self.last_row: dict[str, Any] | None = None

    def start(self) -> None:
        """Call right before the first step: its period starts here."""
        reset_peak_memory(self.device)
        self.prev_end = self.clock.mark()

    def restart_period(self, last_end: Any) -> Any:
        """After a checkpoint: the next step's period starts now, so the time spent saving (and handing the
        checkpoint to Ray Train) is no step's time: goodput counts it as overhead and the breakdown compares steps
        with the plan. Only when every step so far is reported (a checkpoint forces a report); otherwise the period
        keeps running from ``last_end``."""
        if self.pending:
            return last_end
        self.prev_end = self.clock.mark()
        return self.prev_end

    def measure(self, step: int) -> bool:
        every = self.spec.metrics.breakdown_every_steps
        return bool(every) and step % every == 0

    def add(
        self,
        step: int,
        end: Any,
        unix: float,
        *,
        loss: Any,
        grad_norm: Any,
        lr: float,
        rec: StepRecord | None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        """``end``: the step clock's end mark; ``unix``: the wall-clock time read with it (the row's ``time``).
        ``extra``: rank 0's own row keys of the step (cross-group bytes, replica divergence, staleness)."""
        self.pending.append(_Local(step, end, unix, loss, grad_norm, lr, rec, dict(extra or {})))

    def due(self, step: int, *, force: bool = False) -> bool:
        return force or step >= self.next_report or step >= self.last_step

    # --------------------------------------------------------------------------------------------- report
    def report(self, *, stop_vote: int = 0, profile_vote: int = 0) -> None:
        """``stop_vote``: 0, ``workers.preemption.STOP_VOTE`` or ``PREEMPT_VOTE`` (any non-zero vote stops all)."""
        if not self.pending:
            return
        items, self.pending = self.pending, []
        n = len(items)
        self.clock.synchronize(items[-1].end)
        ends = self.clock.seconds(self.prev_end, [it.end for it in items])
        self.prev_end = items[-1].end
        periods = [ends[0]] + [b - a for a, b in zip(ends, ends[1:])]
        local = torch.full((n * PER_STEP + TRAILER,), math.nan, dtype=torch.float64)
        losses = [it.loss for it in items]
        loss_vals = (
            torch.stack([torch.as_tensor(x, dtype=torch.float64, device=self.device) for x in losses]).cpu().tolist()
        )
        for i, it in enumerate(items):
            base = i * PER_STEP
            local[base] = loss_vals[i]
            local[base + 1] = periods[i]
            if it.rec is not None:
                bd = breakdown(resolve(it.rec, self.clock), self.tracker.link)
                local[base + 2 : base + PER_STEP] = torch.tensor([bd[t] for t in BREAKDOWN_TERMS], dtype=torch.float64)
        peak, reserved = peak_memory(self.device)
        reset_peak_memory(self.device)
        local[-4:] = torch.tensor(
            [float(peak), float(reserved) if reserved is not None else math.nan, float(stop_vote), float(profile_vote)],
            dtype=torch.float64,
        )
        dev = local.to(self.device)
        out = [torch.empty_like(dev) for _ in range(self.world)]
        self.tracker.state.set_collective("all_gather (report)", "world")
        try:
            dist.all_gather(out, dev)
        finally:
            self.tracker.state.clear_collective()
        g = torch.stack(out).cpu()  # (world, n * PER_STEP + TRAILER)
        steps = g[:, : n * PER_STEP].reshape(self.world, n, PER_STEP)
        trailer = g[:, -TRAILER:]

        # the same numbers on every rank -> the same decisions, without another message
        mean_period = float(steps[:, :, 1].mean())
        every_s = self.spec.metrics.report_every_s
        gap = 1 if every_s <= 0 else int(every_s / max(mean_period, 1e-9))
        gap = max(1, min(self.spec.metrics.max_steps_per_report, gap))
        self.next_report = items[-1].step + gap
        self.stop_agreed = self.stop_agreed or bool(trailer[:, 2].max() > 0)
        votes = trailer[:, 2].tolist()
        self.preempted_ranks = sorted({*self.preempted_ranks, *(r for r, v in enumerate(votes) if v >= PREEMPT_VOTE)})
        self.profile_request = int(trailer[:, 3].max())
        peaks = [int(v) for v in trailer[:, 0].tolist()]
        self.peaks = [max(a, b) for a, b in zip(self.peaks, peaks)]
        if self.rank == 0:
            self._rows(items, steps, peaks, trailer[:, 1].tolist())

    def _rows(self, items: list[_Local], steps: torch.Tensor, peaks: list[int], reserved: list[float]) -> None:
        plan = self.plan
        grad_norms = (
            torch.stack([torch.as_tensor(it.grad_norm, dtype=torch.float64, device=self.device) for it in items])
            .cpu()
            .tolist()
        )
        has_reserved = not any(math.isnan(v) for v in reserved)
        for i, it in enumerate(items):
            period = float(steps[0, i, 1])
            loss = float(steps[:, i, 0].sum()) / self.dp_size
            row: dict[str, Any] = {
                "step": it.step,
                "loss": loss,
                "tokens_per_s": plan.tokens_per_step / period,
                "step_time_s": period,
                "mfu": self.flops_per_token * plan.tokens_per_step / (period * self.world * self.peak_flops),
                "peak_memory_bytes": max(peaks),
                "peak_memory_bytes_per_rank": peaks,
                "grad_norm": grad_norms[i],
                "lr": it.lr,
                "time": it.unix,
            }
            row.update(it.extra)
            if has_reserved:
                row["peak_memory_reserved_bytes_per_rank"] = [int(v) for v in reserved]
            bd = steps[:, i, 2:]
            if not bool(torch.isnan(bd).any()):
                per_rank = {t: [float(v) for v in bd[:, j].tolist()] for j, t in enumerate(BREAKDOWN_TERMS)}
                mean = {t: sum(v) / len(v) for t, v in per_rank.items()}
                row["breakdown"] = mean
                row["breakdown_per_rank"] = per_rank
                exposed = mean["tp_comm_exposed"] + mean["pp_comm_exposed"] + mean["dp_comm_exposed"]
                row["comm_fraction"] = min(1.0, exposed / mean["total"]) if mean["total"] > 0 else 0.0
            if not math.isfinite(loss):
                log.warning("step %d: loss is %s", it.step, loss)
            self.losses.append(loss)
            self.rows += 1
            if self.rows > 1:  # the first step (warm-up) is left out of the means
                self.sum_tokens_per_s += row["tokens_per_s"]
                self.sum_mfu += row["mfu"]
                self.timed += 1
            self.last_row = row
            if self.sink is not None:
                self.sink(row)
        r = self.last_row
        if r is not None:
            log.info(
                "step %d loss %.4f %.0f tok/s mfu %.3f step %.3f s (%d steps in this report)",
                r["step"],
                r["loss"],
                r["tokens_per_s"],
                r["mfu"],
                r["step_time_s"],
                len(items),
            )

    def summary(self) -> dict[str, Any]:
        first = self.last_row is not None and self.timed == 0
        return {
            "steps_done": self.last_row["step"] if self.last_row else None,
            "final_loss": self.losses[-1] if self.losses else None,
            "mean_tokens_per_s": (
                self.sum_tokens_per_s / self.timed
                if self.timed
                else (self.last_row["tokens_per_s"] if first and self.last_row else None)
            ),
            "mean_mfu": (
                self.sum_mfu / self.timed if self.timed else (self.last_row["mfu"] if first and self.last_row else None)
            ),
            "peak_memory_bytes_per_rank": {str(r): v for r, v in enumerate(self.peaks)},
            "losses": list(self.losses),
        }

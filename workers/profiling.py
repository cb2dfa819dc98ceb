"""Profiles on demand: ``torch.profiler`` over steps N..N+k-1 on every rank.

A window comes from ``spec.profile`` (``start_step``, ``steps``) or from a request at run time (the loop's
``control()`` callback returns ``{"profile_steps": k}``; the ranks agree on it at a report and profile the k
steps after it). Every rank writes, into ``<profile_dir>/steps_<first>-<last>/``:

- ``rank<r>.trace.json``: the torch.profiler Chrome trace (CPU activity, plus CUDA kernels on GPUs); Perfetto
  and chrome://tracing open it;
- ``rank<r>.pipeline.json`` (pp > 1): the measured pipeline timeline in the same Chrome-trace format, one track
  per stage: forward (``F<mb>``), backward (``B<mb>``) and weight-gradient (``W<mb>``) chunks with their start
  and end, and the P2P waits (``pp recv`` / ``pp send``). Timestamps are microseconds of the host's monotonic
  clock on CPU (ranks of one host line up) and from the window's first step on GPU.

Then ``on_profile(first_step, last_step, paths)`` is called (the Ray worker forwards the files to the run's
channel when that offers an ``artifact`` method). Writing the files counts as ``other`` time of the next step.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from workers.comm_hooks import Tracker
from workers.timeline import StepRecord, pipeline_events, resolve

log = logging.getLogger(__name__)


class Profiler:
    def __init__(
        self,
        *,
        out_dir: str | None,
        rank: int,
        tracker: Tracker,
        pipeline: bool,
        on_profile: Callable[[int, int, list[str]], None] | None = None,
    ) -> None:
        self.out_dir = Path(out_dir) if out_dir else None
        self.rank, self.tracker, self.pipeline, self.on_profile = rank, tracker, pipeline, on_profile
        self.window: tuple[int, int] | None = None
        self._prof: Any = None
        self._records: list[StepRecord] = []
        self.written: list[str] = []

    def schedule(self, first: int, steps: int) -> None:
        if self._prof is not None or self.window is not None and self.window[0] > first:
            return
        self.window = (first, first + steps - 1)
        if self.out_dir is None:
            log.warning("profile of steps %d-%d requested but the job has no profile_dir: not profiled", *self.window)
            self.window = None

    def active(self, step: int) -> bool:
        return self.window is not None and self.window[0] <= step <= self.window[1]

    def before_step(self, step: int) -> None:
        if self.window is None or step != self.window[0]:
            return
        acts = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available() and self.tracker.clock.is_cuda:
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(activities=acts, record_shapes=False, with_stack=False)
        self._prof.__enter__()
        self.tracker.chunks_on = True
        self._records = []

    def after_step(self, step: int, rec: StepRecord | None) -> None:
        if self._prof is None or self.window is None:
            return
        if rec is not None:
            self._records.append(rec)
        if step < self.window[1]:
            return
        first, last = self.window
        self._prof.__exit__(None, None, None)
        self.tracker.chunks_on = False
        assert self.out_dir is not None
        d = self.out_dir / f"steps_{first:08d}-{last:08d}"
        d.mkdir(parents=True, exist_ok=True)
        paths = [str(d / f"rank{self.rank}.trace.json")]
        self._prof.export_chrome_trace(paths[0])
        if self.pipeline and self._records:
            paths.append(str(d / f"rank{self.rank}.pipeline.json"))
            Path(paths[-1]).write_text(json.dumps({"traceEvents": self._timeline(), "displayTimeUnit": "ms"}))
        self._prof, self.window, self._records = None, None, []
        self.written += paths
        log.info("rank %d: profile of steps %d-%d in %s", self.rank, first, last, d)
        if self.on_profile is not None:
            self.on_profile(first, last, paths)

    def _timeline(self) -> list[dict[str, Any]]:
        clock = self.tracker.clock
        recs = self._records
        clock.synchronize(recs[-1].end)
        origin = recs[0].start
        starts = clock.seconds(origin, [r.start for r in recs])
        base_us = 0.0 if clock.is_cuda else float(origin) * 1e6
        events: list[dict[str, Any]] = []
        for rec, s in zip(recs, starts):
            r = resolve(rec, clock)
            r["step"] = rec.step
            events += pipeline_events(r, rank=self.rank, origin_us=base_us + s * 1e6)
        return events

    def close(self) -> None:
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            self._prof = None
            self.tracker.chunks_on = False

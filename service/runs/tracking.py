"""Experiment trackers (MLflow, TensorBoard, W&B): what a run's driver logs there, from one place.

The driver's ``Recorder`` (``service.runs.lifecycle``) hands a ``Trackers`` hub everything it writes to the run
database, after it is committed: the flattened spec and plan (params/config) at the start, every metric row at its
step, run events, checkpoints (as references: their paths) and, at the end, the summary and the terminal state.
Sweep trials log as children of their sweep (an MLflow parent run; a W&B group).

A tracker never fails or slows the run: each has its own background thread and a bounded queue. A tracker that is
down or misconfigured gets the run ONE ``tracker_unavailable`` event per outage (through ``on_event``); its items
wait in the queue and are retried with backoff, so everything arrives once it returns. Past ``MAX_PENDING`` items
the oldest metric rows are dropped (counted in the log). ``close`` waits up to a bound for the queues to drain.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from api.spec import Plan, RunSpec, TrackingSpec
from api.spec.tracking import enabled_trackers
from service.runs.tracking_base import (
    Item,
    Rejected,
    Sink,
    flatten,
    numeric_metrics,
    tensorboard_dir,
    tracking_dir,
)
from service.runs.tracking_sinks import make_sink

__all__ = ["Item", "Rejected", "Sink", "Trackers", "flatten", "numeric_metrics", "open_trackers", "track_run"]
logger = logging.getLogger(__name__)

MAX_PENDING = 100_000  # items per tracker queue
RETRY_FIRST_S = 1.0
RETRY_MAX_S = 30.0
RETRY_CLOSING_S = 1.0
MAX_PARAM_CHARS = 500
EventSink = Callable[[str, str], None]


@dataclass
class _Lane:
    """One tracker's queue and thread; the thread makes the sink (imports its client) so that nothing slow runs on
    the caller's thread."""

    name: str
    make: Callable[[], Sink]
    on_event: EventSink
    sink: Sink | None = None
    queue: deque[Item] = field(default_factory=deque)
    cond: threading.Condition = field(default_factory=threading.Condition)
    closing: bool = False
    down: bool = False
    outages: int = 0
    dropped: int = 0
    thread: threading.Thread | None = None
    deadline: float | None = None  # set by close: give up on what is left after it
    lost: bool = False  # close found items it could not send (logged once)

    def _past(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def put(self, item: Item) -> None:
        with self.cond:
            if self.closing:
                return
            if len(self.queue) >= MAX_PENDING:
                for i, old in enumerate(self.queue):  # the oldest metric rows go first, never start/finish
                    if old.kind == "metrics":
                        del self.queue[i]
                        self.dropped += 1
                        break
            self.queue.append(item)
            self.cond.notify()

    def run(self) -> None:
        try:
            self.sink = self.make()
        except Exception as e:  # no client, or a setting it refuses: the run goes on without this tracker
            logger.warning("tracker %s cannot start: %s", self.name, e)
            self._event("tracker_unavailable", f"{self.name}: {type(e).__name__}: {e}; the run goes on without it")
            with self.cond:
                self.queue.clear()
                self.closing = True
            return
        self._serve(self.sink)

    def _serve(self, sink: Sink) -> None:
        delay = RETRY_FIRST_S
        while True:
            with self.cond:
                while not self.queue and not self.closing:
                    self.cond.wait()
                if not self.queue or (self.closing and self._past()):
                    break
                item = self.queue[0]
            try:
                sink.handle(item)
            except Rejected as e:
                logger.warning("tracker %s refused a %s item: %s", self.name, item.kind, e)
            except Exception as e:
                if not self.down:
                    self.down, self.outages = True, self.outages + 1
                    text = f"{self.name}: {type(e).__name__}: {str(e)[:300]}; the run goes on, its rows wait "
                    text += "and are sent when the tracker answers again"
                    logger.warning("tracker %s unavailable: %s", self.name, e)
                    self._event("tracker_unavailable", text)
                with self.cond:
                    if self.closing and self._past():
                        break
                    wait = delay  # closing: retry every RETRY_CLOSING_S up to the deadline
                    if self.deadline is not None:
                        wait = min(delay, RETRY_CLOSING_S, max(0.0, self.deadline - time.monotonic()))
                    self.cond.wait(wait)
                delay = min(delay * 2, RETRY_MAX_S)
                continue
            if self.down:
                logger.info("tracker %s answers again: catching up", self.name)
            self.down, delay = False, RETRY_FIRST_S
            with self.cond:
                if self.queue and self.queue[0] is item:
                    self.queue.popleft()
                self.cond.notify_all()
        try:
            sink.close()
        except Exception:
            logger.warning("closing tracker %s failed", self.name, exc_info=True)
        if self.dropped:
            logger.warning("tracker %s: %d metric batches dropped (queue full)", self.name, self.dropped)

    def _event(self, kind: str, text: str) -> None:
        try:
            self.on_event(kind, text)
        except Exception:
            logger.warning("recording a %s event failed", kind, exc_info=True)


class Trackers:
    """The trackers of one run (see the module docstring). Every method returns at once."""

    def __init__(self, makers: Mapping[str, Callable[[], Sink]], *, on_event: EventSink):
        self.lanes = [_Lane(name, make, on_event) for name, make in makers.items()]
        for lane in self.lanes:
            lane.thread = threading.Thread(target=lane.run, daemon=True, name=f"tracker-{lane.name}")
            lane.thread.start()

    @property
    def names(self) -> list[str]:
        return [lane.name for lane in self.lanes]

    def _put(self, what: str, **data: Any) -> None:
        for lane in self.lanes:
            lane.put(Item(what, data))

    def start(self, spec: RunSpec, plan: Plan | None, *, run_name: str) -> None:
        params = flatten({"spec": spec.model_dump(mode="json", exclude_none=True)})
        if plan is not None:
            params.update(flatten({"plan": plan.model_dump(mode="json", exclude_none=True)}))
        params = {k: v for k, v in params.items() if not k.startswith("spec.tracking")}
        self._put("start", params=params, run_name=run_name, spec=spec.model_dump(mode="json"))

    def metrics(self, rows: list[dict[str, Any]]) -> None:
        rows = [r for r in rows if r.get("step") is not None]
        if rows:
            self._put("metrics", rows=rows)

    def event(self, kind: str, reason: str) -> None:
        if kind.startswith("tracker_"):
            return  # the trackers' own outages are the run's business, not theirs
        self._put("event", kind=kind, reason=reason, time=time.time())

    def checkpoint(self, step: int, path: str) -> None:
        self._put("checkpoint", step=int(step), path=path)

    def finish(self, status: str, summary: Mapping[str, Any] | None) -> None:
        self._put("finish", status=status, summary=dict(summary or {}))

    def close(self, timeout_s: float) -> bool:
        """Stop taking items; wait up to ``timeout_s`` for every queue to drain. True: everything was sent."""
        deadline = time.monotonic() + timeout_s
        for lane in self.lanes:
            with lane.cond:
                lane.closing = True
                lane.deadline = deadline
                lane.cond.notify_all()
        done = True
        for lane in self.lanes:
            assert lane.thread is not None
            lane.thread.join(max(0.0, deadline - time.monotonic()))
            if lane.thread.is_alive() or lane.queue:
                done = False
                if not lane.lost:  # a second close (the driver's exit handler after the caller's) says it once
                    logger.warning(
                        "tracker %s: %d items not sent before the run's driver ended", lane.name, len(lane.queue)
                    )
                lane.lost = True
        return done


def open_trackers(
    tracking: TrackingSpec,
    *,
    run_id: str,
    data_dir: str | Path,
    on_event: EventSink,
    parent: str | None = None,
    project: str | None = None,
) -> Trackers | None:
    """The hub for ``tracking`` (the merged spec + service defaults), None when it names no tracker. ``parent``: the
    sweep a trial belongs to (its parent run / group)."""
    names = enabled_trackers(tracking)
    if not names:
        return None

    def maker(name: str) -> Callable[[], Sink]:
        return lambda: make_sink(name, tracking, run_id=run_id, data_dir=data_dir, parent=parent, project=project)

    return Trackers({name: maker(name) for name in names}, on_event=on_event)


def track_run(
    life: Any,
    spec: RunSpec,
    plan: Plan | None,
    *,
    defaults: TrackingSpec | None,
    data_dir: str | Path,
    run_name: str,
    flush_timeout_s: float,
    parent: str | None = None,
) -> Trackers | None:
    """Attach the run's trackers to a driver's ``RunLifecycle`` (``life``): its recorder hands them what it commits,
    ``life.finish`` the terminal state; they are flushed (up to ``flush_timeout_s``) when the driver process exits.
    Their outages become run events (fenced like every driver write)."""
    import atexit

    from api.spec import merge_tracking
    from service import store

    def on_event(kind: str, reason: str) -> None:
        life.write(f"a {kind} event", lambda s: store.add_event(s, run_id=life.run_id, kind=kind, reason=reason))

    trackers = open_trackers(
        merge_tracking(spec.tracking, defaults), run_id=life.run_id, data_dir=data_dir, on_event=on_event, parent=parent
    )
    if trackers is None:
        return None
    trackers.start(spec, plan, run_name=run_name)
    on_event("tracking", describe_tracking(merge_tracking(spec.tracking, defaults), life.run_id, data_dir))
    life.recorder.trackers = trackers
    atexit.register(trackers.close, flush_timeout_s)
    return trackers


def tracking_links(tracking: TrackingSpec, run_id: str, data_dir: str | Path) -> dict[str, str]:
    """Where the run's trackers are (``RunPublic.tracking``): the TensorBoard event directory, the MLflow server and
    experiment (its run carries the tag ``meshrun.run_id``), the W&B project and run id."""
    out: dict[str, str] = {}
    if tracking.mlflow is not None:
        out["mlflow"] = f"{tracking.mlflow.tracking_uri or ''} experiment {tracking.mlflow.experiment or 'meshrun'}"
    if tracking.tensorboard:
        out["tensorboard"] = str(tensorboard_dir(data_dir, run_id))
    if tracking.wandb is not None and tracking.wandb.mode != "disabled":
        out["wandb"] = (
            f"project {tracking.wandb.project or 'meshrun'}, run {run_id} ({tracking.wandb.mode or 'online'})"
        )
    return out


def tracking_for(run_id: str, spec: Mapping[str, Any] | None, settings: Any) -> dict[str, str] | None:
    """``RunPublic.tracking`` of a stored run: ``tracking_links`` of its spec merged with the service defaults."""
    from api.spec import merge_tracking

    own = (spec or {}).get("tracking")
    if settings is None or (own is None and settings.tracking is None):
        return None
    merged = merge_tracking(TrackingSpec.model_validate(own) if own else None, settings.tracking)
    return tracking_links(merged, run_id, settings.data_dir) or None


def describe_tracking(tracking: TrackingSpec, run_id: str, data_dir: str | Path) -> str:
    """One line: where this run logs (the ``tracking`` event)."""
    parts = []
    if tracking.mlflow is not None:
        parts.append(f"mlflow: {tracking.mlflow.tracking_uri} experiment {tracking.mlflow.experiment or 'meshrun'}")
    if tracking.tensorboard:
        parts.append(f"tensorboard: {tensorboard_dir(data_dir, run_id)}")
    if tracking.wandb is not None and tracking.wandb.mode != "disabled":
        w = tracking.wandb
        parts.append(
            f"wandb: project {w.project or 'meshrun'} ({w.mode or 'online'}) in {tracking_dir(data_dir, run_id)}"
        )
    return "logging to " + "; ".join(parts)

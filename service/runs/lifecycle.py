"""One execution of a run inside its driver: the lifecycle that the run driver (``service.runs.driver``) and the
sweep's trial driver (``service.sweeps.driver.run_trial``) share.

A driver:

1. ``life = RunLifecycle(factory, run_id, actor=...)``; ``life.start(reason)`` moves the run to RUNNING (False:
   somebody ended it meanwhile, the driver stops);
2. ``with life.channel(first_attempt=n) as channel:`` opens the run's channel actor (``service.cluster.jobs``)
   and drains it every ``DRAIN_INTERVAL_S`` into the database through a ``Recorder``: attempts (their cause and
   rank -> node map), per-step metrics, persisted checkpoints, worker errors and the workers' summary. Leaving the
   block drains once more;
3. trains (``service.runs.trainer.build_trainer(...).fit()``) and turns the result into an ``Outcome``
   (``life.failed(error)`` names the workers' exception);
4. ``life.finish(outcome, wall_s=...)`` ends the current attempt and the run with the outcome and its summary.
   A terminal state set meanwhile by someone else (a cancel) is never overwritten (the run controller,
   ``service.store.controller``, refuses the move); an ``Outcome`` without a status (the run was ended externally)
   writes only the summary's inputs. Every state change of the run or an attempt is asked of that controller.

Only the driver writes a running run's attempts, metrics and checkpoints, and only while its attempt is current:
every write happens in a transaction that first passes ``store.fence`` (the run is STARTING or RUNNING under the
driver's own Ray Job, ``job_id``). The service revokes a driver by ending the run, requeueing it or resubmitting it
under another job; a revoked driver writes nothing more and stops (``on_revoked``).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import ray
from ray.actor import ActorHandle
from ray.exceptions import GetTimeoutError
from sqlalchemy.orm import Session, sessionmaker

from api.spec import RunStatus
from api.spec.metrics import PEAK_MEMORY_PER_RANK, SYNC_ALERT
from service import store
from service.cluster.jobs import format_worker_exceptions, open_channel, trim
from service.runs.hangs import diagnose, dump_and_kill, state_dir
from service.runs.watch import HangWatch, StragglerWatch
from service.store import controller
from service.store.artifacts import PROFILE_REQUEST, add_artifact
from service.store.db import session_scope

logger = logging.getLogger(__name__)

DRAIN_INTERVAL_S = 0.5
STATES_INTERVAL_S = 2.0  # how often the driver reads the ranks' heartbeats (hang watch)
DRAIN_TIMEOUT_S = 30.0


def dir_size_bytes(path: str) -> int | None:
    p = Path(path)
    if not p.exists():
        return None
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def delete_checkpoint_dir(path: str) -> None:
    """Delete a checkpoint directory, local or on a ``pyarrow.fs`` URL (s3://, gs://, ...); failures are logged."""
    try:
        if "://" in path:
            from pyarrow import fs as pafs

            filesystem, where = pafs.FileSystem.from_uri(path)
            filesystem.delete_dir(where)
        elif Path(path).exists():
            shutil.rmtree(path)
    except Exception as e:  # a checkpoint left behind costs space, never the run
        logger.warning("could not delete checkpoint %s: %s", path, e)


# ---------------------------------------------------------------------------------------------- recorder
class Recorder:
    """Writes what the run's channel collected into the run database."""

    def __init__(
        self,
        factory: sessionmaker[Session],
        run_id: str,
        *,
        train_run_name: str | None = None,
        job_id: str | None = None,
        checkpoint_keep: int | None = None,
    ):
        self.factory = factory
        self.run_id = run_id
        self.job_id = job_id
        self.checkpoint_keep = checkpoint_keep  # prune to this many recorded checkpoints (None: never prune)
        self.revoked = False
        self.train_run_name = train_run_name
        self.current_attempt: int | None = None
        self.worker_errors: list[str] = []
        self.summary: dict[str, Any] | None = None
        self.rank_nodes: dict[str, str] | None = None
        self.peak_per_rank: dict[str, int] = {}
        self.rank_hosts: dict[str, str] = {}
        self.stragglers = StragglerWatch()
        self.hangs = HangWatch()
        self.hang_reasons: dict[int, str] = {}  # attempt -> why the driver failed it
        self.first_step_seen = False
        self.lock = threading.Lock()
        self._drain_lock = threading.Lock()  # one drain at a time (``drain``)
        self._pending_drain: Any = None  # a drain the channel has not answered yet
        self.trackers: Any = None  # service.runs.tracking.Trackers: gets what was committed (``track_run``)
        self._out: list[tuple[str, Any]] = []  # for the trackers, sent once the transaction committed

    def apply(self, events: list[dict[str, Any]]) -> None:
        if not events:
            return
        with self.lock:
            self._out = []
            if self._apply(events):
                self._prune_checkpoints()
            if self.trackers is not None:
                for what, args in self._out:
                    getattr(self.trackers, what)(*args)

    def _apply(self, events: list[dict[str, Any]]) -> bool:
        """Write ``events`` (one transaction); True when a checkpoint was recorded."""
        recorded = False
        with session_scope(self.factory) as s:
            if self.revoked or not store.fence(s, run_id=self.run_id, job_id=self.job_id):
                if not self.revoked:
                    logger.warning("run %s: this driver's attempt was revoked; it writes nothing more", self.run_id)
                self.revoked = True
                return False
            for ev in events:
                kind = ev.get("type")
                if kind == "attempt":
                    self._attempt(s, ev)
                elif kind == "metrics":
                    self._metrics(s, ev)
                elif kind == "checkpoint":
                    recorded = self._checkpoint(s, ev) or recorded
                elif kind == "worker_error":
                    self.worker_errors.append(ev["text"])
                    self._out.append(("event", ("worker_error", ev["text"])))
                    store.add_event(
                        s,
                        run_id=self.run_id,
                        kind="worker_error",
                        reason=trim(f"attempt {ev['attempt']} failed: {ev['text']}"),
                    )
                elif kind == "event":
                    store.add_event(s, run_id=self.run_id, kind=str(ev["kind"]), reason=trim(str(ev["reason"])))
                    self._out.append(("event", (str(ev["kind"]), trim(str(ev["reason"])))))
                elif kind == "done":
                    self.summary = ev.get("summary") or {}
                elif kind == "artifact":
                    add_artifact(
                        s,
                        run_id=self.run_id,
                        attempt=int(ev["attempt"]),
                        rank=ev.get("rank"),
                        name=str(ev["name"]),
                        content=str(ev.get("text") or "").encode(),
                    )
        return recorded

    def _attempt(self, s: Session, ev: dict[str, Any]) -> None:
        """A new worker group: the previous attempt (if any) failed; record the new one and where its ranks run."""
        if self.current_attempt is not None:
            controller.end_attempt(
                s,
                run_id=self.run_id,
                attempt=self.current_attempt,
                status=RunStatus.FAILED,
                cause=self.attempt_cause(),
            )
        att = controller.start_attempt(
            s, run_id=self.run_id, cause=ev.get("cause") or "start", train_run_name=self.train_run_name
        )
        if att.attempt != ev["attempt"]:
            logger.warning("attempt numbering differs: db %s, channel %s", att.attempt, ev["attempt"])
        self.current_attempt = ev["attempt"]
        self.first_step_seen = False
        ranks = sorted(ev.get("ranks") or [], key=lambda r: r["rank"])
        n_nodes = len({r["node_id"] for r in ranks})
        store.add_phase(
            s, run_id=self.run_id, phase=f"workers ready: {len(ranks)} on {n_nodes} node(s), attempt {ev['attempt']}"
        )
        self.rank_nodes = {str(r["rank"]): r["node_id"] for r in ranks}
        self.rank_hosts = {str(r["rank"]): str(r.get("host") or "") for r in ranks}
        self.stragglers.reset()
        store.get_run(s, run_id=self.run_id).rank_nodes = self.rank_nodes
        where = {str(r["rank"]): f"{r['node_id'][:12]} pid {r['pid']}" for r in ranks}
        store.add_event(s, run_id=self.run_id, kind="placement", reason="rank -> node: " + json.dumps(where))

    def attempt_cause(self) -> str | None:
        """Why the current attempt failed: the driver's hang diagnosis, else the workers' last error."""
        hang = self.hang_reasons.get(self.current_attempt or 0)
        return hang or (self.worker_errors[-1] if self.worker_errors else None)

    def _metrics(self, s: Session, ev: dict[str, Any]) -> None:
        if self.current_attempt is not None and ev["attempt"] < self.current_attempt:
            logger.warning("run %s: dropping metrics of ended attempt %s", self.run_id, ev["attempt"])
            return
        rows = []
        for r in ev["rows"]:
            r = dict(r)
            for i, v in enumerate(r.pop(PEAK_MEMORY_PER_RANK, None) or ()):
                self.peak_per_rank[str(i)] = max(self.peak_per_rank.get(str(i), 0), int(v))
            alert = r.pop(SYNC_ALERT, None)  # layout.sync: staleness at its bound, replicas diverging
            if alert:
                store.add_event(s, run_id=self.run_id, kind="sync_alert", reason=trim(f"step {r['step']}: {alert}"))
                self._out.append(("event", ("sync_alert", f"step {r['step']}: {alert}")))
            rows.append(r)
            self._watch(s, r)
        store.add_metrics(s, run_id=self.run_id, attempt=ev["attempt"], rows=rows)
        self._out.append(("metrics", (rows,)))
        if rows and not self.first_step_seen:
            self.first_step_seen = True
            store.add_phase(s, run_id=self.run_id, phase=f"first step: step {rows[0].get('step')} trained")

    def _watch(self, s: Session, row: dict[str, Any]) -> None:
        """Stragglers (per-rank compute of measured steps) and the step times the hang timeout derives from."""
        self.hangs.step_time(row.get("step_time_s"))
        compute = (row.get("breakdown_per_rank") or {}).get("compute")
        if not isinstance(compute, list) or row.get("step") is None:
            return
        try:
            values = [float(c) for c in compute]
        except (TypeError, ValueError):
            return
        for found in self.stragglers.observe(int(row["step"]), values):
            key = str(found.rank)
            text = found.describe((self.rank_nodes or {}).get(key), self.rank_hosts.get(key))
            logger.warning("run %s: %s", self.run_id, text)
            store.add_event(s, run_id=self.run_id, kind="straggler", reason=text)
            self._out.append(("event", ("straggler", text)))

    def _checkpoint(self, s: Session, ev: dict[str, Any]) -> bool:
        if ev.get("step") is None:
            return False
        store.add_checkpoint(
            s,
            run_id=self.run_id,
            attempt=ev.get("attempt_reported") or ev["attempt"],
            step=int(ev["step"]),
            path=ev["path"],
            size_bytes=dir_size_bytes(ev["path"]),
        )
        store.add_event(
            s, run_id=self.run_id, kind="checkpoint", reason=f"checkpoint of step {ev['step']} at {ev['path']}"
        )
        self._out.append(("checkpoint", (int(ev["step"]), str(ev["path"]))))
        return True

    def _prune_checkpoints(self) -> None:
        """``checkpoint.keep``: delete the recorded checkpoints older than the newest ``keep`` recorded ones, after
        the newest is committed. The driver prunes, not Ray Train (its ``num_to_keep`` deletes as it registers,
        ahead of the database: a run cancelled then could be left with every recorded checkpoint deleted and the
        newer ones unrecorded). Checkpoints written but never recorded (the run ended meanwhile) are left alone."""
        if not self.checkpoint_keep:
            return
        with session_scope(self.factory) as s:
            rows = store.list_checkpoints(s, run_id=self.run_id)
        newest = sorted(rows, key=lambda c: (c.step, c.attempt), reverse=True)
        keep_paths = {c.path for c in newest[: self.checkpoint_keep]}
        for c in newest[self.checkpoint_keep :]:
            if c.path not in keep_paths:
                delete_checkpoint_dir(c.path)

    def drain(self, channel: ActorHandle, *, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        """Apply what the channel holds now (logs and swallows failures: the next drain retries).

        A drain the channel has not answered within ``timeout_s`` (an actor starved on a busy machine) is not asked
        again: the actor has handed its events to that answer, so the next drain (the driver's final one included)
        waits for the same one, and nothing is lost. The drainer thread and the final drain take turns."""
        with self._drain_lock:
            try:
                if self._pending_drain is None:
                    self._pending_drain = channel.drain.remote()
                events = ray.get(self._pending_drain, timeout=timeout_s)
            except GetTimeoutError:
                logger.warning(
                    "the channel of run %s has not answered a drain within %.0f s (a busy machine?); the next drain "
                    "waits for the same answer",
                    self.run_id,
                    timeout_s,
                )
                return
            except Exception:
                self._pending_drain = None
                logger.exception("draining the channel of run %s failed", self.run_id)
                return
            self._pending_drain = None
            try:
                self.apply(events)
            except Exception:
                logger.exception("recording what the channel of run %s held failed", self.run_id)


# ----------------------------------------------------------------------------------------------- outcome
@dataclass(frozen=True)
class Outcome:
    """How a driver's training ended. ``status`` None: somebody else ended the run (nothing more to record)."""

    status: RunStatus | None
    reason: str
    detail: str | None = None  # the full error text (tracebacks), kept as an "error" event

    @classmethod
    def succeeded(cls) -> Outcome:
        return cls(RunStatus.SUCCEEDED, "training finished")


_EXC_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?([A-Z]\w*(?:Error|Exception|Exit|Interrupt|Failure))\b:?\s*(.*)$")
MAX_SENTENCE_CHARS = 300


def one_sentence(text: str) -> str:
    """The error of a (multi-line, traceback-laden) failure text as one readable line: the last
    ``SomeError: message`` line (the innermost cause), else the first line; at most 300 characters."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    if not lines:
        return "unknown error"
    found = [m for m in (_EXC_LINE.match(ln) for ln in lines) if m and m.group(2)]
    line = f"{found[-1].group(1)}: {found[-1].group(2)}" if found else lines[0]
    return line if len(line) <= MAX_SENTENCE_CHARS else line[: MAX_SENTENCE_CHARS - 3] + "..."


def failure_text(e: BaseException, worker_errors: list[str]) -> str:
    """The workers' exception(s) of a failed ``fit()`` (rank: type: message), else the last error the Train
    controller reported, else the exception itself. Ray Train's error types are looked up only when Ray Train was
    imported (a warm run's driver never imports it, and then no error of its can exist)."""
    train = sys.modules.get("ray.train")
    group_error, controller_error = (getattr(train, n, None) for n in ("WorkerGroupError", "ControllerError"))
    if group_error is not None and isinstance(e, group_error) and getattr(e, "worker_failures", None):
        return format_worker_exceptions(e.worker_failures)
    if worker_errors:
        return worker_errors[-1]
    is_controller = controller_error is not None and isinstance(e, controller_error)
    cause: BaseException = e.controller_failure if is_controller else e  # type: ignore[attr-defined]
    return f"{type(cause).__name__}: {cause}"


def run_summary(
    session: Session,
    *,
    run_id: str,
    warmup_steps: int = 0,
    peak_per_rank: Mapping[str, int] | None = None,
    wall_s: float | None = None,
) -> dict[str, Any]:
    """A run's summary (``api.spec.RunSummary``): from its stored steps (means after ``warmup_steps``), the
    per-rank peak memory the workers reported, the wall time of its driver."""
    summ = store.summarize_metrics(session, run_id=run_id, warmup_steps=warmup_steps)
    return {
        "steps_done": summ.get("steps_done", 0),
        "final_loss": summ.get("final_loss"),
        "mean_tokens_per_s": summ.get("mean_tokens_per_s"),
        "mean_mfu": summ.get("mean_mfu"),
        PEAK_MEMORY_PER_RANK: {str(k): int(v) for k, v in (peak_per_rank or {}).items()},
        "wall_time_s": wall_s,
    }


# --------------------------------------------------------------------------------------------- lifecycle
@dataclass
class RunLifecycle:
    """The database side of one execution of a run (see the module docstring)."""

    factory: sessionmaker[Session]
    run_id: str
    actor: str
    warmup_steps: int = 0
    train_run_name: str | None = None
    job_id: str | None = None
    on_revoked: Callable[[], None] | None = None
    data_dir: str | None = None  # the service's data_dir (where the workers keep state and stack files)
    hang_timeout_s: float | None = None  # the spec's resources.hang_timeout_s (None: derived from step times)
    checkpoint_keep: int | None = None  # the spec's checkpoint.keep: the driver prunes older checkpoints
    recorder: Recorder = field(init=False)
    requests_seen: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.recorder = Recorder(
            self.factory,
            self.run_id,
            train_run_name=self.train_run_name,
            job_id=self.job_id,
            checkpoint_keep=self.checkpoint_keep,
        )

    def request(self, to: RunStatus, reason: str, **fields: Any) -> bool:
        """Ask the run controller to move the run; False (logged) when it refuses (e.g. cancelled meanwhile) or this
        driver's attempt was revoked (``store.fence``)."""
        with session_scope(self.factory) as s:
            if not store.fence(s, run_id=self.run_id, job_id=self.job_id):
                logger.info("not moving run %s to %s: this driver's attempt was revoked", self.run_id, to.value)
                return False
            res = controller.request_run(s, run_id=self.run_id, to=to, reason=reason, actor=self.actor, **fields)
        if not res.applied:
            logger.info("not moving run %s to %s: %s", self.run_id, to.value, res.refused_reason)
        return res.applied

    def start(self, reason: str) -> bool:
        return self.request(RunStatus.RUNNING, reason)

    def write(self, what: str, fn: Callable[[Session], object]) -> bool:
        """``fn(session)`` in one transaction behind this driver's fence (``store.fence``): False, with nothing
        written, when the driver's attempt was revoked (the run ended, was requeued or runs under another job)."""
        with session_scope(self.factory) as s:
            if not store.fence(s, run_id=self.run_id, job_id=self.job_id):
                logger.info("run %s: not writing %s: this driver's attempt was revoked", self.run_id, what)
                return False
            fn(s)
        return True

    def phase(self, text: str) -> None:
        """A start-up phase (``store.add_phase``): an event, and the run's reason until it trains (fenced)."""
        self.write("a phase", lambda s: store.add_phase(s, run_id=self.run_id, phase=text, actor=self.actor))

    def status(self) -> RunStatus:
        with session_scope(self.factory) as s:
            return RunStatus(store.get_run(s, run_id=self.run_id).status)

    @contextmanager
    def channel(self, *, first_attempt: int) -> Iterator[ActorHandle]:
        """The run's channel actor, drained into the database in a background thread while the block runs, and
        once more at its end."""
        handle = open_channel(self.run_id, first_attempt)
        stop = threading.Event()

        self.recorder.hangs.timeout_s = self.hang_timeout_s
        self.requests_seen = self._latest_request_id()

        def loop() -> None:
            last_states = 0.0
            while not stop.wait(DRAIN_INTERVAL_S):
                self.recorder.drain(handle)
                if self.recorder.revoked and self.on_revoked is not None:
                    self.on_revoked()
                    return
                now = time.monotonic()
                if now - last_states >= STATES_INTERVAL_S:
                    last_states = now
                    self.watch_hang(handle, now)
                    self.forward_requests(handle)

        drainer = threading.Thread(target=loop, daemon=True, name=f"drain-{self.run_id}")
        drainer.start()
        try:
            yield handle
        finally:
            stop.set()
            drainer.join(timeout=5)
            self.recorder.drain(handle)

    def _latest_request_id(self) -> int:
        with session_scope(self.factory) as s:
            evs = store.list_events(s, run_id=self.run_id, kinds=[PROFILE_REQUEST], limit=1, newest_first=True)
            return evs[0].id if evs else 0

    def forward_requests(self, channel: ActorHandle) -> None:
        """Profile requests (``POST /v1/runs/{id}/profile`` stores them as events) -> the channel, which hands
        them to rank 0 at its next report."""
        try:
            with session_scope(self.factory) as s:
                evs = store.list_events(s, run_id=self.run_id, kinds=[PROFILE_REQUEST], limit=20, newest_first=True)
                new = [(e.id, e.reason or "") for e in evs if e.id > self.requests_seen]
            for eid, reason in sorted(new):
                m = re.search(r"profile (\d+) steps", reason)
                if m:
                    ray.get(channel.request_profile.remote(int(m.group(1))), timeout=DRAIN_TIMEOUT_S)
                self.requests_seen = max(self.requests_seen, eid)
        except Exception:
            logger.exception("forwarding profile requests of run %s failed", self.run_id)

    def watch_hang(self, channel: ActorHandle, now: float) -> None:
        """Read the ranks' heartbeats; on no step for the hang timeout: dump every rank's stack (stored as
        artifacts), record the diagnosis (event ``hang``, the attempt's failure cause) and kill the ranks, so
        that Ray Train's recovery takes over. Failures are logged: the next round retries."""
        if self.recorder.revoked:
            return  # not this driver's attempt any more: the service decides
        try:
            info = cast(dict[str, Any], ray.get(channel.rank_states.remote(), timeout=DRAIN_TIMEOUT_S))
            watch = self.recorder.hangs
            watch.states(int(info["attempt"]), info["states"], now)
            if not watch.hung(now):
                return
            watch.fired = True
            attempt = int(info["attempt"])
            stuck_s = now - (watch.progress_at or now)
            reason = trim(diagnose(info["states"], world_size=len(info["ranks"]), timeout_s=stuck_s))
            logger.error("run %s attempt %d: %s", self.run_id, attempt, reason)
            ray.get(channel.hang.remote(reason), timeout=DRAIN_TIMEOUT_S)
            self.recorder.hang_reasons[attempt] = reason
            sdir = state_dir(self.data_dir, self.run_id, attempt) if self.data_dir else None
            dumps = dump_and_kill(info["ranks"], stacks_dir=sdir)
            with self.recorder.lock, session_scope(self.factory) as s:
                store.add_event(s, run_id=self.run_id, kind="hang", reason=f"attempt {attempt}: {reason}")
                for rank, text in dumps.items():
                    add_artifact(
                        s,
                        run_id=self.run_id,
                        attempt=attempt,
                        rank=rank,
                        name=f"stacks/rank{rank}.txt",
                        content=text.encode(),
                    )
        except Exception:
            logger.exception("watching run %s for hangs failed", self.run_id)

    def failed(self, error: BaseException) -> Outcome:
        """FAILED with the workers' error (call after the channel's last drain, which brings their reports): one
        readable sentence as the reason, the whole text kept as an ``error`` event. A hang the driver diagnosed in
        the last attempt is the better explanation."""
        text = failure_text(error, self.recorder.worker_errors)
        hang = self.recorder.hang_reasons.get(self.recorder.current_attempt or 0)
        if hang:
            return Outcome(RunStatus.FAILED, trim(f"training failed: {hang}"), detail=trim(text, 20_000))
        return Outcome(RunStatus.FAILED, f"training failed: {one_sentence(text)}", detail=trim(text, 20_000))

    def summary(self, session: Session, *, wall_s: float | None) -> dict[str, Any]:
        return run_summary(
            session,
            run_id=self.run_id,
            warmup_steps=self.warmup_steps,
            peak_per_rank=(self.recorder.summary or {}).get(PEAK_MEMORY_PER_RANK) or self.recorder.peak_per_rank,
            wall_s=wall_s,
        )

    def requeue(self, reason: str) -> bool:
        """After a preemption: the current attempt and the run PREEMPTED with ``reason``, then QUEUED to resume from
        the latest checkpoint (the scheduler admits it again as a new Ray Job). False when the run was ended
        meanwhile (a cancel wins)."""
        with session_scope(self.factory) as s:
            if not store.fence(s, run_id=self.run_id, job_id=self.job_id):
                logger.info("not re-queueing run %s: this driver's attempt was revoked", self.run_id)
                return False
            ck = store.latest_checkpoint(s, run_id=self.run_id)
            fields: dict[str, Any] = {"resume_from": ck.path} if ck is not None else {}
            where = f"the checkpoint of step {ck.step}" if ck is not None else "its start (no checkpoint)"
            res = controller.requeue_run(
                s,
                run_id=self.run_id,
                reason=f"back in the queue after preemption; resumes from {where}",
                actor=self.actor,
                preempted_reason=reason,
                allow_from=[RunStatus.RUNNING, RunStatus.STARTING],
                attempt=self.recorder.current_attempt or 0,
                attempt_status=RunStatus.PREEMPTED,
                attempt_cause=reason[:500],
                **fields,
            )
        if not res.changed:
            logger.info("not re-queueing run %s: %s", self.run_id, res.refused_reason)
            return False
        logger.info("run %s: preempted (%s), re-queued", self.run_id, reason[:200])
        return True

    def finish(self, outcome: Outcome, *, wall_s: float | None) -> dict[str, Any]:
        """End the current attempt and the run with ``outcome`` (see the module docstring); returns the summary."""
        with session_scope(self.factory) as s:
            summary = self.summary(s, wall_s=wall_s)
            current = store.fence(s, run_id=self.run_id, job_id=self.job_id)
            if outcome.status is not None and self.recorder.current_attempt is not None and current:
                controller.end_attempt(
                    s,
                    run_id=self.run_id,
                    attempt=self.recorder.current_attempt,
                    status=outcome.status,
                    cause=None if outcome.status == RunStatus.SUCCEEDED else outcome.reason[:500],
                )
            if outcome.detail and current:
                store.add_event(s, run_id=self.run_id, kind="error", reason=outcome.detail, actor=self.actor)
        if outcome.status is not None:
            applied = self.request(outcome.status, outcome.reason, summary=summary)
            if applied and self.recorder.trackers is not None:  # mirrored once the run's own record holds it
                self.recorder.trackers.finish(outcome.status.value, summary | {"reason": outcome.reason})
        logger.info(
            "run %s: %s (%s)%s",
            self.run_id,
            outcome.status.value if outcome.status is not None else "ended externally",
            outcome.reason[:200],
            f" in {wall_s:.1f}s" if wall_s is not None else "",
        )
        return summary

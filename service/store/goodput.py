"""Goodput of a run: productive step time over the wall time since submission, and where the rest went.

Read from what the store already holds (``run_goodput``): the run's state events (QUEUED, STARTING, PREEMPTED ...),
its attempts (one per worker-group start), its per-step metric rows of every attempt (``time`` is the end of a
step, ``step_time_s`` its duration) and its ``worker_error`` events. ``account`` is the pure arithmetic:

- productive: the step time of the steps that count (each step once: the latest attempt's row);
- queue: time spent QUEUED (at submission and after a preemption);
- startup: from the first STARTING to the start of the first step (job, workers, model build, data, compile);
- failure_detection: from the last step a failed attempt finished to the worker error that reported it;
- restart: from that error (or the end of a preempted attempt) back to the start of the next first step, the queue
  time excluded;
- recomputed_steps: the step time of steps done again after a restart (past the checkpoint resumed from);
- checkpoint_stall: what periodic saves held the loop: the gap between the end of a checkpoint's step and the start
  of the next step of the same attempt (a step's period leaves the save out; ``checkpoint.async`` shrinks it to the
  copy);
- other: the rest (reports, the driver's start and end, a run still starting).

``attempts_detail`` splits the same per attempt: its productive and recomputed step time, and the startup, failure
detection, restart and checkpoint stall that led to or held it.

Replica mode (``fault_tolerance.mode: replica``): a lost replica fails no attempt; its peers' failed tries and wait
until the next quorum (a row's ``recovery_s``) count as failure_detection, their wait while its replacement heals
from them (``rejoin_s``) as restart, and ``replicas`` says per replica how many
steps it trained, the step time of the steps the run made without it (``absent_s``: its restart and heal) and how
often it was lost.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.store.models import Checkpoint, Metric, Run, RunAttempt, RunEvent

CAUSES = ("queue", "startup", "failure_detection", "restart", "recomputed_steps", "checkpoint_stall", "other")
PER_ATTEMPT = ("startup", "failure_detection", "restart", "recomputed_steps", "checkpoint_stall")


@dataclass(frozen=True)
class AttemptTimes:
    """One attempt, in epoch seconds: when it began, the start of its first step and the end of its last one (None
    without steps), its total step time and the part of it that later attempts redid."""

    attempt: int
    started_at: float
    first_start: float | None
    last_end: float | None
    step_time_s: float
    recomputed_s: float = 0.0
    recomputed_steps: int = 0
    checkpoint_stall_s: float = 0.0
    recovery_s: float = 0.0  # replica mode: the live replicas' failed tries and quorum wait after a peer was lost
    rejoin_s: float = 0.0  # replica mode: their quorum wait while a replacement healed from them


def account(
    *,
    created: float,
    end: float,
    states: Sequence[tuple[float, str]],
    attempts: Sequence[AttemptTimes],
    error_times: Sequence[float] = (),
) -> dict[str, Any]:
    """The goodput breakdown (see the module docstring). ``states``: (time, status entered), in time order."""
    wall = max(0.0, end - created)
    queue, cur, since = 0.0, "QUEUED", created
    for t, to in sorted(states):
        if cur == "QUEUED":
            queue += max(0.0, t - since)
        cur, since = to, t
    if cur == "QUEUED":
        queue += max(0.0, end - since)
    starts = sorted(t for t, to in states if to == "STARTING")
    requeued = sorted(t for t, to in states if to in ("PREEMPTED", "QUEUED"))
    lost = dict.fromkeys(CAUSES, 0.0)
    lost["queue"] = queue
    detail: list[dict[str, Any]] = []
    prev: AttemptTimes | None = None
    for a in sorted(attempts, key=lambda x: x.attempt):
        mine = dict.fromkeys(PER_ATTEMPT, 0.0)
        mine["recomputed_steps"], mine["checkpoint_stall"] = a.recomputed_s, a.checkpoint_stall_s
        mine["failure_detection"], mine["restart"] = a.recovery_s, a.rejoin_s
        detail.append({"attempt": a.attempt, "productive_s": a.step_time_s - a.recomputed_s, "lost_s": mine})
        if a.first_start is None:
            continue  # no step yet: its time goes to the next attempt's restart (or to other)
        sub = max((s for s in starts if s <= a.started_at), default=None)
        if prev is None or prev.last_end is None:
            mine["startup"] = max(0.0, a.first_start - (sub if sub is not None else a.started_at))
        elif sub is not None and sub >= prev.last_end:  # a new Ray Job after a preemption (or a resume)
            stop = min((t for t in requeued if t >= prev.last_end), default=sub)
            mine["restart"] += max(0.0, stop - prev.last_end) + max(0.0, a.first_start - sub)
        else:  # Ray Train restarted the worker group after a failure
            err = min((e for e in error_times if prev.last_end <= e <= a.first_start), default=a.started_at)
            mine["failure_detection"] += max(0.0, err - prev.last_end)
            mine["restart"] += max(0.0, a.first_start - err)
        prev = a
    for d in detail:
        for k, v in d["lost_s"].items():
            lost[k] += v
    productive = sum(a.step_time_s for a in attempts) - lost["recomputed_steps"]
    lost["other"] = max(0.0, wall - productive - sum(v for k, v in lost.items() if k != "other"))
    return {
        "wall_s": wall,
        "productive_s": productive,
        "goodput": productive / wall if wall > 0 else None,
        "lost_s": lost,
        "recomputed_steps": sum(a.recomputed_steps for a in attempts),
        "attempts": len(attempts),
        "attempts_detail": detail,
    }


def _ts(dt: datetime | None) -> float | None:
    if dt is None:
        return None
    return (dt if dt.tzinfo is not None else dt.replace(tzinfo=UTC)).timestamp()


def run_goodput(session: Session, *, run: Run, now: datetime | None = None) -> dict[str, Any]:
    """The goodput breakdown of ``run`` (until it finished, or until ``now``)."""
    rid = run.id
    replica_mode = ((run.spec or {}).get("fault_tolerance") or {}).get("mode") == "replica"
    events = session.execute(
        select(RunEvent.time, RunEvent.kind, RunEvent.reason, RunEvent.to_status)
        .where(RunEvent.run_id == rid)
        .order_by(RunEvent.id)
    ).all()
    states = [(_ts(t) or 0.0, to) for t, kind, _r, to in events if kind == "state" and to]
    errors = [_ts(t) or 0.0 for t, kind, _r, _to in events if kind == "worker_error"]
    reasons = [(kind, reason) for _t, kind, reason, _to in events]
    redone_from: dict[int, int | None] = {}  # attempt -> the first step a later attempt redid
    per = session.execute(
        select(
            Metric.attempt,
            func.min(Metric.step),
            func.max(Metric.step),
            func.min(Metric.time),
            func.max(Metric.time),
            func.coalesce(func.sum(Metric.step_time_s), 0.0),
        )
        .where(Metric.run_id == rid)
        .group_by(Metric.attempt)
    ).all()
    by_attempt = {int(a): (lo, hi, t0, t1, float(total or 0.0)) for a, lo, hi, t0, t1, total in per}
    started = dict(
        session.execute(select(RunAttempt.attempt, RunAttempt.started_at).where(RunAttempt.run_id == rid)).all()
    )
    attempts: list[AttemptTimes] = []
    numbers = sorted(set(by_attempt) | set(started))
    for n in numbers:
        row = by_attempt.get(n)
        later = [by_attempt[m][0] for m in numbers if m > n and m in by_attempt]
        redo_from = min(later) if later else None
        first_start = last_end = None
        total = redo_s = 0.0
        redo_n = 0
        if row is not None:
            lo, _hi, _t0, t1, total = row
            first = session.execute(
                select(Metric.time, Metric.step_time_s).where(
                    Metric.run_id == rid, Metric.attempt == n, Metric.step == lo
                )
            ).first()
            first_t = _ts(first[0]) if first is not None else None
            first_start = (first_t or 0.0) - float((first[1] if first is not None else 0.0) or 0.0)
            last_end = _ts(t1)
            if redo_from is not None:
                redo = session.execute(
                    select(func.count(), func.coalesce(func.sum(Metric.step_time_s), 0.0)).where(
                        Metric.run_id == rid, Metric.attempt == n, Metric.step >= redo_from
                    )
                ).one()
                redo_n, redo_s = int(redo[0]), float(redo[1] or 0.0)
        begun = _ts(started.get(n)) or first_start or 0.0
        stall = _checkpoint_stall(session, rid, n) if row is not None else 0.0
        recovery = _recovery_s(session, rid, n, redo_from) if replica_mode and row is not None else (0.0, 0.0)
        attempts.append(AttemptTimes(n, begun, first_start, last_end, total, redo_s, redo_n, stall, *recovery))
        redone_from[n] = redo_from
    created = _ts(run.created_at) or 0.0
    end = _ts(run.finished_at) or _ts(now) or datetime.now(UTC).timestamp()
    out = account(created=created, end=end, states=states, attempts=attempts, error_times=errors)
    if replica_mode:
        lost_text = [reason or "" for kind, reason in reasons if kind == "replica_lost"]
        out["replicas"] = _replicas(session, rid, _replica_count(run), redone_from, lost_text)
    return out


def _checkpoint_stall(session: Session, run_id: str, attempt: int) -> float:
    """Seconds the attempt's periodic saves held its loop: for each checkpoint it recorded at step s, the start of
    its step s+1 (end minus period) less the end of step s."""
    saved = set(
        session.scalars(select(Checkpoint.step).where(Checkpoint.run_id == run_id, Checkpoint.attempt == attempt))
    )
    if not saved:
        return 0.0
    rows = session.execute(
        select(Metric.step, Metric.time, Metric.step_time_s).where(
            Metric.run_id == run_id, Metric.attempt == attempt, Metric.step.in_(sorted(saved | {k + 1 for k in saved}))
        )
    ).all()
    at = {int(step): (_ts(t) or 0.0, float(period or 0.0)) for step, t, period in rows}
    return sum(max(0.0, (at[k + 1][0] - at[k + 1][1]) - at[k][0]) for k in saved if k in at and k + 1 in at)


LOST_RE = re.compile(r"^replica (\d+) lost")


def _replica_count(run: Run) -> int:
    """Replica mode's replicas: ``dp_replicate`` (HSDP: FSDP shard groups of several workers), else ``dp``."""
    plan = run.plan or {}
    lay = plan.get("layout") or {}
    return int(lay.get("dp_replicate") or lay.get("dp") or ((run.spec or {}).get("layout") or {}).get("dp") or 1)


def _counted(run_id: str, attempt: int, redo_from: int | None) -> list[Any]:
    """The conditions of an attempt's rows that count (not redone by a later attempt)."""
    where = [Metric.run_id == run_id, Metric.attempt == attempt]
    if redo_from is not None:
        where.append(Metric.step < redo_from)
    return where


def _recovery_s(session: Session, run_id: str, attempt: int, redo_from: int | None) -> tuple[float, float]:
    """Replica mode: the live replicas' lost time when a peer was lost (rows' ``recovery_s``) and when its
    replacement joined (``rejoin_s``)."""
    lost, rejoin = session.execute(
        select(
            func.coalesce(func.sum(Metric.extra["recovery_s"].as_float()), 0.0),
            func.coalesce(func.sum(Metric.extra["rejoin_s"].as_float()), 0.0),
        ).where(*_counted(run_id, attempt, redo_from))
    ).one()
    return float(lost or 0.0), float(rejoin or 0.0)


def _replicas(
    session: Session, run_id: str, n: int, redo: dict[int, int | None], lost_text: Sequence[str]
) -> list[dict[str, Any]]:
    """Per replica: steps trained, the step time of the steps the run made without it, times it was lost."""
    steps, productive, absent = [0] * n, [0.0] * n, [0.0] * n
    for attempt, redo_from in redo.items():
        mask = Metric.extra["replica_mask"].as_integer()
        groups = session.execute(
            select(mask, func.count(), func.coalesce(func.sum(Metric.step_time_s), 0.0))
            .where(*_counted(run_id, attempt, redo_from))
            .group_by(mask)
        ).all()
        for m, count, secs in groups:
            for i in range(n):
                if m is not None and int(m) >> i & 1:
                    steps[i] += int(count)
                    productive[i] += float(secs or 0.0)
                else:
                    absent[i] += float(secs or 0.0)
    losses = [0] * n
    for text in lost_text:
        if (hit := LOST_RE.match(text)) and int(hit.group(1)) < n:
            losses[int(hit.group(1))] += 1
    return [
        {"replica": i, "steps": steps[i], "productive_s": productive[i], "absent_s": absent[i], "losses": losses[i]}
        for i in range(n)
    ]

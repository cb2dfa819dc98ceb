"""The sweep/trial store: sweeps, trials and their events, and their public forms.

The sweep and trial state machines (``SWEEP_ALLOWED`` / ``TRIAL_ALLOWED``) and every status change of a sweep or a
trial belong to the run controller (``service.store.controller``: ``request_sweep`` / ``request_trial``, typed
results; ``transition_sweep`` / ``transition_trial``, their strict forms that raise ``Conflict``, re-exported here),
which records a ``sweep_events`` row (``trial_id`` set for a trial) with the reason and the actor. Events without a
state change (a submission, a stop request) are ``add_sweep_event`` rows of another ``kind``.

Sweep: QUEUED -> RUNNING -> SUCCEEDED | FAILED | CANCELLED; a QUEUED sweep may also fail (its driver was lost) or be
cancelled. Trial: created PENDING or SKIPPED (with the reason); PENDING -> RUNNING -> SUCCEEDED | FAILED |
EARLY_STOPPED | CANCELLED; a PENDING trial may also be CANCELLED or FAILED (the sweep ended before it ran). Terminal
states never change.

Keyword-only functions over a Session; the caller owns the transaction.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api.spec import Layout, SweepCreate, SweepEventPublic, SweepPublic, TrialPublic
from service.errors import NotFound
from service.store import new_id
from service.store.controller import SWEEP_TRANSITIONS as SWEEP_ALLOWED  # noqa: F401 - re-exported
from service.store.controller import TRIAL_INITIAL
from service.store.controller import TRIAL_TRANSITIONS as TRIAL_ALLOWED  # noqa: F401 - re-exported
from service.store.controller import SweepStatus as SweepStatus
from service.store.controller import TrialStatus as TrialStatus
from service.store.controller import transition_sweep as transition_sweep
from service.store.controller import transition_trial as transition_trial
from service.store.models import Metric, Run, RunEvent, Sweep, SweepEvent, Trial, utcnow
from service.store.runs import capped_count, newest_first


def add_trial(
    session: Session, *, sweep: Sweep, status: str, reason: str | None, actor: str | None = None, **fields: Any
) -> Trial:
    """A new trial of ``sweep`` (PENDING or SKIPPED) with its creation event."""
    if status not in TRIAL_INITIAL:
        raise ValueError(f"a trial starts PENDING or SKIPPED, not {status}")
    trial = Trial(sweep_id=sweep.id, status=status, reason=reason, **fields)
    session.add(trial)
    session.flush()
    session.add(SweepEvent(sweep_id=sweep.id, trial_id=trial.id, to_status=status, reason=reason, actor=actor))
    return trial


def add_sweep_event(
    session: Session, *, sweep_id: str, kind: str, reason: str, actor: str | None = None, trial_id: int | None = None
) -> SweepEvent:
    ev = SweepEvent(sweep_id=sweep_id, trial_id=trial_id, kind=kind, reason=reason, actor=actor)
    session.add(ev)
    session.flush()
    return ev


def set_sweep_reason(session: Session, *, sweep: Sweep, reason: str) -> None:
    """Update the human-readable reason without a state change (why a sweep still waits)."""
    if sweep.status_reason != reason:
        sweep.status_reason = reason
        sweep.updated_at = utcnow()


# ------------------------------------------------------------------------------------------------ store
def new_sweep_id() -> str:
    return new_id("sweep")


def get_sweep(session: Session, *, sweep_id: str, project: str | None = None, lock: bool = False) -> Sweep:
    """The sweep, or NotFound (a sweep of another project too). ``lock``: re-read it (a stale status must not
    decide a transition)."""
    stmt = select(Sweep).where(Sweep.id == sweep_id)
    if project is not None:
        stmt = stmt.where(Sweep.project == project)
    if lock:
        stmt = stmt.execution_options(populate_existing=True)
    sweep = session.scalar(stmt)
    if sweep is None:
        raise NotFound(f"sweep '{sweep_id}' not found", param="sweep_id")
    return sweep


def get_trial(session: Session, *, trial_id: int, fresh: bool = False) -> Trial | None:
    """The trial or None; ``fresh``: re-read it from the database."""
    return session.get(Trial, trial_id, populate_existing=fresh)


def trial_of_run(session: Session, *, run_id: str) -> Trial | None:
    return session.scalar(select(Trial).where(Trial.run_id == run_id))


def list_sweeps(
    session: Session,
    *,
    project: str | None = None,
    status: Sequence[str] | None = None,
    limit: int = 50,
    offset: int = 0,
    after: tuple[datetime, str] | None = None,
) -> tuple[list[Sweep], int, bool]:
    """Newest first, a page after the keyset ``after`` (created_at, id) or ``offset``; (sweeps, total counted up to
    store.TOTAL_CAP, whether it is exact)."""
    stmt = select(Sweep)
    if project is not None:
        stmt = stmt.where(Sweep.project == project)
    if status:
        stmt = stmt.where(Sweep.status.in_([s.upper() for s in status]))
    total, exact = capped_count(session, stmt)
    rows = session.scalars(newest_first(stmt, Sweep, after).limit(limit).offset(offset)).all()
    return list(rows), total, exact


def sweeps_in(session: Session, *, statuses: Sequence[str], with_job: bool = False) -> list[Sweep]:
    """Sweeps in these statuses, oldest first (``with_job``: only those submitted as a Ray Job)."""
    stmt = select(Sweep).where(Sweep.status.in_(list(statuses)))
    if with_job:
        stmt = stmt.where(Sweep.ray_job_id.is_not(None))
    return list(session.scalars(stmt.order_by(Sweep.created_at, Sweep.id)).all())


def list_trials(session: Session, *, sweep_id: str, status: str | None = None) -> list[Trial]:
    stmt = select(Trial).where(Trial.sweep_id == sweep_id)
    if status is not None:
        stmt = stmt.where(Trial.status == status)
    return list(session.scalars(stmt.order_by(Trial.id)).all())


def list_sweep_events(session: Session, *, sweep_id: str) -> list[SweepEvent]:
    return list(
        session.scalars(
            select(SweepEvent)
            .where(SweepEvent.sweep_id == sweep_id)
            .order_by(SweepEvent.time.asc(), SweepEvent.id.asc())
        ).all()
    )


# ---------------------------------------------------------------------------------------------- public
def _utc(dt: datetime | None) -> datetime | None:
    if dt is not None and dt.tzinfo is None:
        return dt.replace(tzinfo=UTC)
    return dt


def trial_public(t: Trial) -> TrialPublic:
    return TrialPublic(
        id=t.id,
        run_id=t.run_id,
        layout=Layout.model_validate(t.layout),
        micro_batch_size=t.micro_batch_size,
        status=t.status,
        reason=t.reason,
        predicted_tokens_per_s=t.predicted_tokens_per_s,
        measured_tokens_per_s=t.measured_tokens_per_s,
        measured_mfu=t.measured_mfu,
        peak_memory_bytes=t.peak_memory_bytes,
    )


def trial_phases(session: Session, sweep: Sweep, trials: Sequence[Trial]) -> dict[int, str]:
    """The phase of each RUNNING trial, from its run's status and its latest step (``TrialPublic.phase``)."""
    running = {t.run_id: t.id for t in trials if t.status == TrialStatus.RUNNING and t.run_id}
    if not running:
        return {}
    budget = SweepCreate.model_validate(sweep.spec).budget
    status = dict(session.execute(select(Run.id, Run.status).where(Run.id.in_(list(running)))).all())
    last = dict(
        session.execute(
            select(Metric.run_id, func.max(Metric.step)).where(Metric.run_id.in_(list(running))).group_by(Metric.run_id)
        ).all()
    )
    starting = [r for r in running if not last.get(r)]
    phase = _latest_phases(session, starting) if starting else {}
    out = {}
    for run_id, trial_id in running.items():
        step, st = int(last.get(run_id) or 0), status.get(run_id)
        if st in ("QUEUED", "PREEMPTED"):
            out[trial_id] = "queued"
        elif step == 0:  # a warm group's trial says whether it re-meshes one or starts a new one
            said = phase.get(run_id) or ""
            out[trial_id] = "re-meshing" if said.startswith("re-meshing") else "starting"
        elif step <= budget.warmup_steps:
            out[trial_id] = f"warm-up {step}/{budget.warmup_steps}"
        else:
            out[trial_id] = f"measuring {step - budget.warmup_steps}/{budget.steps_per_trial - budget.warmup_steps}"
    return out


def _latest_phases(session: Session, run_ids: Sequence[str]) -> dict[str, str]:
    """Each run's latest start-up phase (its newest ``phase`` event)."""
    newest = (
        select(RunEvent.run_id, func.max(RunEvent.id).label("id"))
        .where(RunEvent.run_id.in_(list(run_ids)), RunEvent.kind == "phase")
        .group_by(RunEvent.run_id)
        .subquery()
    )
    rows = session.execute(select(RunEvent.run_id, RunEvent.reason).join(newest, RunEvent.id == newest.c.id)).all()
    return {r: reason or "" for r, reason in rows}


def sweep_public(session: Session, sweep: Sweep) -> SweepPublic:
    trials = list_trials(session, sweep_id=sweep.id)
    phases = trial_phases(session, sweep, trials)
    pub = [trial_public(t).model_copy(update={"phase": phases.get(t.id)}) for t in trials]
    best = next((p for p in pub if p.id == sweep.best_trial_id), None) if sweep.best_trial_id else None
    return SweepPublic(
        id=sweep.id,
        name=sweep.name,
        project=sweep.project,
        status=sweep.status,
        status_reason=sweep.status_reason,
        objective=sweep.objective,
        spec=SweepCreate.model_validate(sweep.spec),
        trials=pub,
        best_trial=best,
        calibration=sweep.calibration,
        ray_job_id=sweep.ray_job_id,
        created_at=sweep.created_at if sweep.created_at.tzinfo else sweep.created_at.replace(tzinfo=UTC),
        updated_at=sweep.updated_at if sweep.updated_at.tzinfo else sweep.updated_at.replace(tzinfo=UTC),
        finished_at=_utc(sweep.finished_at),
    )


def sweep_event_public(e: SweepEvent) -> SweepEventPublic:
    ev = SweepEventPublic.model_validate(e)
    return ev.model_copy(update={"time": _utc(e.time)})

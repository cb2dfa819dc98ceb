"""Run database operations: keyword-only functions over a Session. The caller owns the transaction.

A run is created QUEUED here (``create_run``); every later change of its status or of an attempt's goes through
the run controller (``service.store.controller``), which owns the transition table.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar, overload

from sqlalchemy import and_, func, or_, select, text, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api.spec import TERMINAL_STATUSES, RunStatus
from service.errors import NotFound
from service.store.models import Checkpoint, Run, RunAttempt, RunEvent, Sweep, utcnow

# ``total`` of a list is counted up to this many rows (a bounded cost whatever the history); beyond, it is capped
TOTAL_CAP = 1_000

S = RunStatus
TERMINAL = TERMINAL_STATUSES
Keyed = TypeVar("Keyed", Run, Sweep)  # tables with ``project`` and ``idempotency_key`` columns


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(6)}"


def _as_utc(dt: datetime | None) -> datetime | None:
    if dt is not None and dt.tzinfo is None:
        return dt.replace(tzinfo=UTC)
    return dt


# ------------------------------------------------------------------------------------------------- runs
@overload
def find_by_idempotency_key(session: Session, *, project: str, key: str) -> Run | None: ...


@overload
def find_by_idempotency_key(session: Session, *, model: type[Keyed], project: str, key: str) -> Keyed | None: ...


def find_by_idempotency_key(session: Session, *, model: Any = Run, project: str, key: str) -> Any:
    """The run (or sweep: ``model``) that this project created with this Idempotency-Key, or None."""
    return session.scalar(select(model).where(model.project == project, model.idempotency_key == key))


def create_run(
    session: Session,
    *,
    spec: dict[str, Any],
    plan: dict[str, Any] | None,
    project: str = "default",
    name: str | None = None,
    priority: int = 0,
    created_by: str | None = None,
    idempotency_key: str | None = None,
    sweep_id: str | None = None,
) -> tuple[Run, bool]:
    """Insert a QUEUED run. Returns (run, created). With an idempotency key already used in this project,
    returns the existing run and created=False (a retried POST never makes two runs).

    The insert runs in a SAVEPOINT: when a concurrent request with the same key wins the race, only the savepoint
    is rolled back; the caller's earlier writes in this transaction survive."""
    if idempotency_key:
        existing = find_by_idempotency_key(session, model=Run, project=project, key=idempotency_key)
        if existing is not None:
            return existing, False
    run = Run(
        id=new_id("run"),
        name=name or spec.get("name", "run"),
        project=project,
        status=S.QUEUED.value,
        priority=priority,
        spec=spec,
        plan=plan,
        created_by=created_by,
        idempotency_key=idempotency_key,
        sweep_id=sweep_id,
        status_reason="waiting for cluster capacity",
    )
    if session.get_bind().dialect.name == "sqlite":
        # pysqlite opens its transaction lazily, on the first INSERT/UPDATE/DELETE. A SAVEPOINT issued before that
        # would itself be the outermost transaction and its RELEASE would COMMIT the caller's work: make sure the
        # real transaction is open first (a no-op UPDATE makes pysqlite emit BEGIN).
        session.execute(text("UPDATE runs SET id = id WHERE 1 = 0"))
    try:
        with session.begin_nested():
            session.add(run)
            session.add(
                RunEvent(run_id=run.id, kind="state", to_status=S.QUEUED.value, reason="submitted", actor=created_by)
            )
    except IntegrityError:
        # a concurrent request with the same idempotency key won the race (the savepoint is rolled back)
        if idempotency_key:
            existing = find_by_idempotency_key(session, model=Run, project=project, key=idempotency_key)
            if existing is not None:
                return existing, False
        raise
    return run, True


def get_run(session: Session, *, run_id: str, project: str | None = None, lock: bool = False) -> Run:
    """The run, or NotFound. With ``project``, a run of another project is also NotFound (nothing leaks)."""
    stmt = select(Run).where(Run.id == run_id)
    if project is not None:
        stmt = stmt.where(Run.project == project)
    if lock:
        # re-read the row even if this session loaded it before (else a stale status decides the transition)
        stmt = stmt.with_for_update().execution_options(populate_existing=True)
        if session.get_bind().dialect.name == "sqlite":
            # SQLite has no row locks and pysqlite starts transactions lazily: take the database write lock
            # now (waits up to the busy timeout), so the read below and the write after it are atomic.
            session.execute(text("UPDATE runs SET id = id WHERE id = :id"), {"id": run_id})
    run = session.scalar(stmt)
    if run is None:
        raise NotFound(f"run '{run_id}' not found", param="run_id")
    return run


def capped_count(session: Session, stmt: Any, *, cap: int = TOTAL_CAP) -> tuple[int, bool]:
    """(rows of ``stmt`` counted up to ``cap``, whether the count is exact). A bounded cost on any history."""
    n = session.scalar(select(func.count()).select_from(stmt.limit(cap + 1).subquery())) or 0
    return min(int(n), cap), n <= cap


def newest_first(stmt: Any, model: Any, after: tuple[datetime, str] | None) -> Any:
    """``stmt`` ordered newest first (created_at, id descending), from after the keyset ``after``."""
    if after is not None:
        t, key = after
        stmt = stmt.where(or_(model.created_at < t, and_(model.created_at == t, model.id < key)))
    return stmt.order_by(model.created_at.desc(), model.id.desc())


def list_runs(
    session: Session,
    *,
    project: str | None = None,
    status: Sequence[str] | None = None,
    name: str | None = None,
    sweep_id: str | None = None,
    name_contains: str | None = None,
    limit: int = 50,
    offset: int = 0,
    after: tuple[datetime, str] | None = None,
    count: bool = True,
) -> tuple[list[Run], int | None, bool]:
    """Newest first: one page of ``limit`` runs after the keyset ``after`` (created_at, id of the previous page's
    last run; an index range scan) or after ``offset`` rows. Returns (runs, total counted up to TOTAL_CAP or None
    without ``count``, whether the total is exact)."""
    stmt = select(Run)
    if project is not None:
        stmt = stmt.where(Run.project == project)
    if status:
        stmt = stmt.where(Run.status.in_(list(status)))
    if name:
        stmt = stmt.where(Run.name == name)
    if sweep_id:
        stmt = stmt.where(Run.sweep_id == sweep_id)
    if name_contains:
        stmt = stmt.where(Run.name.icontains(name_contains, autoescape=True))
    total, exact = capped_count(session, stmt) if count else (None, False)
    rows = session.scalars(newest_first(stmt, Run, after).limit(limit).offset(offset)).all()
    return list(rows), total, exact


def queued_runs(session: Session) -> list[Run]:
    """QUEUED runs in admission order: priority high first, FIFO within a priority."""
    return list(
        session.scalars(
            select(Run)
            .where(Run.status == S.QUEUED.value)
            .order_by(Run.priority.desc(), Run.created_at.asc(), Run.id.asc())
        ).all()
    )


def runs_in(session: Session, statuses: Sequence[S | str]) -> list[Run]:
    """Runs in any of ``statuses``, oldest first."""
    wanted = [st.value if isinstance(st, S) else st for st in statuses]
    return list(session.scalars(select(Run).where(Run.status.in_(wanted)).order_by(Run.created_at, Run.id)).all())


def active_runs(session: Session) -> list[Run]:
    return list(session.scalars(select(Run).where(Run.status.in_([S.STARTING.value, S.RUNNING.value]))).all())


def fence(session: Session, *, run_id: str, job_id: str | None) -> bool:
    """A driver's write fence: True when the run is STARTING or RUNNING and (with ``job_id``) its current Ray Job is
    ``job_id``; then the run's row is locked for this transaction (a conditional UPDATE), so a terminal transition or
    a resubmission cannot commit between this check and the driver's writes. False: the driver's attempt has been
    revoked (the run ended, was requeued or runs under another job): it must write nothing and stop."""
    stmt = update(Run).where(Run.id == run_id, Run.status.in_([S.STARTING.value, S.RUNNING.value]))
    if job_id:
        stmt = stmt.where(Run.ray_job_id == job_id)
    result = session.execute(stmt.values(updated_at=utcnow()).execution_options(synchronize_session=False))
    return int(getattr(result, "rowcount", 0) or 0) == 1


def set_reason(session: Session, *, run_id: str, reason: str) -> None:
    """Update the human-readable reason without a state change (e.g. why a run still waits)."""
    run = get_run(session, run_id=run_id)
    if run.status_reason != reason:
        run.status_reason = reason
        run.updated_at = utcnow()


def add_phase(
    session: Session, *, run_id: str, phase: str, actor: str | None = None, as_reason: bool = True
) -> RunEvent:
    """A start-up phase of the run ("queued: needs ...", "starting Ray Job ...", "placing 8 workers", "workers
    ready", "first step"), with the seconds since it was (last) queued: an event of kind ``phase``, and the run's
    reason while it has not trained a step yet (what the progress bar shows)."""
    queued_at = session.scalar(
        select(RunEvent.time)
        .where(RunEvent.run_id == run_id, RunEvent.to_status == S.QUEUED.value)
        .order_by(RunEvent.time.desc(), RunEvent.id.desc())
        .limit(1)
    )
    elapsed = (utcnow() - _aware(queued_at)).total_seconds() if queued_at is not None else None
    text = phase + (f" [+{elapsed:.1f} s since queued]" if elapsed is not None else "")
    run = get_run(session, run_id=run_id)
    if as_reason and not S(run.status).terminal:
        run.status_reason = text
        run.updated_at = utcnow()
    return add_event(session, run_id=run_id, kind="phase", reason=text, actor=actor)


def _aware(t: datetime) -> datetime:
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


def add_event(session: Session, *, run_id: str, kind: str, reason: str, actor: str | None = None) -> RunEvent:
    ev = RunEvent(run_id=run_id, kind=kind, reason=reason, actor=actor)
    session.add(ev)
    session.flush()
    return ev


def list_events(
    session: Session,
    *,
    run_id: str,
    kinds: Sequence[str] | None = None,
    after: tuple[datetime, int] | None = None,
    limit: int | None = None,
    newest_first: bool = False,
) -> list[RunEvent]:
    """The run's events in time order (``newest_first``: reversed), ``kinds`` only, after the keyset ``after``
    (time, id of the previous page's last event), at most ``limit``."""
    stmt = select(RunEvent).where(RunEvent.run_id == run_id)
    if kinds:
        stmt = stmt.where(RunEvent.kind.in_(list(kinds)))
    if after is not None:
        t, key = after
        if newest_first:
            stmt = stmt.where(or_(RunEvent.time < t, and_(RunEvent.time == t, RunEvent.id < key)))
        else:
            stmt = stmt.where(or_(RunEvent.time > t, and_(RunEvent.time == t, RunEvent.id > key)))
    if newest_first:
        stmt = stmt.order_by(RunEvent.time.desc(), RunEvent.id.desc())
    else:
        stmt = stmt.order_by(RunEvent.time.asc(), RunEvent.id.asc())
    if limit:
        stmt = stmt.limit(limit)
    return list(session.scalars(stmt).all())


# --------------------------------------------------------------------------------------------- attempts
def list_attempts(session: Session, *, run_id: str) -> list[RunAttempt]:
    return list(
        session.scalars(select(RunAttempt).where(RunAttempt.run_id == run_id).order_by(RunAttempt.attempt)).all()
    )


# ------------------------------------------------------------------------------------------ checkpoints
def add_checkpoint(
    session: Session, *, run_id: str, attempt: int, step: int, path: str, size_bytes: int | None = None
) -> Checkpoint:
    existing = session.scalar(
        select(Checkpoint).where(Checkpoint.run_id == run_id, Checkpoint.attempt == attempt, Checkpoint.step == step)
    )
    if existing is not None:
        existing.path, existing.size_bytes = path, size_bytes
        return existing
    ck = Checkpoint(run_id=run_id, attempt=attempt, step=step, path=path, size_bytes=size_bytes)
    session.add(ck)
    session.flush()
    return ck


def list_checkpoints(
    session: Session, *, run_id: str, after: tuple[int, int] | None = None, limit: int | None = None
) -> list[Checkpoint]:
    """The run's checkpoints by step (then attempt), after the keyset ``after`` = (step, attempt), at most
    ``limit``."""
    stmt = select(Checkpoint).where(Checkpoint.run_id == run_id)
    if after is not None:
        step, attempt = after
        stmt = stmt.where(or_(Checkpoint.step > step, and_(Checkpoint.step == step, Checkpoint.attempt > attempt)))
    stmt = stmt.order_by(Checkpoint.step, Checkpoint.attempt)
    return list(session.scalars(stmt.limit(limit) if limit else stmt).all())


def checkpoint_exists(path: str) -> bool:
    """A recorded checkpoint is still there: a local directory that exists (Ray Train's ``keep`` prunes older
    ones), or a remote URL (not probed)."""
    return "://" in path or Path(path).exists()


def latest_checkpoint(session: Session, *, run_id: str, existing: bool = True) -> Checkpoint | None:
    """The run's latest checkpoint (by step, then attempt); ``existing``: the latest one still on disk."""
    stmt = (
        select(Checkpoint)
        .where(Checkpoint.run_id == run_id)
        .order_by(Checkpoint.step.desc(), Checkpoint.attempt.desc())
    )
    if not existing:
        return session.scalar(stmt.limit(1))
    return next((c for c in session.scalars(stmt) if checkpoint_exists(c.path)), None)

"""Run database operations: keyword-only functions over a Session. The caller owns the transaction.

The run state machine lives here (``ALLOWED``): every status change goes through ``transition``, which
refuses illegal moves with ``Conflict`` and records a ``run_events`` row with its reason.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import false, func, or_, select, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api.schemas import TERMINAL_STATUSES, RunStatus
from service.models import Checkpoint, Metric, Run, RunAttempt, RunEvent, utcnow

S = RunStatus
ALLOWED: dict[RunStatus, frozenset[RunStatus]] = {
    S.QUEUED: frozenset({S.STARTING, S.CANCELLED, S.FAILED}),
    S.STARTING: frozenset({S.RUNNING, S.SUCCEEDED, S.FAILED, S.CANCELLED, S.QUEUED}),
    S.RUNNING: frozenset({S.SUCCEEDED, S.FAILED, S.CANCELLED}),
    # terminal states only leave through an explicit resume
    S.SUCCEEDED: frozenset(),
    S.FAILED: frozenset({S.QUEUED}),
    S.CANCELLED: frozenset({S.QUEUED}),
}
TERMINAL = TERMINAL_STATUSES

METRIC_FIELDS = ("loss", "tokens_per_s", "step_time_s", "mfu", "peak_memory_bytes", "comm_fraction", "grad_norm",
                 "lr")


class StoreError(Exception):
    code = "store_error"

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class NotFound(StoreError):
    code = "not_found"


class Conflict(StoreError):
    code = "conflict"


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(6)}"


def _as_utc(dt: datetime | None) -> datetime | None:
    if dt is not None and dt.tzinfo is None:
        return dt.replace(tzinfo=timezone.utc)
    return dt


# ------------------------------------------------------------------------------------------------- runs
def find_by_idempotency_key(session: Session, *, model: type = Run, project: str, key: str) -> Any | None:
    """The row of ``model`` (a table with ``project`` and ``idempotency_key`` columns) that this project created
    with this Idempotency-Key, or None."""
    return session.scalar(select(model).where(model.project == project, model.idempotency_key == key))


def create_run(session: Session, *, spec: dict[str, Any], plan: dict[str, Any] | None, project: str = "default",
               name: str | None = None, priority: int = 0, created_by: str | None = None,
               idempotency_key: str | None = None, sweep_id: str | None = None) -> tuple[Run, bool]:
    """Insert a QUEUED run. Returns (run, created). With an idempotency key already used in this project,
    returns the existing run and created=False (a retried POST never makes two runs).

    The insert runs in a SAVEPOINT: when a concurrent request with the same key wins the race, only the savepoint
    is rolled back; the caller's earlier writes in this transaction survive."""
    if idempotency_key:
        existing = find_by_idempotency_key(session, project=project, key=idempotency_key)
        if existing is not None:
            return existing, False
    run = Run(id=new_id("run"), name=name or spec.get("name", "run"), project=project, status=S.QUEUED.value,
              priority=priority, spec=spec, plan=plan, created_by=created_by, idempotency_key=idempotency_key,
              sweep_id=sweep_id, status_reason="waiting for cluster capacity")
    if session.get_bind().dialect.name == "sqlite":
        # pysqlite opens its transaction lazily, on the first INSERT/UPDATE/DELETE. A SAVEPOINT issued before that
        # would itself be the outermost transaction and its RELEASE would COMMIT the caller's work: make sure the
        # real transaction is open first (a no-op UPDATE makes pysqlite emit BEGIN).
        session.execute(text("UPDATE runs SET id = id WHERE 1 = 0"))
    try:
        with session.begin_nested():
            session.add(run)
            session.add(RunEvent(run_id=run.id, kind="state", to_status=S.QUEUED.value, reason="submitted",
                                 actor=created_by))
    except IntegrityError:
        # a concurrent request with the same idempotency key won the race (the savepoint is rolled back)
        if idempotency_key:
            existing = find_by_idempotency_key(session, project=project, key=idempotency_key)
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


def list_runs(session: Session, *, project: str | None = None, status: Sequence[str] | None = None,
              name: str | None = None, sweep_id: str | None = None, limit: int = 50,
              offset: int = 0) -> tuple[list[Run], int]:
    stmt = select(Run)
    if project is not None:
        stmt = stmt.where(Run.project == project)
    if status:
        stmt = stmt.where(Run.status.in_(list(status)))
    if name:
        stmt = stmt.where(Run.name == name)
    if sweep_id:
        stmt = stmt.where(Run.sweep_id == sweep_id)
    total = session.scalar(select(func.count()).select_from(stmt.subquery())) or 0
    rows = session.scalars(stmt.order_by(Run.created_at.desc(), Run.id.desc()).limit(limit).offset(offset)).all()
    return list(rows), int(total)


def queued_runs(session: Session) -> list[Run]:
    """QUEUED runs in admission order: priority high first, FIFO within a priority."""
    return list(session.scalars(select(Run).where(Run.status == S.QUEUED.value)
                                .order_by(Run.priority.desc(), Run.created_at.asc(), Run.id.asc())).all())


def active_runs(session: Session) -> list[Run]:
    return list(session.scalars(select(Run).where(Run.status.in_([S.STARTING.value, S.RUNNING.value]))).all())


def transition(session: Session, *, run_id: str, to: RunStatus | str, reason: str | None = None,
               actor: str | None = None, allow_from: Iterable[RunStatus | str] | None = None,
               **fields: Any) -> Run:
    """Move a run to ``to`` (row-locked), record the event, set timestamps and any extra ``fields``.

    Raises Conflict if the move is not allowed from the current status (or not in ``allow_from``).
    A move to the status the run already has is a no-op that returns the run.
    """
    to = RunStatus(to)
    run = get_run(session, run_id=run_id, lock=True)
    cur = RunStatus(run.status)
    if cur == to and not fields:
        return run
    allowed = ALLOWED[cur] if allow_from is None or cur.value in {RunStatus(s).value for s in allow_from} \
        else frozenset()
    if cur != to and to not in allowed:
        raise Conflict(f"run '{run_id}' is {cur.value}; it cannot become {to.value}", param="status")
    now = utcnow()
    if cur != to:
        run.status = to.value
        run.status_reason = reason
        session.add(RunEvent(run_id=run.id, kind="state", from_status=cur.value, to_status=to.value,
                             reason=reason, actor=actor, time=now))
        if to == S.RUNNING and run.started_at is None:
            run.started_at = now
        if to in TERMINAL:
            run.finished_at = now
        if to == S.QUEUED:
            # a resumed run starts over: no finish time, no summary or node placement of the previous attempt
            # (ray_job_id is overwritten by the next submission)
            run.finished_at = None
            run.summary = None
            run.rank_nodes = None
    for k, v in fields.items():
        setattr(run, k, v)
    run.updated_at = now
    session.flush()
    return run


def set_reason(session: Session, *, run_id: str, reason: str) -> None:
    """Update the human-readable reason without a state change (e.g. why a run still waits)."""
    run = get_run(session, run_id=run_id)
    if run.status_reason != reason:
        run.status_reason = reason
        run.updated_at = utcnow()


def add_event(session: Session, *, run_id: str, kind: str, reason: str, actor: str | None = None) -> RunEvent:
    ev = RunEvent(run_id=run_id, kind=kind, reason=reason, actor=actor)
    session.add(ev)
    session.flush()
    return ev


def list_events(session: Session, *, run_id: str) -> list[RunEvent]:
    return list(session.scalars(select(RunEvent).where(RunEvent.run_id == run_id)
                                .order_by(RunEvent.time.asc(), RunEvent.id.asc())).all())


# --------------------------------------------------------------------------------------------- attempts
def start_attempt(session: Session, *, run_id: str, cause: str, train_run_name: str | None = None) -> RunAttempt:
    """Record a new attempt (1, 2, ...) and bump the run's counter."""
    run = get_run(session, run_id=run_id, lock=True)
    run.attempts = (run.attempts or 0) + 1
    att = RunAttempt(run_id=run_id, attempt=run.attempts, cause=cause, train_run_name=train_run_name)
    session.add(att)
    session.add(RunEvent(run_id=run_id, kind="attempt", reason=f"attempt {run.attempts}: {cause}"))
    session.flush()
    return att


def finish_attempt(session: Session, *, run_id: str, attempt: int, status: str, cause: str | None = None) -> None:
    att = session.scalar(select(RunAttempt).where(RunAttempt.run_id == run_id, RunAttempt.attempt == attempt))
    if att is not None and att.finished_at is None:
        att.status, att.finished_at = status, utcnow()
        if cause:
            att.cause = f"{att.cause}; ended: {cause}" if att.cause else cause


def list_attempts(session: Session, *, run_id: str) -> list[RunAttempt]:
    return list(session.scalars(select(RunAttempt).where(RunAttempt.run_id == run_id)
                                .order_by(RunAttempt.attempt)).all())


# ---------------------------------------------------------------------------------------------- metrics
def json_safe(x: Any) -> Any:
    """``x`` with every non-finite float (NaN, +-inf) replaced by None, recursively through dicts, lists and
    tuples. PostgreSQL rejects NaN inside JSON columns and SQLite silently stores NULL: store None explicitly."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def _insert_for(session: Session):
    name = session.get_bind().dialect.name
    if name == "postgresql":
        return postgresql.insert
    if name == "sqlite":
        return sqlite.insert
    raise RuntimeError(f"unsupported database dialect {name}")


def add_metrics(session: Session, *, run_id: str, attempt: int, rows: Iterable[dict[str, Any]]) -> int:
    """Upsert per-step rows for one attempt (a re-sent step replaces its row: never two rows per
    (run, attempt, step)). Unknown keys go to ``extra``. Returns the number of rows written."""
    values = []
    for r in rows:
        if r.get("step") is None:
            continue
        v: dict[str, Any] = {"run_id": run_id, "attempt": attempt, "step": int(r["step"])}
        for k in METRIC_FIELDS:
            x = json_safe(r.get(k))
            v[k] = int(x) if (k == "peak_memory_bytes" and x is not None) else x
        t = r.get("time")
        v["time"] = datetime.fromtimestamp(t, timezone.utc) if isinstance(t, (int, float)) else (t or utcnow())
        extra = {k: x for k, x in r.items() if k not in METRIC_FIELDS and k not in ("step", "time", "attempt")}
        v["extra"] = json_safe(extra) or None
        values.append(v)
    if not values:
        return 0
    # one row per step (the last wins: a single INSERT .. ON CONFLICT may not touch a row twice), in step order
    # (concurrent writers then lock rows in the same order and cannot deadlock on PostgreSQL)
    values = sorted({v["step"]: v for v in values}.values(), key=lambda v: v["step"])
    insert = _insert_for(session)
    stmt = insert(Metric).values(values)
    stmt = stmt.on_conflict_do_update(
        index_elements=["run_id", "attempt", "step"],
        set_={k: getattr(stmt.excluded, k) for k in (*METRIC_FIELDS, "time", "extra")})
    session.execute(stmt)
    return len(values)


def list_metrics(session: Session, *, run_id: str, since_step: int = 0, attempt: int | None = None,
                 limit: int | None = None) -> list[Metric]:
    """The run's metric history as one continuous series: every step exactly once, in step order.

    An attempt that resumed from a checkpoint starts recording at the step after it; from that step on, rows
    of EARLIER attempts belong to an abandoned trajectory and are hidden (even steps the new attempt has not
    reached yet), so replayed steps replace the lost ones. ``since_step`` is exclusive; ``attempt`` returns
    one attempt's raw rows."""
    stmt = select(Metric).where(Metric.run_id == run_id, Metric.step > since_step)
    if attempt is not None:
        stmt = stmt.where(Metric.attempt == attempt).order_by(Metric.step)
        if limit:
            stmt = stmt.limit(limit)
        return list(session.scalars(stmt).all())
    first_step = dict(session.execute(select(Metric.attempt, func.min(Metric.step)).where(Metric.run_id == run_id)
                                      .group_by(Metric.attempt)).tuples().all())
    current: list[Any] = []
    resumed_at: int | None = None  # first step recorded by any later attempt
    for a in sorted(first_step, reverse=True):
        current.append((Metric.attempt == a) & (Metric.step < resumed_at) if resumed_at is not None
                       else Metric.attempt == a)
        resumed_at = first_step[a] if resumed_at is None else min(resumed_at, first_step[a])
    latest = (select(Metric.step, func.max(Metric.attempt).label("attempt"))
              .where(Metric.run_id == run_id, Metric.step > since_step, or_(false(), *current))
              .group_by(Metric.step).subquery())
    stmt = (select(Metric).join(latest, (Metric.step == latest.c.step) & (Metric.attempt == latest.c.attempt))
            .where(Metric.run_id == run_id).order_by(Metric.step))
    if limit:
        stmt = stmt.limit(limit)
    return list(session.scalars(stmt).all())


def summarize_metrics(session: Session, *, run_id: str, warmup_steps: int = 0) -> dict[str, Any]:
    """Steps done, final loss, mean tokens/s and MFU (excluding warm-up steps), max peak memory."""
    rows = list_metrics(session, run_id=run_id)
    if not rows:
        return {"steps_done": 0}
    steady = [r for r in rows if r.step > warmup_steps] or rows
    tps = [r.tokens_per_s for r in steady if r.tokens_per_s is not None]
    mfu = [r.mfu for r in steady if r.mfu is not None]
    return json_safe({"steps_done": rows[-1].step, "final_loss": rows[-1].loss,
                      "mean_tokens_per_s": sum(tps) / len(tps) if tps else None,
                      "mean_mfu": sum(mfu) / len(mfu) if mfu else None,
                      "peak_memory_bytes": max((r.peak_memory_bytes or 0) for r in rows) or None})


# ------------------------------------------------------------------------------------------ checkpoints
def add_checkpoint(session: Session, *, run_id: str, attempt: int, step: int, path: str,
                   size_bytes: int | None = None) -> Checkpoint:
    existing = session.scalar(select(Checkpoint).where(Checkpoint.run_id == run_id, Checkpoint.attempt == attempt,
                                                       Checkpoint.step == step))
    if existing is not None:
        existing.path, existing.size_bytes = path, size_bytes
        return existing
    ck = Checkpoint(run_id=run_id, attempt=attempt, step=step, path=path, size_bytes=size_bytes)
    session.add(ck)
    session.flush()
    return ck


def list_checkpoints(session: Session, *, run_id: str) -> list[Checkpoint]:
    return list(session.scalars(select(Checkpoint).where(Checkpoint.run_id == run_id)
                                .order_by(Checkpoint.step, Checkpoint.attempt)).all())


def latest_checkpoint(session: Session, *, run_id: str) -> Checkpoint | None:
    return session.scalar(select(Checkpoint).where(Checkpoint.run_id == run_id)
                          .order_by(Checkpoint.step.desc(), Checkpoint.attempt.desc()).limit(1))

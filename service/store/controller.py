"""The run controller: the one owner of run, attempt, sweep and trial state.

Every change of a run's, an attempt's, a sweep's or a trial's status happens in this module and nowhere else
(``tests/service/test_state_owner.py`` scans ``service/`` and ``workers/`` for any other write). The scheduler, the
drivers' lifecycle, recovery, the runtime, submission and the sweeps ask for a transition with a reason and get a
``TransitionResult``: applied (the status moved, or already was the one asked for) or refused with why. A refusal is
a value to branch on, not an exception. Each request is decided first (``decide``, a pure function of the current
status, the wanted one and the transition table) and then acted on: the status, its reason, timestamps, any extra
fields and one event row (``run_events`` / ``sweep_events``) written in the caller's transaction and flushed.

Where a refusal is itself the answer (an HTTP 409, a test of the state machine), the caller uses
``TransitionResult.or_raise`` (``Conflict``) or the strict forms ``transition``, ``transition_sweep`` and
``transition_trial``.

The transition tables below are the only ones. The state diagrams in docs/architecture.md are rendered from them
(``render_diagram``; a test fails when the document differs; ``write_diagrams`` rewrites them).
Keyword-only functions over a Session; the caller owns the transaction.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from sqlalchemy import select
from sqlalchemy.orm import Session

from api.spec import RunStatus
from service.errors import Conflict
from service.store.models import Run, RunAttempt, RunEvent, Sweep, SweepEvent, Trial, utcnow
from service.store.runs import get_run

S = RunStatus

# ------------------------------------------------------------------------------------------ the tables
RUN_INITIAL = S.QUEUED
RUN_TRANSITIONS: dict[RunStatus, frozenset[RunStatus]] = {
    S.QUEUED: frozenset({S.STARTING, S.CANCELLED, S.FAILED}),
    S.STARTING: frozenset({S.RUNNING, S.SUCCEEDED, S.FAILED, S.CANCELLED, S.QUEUED, S.PREEMPTED}),
    # RUNNING -> QUEUED: its Ray head or its driver was lost and the service requeues it to resume (control.recovery)
    S.RUNNING: frozenset({S.SUCCEEDED, S.FAILED, S.CANCELLED, S.PREEMPTED, S.QUEUED}),
    # preempted (a notice or a higher-priority run): checkpointed, then straight back to the queue
    S.PREEMPTED: frozenset({S.QUEUED, S.FAILED, S.CANCELLED}),
    # terminal states only leave through an explicit resume
    S.SUCCEEDED: frozenset(),
    S.FAILED: frozenset({S.QUEUED}),
    S.CANCELLED: frozenset({S.QUEUED}),
}


class SweepStatus:
    QUEUED = "QUEUED"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    ALL = ("QUEUED", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED")
    TERMINAL = frozenset({"SUCCEEDED", "FAILED", "CANCELLED"})


class TrialStatus:
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    EARLY_STOPPED = "EARLY_STOPPED"
    SKIPPED = "SKIPPED"
    CANCELLED = "CANCELLED"
    ALL = ("PENDING", "RUNNING", "SUCCEEDED", "FAILED", "EARLY_STOPPED", "SKIPPED", "CANCELLED")
    TERMINAL = frozenset({"SUCCEEDED", "FAILED", "EARLY_STOPPED", "SKIPPED", "CANCELLED"})
    MEASURED = frozenset({"SUCCEEDED", "EARLY_STOPPED"})


# a sweep: a QUEUED sweep may also fail (its driver was lost) or be cancelled; terminal states never change
SWEEP_TRANSITIONS: dict[str, frozenset[str]] = {
    SweepStatus.QUEUED: frozenset({SweepStatus.RUNNING, SweepStatus.FAILED, SweepStatus.CANCELLED}),
    SweepStatus.RUNNING: frozenset({SweepStatus.SUCCEEDED, SweepStatus.FAILED, SweepStatus.CANCELLED}),
    SweepStatus.SUCCEEDED: frozenset(),
    SweepStatus.FAILED: frozenset(),
    SweepStatus.CANCELLED: frozenset(),
}
# a trial is created PENDING or SKIPPED (with the reason); a PENDING trial may also be CANCELLED or FAILED (the sweep
# ended before it ran); only a running trial stops early; terminal states never change
TRIAL_INITIAL = frozenset({TrialStatus.PENDING, TrialStatus.SKIPPED})
TRIAL_TRANSITIONS: dict[str, frozenset[str]] = {
    TrialStatus.PENDING: frozenset({TrialStatus.RUNNING, TrialStatus.CANCELLED, TrialStatus.FAILED}),
    TrialStatus.RUNNING: frozenset(
        {TrialStatus.SUCCEEDED, TrialStatus.FAILED, TrialStatus.EARLY_STOPPED, TrialStatus.CANCELLED}
    ),
    **{s: frozenset() for s in TrialStatus.TERMINAL},
}

_PROTECTED_FIELDS = frozenset({"status", "finished_at", "started_at", "attempts"})

# ------------------------------------------------------------------------------------------ the result
Subject = TypeVar("Subject", Run, Sweep, Trial)


@dataclass(frozen=True)
class TransitionResult(Generic[Subject]):
    """The answer to one transition request. ``applied``: the subject is now in ``to`` (it moved, or already was
    there: an idempotent repeat, see ``changed``); else ``refused_reason`` says why nothing was written."""

    applied: bool
    subject: Subject
    from_: str
    to: str
    refused_reason: str | None = None

    @property
    def changed(self) -> bool:
        """The status moved (False for a refusal and for a repeat of the status it had)."""
        return self.applied and self.from_ != self.to

    def or_raise(self) -> Subject:
        """The subject, or ``Conflict`` (409) with the refusal: for callers whose answer the refusal is."""
        if not self.applied:
            raise Conflict(self.refused_reason or f"cannot become {self.to}", param="status")
        return self.subject


# ------------------------------------------------------------------------------------------ decide
def decide(table: Mapping[Any, frozenset[Any]], cur: str, to: str, *, allow_from: Iterable[Any] | None = None) -> bool:
    """Whether ``cur -> to`` may happen (pure): a repeat of the current status always may (it changes nothing); a
    move must be in ``table`` and, with ``allow_from``, start from one of those statuses."""
    if cur == to:
        return True
    if allow_from is not None and cur not in _values(allow_from):
        return False
    return to in _moves(table, cur)


def _moves(table: Mapping[Any, frozenset[Any]], cur: str) -> set[str]:
    """Where ``cur`` may go in ``table`` (its keys are ``RunStatus`` members or plain strings)."""
    return next(_values(v) for k, v in table.items() if str(getattr(k, "value", k)) == cur)


def _values(statuses: Iterable[Any]) -> set[str]:
    """Plain status strings (a ``RunStatus`` is a str enum: its ``str()`` is not its value)."""
    return {str(getattr(s, "value", s)) for s in statuses}


def _check_fields(fields: Mapping[str, Any]) -> None:
    bad = sorted(_PROTECTED_FIELDS & set(fields))
    if bad:
        raise ValueError(f"{', '.join(bad)} change only through the transition itself, not as extra fields")


# ------------------------------------------------------------------------------------------ runs
def request_run(
    session: Session,
    *,
    run_id: str,
    to: RunStatus | str,
    reason: str | None = None,
    actor: str | None = None,
    allow_from: Iterable[RunStatus | str] | None = None,
    **fields: Any,
) -> TransitionResult[Run]:
    """Move a run to ``to`` (its row locked and re-read first), with the event, timestamps and any extra
    ``fields``; refused when the table (or ``allow_from``) forbids it. Asking for the status it has sets only the
    ``fields``. NotFound when there is no such run."""
    _check_fields(fields)
    to = RunStatus(to)
    run = get_run(session, run_id=run_id, lock=True)
    cur = RunStatus(run.status)
    if not decide(RUN_TRANSITIONS, cur.value, to.value, allow_from=allow_from):
        why = f"run '{run_id}' is {cur.value}; it cannot become {to.value}"
        return TransitionResult(False, run, cur.value, to.value, why)
    if cur == to and not fields:
        return TransitionResult(True, run, cur.value, to.value)
    now = utcnow()
    if cur != to:
        run.status = to.value
        run.status_reason = reason
        session.add(
            RunEvent(
                run_id=run.id,
                kind="state",
                from_status=cur.value,
                to_status=to.value,
                reason=reason,
                actor=actor,
                time=now,
            )
        )
        if to == S.RUNNING and run.started_at is None:
            run.started_at = now
        if to.terminal:
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
    return TransitionResult(True, run, cur.value, to.value)


def end_run(
    session: Session,
    *,
    run_id: str,
    to: RunStatus | str,
    reason: str,
    actor: str | None = None,
    attempt_cause: str | None = None,
    allow_from: Iterable[RunStatus | str] | None = None,
    **fields: Any,
) -> TransitionResult[Run]:
    """Move a run to a terminal status and end its current attempt with the same status; a failed or cancelled
    attempt records ``attempt_cause`` (default: the reason) as its end."""
    to = RunStatus(to)
    if not to.terminal:
        raise ValueError(f"end_run needs a terminal status, not {to.value}")
    res = request_run(session, run_id=run_id, to=to, reason=reason, actor=actor, allow_from=allow_from, **fields)
    if res.applied and res.subject.attempts:
        cause = None if to == S.SUCCEEDED else (attempt_cause or reason)[:500]
        end_attempt(session, run_id=run_id, attempt=res.subject.attempts, status=to, cause=cause)
    return res


def requeue_run(
    session: Session,
    *,
    run_id: str,
    reason: str,
    actor: str | None = None,
    allow_from: Iterable[RunStatus | str] | None = None,
    attempt: int | None = None,
    attempt_status: RunStatus = S.FAILED,
    attempt_cause: str | None = None,
    preempted_reason: str | None = None,
    **fields: Any,
) -> TransitionResult[Run]:
    """Back to QUEUED (to resume) with its current attempt (``attempt``, default the run's latest) ended
    ``attempt_status`` with ``attempt_cause``. ``preempted_reason``: through PREEMPTED first with that reason (a
    preemption: ``allow_from`` then applies to that first move). The result names the status it left."""
    first = request_run(
        session,
        run_id=run_id,
        to=S.PREEMPTED if preempted_reason is not None else S.QUEUED,
        reason=preempted_reason if preempted_reason is not None else reason,
        actor=actor,
        allow_from=allow_from,
        **({} if preempted_reason is not None else fields),
    )
    if not first.changed:
        return first
    res = first
    if preempted_reason is not None:
        res = request_run(session, run_id=run_id, to=S.QUEUED, reason=reason, actor=actor, **fields)
    n = attempt if attempt is not None else first.subject.attempts
    if n:
        end_attempt(session, run_id=run_id, attempt=n, status=attempt_status, cause=attempt_cause)
    return TransitionResult(res.applied, res.subject, first.from_, S.QUEUED.value, res.refused_reason)


def transition(
    session: Session,
    *,
    run_id: str,
    to: RunStatus | str,
    reason: str | None = None,
    actor: str | None = None,
    allow_from: Iterable[RunStatus | str] | None = None,
    **fields: Any,
) -> Run:
    """``request_run`` that raises ``Conflict`` when refused (a 409 to the caller) and returns the run."""
    res = request_run(session, run_id=run_id, to=to, reason=reason, actor=actor, allow_from=allow_from, **fields)
    return res.or_raise()


# ------------------------------------------------------------------------------------------ attempts
def start_attempt(session: Session, *, run_id: str, cause: str, train_run_name: str | None = None) -> RunAttempt:
    """Record a new attempt (1, 2, ...) and bump the run's counter."""
    run = get_run(session, run_id=run_id, lock=True)
    run.attempts = (run.attempts or 0) + 1
    att = RunAttempt(run_id=run_id, attempt=run.attempts, cause=cause, train_run_name=train_run_name)
    session.add(att)
    session.add(RunEvent(run_id=run_id, kind="attempt", reason=f"attempt {run.attempts}: {cause}"))
    session.flush()
    return att


def end_attempt(
    session: Session, *, run_id: str, attempt: int, status: RunStatus | str, cause: str | None = None
) -> bool:
    """End an attempt with ``status`` (and ``cause`` appended to why it started); False when it had ended already
    or does not exist (an attempt ends once)."""
    att = session.scalar(select(RunAttempt).where(RunAttempt.run_id == run_id, RunAttempt.attempt == attempt))
    if att is None or att.finished_at is not None:
        return False
    att.status, att.finished_at = RunStatus(status).value, utcnow()
    if cause:
        att.cause = f"{att.cause}; ended: {cause}" if att.cause else cause
    return True


# ------------------------------------------------------------------------------------------ sweeps and trials
def request_sweep(
    session: Session, *, sweep: Sweep, to: str, reason: str, actor: str | None = None, **fields: Any
) -> TransitionResult[Sweep]:
    """Move ``sweep`` to ``to`` with the event, its reason, timestamps and any extra ``fields``; refused when the
    table forbids it. Asking for the status it has sets only the ``fields``."""
    _check_fields(fields)
    cur = sweep.status
    if not decide(SWEEP_TRANSITIONS, cur, to):
        return TransitionResult(False, sweep, cur, to, f"sweep '{sweep.id}' is {cur}; it cannot become {to}")
    now = utcnow()
    if to != cur:
        sweep.status, sweep.status_reason = to, reason
        session.add(SweepEvent(sweep_id=sweep.id, from_status=cur, to_status=to, reason=reason, actor=actor, time=now))
        if to in SweepStatus.TERMINAL:
            sweep.finished_at = now
    for k, v in fields.items():
        setattr(sweep, k, v)
    sweep.updated_at = now
    session.flush()
    return TransitionResult(True, sweep, cur, to)


def request_trial(
    session: Session, *, trial: Trial, to: str, reason: str | None, actor: str | None = None
) -> TransitionResult[Trial]:
    """Move ``trial`` to ``to`` with ``reason`` on the trial (None clears it) and the event; refused when the table
    forbids it. Asking for the status it has sets only the reason."""
    cur = trial.status
    if not decide(TRIAL_TRANSITIONS, cur, to):
        why = f"trial {trial.id} of sweep '{trial.sweep_id}' is {cur}; it cannot become {to}"
        return TransitionResult(False, trial, cur, to, why)
    if to != cur:
        session.add(
            SweepEvent(
                sweep_id=trial.sweep_id, trial_id=trial.id, from_status=cur, to_status=to, reason=reason, actor=actor
            )
        )
    trial.status, trial.reason = to, reason
    session.flush()
    return TransitionResult(True, trial, cur, to)


def transition_sweep(
    session: Session, *, sweep: Sweep, to: str, reason: str, actor: str | None = None, **fields: Any
) -> Sweep:
    """``request_sweep`` that raises ``Conflict`` when refused."""
    return request_sweep(session, sweep=sweep, to=to, reason=reason, actor=actor, **fields).or_raise()


def transition_trial(session: Session, *, trial: Trial, to: str, reason: str | None, actor: str | None = None) -> Trial:
    """``request_trial`` that raises ``Conflict`` when refused."""
    return request_trial(session, trial=trial, to=to, reason=reason, actor=actor).or_raise()


# ------------------------------------------------------------------------------------------ the diagrams
_TABLES: dict[str, tuple[tuple[str, ...], tuple[str, ...], Mapping[Any, frozenset[Any]], frozenset[str]]] = {
    "run": (
        tuple(s.value for s in RunStatus),
        (RUN_INITIAL.value,),
        RUN_TRANSITIONS,
        frozenset(s.value for s in RunStatus if s.terminal),
    ),
    "sweep": (SweepStatus.ALL, (SweepStatus.QUEUED,), SWEEP_TRANSITIONS, SweepStatus.TERMINAL),
    "trial": (
        TrialStatus.ALL,
        tuple(s for s in TrialStatus.ALL if s in TRIAL_INITIAL),
        TRIAL_TRANSITIONS,
        TrialStatus.TERMINAL,
    ),
}
DIAGRAMS = tuple(_TABLES)


def render_diagram(kind: str) -> str:
    """The state diagram of ``kind`` (run, sweep, trial) as a mermaid block, rendered from its transition table:
    ``[*] -->`` its initial states, every allowed move, ``--> [*]`` its terminal states."""
    states, initial, table, terminal = _TABLES[kind]
    lines = ["```mermaid", "stateDiagram-v2"]
    lines += [f"    [*] --> {s}" for s in initial]
    for cur in states:
        targets = _moves(table, cur)
        lines += [f"    {cur} --> {to}" for to in states if to in targets]
    lines += [f"    {s} --> [*]" for s in states if s in terminal]
    return "\n".join([*lines, "```"])


def _marker(kind: str, end: bool) -> str:
    return f"<!-- state-diagram:{kind} {'end' if end else 'begin'} (generated from service/store/controller.py) -->"


def _literal(block: str) -> Callable[[re.Match[str]], str]:
    """A ``re.sub`` replacement that inserts ``block`` as it is (no backslash or group escapes)."""
    return lambda _m: block


def with_diagrams(text: str) -> str:
    """``text`` (docs/architecture.md) with the block between each kind's markers replaced by its rendering."""
    for kind in DIAGRAMS:
        begin, end = re.escape(_marker(kind, False)), re.escape(_marker(kind, True))
        block = f"{_marker(kind, False)}\n{render_diagram(kind)}\n{_marker(kind, True)}"
        text, n = re.subn(f"{begin}.*?{end}", _literal(block), text, flags=re.S)
        if n != 1:
            raise ValueError(f"expected one '{kind}' state diagram between its markers, found {n}")
    return text


def write_diagrams(path: str | Path = "docs/architecture.md") -> None:
    """Rewrite the state diagrams in ``path`` from the tables (``python -c "from service.store.controller import
    write_diagrams; write_diagrams()"`` from the repository root)."""
    doc = Path(path)
    doc.write_text(with_diagrams(doc.read_text()))

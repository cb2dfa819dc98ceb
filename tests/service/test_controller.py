"""The run controller (``service.store.controller``) on SQLite and PostgreSQL: typed results for allowed, refused,
terminal and repeated requests, and what each writes (or does not) in the database."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select, text

from api.spec import RunStatus
from service import store
from service.errors import Conflict
from service.store import controller, migrate
from service.store.controller import (
    RUN_TRANSITIONS,
    SWEEP_TRANSITIONS,
    TRIAL_TRANSITIONS,
    SweepStatus,
    TrialStatus,
    decide,
)
from service.store.db import make_engine, make_sessionmaker, session_scope
from service.store.models import Base, RunAttempt, RunEvent, Sweep, SweepEvent, Trial
from tests.service.pg import postgres_database


@pytest.fixture(scope="module")
def _pg_url():
    with postgres_database("meshrun_test_controller") as url:
        migrate.upgrade(url)
        yield url


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def factory(request, tmp_path):
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'c.db'}"
        migrate.upgrade(url)
    else:
        url = request.getfixturevalue("_pg_url")
    engine = make_engine(url)
    if request.param == "postgresql":
        with engine.begin() as conn:
            conn.execute(text(f"TRUNCATE {', '.join(t.name for t in Base.metadata.sorted_tables)} CASCADE"))
    yield make_sessionmaker(engine)
    engine.dispose()


def _run(factory, *path: str) -> str:
    """A new run, moved along ``path`` (each move must be applied)."""
    with session_scope(factory) as s:
        run, _ = store.create_run(s, spec={"name": "r"}, plan=None)
        for to in path:
            assert controller.request_run(s, run_id=run.id, to=to, reason=f"to {to}", actor="test").changed
        return run.id


def _events(factory, run_id: str) -> list[tuple[str | None, str | None, str | None]]:
    with session_scope(factory) as s:
        rows = s.execute(
            select(RunEvent.from_status, RunEvent.to_status, RunEvent.reason)
            .where(RunEvent.run_id == run_id, RunEvent.kind == "state")
            .order_by(RunEvent.time, RunEvent.id)
        ).all()
    return [tuple(r) for r in rows]


def _status(factory, run_id: str) -> str:
    with session_scope(factory) as s:
        return store.get_run(s, run_id=run_id).status


# ----------------------------------------------------------------------------------------------- runs
def test_an_allowed_request_is_applied_and_stored_with_its_event(factory):
    rid = _run(factory)
    with session_scope(factory) as s:
        res = controller.request_run(s, run_id=rid, to=RunStatus.STARTING, reason="admitted", actor="scheduler",
                                     ray_job_id="meshrun-x-1")
        assert (res.applied, res.changed, res.from_, res.to, res.refused_reason) == (
            True, True, "QUEUED", "STARTING", None)
        assert res.subject.id == rid
    with session_scope(factory) as s:
        run = store.get_run(s, run_id=rid)
        assert (run.status, run.status_reason, run.ray_job_id) == ("STARTING", "admitted", "meshrun-x-1")
        ev = s.scalar(select(RunEvent).where(RunEvent.run_id == rid, RunEvent.to_status == "STARTING"))
        assert (ev.from_status, ev.reason, ev.actor) == ("QUEUED", "admitted", "scheduler")


def test_a_refused_request_writes_nothing_and_says_why(factory):
    rid = _run(factory)
    with session_scope(factory) as s:
        res = controller.request_run(s, run_id=rid, to="RUNNING", reason="skip a step", ray_job_id="job-9")
        assert not res.applied and not res.changed
        assert (res.from_, res.to) == ("QUEUED", "RUNNING")
        assert res.refused_reason == f"run '{rid}' is QUEUED; it cannot become RUNNING"
        with pytest.raises(Conflict, match="is QUEUED; it cannot become RUNNING") as ei:
            res.or_raise()
        assert ei.value.status_code == 409
    with session_scope(factory) as s:
        run = store.get_run(s, run_id=rid)
        assert (run.status, run.ray_job_id) == ("QUEUED", None)  # not even the extra fields
    assert _events(factory, rid) == [(None, "QUEUED", "submitted")]


def test_allow_from_refuses_a_move_the_table_allows(factory):
    rid = _run(factory, "STARTING", "RUNNING")
    with session_scope(factory) as s:  # RUNNING -> QUEUED is in the table, but not from RUNNING when only STARTING
        res = controller.request_run(s, run_id=rid, to="QUEUED", reason="retry", allow_from=[RunStatus.STARTING])
        assert not res.applied and res.from_ == "RUNNING"
    assert _status(factory, rid) == "RUNNING"


def test_terminal_states_are_refused_except_an_explicit_resume(factory):
    rid = _run(factory, "STARTING", "RUNNING", "SUCCEEDED")
    with session_scope(factory) as s:
        for to in RunStatus:
            if to == RunStatus.SUCCEEDED:
                continue
            res = controller.request_run(s, run_id=rid, to=to, reason="again")
            assert not res.applied and res.refused_reason and "is SUCCEEDED" in res.refused_reason
    failed = _run(factory, "FAILED")
    with session_scope(factory) as s:
        assert not controller.end_run(s, run_id=failed, to="CANCELLED", reason="late cancel").applied
        res = controller.request_run(s, run_id=failed, to="QUEUED", reason="resumed", allow_from=["FAILED"])
        assert res.changed and res.subject.finished_at is None  # a resumed run starts over


def test_a_repeated_request_is_applied_without_a_second_event(factory):
    rid = _run(factory, "CANCELLED")
    with session_scope(factory) as s:
        res = controller.request_run(s, run_id=rid, to="CANCELLED", reason="cancelled twice")
        assert res.applied and not res.changed and res.refused_reason is None
        assert res.subject.status_reason == "to CANCELLED"  # the first reason stays
    assert [e[1] for e in _events(factory, rid)] == ["QUEUED", "CANCELLED"]


def test_end_run_ends_the_current_attempt_once(factory):
    rid = _run(factory, "STARTING", "RUNNING")
    with session_scope(factory) as s:
        controller.start_attempt(s, run_id=rid, cause="start")
        res = controller.end_run(s, run_id=rid, to="FAILED", reason="worker died: OOM", attempt_cause="OOM",
                                 summary={"steps_done": 3})
        assert res.changed and res.subject.finished_at is not None and res.subject.summary == {"steps_done": 3}
    with session_scope(factory) as s:
        att = s.scalar(select(RunAttempt).where(RunAttempt.run_id == rid))
        assert (att.status, att.cause) == ("FAILED", "start; ended: OOM")
        first_end = att.finished_at
        again = controller.end_run(s, run_id=rid, to="FAILED", reason="driver lost")
        assert again.applied and not again.changed
        assert not controller.end_attempt(s, run_id=rid, attempt=1, status="CANCELLED")  # an attempt ends once
    with session_scope(factory) as s:
        att = s.scalar(select(RunAttempt).where(RunAttempt.run_id == rid))
        assert (att.status, att.cause, att.finished_at) == ("FAILED", "start; ended: OOM", first_end)
    with pytest.raises(ValueError, match="terminal"):
        with session_scope(factory) as s:
            controller.end_run(s, run_id=rid, to="QUEUED", reason="not an end")


def test_requeue_after_preemption_goes_through_preempted(factory):
    rid = _run(factory, "STARTING", "RUNNING")
    with session_scope(factory) as s:
        controller.start_attempt(s, run_id=rid, cause="start")
        res = controller.requeue_run(s, run_id=rid, reason="back in the queue", preempted_reason="notice",
                                     allow_from=["RUNNING", "STARTING"], attempt_status=RunStatus.PREEMPTED,
                                     attempt_cause="notice", resume_from="/ck/10")
        assert (res.applied, res.changed, res.from_, res.to) == (True, True, "RUNNING", "QUEUED")
        assert res.subject.resume_from == "/ck/10"
    assert _events(factory, rid)[-2:] == [("RUNNING", "PREEMPTED", "notice"), ("PREEMPTED", "QUEUED",
                                                                                "back in the queue")]
    with session_scope(factory) as s:
        assert s.scalar(select(RunAttempt.status).where(RunAttempt.run_id == rid)) == "PREEMPTED"
    cancelled = _run(factory, "CANCELLED")
    with session_scope(factory) as s:  # a cancel wins over a late preemption
        res = controller.requeue_run(s, run_id=cancelled, reason="back", preempted_reason="notice",
                                     allow_from=["RUNNING", "STARTING"])
        assert not res.applied and res.to == "PREEMPTED"
    assert _status(factory, cancelled) == "CANCELLED"


def test_status_and_timestamps_cannot_ride_along_as_fields(factory):
    rid = _run(factory)
    for field in ("status", "finished_at", "attempts"):
        with pytest.raises(ValueError, match="change only through the transition"):
            with session_scope(factory) as s:
                controller.request_run(s, run_id=rid, to="STARTING", reason="x", **{field: None})
    assert _status(factory, rid) == "QUEUED"


def test_unknown_run_is_not_found(factory):
    with pytest.raises(store.NotFound):
        with session_scope(factory) as s:
            controller.request_run(s, run_id="run-nope", to="CANCELLED", reason="x")


# ----------------------------------------------------------------------------------------- sweeps, trials
def _sweep(factory) -> tuple[str, int]:
    with session_scope(factory) as s:
        sweep = Sweep(id=store.new_id("sweep"), name="sw", spec={}, status=SweepStatus.QUEUED)
        s.add(sweep)
        s.flush()
        trial = Trial(sweep_id=sweep.id, layout={"dp": 1}, micro_batch_size=1, status=TrialStatus.PENDING)
        s.add(trial)
        s.flush()
        return sweep.id, trial.id


def test_sweep_and_trial_requests_are_typed_and_stored(factory):
    sweep_id, trial_id = _sweep(factory)
    with session_scope(factory) as s:
        sweep, trial = s.get(Sweep, sweep_id), s.get(Trial, trial_id)
        early = controller.request_sweep(s, sweep=sweep, to=SweepStatus.SUCCEEDED, reason="too early")
        assert not early.applied and early.refused_reason == f"sweep '{sweep_id}' is QUEUED; it cannot become SUCCEEDED"
        stop = controller.request_trial(s, trial=trial, to=TrialStatus.EARLY_STOPPED, reason="never ran")
        assert not stop.applied and "is PENDING; it cannot become EARLY_STOPPED" in (stop.refused_reason or "")
        assert controller.request_sweep(s, sweep=sweep, to=SweepStatus.RUNNING, reason="driver", ray_job_id="j").changed
        assert controller.request_trial(s, trial=trial, to=TrialStatus.RUNNING, reason=None).changed
        done = controller.request_sweep(s, sweep=sweep, to=SweepStatus.CANCELLED, reason="user")
        assert done.changed and done.subject.finished_at is not None
        again = controller.request_sweep(s, sweep=sweep, to=SweepStatus.CANCELLED, reason="user again")
        assert again.applied and not again.changed
        with pytest.raises(Conflict):
            controller.transition_sweep(s, sweep=sweep, to=SweepStatus.RUNNING, reason="revive")
    with session_scope(factory) as s:
        moves = s.execute(select(SweepEvent.trial_id, SweepEvent.from_status, SweepEvent.to_status)
                          .where(SweepEvent.sweep_id == sweep_id).order_by(SweepEvent.id)).all()
        assert [tuple(m) for m in moves] == [(None, "QUEUED", "RUNNING"), (trial_id, "PENDING", "RUNNING"),
                                             (None, "RUNNING", "CANCELLED")]
        assert s.scalar(select(func.count()).select_from(SweepEvent)) == 3


# ------------------------------------------------------------------------------------------ decide (pure)
@pytest.mark.parametrize("table", [RUN_TRANSITIONS, SWEEP_TRANSITIONS, TRIAL_TRANSITIONS])
def test_decide_is_the_table(table):
    states = [str(getattr(k, "value", k)) for k in table]
    for cur_key, moves in table.items():
        cur = str(getattr(cur_key, "value", cur_key))
        allowed = {str(getattr(m, "value", m)) for m in moves}
        for to in states:
            assert decide(table, cur, to) == (to == cur or to in allowed), (cur, to)
            assert decide(table, cur, to, allow_from=[]) == (to == cur)

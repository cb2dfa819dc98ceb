"""service.store on SQLite and PostgreSQL: state machine, metric upserts, and concurrent writers (threads, one
session each) that must never lose or duplicate a run, a transition or a metric row."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import func, select, text

from service.store import migrate
from service import store
from service.store import runs as store_runs
from service.store.db import make_engine, make_sessionmaker, session_scope
from service.store.models import Base, Metric, Run, RunEvent
from tests.service.pg import postgres_database

THREADS = 8


@pytest.fixture(scope="module")
def _pg_url():
    with postgres_database("meshrun_test_store") as url:
        migrate.upgrade(url)
        yield url


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def factory(request, tmp_path):
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 's.db'}"
        migrate.upgrade(url)
    else:
        url = request.getfixturevalue("_pg_url")
    engine = make_engine(url)
    if request.param == "postgresql":
        with engine.begin() as conn:
            conn.execute(text(f"TRUNCATE {', '.join(t.name for t in Base.metadata.sorted_tables)} CASCADE"))
    yield make_sessionmaker(engine)
    engine.dispose()


def _run(factory, **kw) -> str:
    with session_scope(factory) as s:
        run, _ = store.create_run(s, spec={"name": "r"}, plan=None, **kw)
        return run.id


def _parallel(n: int, fn: Callable[[int], object]) -> list[object]:
    barrier = threading.Barrier(n)

    def go(i: int) -> object:
        barrier.wait()
        try:
            return fn(i)
        except Exception as e:  # noqa: BLE001 - returned for the assertions
            return e

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(go, range(n)))


# ----------------------------------------------------------------------------------------- state machine
def test_transitions_follow_the_state_machine(factory):
    rid = _run(factory)
    with session_scope(factory) as s:
        with pytest.raises(store.Conflict):
            store.transition(s, run_id=rid, to="RUNNING")  # QUEUED cannot jump to RUNNING
    with session_scope(factory) as s:
        store.transition(s, run_id=rid, to="STARTING", reason="admitted")
        store.transition(s, run_id=rid, to="RUNNING")
        run = store.transition(s, run_id=rid, to="SUCCEEDED")
        assert run.started_at is not None and run.finished_at is not None
    with session_scope(factory) as s:
        with pytest.raises(store.Conflict):
            store.transition(s, run_id=rid, to="QUEUED")  # SUCCEEDED is final
        kinds = [(e.from_status, e.to_status) for e in store.list_events(s, run_id=rid)]
    assert kinds == [(None, "QUEUED"), ("QUEUED", "STARTING"), ("STARTING", "RUNNING"), ("RUNNING", "SUCCEEDED")]


def test_get_run_is_project_scoped(factory):
    rid = _run(factory, project="a")
    with session_scope(factory) as s:
        assert store.get_run(s, run_id=rid, project="a").id == rid
        with pytest.raises(store.NotFound):
            store.get_run(s, run_id=rid, project="b")


def test_metric_upsert_replaces_and_latest_attempt_wins(factory):
    rid = _run(factory)
    with session_scope(factory) as s:
        store.add_metrics(s, run_id=rid, attempt=1, rows=[{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5},
                                                         {"step": 2, "loss": 1.4}])  # duplicate in one batch
        store.add_metrics(s, run_id=rid, attempt=1, rows=[{"step": 2, "loss": 1.0, "custom": 7}])
        store.add_metrics(s, run_id=rid, attempt=2, rows=[{"step": 2, "loss": 0.9}])
    with session_scope(factory) as s:
        rows = store.list_metrics(s, run_id=rid)
        assert [(r.step, r.attempt, r.loss) for r in rows] == [(1, 1, 2.0), (2, 2, 0.9)]
        a1 = store.list_metrics(s, run_id=rid, attempt=1)
        assert [(r.step, r.loss, r.extra) for r in a1] == [(1, 2.0, None), (2, 1.0, {"custom": 7})]
        assert store.summarize_metrics(s, run_id=rid)["final_loss"] == 0.9


def test_resumed_attempt_hides_the_abandoned_trajectory(factory):
    # attempt 1 logged steps 1..30 then failed; attempt 2 resumed from the step-20 checkpoint and has reached
    # step 22: steps 21.. of attempt 1 belong to the abandoned trajectory, even the ones not replayed yet
    rid = _run(factory)
    with session_scope(factory) as s:
        store.add_metrics(s, run_id=rid, attempt=1, rows=[{"step": i, "loss": 1.0} for i in range(1, 31)])
        store.add_metrics(s, run_id=rid, attempt=2, rows=[{"step": i, "loss": 2.0} for i in (21, 22)])
    with session_scope(factory) as s:
        rows = store.list_metrics(s, run_id=rid)
        assert [r.step for r in rows] == list(range(1, 23))
        assert {r.attempt for r in rows if r.step <= 20} == {1} and {r.attempt for r in rows if r.step > 20} == {2}
        assert store.summarize_metrics(s, run_id=rid)["steps_done"] == 22
        assert [r.step for r in store.list_metrics(s, run_id=rid, since_step=20)] == [21, 22]
        # a third attempt that resumed from an even earlier checkpoint (step 10) supersedes both
        store.add_metrics(s, run_id=rid, attempt=3, rows=[{"step": 11, "loss": 3.0}])
    with session_scope(factory) as s:
        rows = store.list_metrics(s, run_id=rid)
        assert [(r.step, r.attempt) for r in rows][-2:] == [(10, 1), (11, 3)] and len(rows) == 11


# ------------------------------------------------------------------------------------------- concurrency
def test_concurrent_metric_upserts_never_duplicate_rows(factory):
    rid = _run(factory)
    steps = list(range(1, 41))

    def write(i: int) -> None:
        order = steps if i % 2 else list(reversed(steps))  # opposite orders: no deadlock either
        for chunk in range(0, len(order), 10):
            with session_scope(factory) as s:
                store.add_metrics(s, run_id=rid, attempt=1,
                                  rows=[{"step": st, "loss": float(i)} for st in order[chunk:chunk + 10]])

    results = _parallel(THREADS, write)
    assert [r for r in results if r is not None] == []
    with session_scope(factory) as s:
        n = s.scalar(select(func.count()).select_from(Metric).where(Metric.run_id == rid))
        distinct = s.scalar(select(func.count(func.distinct(Metric.step))).where(Metric.run_id == rid))
    assert n == distinct == len(steps)


def test_concurrent_idempotent_creates_make_one_run(factory):
    def create(i: int) -> str:
        with session_scope(factory) as s:
            run, _ = store.create_run(s, spec={"name": "r"}, plan=None, project="p", idempotency_key="k-1")
            return run.id

    ids = _parallel(THREADS, create)
    assert all(isinstance(i, str) for i in ids), ids
    assert len(set(ids)) == 1
    with session_scope(factory) as s:
        assert s.scalar(select(func.count()).select_from(Run)) == 1


def test_concurrent_creates_without_keys_are_all_kept(factory):
    ids = _parallel(THREADS, lambda i: _run(factory))
    assert len(set(ids)) == THREADS
    with session_scope(factory) as s:
        assert s.scalar(select(func.count()).select_from(Run)) == THREADS


def test_concurrent_transitions_have_one_winner(factory):
    rid = _run(factory)

    def leave_queue(i: int) -> str:
        with session_scope(factory) as s:
            store.transition(s, run_id=rid, to="CANCELLED" if i % 2 else "FAILED", reason=f"t{i}",
                             allow_from=["QUEUED"])
            return "ok"

    results = _parallel(THREADS, leave_queue)
    assert all(r == "ok" or isinstance(r, store.Conflict) for r in results), results
    with session_scope(factory) as s:
        final = store.get_run(s, run_id=rid).status
        moves = s.scalars(select(RunEvent.to_status).where(RunEvent.run_id == rid,
                                                           RunEvent.from_status == "QUEUED")).all()
    assert moves == [final]  # exactly one move out of QUEUED, and it is the one that stuck
    losers = [r for r in results if isinstance(r, store.Conflict)]
    assert len(losers) == THREADS // 2  # every thread aiming at the other terminal state was refused


# ------------------------------------------------------------------------------------- non-finite metrics
def test_non_finite_metrics_are_stored_as_null_and_the_summary_is_storable(factory):
    import json
    import math

    rid = _run(factory)
    with session_scope(factory) as s:
        store.add_metrics(s, run_id=rid, attempt=1, rows=[
            {"step": 1, "loss": 2.0, "tokens_per_s": 100.0},
            {"step": 2, "loss": float("nan"), "grad_norm": float("inf"), "tokens_per_s": float("-inf"),
             "custom": {"a": float("nan"), "b": [1.0, float("inf"), {"c": float("-inf")}], "ok": 3}}])
    with session_scope(factory) as s:
        loss, grad_norm, extra = s.execute(text(
            "SELECT loss, grad_norm, extra FROM metrics WHERE run_id = :r AND step = 2"), {"r": rid}).one()
        assert loss is None and grad_norm is None  # SQL NULL, not a NaN double
        extra = json.loads(extra) if isinstance(extra, str) else extra
        assert extra == {"custom": {"a": None, "b": [1.0, None, {"c": None}], "ok": 3}}
        summary = store.summarize_metrics(s, run_id=rid)
        json.dumps(summary, allow_nan=False)  # strict JSON: no NaN/Infinity tokens
        assert summary["final_loss"] is None and summary["steps_done"] == 2
        assert summary["mean_tokens_per_s"] is None or math.isfinite(summary["mean_tokens_per_s"])
        store.transition(s, run_id=rid, to="FAILED", reason="diverged", summary=summary)
    with session_scope(factory) as s:
        assert store.get_run(s, run_id=rid).summary == summary


def test_json_safe_replaces_non_finite_floats_recursively():
    nan, inf = float("nan"), float("inf")
    assert store.json_safe({"a": nan, "b": (inf, 1.5, [-inf, {"c": nan}]), "d": "NaN", "e": 2}) == \
        {"a": None, "b": [None, 1.5, [None, {"c": None}]], "d": "NaN", "e": 2}


# ------------------------------------------------------------------------------------ create_run savepoint
def test_duplicate_key_create_keeps_earlier_writes_of_the_same_transaction(factory, monkeypatch):
    first = None
    with session_scope(factory) as s:
        first, created = store.create_run(s, spec={"name": "r"}, plan=None, project="p", idempotency_key="dup")
        assert created
    other = _run(factory, project="p")
    real_find = store.find_by_idempotency_key
    calls = []

    def racing_find(session, **kw):
        calls.append(kw)
        # the first look-up misses (a concurrent request has not committed yet), the insert then collides
        return None if len(calls) == 1 else real_find(session, **kw)

    monkeypatch.setattr(store_runs, "find_by_idempotency_key", racing_find)
    with session_scope(factory) as s:
        store.add_event(s, run_id=other, kind="audit", reason="written before the duplicate create")
        run, created = store.create_run(s, spec={"name": "r"}, plan=None, project="p", idempotency_key="dup")
        assert (run.id, created) == (first.id, False)
        store.add_event(s, run_id=other, kind="audit", reason="written after the duplicate create")
    assert len(calls) == 2
    with session_scope(factory) as s:
        reasons = [e.reason for e in store.list_events(s, run_id=other) if e.kind == "audit"]
        assert reasons == ["written before the duplicate create", "written after the duplicate create"]
        assert s.scalar(select(func.count()).select_from(Run)) == 2


def test_create_run_belongs_to_the_callers_transaction(factory):
    s = factory()
    try:
        store.create_run(s, spec={"name": "r"}, plan=None, idempotency_key="rolled-back")
        s.rollback()  # the caller gives up: the savepoint must not have committed the run on its own
    finally:
        s.close()
    with session_scope(factory) as s:
        assert s.scalar(select(func.count()).select_from(Run)) == 0
        assert store.find_by_idempotency_key(s, project="default", key="rolled-back") is None


# ------------------------------------------------------------------------------------ resume / list_metrics
def test_requeue_clears_summary_and_rank_nodes(factory):
    rid = _run(factory)
    with session_scope(factory) as s:
        store.transition(s, run_id=rid, to="STARTING", rank_nodes={"0": "node-a"}, ray_job_id="job-1")
        store.transition(s, run_id=rid, to="FAILED", summary={"steps_done": 3})
    with session_scope(factory) as s:
        run = store.transition(s, run_id=rid, to="QUEUED", reason="resumed")
        assert run.summary is None and run.rank_nodes is None and run.finished_at is None
    with session_scope(factory) as s:
        run = store.get_run(s, run_id=rid)
        assert (run.summary, run.rank_nodes, run.ray_job_id) == (None, None, "job-1")


def test_list_metrics_honours_limit_with_an_attempt(factory):
    rid = _run(factory)
    with session_scope(factory) as s:
        store.add_metrics(s, run_id=rid, attempt=1, rows=[{"step": i, "loss": 1.0} for i in range(1, 6)])
    with session_scope(factory) as s:
        assert [r.step for r in store.list_metrics(s, run_id=rid, attempt=1, limit=2)] == [1, 2]
        assert [r.step for r in store.list_metrics(s, run_id=rid, attempt=1, since_step=2, limit=2)] == [3, 4]
        assert [r.step for r in store.list_metrics(s, run_id=rid, limit=3)] == [1, 2, 3]


# --------------------------------------------------------------------------------------- pg test helper
def test_postgres_fixtures_fail_instead_of_skipping(monkeypatch):
    from tests.service import pg

    monkeypatch.setattr(pg, "pg_available", lambda: "PostgreSQL at test not reachable: refused")
    with pytest.raises(pytest.fail.Exception, match="the suite needs PostgreSQL at 127.0.0.1:5432"):
        with pg.postgres_database("never"):
            pass

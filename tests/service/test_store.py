"""service.store on SQLite and PostgreSQL: state machine, metric upserts, and concurrent writers (threads, one
session each) that must never lose or duplicate a run, a transition or a metric row."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import func, select, text

from service import migrate, store
from service.db import make_engine, make_sessionmaker, session_scope
from service.models import Base, Metric, Run, RunEvent
from tests.service.pg import pg_available, pg_database

THREADS = 8


@pytest.fixture(scope="module")
def _pg_url():
    why = pg_available()
    if why:
        pytest.skip(why)
    with pg_database("meshrun_test_store") as url:
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

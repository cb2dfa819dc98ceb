"""A run that failed on a full disk: the failure is classified (ENOSPC raised or wrapped, SQLite's and PostgreSQL's
disk-full errors, a worker's formatted traceback), and the driver requeues it by the run's failure policy
(``resources.max_failures``) once space returns, against a real SQLite store and a real full tmpfs."""

from __future__ import annotations

import errno
import os
import sqlite3
import threading

import pytest

from api.spec import RunSpec
from api.spec.validation import build_plan
from service import store
from service.runs.disk_full import (
    EVENT_KIND,
    disk_full_failures,
    is_disk_full,
    may_retry,
    retry_after_disk_full,
    wait_for_space,
)
from service.store import controller
from service.store.db import make_engine, make_sessionmaker, session_scope
from service.store.models import Base

SPEC = {
    "name": "df",
    "model": {"name": "gpt", "preset": "tiny"},
    "layout": {"dp": 1},
    "batch": {"global_batch_size": 4, "micro_batch_size": 2},
    "resources": {"device": "cpu", "cpus_per_worker": 1, "max_failures": 1},
}




def _fill(mnt):
    filler = mnt / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as e:
            assert e.errno == errno.ENOSPC
    return filler


def test_disk_full_failures_are_told_apart_from_the_users_errors(tiny_tmpfs):
    filler = _fill(tiny_tmpfs)
    try:
        (tiny_tmpfs / "more").write_bytes(b"x" * 8192)
    except OSError as e:
        raised = e
    assert is_disk_full(raised)
    try:
        con = sqlite3.connect(tiny_tmpfs / "db.sqlite")
        con.execute("CREATE TABLE t (x BLOB)")
        for _ in range(100):
            con.execute("INSERT INTO t VALUES (?)", (b"\0" * 65536,))
            con.commit()
        pytest.fail("SQLite wrote 6 MiB into a full 1 MiB tmpfs")
    except sqlite3.OperationalError as e:  # "database or disk is full"
        assert is_disk_full(e), str(e)
    filler.unlink()

    try:  # wrapped, as Ray Train's WorkerGroupError or DCP's CheckpointException carry it
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as inner:
            raise RuntimeError("Training worker 0 failed") from inner
    except RuntimeError as outer:
        assert is_disk_full(outer)
    worker_text = "Rank 0: CheckpointException ranks:dict_keys([0])\n  OSError: [Errno 28] No space left on device"
    assert is_disk_full(RuntimeError("worker group failed"), [worker_text])
    assert is_disk_full(RuntimeError('psycopg.errors.DiskFull: could not extend file "base/16384/2619"'))

    assert not is_disk_full(ValueError("loss is NaN"), ["Rank 0: ValueError: loss is NaN"])
    assert not is_disk_full(OSError(errno.ENOENT, "No such file or directory"))


def test_the_failure_policy_decides_retries():
    assert may_retry(0, 1) and not may_retry(1, 1)
    assert not may_retry(0, 0)  # max_failures 0: a full disk fails the run as before
    assert may_retry(1000, -1)  # unlimited


def test_wait_for_space_returns_when_space_comes_back_and_not_before(tiny_tmpfs):
    filler = _fill(tiny_tmpfs)
    assert not wait_for_space([tiny_tmpfs / "ckpt" / "run"], 256 << 10, timeout_s=0.3, poll_s=0.05)
    threading.Timer(0.5, filler.unlink).start()
    assert wait_for_space([tiny_tmpfs / "ckpt" / "run"], 256 << 10, timeout_s=30, poll_s=0.05)


@pytest.fixture
def factory(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path / 'runs.db'}")
    Base.metadata.create_all(engine)
    yield make_sessionmaker(engine)
    engine.dispose()


def _running(factory, run_id=None):
    with session_scope(factory) as s:
        if run_id is None:
            spec = RunSpec.model_validate(SPEC)
            run, _ = store.create_run(
                s, spec=spec.model_dump(mode="json"), plan=build_plan(spec).model_dump(mode="json"), name="df"
            )
            run_id = run.id
        controller.request_run(s, run_id=run_id, to="STARTING", reason="admitted")
        controller.start_attempt(s, run_id=run_id, cause="test")
        controller.request_run(s, run_id=run_id, to="RUNNING", reason="driver started")
    return run_id


def test_a_disk_full_run_is_requeued_to_resume_then_fails_past_max_failures(factory, tmp_path):
    rid = _running(factory)
    ck = tmp_path / "ck" / "step_00000004"
    ck.mkdir(parents=True)
    with session_scope(factory) as s:
        store.add_checkpoint(s, run_id=rid, attempt=1, step=4, path=str(ck))
    kw = dict(job_id=None, max_failures=1, space_paths=[tmp_path], min_free_bytes=1, timeout_s=5, poll_s=0.05)
    sentence = "OSError: [Errno 28] No space left on device"

    assert retry_after_disk_full(factory, run_id=rid, attempt=1, sentence=sentence, **kw)
    with session_scope(factory) as s:
        run = store.get_run(s, run_id=rid)
        assert run.status == "QUEUED" and run.resume_from == str(ck)
        assert (
            "space is back, resuming from the checkpoint of step 4 (failure 1 of max_failures=1)" in run.status_reason
        )
        (attempt,) = store.list_attempts(s, run_id=rid)
        assert attempt.status == "FAILED" and "ended: disk full: OSError: [Errno 28]" in attempt.cause
        assert disk_full_failures(s, run_id=rid) == 1
        assert [e.kind for e in store.list_events(s, run_id=rid, kinds=[EVENT_KIND], limit=10)] == [EVENT_KIND]

    _running(factory, rid)  # admitted again; the disk fills again: the budget is spent, the failure stands
    assert not retry_after_disk_full(factory, run_id=rid, attempt=2, sentence=sentence, **kw)
    with session_scope(factory) as s:
        assert store.get_run(s, run_id=rid).status == "RUNNING"  # the driver then ends it FAILED as before
        assert disk_full_failures(s, run_id=rid) == 1

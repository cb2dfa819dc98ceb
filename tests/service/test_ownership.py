"""One owner per head and per run: the driver's write fence, the recovery of a lost head's runs, the head's lock,
record and ports, and the credential file that replaces the database URL in a job's environment (no Ray here; the
end-to-end checks are in tests/chaos/)."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import time

import pytest
from sqlalchemy import select

from api.spec import RunSpec
from api.spec.validation import build_plan
from service import store
from service.cluster import ownership
from service.cluster.env import credential_file, job_runtime_env
from service.control.recovery import DRIVER_LOST, HEAD_LOST, requeue_lost_runs, resume_lost_driver
from service.runs.lifecycle import Outcome, RunLifecycle
from service.settings import Settings
from service.store import migrate
from service.store.db import make_engine, make_sessionmaker, session_scope
from service.store.models import Metric


@pytest.fixture
def factory(tmp_path):
    url = f"sqlite:///{tmp_path / 'o.db'}"
    migrate.upgrade(url)
    engine = make_engine(url)
    yield make_sessionmaker(engine)
    engine.dispose()


def _running_run(factory, job_id: str, *, max_failures: int = 1) -> str:
    spec = RunSpec.model_validate({"name": "r", "train": {"steps": 10},
                                   "resources": {"max_failures": max_failures}})
    with session_scope(factory) as s:
        run, _ = store.create_run(s, spec=spec.model_dump(mode="json"),
                                  plan=build_plan(spec).model_dump(mode="json"))
        store.transition(s, run_id=run.id, to="STARTING", ray_job_id=job_id)
        store.transition(s, run_id=run.id, to="RUNNING")
        return run.id


def _row(factory, run_id):
    with session_scope(factory) as s:
        r = store.get_run(s, run_id=run_id)
        return r.status, r.status_reason, r.resume_from, store.count_metrics(s, run_id=run_id)


def _metrics_event(attempt: int, step: int) -> dict:
    return {"type": "metrics", "attempt": attempt, "rows": [{"step": step, "loss": 1.0}]}


def test_the_fence_holds_only_for_the_current_job_of_an_active_run(factory):
    rid = _running_run(factory, "meshrun-x-1")
    with session_scope(factory) as s:
        assert store.fence(s, run_id=rid, job_id="meshrun-x-1")
        assert not store.fence(s, run_id=rid, job_id="meshrun-x-2")  # a resubmission's driver is another job
    with session_scope(factory) as s:
        store.end_run(s, run_id=rid, to="FAILED", reason="driver lost")
    with session_scope(factory) as s:
        assert not store.fence(s, run_id=rid, job_id="meshrun-x-1")


def test_a_revoked_driver_writes_nothing_after_the_terminal_transition(factory):
    rid = _running_run(factory, "meshrun-x-1")
    revoked = []
    life = RunLifecycle(factory, rid, actor="driver", job_id="meshrun-x-1", on_revoked=lambda: revoked.append(1))
    life.recorder.apply([{"type": "attempt", "attempt": 1, "cause": "start", "ranks": []}, _metrics_event(1, 1)])
    assert _row(factory, rid)[3] == 1
    with session_scope(factory) as s:  # the service ends the run (reconcile, cancel): the attempt is revoked
        store.end_run(s, run_id=rid, to="FAILED", reason="driver lost")
    life.recorder.apply([_metrics_event(1, 2), _metrics_event(1, 3)])
    assert life.recorder.revoked and _row(factory, rid)[3] == 1
    # the revoked driver's end changes nothing: no SUCCEEDED over FAILED, no attempt rewritten
    life.finish(Outcome.succeeded(), wall_s=1.0)
    assert _row(factory, rid)[:2] == ("FAILED", "driver lost")
    with session_scope(factory) as s:
        [att] = store.list_attempts(s, run_id=rid)
        assert att.status == "FAILED"


def test_the_model_inspection_and_phases_are_fenced_by_the_attempt(factory):
    from service.runs.driver import record_inspection

    rid = _running_run(factory, "meshrun-x-1")
    with session_scope(factory) as s:
        old_plan = store.get_run(s, run_id=rid).plan
    inspected = build_plan(RunSpec.model_validate({"name": "r", "train": {"steps": 10}, "layout": {"dp": 2}}))
    assert inspected.model_dump(mode="json") != old_plan

    def inspect_events() -> list[str]:
        with session_scope(factory) as s:
            return [e.kind for e in store.list_events(s, run_id=rid) if e.kind in ("inspect", "phase")]

    # a driver of another job (a resubmission's, or one whose run was requeued) writes nothing
    stale = RunLifecycle(factory, rid, actor="driver", job_id="meshrun-x-0")
    assert not record_inspection(stale, inspected, "user model: 1 M parameters")
    stale.phase("placing workers")
    with session_scope(factory) as s:
        assert store.get_run(s, run_id=rid).plan == old_plan
    assert inspect_events() == []
    # the current driver writes both
    life = RunLifecycle(factory, rid, actor="driver", job_id="meshrun-x-1")
    assert record_inspection(life, inspected, "user model: 1 M parameters")
    life.phase("placing workers")
    assert inspect_events() == ["inspect", "phase"]
    # once the run ended, the same driver writes nothing more
    with session_scope(factory) as s:
        store.end_run(s, run_id=rid, to="FAILED", reason="driver lost")
    assert not record_inspection(life, build_plan(RunSpec.model_validate({"name": "r"})), "again")
    life.phase("placing workers again")
    with session_scope(factory) as s:
        assert store.get_run(s, run_id=rid).plan == inspected.model_dump(mode="json")
    assert inspect_events() == ["inspect", "phase"]


def test_metrics_of_an_ended_attempt_are_dropped(factory):
    rid = _running_run(factory, "meshrun-x-1")
    life = RunLifecycle(factory, rid, actor="driver", job_id="meshrun-x-1")
    life.recorder.apply([{"type": "attempt", "attempt": 1, "ranks": []}, _metrics_event(1, 1),
                         {"type": "attempt", "attempt": 2, "ranks": []}, _metrics_event(1, 2), _metrics_event(2, 2)])
    with session_scope(factory) as s:
        rows = s.execute(select(Metric.attempt, Metric.step).where(Metric.run_id == rid)).all()
        assert sorted(tuple(r) for r in rows) == [(1, 1), (2, 2)]  # attempt 1's late step 2 is not stored


def test_runs_of_a_lost_head_resume_from_their_checkpoint_within_max_failures(factory, tmp_path):
    ck = tmp_path / "ck" / "5"
    ck.mkdir(parents=True)  # resume only names checkpoints that are still on disk
    rid = _running_run(factory, "meshrun-x-1", max_failures=1)
    with session_scope(factory) as s:
        store.start_attempt(s, run_id=rid, cause="start")
        store.add_checkpoint(s, run_id=rid, attempt=1, step=5, path=str(ck))
    assert requeue_lost_runs(factory, detail="the Ray head (pid 1) died") == [rid]
    status, reason, resume_from, _ = _row(factory, rid)
    assert status == "QUEUED" and resume_from == str(ck)
    assert reason.startswith(HEAD_LOST) and "checkpoint of step 5" in reason and "1 of max_failures=1" in reason
    with session_scope(factory) as s:
        assert [e.reason for e in store.list_events(s, run_id=rid) if e.kind == "head_lost"] == [reason]
        assert store.list_attempts(s, run_id=rid)[0].status == "FAILED"
        # the second loss is past max_failures=1: FAILED with the same reason
        store.transition(s, run_id=rid, to="STARTING", ray_job_id="meshrun-x-2")
    assert requeue_lost_runs(factory, detail="again") == []
    status, reason, _, _ = _row(factory, rid)
    assert status == "FAILED" and reason.startswith(HEAD_LOST) and "max_failures=1 reached" in reason


def test_a_lost_driver_resumes_by_itself_within_max_failures_shared_with_head_losses(factory, tmp_path):
    ck = tmp_path / "ck" / "5"
    ck.mkdir(parents=True)
    rid = _running_run(factory, "meshrun-x-1", max_failures=2)
    with session_scope(factory) as s:
        store.start_attempt(s, run_id=rid, cause="start")
        store.add_checkpoint(s, run_id=rid, attempt=1, step=5, path=str(ck))
    # another job's verdict changes nothing (the run moved on to a new job meanwhile)
    assert resume_lost_driver(factory, rid, detail="Ray Job meshrun-x-0 is FAILED", job_id="meshrun-x-0") is None
    assert _row(factory, rid)[0] == "RUNNING"

    assert resume_lost_driver(factory, rid, detail="Ray Job meshrun-x-1 is FAILED: killed", job_id="meshrun-x-1")
    status, reason, resume_from, _ = _row(factory, rid)
    assert status == "QUEUED" and resume_from == str(ck)
    assert reason == (f"{DRIVER_LOST}: Ray Job meshrun-x-1 is FAILED: killed; resuming from the checkpoint of step 5 "
                      "(failure 1 of max_failures=2)")
    with session_scope(factory) as s:
        assert [e.reason for e in store.list_events(s, run_id=rid) if e.kind == "driver_lost"] == [reason]
        assert store.list_attempts(s, run_id=rid)[0].status == "FAILED"
        store.transition(s, run_id=rid, to="STARTING", ray_job_id="meshrun-x-2")
    # a head loss counts against the same budget: the 2nd loss resumes, the 3rd is past max_failures=2
    assert requeue_lost_runs(factory, detail="the Ray head (pid 1) died") == [rid]
    with session_scope(factory) as s:
        store.transition(s, run_id=rid, to="STARTING", ray_job_id="meshrun-x-3")
    assert resume_lost_driver(factory, rid, detail="Ray Job meshrun-x-3 is gone", job_id="meshrun-x-3") is False
    status, reason, _, _ = _row(factory, rid)
    assert status == "FAILED" and reason.startswith(f"{DRIVER_LOST}: Ray Job meshrun-x-3 is gone; not resumed: "
                                                    "max_failures=2 reached; resume it (POST /v1/runs/")
    with session_scope(factory) as s:
        assert [e.kind for e in store.list_events(s, run_id=rid) if e.kind.endswith("_lost")] == [
            "driver_lost", "head_lost", "driver_lost"]


def test_a_configured_port_in_use_is_an_error_naming_the_setting():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ownership.HeadOwnershipError, match=f"MESHRUN_RAY_GCS_PORT={port} is in use"):
            ownership.check_port(port, setting="MESHRUN_RAY_GCS_PORT", wait_s=0)
    ownership.check_port(port, setting="MESHRUN_RAY_GCS_PORT", wait_s=0)  # free again
    with pytest.raises(ownership.HeadOwnershipError, match="Redis"):
        ownership.check_port(6379, setting="MESHRUN_RAY_GCS_PORT", wait_s=0)


def test_one_service_per_data_directory_and_a_private_head_record(tmp_path):
    first, second = ownership.HeadLock(tmp_path / "ray"), ownership.HeadLock(tmp_path / "ray")
    first.acquire()
    with pytest.raises(ownership.HeadOwnershipError, match=f"pid {os.getpid()}.*own MESHRUN_DATA_DIR"):
        second.acquire()
    first.release()
    second.acquire()
    second.release()
    rec = ownership.HeadRecord(pid=1, pgid=1, gcs_port=6400, dashboard_port=8300, metrics_port=None,
                               address="127.0.0.1:6400", temp_dir="/tmp/x", session_dir=None, started_at=0.0,
                               service_pid=os.getpid())
    ownership.save_record(tmp_path, rec)
    assert ownership.load_record(tmp_path) == rec
    assert stat.S_IMODE(os.stat(ownership.record_path(tmp_path)).st_mode) == 0o600
    assert not ownership.is_ray_head(os.getpid())
    ownership.clear_record(tmp_path)
    assert ownership.load_record(tmp_path) is None


def test_a_jobs_environment_names_a_private_credential_file_never_the_url(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHRUN_DATABASE_URL", "postgresql://meshrun:s3cret@db/meshrun")
    settings = Settings(data_dir=tmp_path)
    renv = job_runtime_env(settings, job_id="meshrun-x-1", gcs_address="127.0.0.1:6400",
                           extra_env={"MESHRUN_DATABASE_URL": "x"})
    assert "s3cret" not in repr(renv) and "MESHRUN_DATABASE_URL" not in renv["env_vars"]
    path = renv["env_vars"]["MESHRUN_DATABASE_URL_FILE"]
    assert path == str(credential_file(settings))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and stat.S_IMODE(os.stat(tmp_path / "secrets").st_mode) == 0o700
    monkeypatch.delenv("MESHRUN_DATABASE_URL")
    monkeypatch.setenv("MESHRUN_DATABASE_URL_FILE", path)
    assert Settings(data_dir=tmp_path).database_url == "postgresql+psycopg://meshrun:s3cret@db/meshrun"


def test_cluster_state_of_a_dead_gcs_fails_at_once_without_a_reader_process():
    from service.cluster.gcs_view import ClusterUnavailable, GcsView

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        view = GcsView(f"127.0.0.1:{port}")
        with pytest.raises(ClusterUnavailable, match=f"the Ray GCS at 127.0.0.1:{port} does not answer"):
            view.nodes()
        assert view._proc is None


def _ckpt_dir(root, step: int):
    d = root / f"step_{step:08d}_a1"
    d.mkdir(parents=True)
    (d / "shard.bin").write_bytes(b"x" * 10)
    return d


def test_the_driver_prunes_checkpoints_only_after_the_newer_ones_are_recorded(factory, tmp_path):
    """checkpoint.keep is the driver's job, not Ray Train's: what is recorded and not among the newest ``keep``
    is deleted; a checkpoint that arrives after the run ended is not recorded and deletes nothing, so the newest
    recorded ones always exist (a cancel no longer leaves a run whose recorded checkpoints are all gone)."""
    rid = _running_run(factory, "meshrun-x-1")
    life = RunLifecycle(factory, rid, actor="driver", job_id="meshrun-x-1", checkpoint_keep=2)
    dirs = {step: _ckpt_dir(tmp_path / "ck", step) for step in (5, 10, 15, 20)}

    def ck(step):
        return {"type": "checkpoint", "attempt": 1, "step": step, "path": str(dirs[step])}

    life.recorder.apply([{"type": "attempt", "attempt": 1, "ranks": []}, ck(5), ck(10)])
    assert dirs[5].exists() and dirs[10].exists()
    life.recorder.apply([ck(15)])
    assert not dirs[5].exists() and dirs[10].exists() and dirs[15].exists()
    with session_scope(factory) as s:  # cancelled: the attempt is revoked
        store.end_run(s, run_id=rid, to="CANCELLED", reason="cancelled by user")
    life.recorder.apply([ck(20)])  # written by the workers before they stopped, never recorded
    assert dirs[10].exists() and dirs[15].exists() and dirs[20].exists()
    with session_scope(factory) as s:
        latest = store.latest_checkpoint(s, run_id=rid)
        assert latest is not None and latest.step == 15
        assert [c.step for c in store.list_checkpoints(s, run_id=rid)] == [5, 10, 15]


def test_without_keep_the_driver_deletes_no_checkpoint(factory, tmp_path):
    rid = _running_run(factory, "meshrun-x-1")
    life = RunLifecycle(factory, rid, actor="driver", job_id="meshrun-x-1")
    dirs = [_ckpt_dir(tmp_path / "ck", step) for step in (5, 10, 15)]
    life.recorder.apply([{"type": "attempt", "attempt": 1, "ranks": []}]
                        + [{"type": "checkpoint", "attempt": 1, "step": 5 * (i + 1), "path": str(d)}
                           for i, d in enumerate(dirs)])
    assert all(d.exists() for d in dirs)


def test_a_process_tree_that_ignores_sigterm_is_killed_after_the_grace():
    """What stopping a head does once a job has run there: ``ray start --block`` waits about 30 s for its workers
    after a SIGTERM. Here a leader that ignores SIGTERM and two children (one in a session of its own, as Ray's
    workers can be) are all gone after the grace, not after the leader would have exited by itself."""
    import ray  # noqa: F401 - ray vendors psutil (ray/thirdparty_files), as service.cluster.ownership uses it
    import psutil

    script = "trap '' TERM; sleep 300 & setsid sleep 300 & echo ready; wait"
    proc = subprocess.Popen(["sh", "-c", script], start_new_session=True, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    with proc.stdout:
        assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.3)  # both children forked
    children = psutil.Process(proc.pid).children(recursive=True)
    assert len(children) == 2, children
    t0 = time.monotonic()
    ownership.kill_process_group(proc, timeout_s=1.0)
    took = time.monotonic() - t0
    assert proc.poll() is not None  # the leader, which ignored SIGTERM, was killed
    deadline = time.monotonic() + 10  # SIGKILL is delivered at once, but the state is read a moment later
    while (left := [c.pid for c in children if ownership.pid_alive(c.pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left  # and both children, the one in a session of its own too
    # one grace for the whole tree (1 s here), not the 300 s it would have lasted, nor a second wait after it
    assert 0.9 <= took < 4.0, took
    assert ownership.STOP_GRACE_S <= 10  # a service's stop does not wait out Ray's workers (about 30 s)

"""The driver's side of tracking, without Ray: ``track_run`` on a real ``RunLifecycle`` over a real SQLite run
database. What the recorder commits (metric rows, events, checkpoints) and the terminal state reach TensorBoard's
event files; what a revoked driver is refused never does; an outage is a run event in the database."""

from __future__ import annotations

import pytest

from api.spec import RunSpec
from api.spec.validation import build_plan
from service import store
from service.runs.lifecycle import Outcome, RunLifecycle
from service.runs.tracking import tensorboard_dir, track_run
from service.store import migrate
from service.store.db import make_engine, make_sessionmaker, session_scope
from tests.tracking.conftest import free_port, tensorboard_scalars, tensorboard_texts, wait_until

pytestmark = pytest.mark.slow  # TensorBoard's writer and reader take seconds to import


@pytest.fixture
def factory(tmp_path):
    url = f"sqlite:///{tmp_path / 'o.db'}"
    migrate.upgrade(url)
    engine = make_engine(url)
    yield make_sessionmaker(engine)
    engine.dispose()


def _running(factory, spec: RunSpec) -> str:
    with session_scope(factory) as s:
        run, _ = store.create_run(s, spec=spec.model_dump(mode="json"), plan=build_plan(spec).model_dump(mode="json"))
        store.transition(s, run_id=run.id, to="STARTING", ray_job_id="job-1")
        store.transition(s, run_id=run.id, to="RUNNING")
        return run.id


def _metrics(steps) -> dict:
    return {"type": "metrics", "attempt": 1,
            "rows": [{"step": s, "loss": 10.0 / s, "tokens_per_s": 50.0, "breakdown": {"compute": 0.1}} for s in steps]}


def _events(factory, run_id: str) -> list:
    with session_scope(factory) as s:
        return [(e.kind, e.reason) for e in store.list_events(s, run_id=run_id, limit=1000)]


def test_what_the_recorder_commits_and_the_end_reach_the_trackers(factory, tmp_path):
    # TensorBoard, and an MLflow server that never answers: one event, and the run ends as if nothing happened
    dead = f"http://127.0.0.1:{free_port()}"
    spec = RunSpec.model_validate({"name": "tracked", "train": {"steps": 6}, "tracking": {
        "tensorboard": True, "mlflow": {"tracking_uri": dead}}})
    rid = _running(factory, spec)
    life = RunLifecycle(factory, rid, actor="driver", job_id="job-1")
    trackers = track_run(life, spec, build_plan(spec), defaults=None, data_dir=tmp_path, run_name="tracked",
                         flush_timeout_s=5)
    assert trackers is not None and trackers.names == ["mlflow", "tensorboard"]
    life.recorder.apply([{"type": "attempt", "attempt": 1, "ranks": []}, _metrics([1, 2, 3])])
    life.recorder.apply([{"type": "event", "kind": "sync_alert", "reason": "replicas diverge"},
                         {"type": "checkpoint", "attempt": 1, "step": 3, "path": str(tmp_path / "ck3")},
                         _metrics([4, 5, 6])])
    # the outage is an event of the running run (a driver writes nothing to a run that has ended)
    wait_until(lambda: "tracker_unavailable" in [k for k, _ in _events(factory, rid)], 60, "the outage event")
    life.finish(Outcome.succeeded(), wall_s=1.0)
    assert trackers.close(5) is False  # MLflow never came back: its items are given up after the flush bound
    with session_scope(factory) as s:
        assert store.get_run(s, run_id=rid).status == "SUCCEEDED"
    kinds = [k for k, _ in _events(factory, rid)]
    assert kinds.count("tracker_unavailable") == 1 and kinds.count("tracking") == 1
    logdir = tensorboard_dir(tmp_path, rid)
    assert [s for s, _ in tensorboard_scalars(logdir)["loss"]] == [1, 2, 3, 4, 5, 6]
    texts = tensorboard_texts(logdir)
    assert texts["meshrun/status/text_summary"] == ["SUCCEEDED"]
    assert any("sync_alert: replicas diverge" in t for t in texts["meshrun/events/text_summary"])
    assert any("ck3" in t for t in texts["meshrun/checkpoints/text_summary"])


def test_a_revoked_driver_sends_the_trackers_nothing_more(factory, tmp_path):
    spec = RunSpec.model_validate({"name": "tracked", "tracking": {"tensorboard": True}})
    rid = _running(factory, spec)
    life = RunLifecycle(factory, rid, actor="driver", job_id="job-1")
    trackers = track_run(life, spec, None, defaults=None, data_dir=tmp_path, run_name="t", flush_timeout_s=30)
    life.recorder.apply([{"type": "attempt", "attempt": 1, "ranks": []}, _metrics([1, 2])])
    with session_scope(factory) as s:
        store.end_run(s, run_id=rid, to="CANCELLED", reason="cancelled by user")
    life.recorder.apply([_metrics([3, 4])])  # refused by the fence: not recorded, so not tracked
    life.finish(Outcome.succeeded(), wall_s=1.0)  # the run is no longer this driver's: no terminal state mirrored
    assert trackers is not None and trackers.close(30)
    logdir = tensorboard_dir(tmp_path, rid)
    assert [s for s, _ in tensorboard_scalars(logdir)["loss"]] == [1, 2]
    assert "meshrun/status/text_summary" not in tensorboard_texts(logdir)

"""Elastic recovery (issue 22): the pure re-plan (``service.control.elastic``) and the scheduler acting on a lost
node (fake cluster and jobs, SQLite): the run is stopped, then re-queued in a smaller layout from its checkpoint."""

from __future__ import annotations

import pytest

from api.spec import RunSpec
from api.spec.validation import build_plan
from service import store
from service.cluster.head import NodeView
from service.cluster.placement import NodeCapacity
from service.control.elastic import replan
from service.store.db import session_scope
from tests.service.test_placement import FakeJobs

SPEC = {
    "name": "el",
    "model": {"name": "gpt", "preset": "tiny"},
    "layout": {"dp": 4},
    "batch": {"global_batch_size": 16, "micro_batch_size": 2},
    "resources": {"device": "cpu", "cpus_per_worker": 1},
    "elastic": {"min_dp": 2},
}


def _caps(*cpus: int) -> list[NodeCapacity]:
    return [NodeCapacity(f"n{i}", total={"CPU": float(c)}, free={"CPU": 0.0}) for i, c in enumerate(cpus, 1)]


def test_replan_keeps_the_global_batch_within_bounds() -> None:
    spec = RunSpec.model_validate(SPEC)
    plan = build_plan(spec)
    new = replan(spec, plan, _caps(3), why="node lost: n2")
    assert new is not None and new.plan.dp == 2 and new.plan.global_batch_size == 16
    assert new.spec.batch.micro_batch_size == 2  # 8 per rank: 4 micro-batches instead of 2
    assert "dp=4 tp=1 pp=1 -> dp=2 tp=1 pp=1" in new.reason and "global batch 16 kept" in new.reason
    assert replan(spec, plan, _caps(1), why="x") is None  # dp 1 is below min_dp
    assert replan(spec.model_copy(update={"elastic": None}), plan, _caps(3), why="x") is None


class Cluster:
    address = "127.0.0.1:6390"
    dashboard_url = None

    def __init__(self) -> None:
        self.views = [NodeView(node_id=n, alive=True, address=None, total={"CPU": 2.0}, free={"CPU": 2.0})
                      for n in ("n1", "n2")]

    def nodes(self):
        return self.views


@pytest.fixture
def sched(tmp_path):
    from service.control.scheduler import Scheduler
    from service.settings import Settings
    from service.store.db import make_engine, make_sessionmaker
    from service.store.models import Base

    settings = Settings(data_dir=tmp_path)
    engine = make_engine(settings.database_url)
    Base.metadata.create_all(engine)
    s = Scheduler(settings=settings, session_factory=make_sessionmaker(engine), cluster=Cluster(), jobs=FakeJobs())
    yield s
    engine.dispose()


def test_a_lost_node_requeues_an_elastic_run_in_a_smaller_layout(sched, tmp_path) -> None:
    ck = tmp_path / "ck" / "step_10"
    ck.mkdir(parents=True)  # resume only names checkpoints that are still on disk
    stopped: list[str] = []
    sched.jobs.stop = lambda job_id: stopped.append(job_id) or True
    spec = RunSpec.model_validate(SPEC)
    with session_scope(sched.factory) as s:
        run, _ = store.create_run(s, spec=spec.model_dump(mode="json"),
                                  plan=build_plan(spec).model_dump(mode="json"), name="el")
        rid = run.id
    sched.tick()
    with session_scope(sched.factory) as s:
        job = store.get_run(s, run_id=rid).ray_job_id
    sched.jobs.states[job] = "RUNNING"
    with session_scope(sched.factory) as s:
        store.transition(s, run_id=rid, to="RUNNING", reason="driver",
                         rank_nodes={"0": "n1", "1": "n1", "2": "n2", "3": "n2"})
        store.add_checkpoint(s, run_id=rid, attempt=1, step=10, path=str(ck), size_bytes=1)
    sched.cluster.views = [sched.cluster.views[0], NodeView(node_id="n2", alive=False, address=None,
                                                            total={"CPU": 2.0})]
    sched.cluster.views[0] = NodeView(node_id="n1", alive=True, address=None, total={"CPU": 2.0}, free={"CPU": 0.0})
    sched.tick()
    assert stopped == [job]
    with session_scope(sched.factory) as s:
        assert store.get_run(s, run_id=rid).status == "RUNNING"  # its driver ends it first
        # the stopped driver ends the run (as on SIGTERM), its job ends
        store.end_run(s, run_id=rid, to="CANCELLED", reason="Ray Job stopped")
    sched.jobs.states[job] = "STOPPED"
    sched.cluster.views[0] = NodeView(node_id="n1", alive=True, address=None, total={"CPU": 2.0}, free={"CPU": 2.0})
    sched.tick()
    with session_scope(sched.factory) as s:
        run = store.get_run(s, run_id=rid)
        assert run.status in ("QUEUED", "STARTING")
        assert run.plan["dp"] == 2 and run.spec["layout"]["dp"] == 2 and run.plan["global_batch_size"] == 16
        assert run.resume_from == str(ck)
        kinds = [(e.kind, e.reason) for e in store.list_events(s, run_id=rid, limit=100)]
    elastic = [r for k, r in kinds if k == "elastic"]
    assert elastic and "node lost: n2" in elastic[0] and "dp=4 tp=1 pp=1 -> dp=2 tp=1 pp=1" in elastic[0]

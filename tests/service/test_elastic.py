"""Elastic recovery (issue 22): the pure re-plan (``service.control.elastic``) and the scheduler acting on a lost
node (fake cluster and jobs, SQLite): the run is stopped, then re-queued in a smaller layout from its checkpoint."""

from __future__ import annotations

import pytest

from api.spec import RunSpec
from api.spec.validation import build_plan
from service import store
from service.cluster.head import NodeView
from service.cluster.placement import NodeCapacity
from service.control.elastic import grow, held_per_node, may_grow, replan, with_own
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
    assert "layout dp4 -> dp2" in new.reason and "global batch 16 kept" in new.reason
    assert replan(spec, plan, _caps(1), why="x") is None  # dp 1 is below min_dp
    assert replan(spec.model_copy(update={"elastic": None}), plan, _caps(3), why="x") is None


class Cluster:
    address = "127.0.0.1:6390"
    dashboard_url = None

    def __init__(self) -> None:
        self.views = [
            NodeView(node_id=n, alive=True, address=None, total={"CPU": 2.0}, free={"CPU": 2.0}) for n in ("n1", "n2")
        ]

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


def _running(sched, tmp_path, rank_nodes):
    """An elastic dp4 run admitted, RUNNING on ``rank_nodes`` with a checkpoint of step 10; (run id, its job)."""
    ck = tmp_path / "ck" / "step_10"
    ck.mkdir(parents=True)  # resume only names checkpoints that are still on disk
    spec = RunSpec.model_validate(SPEC)
    with session_scope(sched.factory) as s:
        run, _ = store.create_run(
            s, spec=spec.model_dump(mode="json"), plan=build_plan(spec).model_dump(mode="json"), name="el"
        )
        rid = run.id
    sched.tick()
    with session_scope(sched.factory) as s:
        job = store.get_run(s, run_id=rid).ray_job_id
    sched.jobs.states[job] = "RUNNING"
    with session_scope(sched.factory) as s:
        store.transition(s, run_id=rid, to="RUNNING", reason="driver", rank_nodes=rank_nodes)
        store.start_attempt(s, run_id=rid, cause="start")
        store.add_checkpoint(s, run_id=rid, attempt=1, step=10, path=str(ck), size_bytes=1)
    return rid, job, ck


def _view(node_id, *, alive=True, total=2.0, free=0.0):
    return NodeView(
        node_id=node_id, alive=alive, address=None, total={"CPU": total}, free={"CPU": free} if alive else {}
    )


def test_a_lost_node_requeues_an_elastic_run_in_a_smaller_layout(sched, tmp_path) -> None:
    stopped: list[str] = []
    sched.jobs.stop = lambda job_id: stopped.append(job_id) or True
    rid, job, ck = _running(sched, tmp_path, {"0": "n1", "1": "n1", "2": "n2", "3": "n2"})
    sched.cluster.views = [_view("n1"), _view("n2", alive=False)]
    sched.tick()
    assert stopped == [job]
    with session_scope(sched.factory) as s:
        run = store.get_run(s, run_id=rid)
        # re-queued at once (its driver is revoked), but not admitted while its old job still runs
        assert run.status == "QUEUED" and "waiting for its previous Ray Job" in run.status_reason
        assert run.plan["dp"] == 2 and run.spec["layout"]["dp"] == 2 and run.plan["global_batch_size"] == 16
        assert run.spec["elastic"]["max_dp"] == 4  # how far it may grow back
        assert run.resume_from == str(ck)
        kinds = [(e.kind, e.reason) for e in store.list_events(s, run_id=rid, limit=100)]
    elastic = [r for k, r in kinds if k == "elastic"]
    assert len(elastic) == 1 and "node lost: n2" in elastic[0] and "layout dp4 -> dp2" in elastic[0]
    assert "the checkpoint of step 10" in elastic[0]
    sched.jobs.states[job] = "STOPPED"
    sched.cluster.views = [_view("n1", free=2.0)]  # the dead node gone from the table: nothing to re-plan again
    sched.tick()
    with session_scope(sched.factory) as s:
        run = store.get_run(s, run_id=rid)
        assert run.status == "STARTING" and run.ray_job_id != job
    assert len(sched.jobs.submitted) == 2


def test_a_node_gone_from_the_table_counts_as_lost(sched, tmp_path) -> None:
    sched.jobs.stop = lambda job_id: True
    rid, _, _ = _running(sched, tmp_path, {"0": "n1", "1": "n1", "2": "n2", "3": "n2"})
    sched.cluster.views = [_view("n1")]
    sched.tick()
    with session_scope(sched.factory) as s:
        assert store.get_run(s, run_id=rid).status == "QUEUED"


def test_grow_picks_the_largest_layout_up_to_max_dp() -> None:
    spec = RunSpec.model_validate({**SPEC, "layout": {"dp": 2}, "elastic": {"min_dp": 2, "max_dp": 4}})
    plan = build_plan(spec)
    free = [NodeCapacity("n1", total={"CPU": 2.0}, free={"CPU": 2.0}), NodeCapacity("n2", {"CPU": 2.0}, {"CPU": 2.0})]
    new = grow(spec, plan, free, why="capacity returned")
    assert new is not None and new.plan.dp == 4 and new.plan.global_batch_size == 16
    assert "layout dp2 -> dp4" in new.reason and "capacity returned" in new.reason
    assert grow(spec, plan, free[:1], why="x") is None  # 2 slots: no larger layout fits
    at_max = RunSpec.model_validate({**SPEC, "elastic": {"min_dp": 2}})
    assert grow(at_max, build_plan(at_max), free * 2, why="x") is None  # dp4 is its max (the layout's dp)
    # what the run holds counts as free for its own new layout
    held = with_own([NodeCapacity("n1", {"CPU": 4.0}, {"CPU": 2.0})], held_per_node({"0": "n1", "1": "n1"}, plan))
    assert held[0].free["CPU"] == 4.0 and grow(spec, plan, held, why="x").plan.dp == 4


@pytest.mark.parametrize("restart", [False, True], ids=["same-service", "service-restarted-after-the-request"])
def test_an_elastic_run_below_max_dp_grows_back_through_a_checkpoint(sched, tmp_path, restart) -> None:
    from service.control.scheduler import Scheduler
    from service.runs.preemption import PREEMPT_REQUEST

    sched.jobs.stop = lambda job_id: True
    rid, job, _ = _running(sched, tmp_path, {"0": "n1", "1": "n1", "2": "n2", "3": "n2"})
    sched.cluster.views = [_view("n1"), _view("n2", alive=False)]
    sched.tick()  # shrunk to dp2
    sched.jobs.states[job] = "STOPPED"
    sched.cluster.views = [_view("n1", free=2.0)]
    sched.tick()  # admitted as dp2
    with session_scope(sched.factory) as s:
        run = store.get_run(s, run_id=rid)
        job2 = run.ray_job_id
        store.transition(s, run_id=rid, to="RUNNING", reason="driver", rank_nodes={"0": "n1", "1": "n1"})
        store.start_attempt(s, run_id=rid, cause="resume")  # its workers are up: no reservation any more
    sched.jobs.states[job2] = "RUNNING"
    sched.cluster.views = [_view("n1", free=0.0)]
    sched.tick()  # nothing free: no grow
    with session_scope(sched.factory) as s:
        assert not store.list_events(s, run_id=rid, kinds=[PREEMPT_REQUEST], limit=10)
    sched.cluster.views = [_view("n1", free=0.0), _view("n3", free=2.0)]  # a node joins
    sched.tick()
    with session_scope(sched.factory) as s:
        asked = store.list_events(s, run_id=rid, kinds=[PREEMPT_REQUEST], limit=10)
        assert len(asked) == 1 and "layout dp2 -> dp4" in asked[0].reason
        assert store.get_run(s, run_id=rid).plan["dp"] == 2  # unchanged until it yields
    sched.tick()  # asked once only
    with session_scope(sched.factory) as s:
        assert len(store.list_events(s, run_id=rid, kinds=[PREEMPT_REQUEST], limit=10)) == 1
    if restart:  # a new service (scheduler) on the same database: the stored request is not forgotten
        cluster, jobs = sched.cluster, sched.jobs
        sched = Scheduler(settings=sched.settings, session_factory=sched.factory, cluster=cluster, jobs=jobs)
        sched.tick()  # still RUNNING: waits for the run to yield, asks nothing twice
        assert list(sched.growing) == [rid]
    with session_scope(sched.factory) as s:
        assert len(store.list_events(s, run_id=rid, kinds=[PREEMPT_REQUEST], limit=10)) == 1
        # its driver checkpoints, yields and re-queues it (RunLifecycle.requeue)
        store.transition(s, run_id=rid, to="PREEMPTED", reason="yielded")
        store.transition(s, run_id=rid, to="QUEUED", reason="back in the queue")
    sched.jobs.states[job2] = "SUCCEEDED"
    sched.cluster.views = [_view("n1", free=2.0), _view("n3", free=2.0)]
    sched.tick()
    with session_scope(sched.factory) as s:
        run = store.get_run(s, run_id=rid)
        assert run.plan["dp"] == 4 and run.spec["layout"]["dp"] == 4 and run.status == "STARTING"
        elastic = [e.reason for e in store.list_events(s, run_id=rid, kinds=["elastic"], limit=10)]
    assert any("capacity returned" in r and "layout dp2 -> dp4" in r for r in elastic), elastic


def test_a_failed_elastic_driver_waits_for_the_services_verdict(sched, tmp_path, monkeypatch) -> None:
    """The driver of an elastic run whose workers failed leaves the run alone once the service re-queued it (True), and
    ends it as usual when nothing says a node was lost (False, after NODE_DEATH_S)."""
    from service.runs import driver
    from service.runs.lifecycle import RunLifecycle

    rid, job, _ = _running(sched, tmp_path, {"0": "n1", "1": "n2"})
    life = RunLifecycle(sched.factory, rid, actor="driver", job_id=job)
    monkeypatch.setattr(driver, "NODE_DEATH_S", 0.0)
    monkeypatch.setattr(driver, "_dead_nodes", lambda rank_nodes: [])
    monkeypatch.setattr(driver.time, "sleep", lambda s: None)
    assert driver._elastic_verdict(life, ValueError("user code")) is False
    with session_scope(sched.factory) as s:  # the scheduler re-planned it
        store.transition(s, run_id=rid, to="QUEUED", reason="elastic: node lost")
    assert driver._elastic_verdict(life, RuntimeError("Connection reset by peer")) is True


LISTED = {**SPEC, "layout": {"dp": 2, "tp": 2}, "elastic": {"layouts": [{"dp": 1, "tp": 2}, {"dp": 2}, {"dp": 4}]}}


def test_a_list_of_layouts_is_taken_best_first_and_changes_back() -> None:
    from api.spec.elastic import preferences

    spec = RunSpec.model_validate(LISTED)
    plan = build_plan(spec)
    assert preferences(spec) == [(2, 2, 1), (1, 2, 1), (2, 1, 1), (4, 1, 1)]  # its own layout first: not listed
    # two nodes of 2 CPUs, one lost: dp2 x tp2 no longer fits; the first listed layout that fits is tp2 (dp2 would
    # fit too, but comes later)
    new = replan(spec, plan, _caps(2), why="node lost: n2")
    assert new is not None and (new.plan.dp, new.plan.tp, new.plan.pp) == (1, 2, 1) and new.plan.global_batch_size == 16
    assert "layout dp2 tp2 -> dp1 tp2 (global batch 16 kept: 8 micro-batches of 2 per rank" in new.reason, new.reason
    # the new spec keeps the whole list, its original layout first: it may come back
    assert [(x.dp, x.tp, x.pp) for x in new.spec.elastic.layouts] == [(2, 2, 1), (1, 2, 1), (2, 1, 1), (4, 1, 1)]
    assert may_grow(new.spec, new.plan) and not may_grow(spec, plan)
    free = [NodeCapacity("n1", {"CPU": 2.0}, {"CPU": 2.0}), NodeCapacity("n3", {"CPU": 2.0}, {"CPU": 2.0})]
    back = grow(new.spec, new.plan, free, why="capacity returned")
    assert back is not None and (back.plan.dp, back.plan.tp) == (2, 2)
    assert grow(new.spec, new.plan, free[:1], why="x") is None  # only layouts listed before tp2 are better
    assert replan(spec, plan, _caps(1), why="x") is None  # nothing listed fits one CPU


def test_a_listed_layout_the_run_can_never_take_is_refused_naming_it() -> None:
    from api.spec.validation import SpecError

    bad = {**LISTED, "elastic": {"layouts": [{"dp": 2}, {"tp": 3}, {"dp": 3}]}}
    with pytest.raises(SpecError) as err:
        build_plan(RunSpec.model_validate(bad))
    issues = {i.param: i.message for i in err.value.issues}
    assert set(issues) == {"elastic.layouts[1]", "elastic.layouts[2]"}, issues
    assert issues["elastic.layouts[1]"].startswith("dp=1 tp=3 pp=1: layout.tp: tp=3 does not divide"), issues
    assert "global_batch_size=16 does not split over dp=3" in issues["elastic.layouts[2]"], issues


def test_a_grow_request_counts_as_pending_only_until_it_was_applied_or_dropped(sched, tmp_path) -> None:
    from service.control.scheduler import _grow_pending
    from service.runs.preemption import PREEMPT_REQUEST

    rid, _, _ = _running(sched, tmp_path, {"0": "n1", "1": "n1"})
    with session_scope(sched.factory) as s:
        assert not _grow_pending(s, rid, queued=False)
        store.add_event(s, run_id=rid, kind=PREEMPT_REQUEST, reason="preempted by run x (priority 10 > 0)")
        assert not _grow_pending(s, rid, queued=False)  # a priority preemption is no grow request
        store.add_event(s, run_id=rid, kind=PREEMPT_REQUEST, reason="elastic: capacity returned; layout dp2 -> dp4")
        assert _grow_pending(s, rid, queued=False)  # asked, the run still runs: it will yield
        store.transition(s, run_id=rid, to="PREEMPTED", reason="yielded")
        store.transition(s, run_id=rid, to="QUEUED", reason="back in the queue")
        assert _grow_pending(s, rid, queued=True)  # yielded: the larger layout is applied while it waits
        store.transition(s, run_id=rid, to="STARTING", reason="admitted in its old layout: dp4 no longer fit")
        assert not _grow_pending(s, rid, queued=False)  # dropped: a later grow may be asked again
        store.add_event(s, run_id=rid, kind=PREEMPT_REQUEST, reason="elastic: capacity returned; layout dp2 -> dp4")
        store.add_event(s, run_id=rid, kind="elastic", reason="elastic: capacity returned; layout dp2 -> dp4")
        assert not _grow_pending(s, rid, queued=False)  # applied

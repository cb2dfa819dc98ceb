"""service.cluster.placement: layout -> worker slots per node (pure logic, no Ray)."""

from __future__ import annotations

from pathlib import Path

import pytest

from api.spec import RunSpec
from api.spec.validation import build_plan
from service.cluster.placement import (NODE_ID_LABEL, NodeCapacity, Placement, add_reservations, check_tp_groups,
                               never_fits, place, reservation, slot_description, slots, worker_resources)


def plan_for(dp=1, tp=1, pp=1, cpus=1.0, device="cpu"):
    spec = RunSpec.model_validate({
        "model": {"name": "gpt", "preset": "tiny"}, "layout": {"dp": dp, "tp": tp, "pp": pp},
        "batch": {"global_batch_size": 4 * dp * pp, "micro_batch_size": 1},
        "resources": {"device": device, "cpus_per_worker": cpus}})
    return build_plan(spec)


def node(nid, cpus, free=None, gpus=0.0, gpus_free=None):
    total = {"CPU": float(cpus)}
    fr = {"CPU": float(cpus if free is None else free)}
    if gpus:
        total["GPU"] = float(gpus)
        fr["GPU"] = float(gpus if gpus_free is None else gpus_free)
    return NodeCapacity(node_id=nid, total=total, free=fr)


def test_worker_resources_and_slot_text():
    assert worker_resources(plan_for(cpus=1)) == {"CPU": 1.0}
    assert worker_resources(plan_for(cpus=2)) == {"CPU": 2.0}
    assert worker_resources(plan_for(device="gpu"))["GPU"] == 1.0
    assert slot_description({"CPU": 1.0}) == "1 CPU"
    assert slot_description({"CPU": 2.0}) == "2 CPUs"
    assert slot_description({"GPU": 1.0, "CPU": 1.0}) == "1 GPU + 1 CPU"
    assert slots({"CPU": 7.0}, {"CPU": 2.0}) == 3
    assert slots({"CPU": 8.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}) == 1
    assert slots({"CPU": 8.0}, {"CPU": 1.0, "GPU": 1.0}) == 0


def test_not_enough_free_slots_names_the_numbers():
    p = place(plan_for(dp=8), [node("a", 8, free=3)])
    assert not p.fits
    assert p.reason == "needs 8 worker slots of 1 CPU; 3 free"


def test_single_node_is_not_pinned_and_fits():
    p = place(plan_for(dp=2), [node("a", 8)])
    assert p.fits and p.rank_nodes == ["a", "a"] and p.label_selector is None
    kw = p.scaling_kwargs()
    assert kw == {"num_workers": 2, "use_gpu": False, "resources_per_worker": {"CPU": 1.0},
                  "placement_strategy": "PACK"}


def test_tp_groups_stay_on_one_node_across_two_nodes():
    # two nodes with 4 free slots each; tp=4 dp=2 -> one TP group per node, pinned per worker
    p = place(plan_for(dp=2, tp=4), [node("a", 4), node("b", 4)])
    assert p.fits
    assert p.rank_nodes[:4] == [p.rank_nodes[0]] * 4 and p.rank_nodes[4:] == [p.rank_nodes[4]] * 4
    assert set(p.rank_nodes) == {"a", "b"}
    assert p.label_selector == [{NODE_ID_LABEL: n} for n in p.rank_nodes]
    assert check_tp_groups(p.rank_nodes, 4) is None
    assert p.scaling_kwargs()["label_selector"] == p.label_selector


def test_uses_fewest_nodes_and_best_fit():
    # the whole run fits on one node: pick the tightest node that holds it (leave the big one free)
    p = place(plan_for(dp=2, tp=2), [node("big", 16), node("small", 4), node("tiny", 2)])
    assert set(p.rank_nodes) == {"small"}
    # it does not fit on one: the roomiest nodes first
    p = place(plan_for(dp=4, tp=2), [node("a", 6), node("b", 2), node("c", 4)])
    assert p.fits and p.workers_per_node == {"a": 6, "c": 2}


def test_tp_group_that_cannot_share_a_node_does_not_fit():
    # 9 free slots in total (8 needed) but no node holds a whole tp=4 group
    p = place(plan_for(dp=2, tp=4), [node("a", 4, free=3), node("b", 4, free=3), node("c", 4, free=3)])
    assert not p.fits
    assert "tensor-parallel group" in p.reason and "[3, 3, 3]" in p.reason


def test_pipeline_stages_spread_only_when_needed():
    p = place(plan_for(pp=2, tp=2), [node("a", 4), node("b", 4)])
    assert len(set(p.rank_nodes)) == 1
    p = place(plan_for(pp=2, tp=2), [node("a", 2), node("b", 2)])
    assert p.fits and p.rank_nodes == [p.rank_nodes[0]] * 2 + [p.rank_nodes[2]] * 2
    assert p.rank_nodes[0] != p.rank_nodes[2]


def test_reservations_of_admitted_runs_count_as_used():
    first = place(plan_for(dp=4), [node("a", 6)])
    assert first.fits
    reserved = reservation(first)
    assert reserved == {"a": {"CPU": 4.0}}
    p = place(plan_for(dp=4), [node("a", 6)], reserved=reserved)
    assert not p.fits and p.reason == "needs 4 worker slots of 1 CPU; 2 free"
    assert add_reservations(reserved, reserved) == {"a": {"CPU": 8.0}}


def test_never_fits_names_the_cpu_setting_and_the_smaller_layout():
    """A 3-D layout on a 4-slot head: the 422 names the setting (with the value that fits: 8 workers + the driver)
    and the largest layout (dp halved first, then pp) that would fit now."""
    reason = never_fits(plan_for(dp=2, tp=2, pp=2), [node("a", 4)], cpu_setting="MESHRUN_RAY_NUM_CPUS")
    assert reason == ("needs 8 worker slots of 1 CPU; 4 in the cluster; restart the service with "
                      "MESHRUN_RAY_NUM_CPUS=9 (logical CPU slots; workers share cores) or use a smaller layout that "
                      "fits: dp=1, tp=2, pp=2 (4 workers)")
    assert "MESHRUN_RAY_NUM_CPUS" not in never_fits(plan_for(dp=8), [node("a", 4)])  # not the service's own head
    assert never_fits(plan_for(tp=4), [node(n, 2) for n in "ab"]).endswith("dp=1, tp=2, pp=1 (2 workers)")


def test_default_local_cpu_slots_fit_every_example(monkeypatch):
    import os

    from service.cluster.head import MIN_LOCAL_CPU_SLOTS, local_cpu_slots

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    slots_, note = local_cpu_slots(None)
    assert slots_ == MIN_LOCAL_CPU_SLOTS and "5.0x oversubscribed" in note and "MESHRUN_RAY_NUM_CPUS" in note
    assert local_cpu_slots(3)[0] == 3
    from pathlib import Path

    import yaml

    for path in sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        if path.name == "plan-7b.yaml":
            continue
        specs = [doc] if path.name != "sweep.yaml" else [
            {**doc["base"], "layout": lay} for lay in doc["search"]["layouts"]]
        for raw in specs:
            plan = build_plan(RunSpec.model_validate(raw))
            assert never_fits(plan, [node("head", slots_)]) is None, path.name


def test_never_fits_uses_totals_not_free():
    nodes = [node("a", 4, free=0), node("b", 4, free=0)]
    assert never_fits(plan_for(dp=8), nodes) is None  # busy now, but could run later
    assert never_fits(plan_for(dp=16), nodes) == ("needs 16 worker slots of 1 CPU; 8 in the cluster; use a smaller "
                                                  "layout that fits: dp=8, tp=1, pp=1 (8 workers)")
    assert "tensor-parallel group" in never_fits(plan_for(dp=2, tp=4), [node(n, 3, free=0) for n in "abc"])
    assert "no GPUs" in never_fits(plan_for(dp=1, device="gpu"), nodes)


def test_gpu_plan_places_one_worker_per_gpu():
    p = place(plan_for(dp=2, tp=2, device="gpu"), [node("g1", 32, gpus=2), node("g2", 32, gpus=2)])
    assert p.fits and p.use_gpu and p.resources_per_worker["GPU"] == 1.0
    assert p.workers_per_node == {"g1": 2, "g2": 2} and check_tp_groups(p.rank_nodes, 2) is None


def test_check_tp_groups_names_the_split_group():
    msg = check_tp_groups(["a", "a", "a", "b"], 2)
    assert msg is not None and "ranks 2..3" in msg
    assert check_tp_groups(["a", "a", "b", "b"], 2) is None


def test_placement_json_round_trip():
    p = place(plan_for(dp=2, tp=4), [node("a", 4), node("b", 4)])
    q = Placement.from_json(p.to_json())
    assert q.scaling_kwargs() == p.scaling_kwargs() and q.rank_nodes == p.rank_nodes


@pytest.mark.parametrize("dp,tp,pp", [(1, 1, 1), (2, 2, 1), (1, 2, 2), (2, 4, 1), (4, 1, 2)])
def test_every_layout_places_whole_tp_groups(dp, tp, pp):
    nodes = [node("a", 5), node("b", 3), node("c", 8)]
    p = place(plan_for(dp=dp, tp=tp, pp=pp), nodes)
    if p.fits:
        assert len(p.rank_nodes) == dp * tp * pp
        assert check_tp_groups(p.rank_nodes, tp) is None
        for n, c in p.workers_per_node.items():
            assert c % tp == 0 and c <= {"a": 5, "b": 3, "c": 8}[n]


# ------------------------------------------------------------------ admission (scheduler, fake cluster and jobs)
class FakeCluster:
    address = "127.0.0.1:6390"
    dashboard_url = "http://127.0.0.1:8266"

    def __init__(self, cpus: float = 6, free: float | None = None):
        from service.cluster.head import NodeView

        self.node = NodeView(node_id="n1", alive=True, address="127.0.0.1", total={"CPU": cpus},
                             free={"CPU": cpus if free is None else free})

    def nodes(self):
        return [self.node]


class FakeJobs:
    def __init__(self):
        self.submitted: list[dict] = []
        self.states: dict[str, str] = {}
        self.fail_submit = False

    def submit(self, **kw):
        if self.fail_submit:
            raise RuntimeError("dashboard unreachable")
        self.submitted.append(kw)
        self.states[kw["submission_id"]] = "PENDING"
        return kw["submission_id"]

    def state(self, job_id):
        from service.cluster.jobs import JobState

        return JobState(status=self.states.get(job_id, "MISSING"), message="boom" if job_id in self.states else None)

    def reset(self):
        pass


@pytest.fixture
def sched(tmp_path):
    from service.store.db import make_engine, make_sessionmaker
    from service.store.models import Base
    from service.control.scheduler import Scheduler
    from service.settings import Settings

    settings = Settings(data_dir=tmp_path)
    engine = make_engine(settings.database_url)
    Base.metadata.create_all(engine)
    factory = make_sessionmaker(engine)
    s = Scheduler(settings=settings, session_factory=factory, cluster=FakeCluster(), jobs=FakeJobs())
    yield s
    engine.dispose()


def _add_run(sched, name, *, dp=1, priority=0, max_failures=0):
    from service import store
    from service.store.db import session_scope

    plan = plan_for(dp=dp)
    spec = {"name": name, "resources": {"max_failures": max_failures}}
    with session_scope(sched.factory) as s:
        run, _ = store.create_run(s, spec=spec, plan=plan.model_dump(mode="json"), name=name,
                                  priority=priority)
        return run.id


def _run(sched, run_id):
    from service import store
    from service.store.db import session_scope

    with session_scope(sched.factory) as s:
        r = store.get_run(s, run_id=run_id)
        return r.status, r.status_reason, r.ray_job_id


def test_admission_counts_just_admitted_runs_and_keeps_fifo_with_priority(sched):
    a = _add_run(sched, "a", dp=4)
    b = _add_run(sched, "b", dp=4)
    c = _add_run(sched, "c", dp=1)
    sched.tick()
    assert _run(sched, a)[0] == "STARTING" and _run(sched, a)[2] == f"meshrun-{a}-1"
    job = sched.jobs.submitted[0]
    assert job["entrypoint"].endswith(f"-m service.runs.driver --run-id {a}")
    assert job["metadata"]["run_id"] == a and job["metadata"]["name"] == "a"
    env = job["runtime_env"]["env_vars"]
    # the driver reads the database URL from a 0600 file; the job's runtime_env never carries it
    assert "MESHRUN_DATABASE_URL" not in env and "MESHRUN_PLACEMENT" in env
    assert Path(env["MESHRUN_DATABASE_URL_FILE"]).read_text() == sched.settings.database_url
    # the cluster still reports 6 free CPUs (a's workers are not up yet): a's 4 count as used
    assert _run(sched, b)[:2] == ("QUEUED", "needs 4 worker slots of 1 CPU; 2 free")
    assert _run(sched, c)[0] == "QUEUED" and "waiting behind run" in _run(sched, c)[1]  # no overtaking
    # a higher priority run goes first
    d = _add_run(sched, "d", dp=2, priority=10)
    sched.tick()
    assert _run(sched, d)[0] == "STARTING" and _run(sched, b)[0] == "QUEUED"


def test_reconcile_fails_runs_whose_job_is_gone(sched):
    a = _add_run(sched, "a", dp=1)
    sched.tick()
    job_id = _run(sched, a)[2]
    sched.jobs.states[job_id] = "RUNNING"
    sched.tick()
    assert _run(sched, a)[0] == "STARTING"
    sched.jobs.states[job_id] = "FAILED"
    sched.tick()
    status, reason, _ = _run(sched, a)
    assert status == "FAILED" and reason.startswith(f"driver lost: Ray Job {job_id} is FAILED: boom")
    # a job Ray does not know at all (e.g. the head restarted)
    b = _add_run(sched, "b", dp=1)
    sched.tick()
    sched.jobs.states.pop(_run(sched, b)[2])
    sched.tick()
    assert _run(sched, b)[0] == "FAILED" and "is gone from the Ray cluster" in _run(sched, b)[1]


def test_a_lost_driver_is_resubmitted_while_max_failures_allows(sched):
    a = _add_run(sched, "a", dp=1, max_failures=1)
    sched.tick()
    first = _run(sched, a)[2]
    sched.jobs.states[first] = "FAILED"  # its driver killed: Ray ends the job
    sched.tick()  # reconcile: re-queued to resume (no checkpoint yet), then admitted again as a new Ray Job
    status, reason, job = _run(sched, a)
    assert status == "STARTING" and job == f"meshrun-{a}-2", (status, reason, job)
    events = _events(sched, a)
    assert [e for e in events if e[0] == "driver_lost"] == [
        ("driver_lost", f"driver lost: Ray Job {first} is FAILED: boom; resuming from scratch (no checkpoint yet) "
                        "(failure 1 of max_failures=1)")]
    sched.jobs.states.pop(job)  # the second loss is past max_failures=1
    sched.tick()
    status, reason, _ = _run(sched, a)
    assert status == "FAILED" and reason.startswith(f"driver lost: Ray Job {job} is gone from the Ray cluster")
    assert "not resumed: max_failures=1 reached" in reason and f"POST /v1/runs/{a}/resume" in reason


def _events(sched, run_id):
    from service import store
    from service.store.db import session_scope

    with session_scope(sched.factory) as s:
        return [(e.kind, e.reason) for e in store.list_events(s, run_id=run_id)]


def test_failed_submission_requeues_with_the_reason(sched):
    sched.jobs.fail_submit = True
    a = _add_run(sched, "a", dp=1)
    sched.tick()
    status, reason, _ = _run(sched, a)
    assert status == "QUEUED" and "dashboard unreachable" in reason
    sched.jobs.fail_submit = False
    sched.tick()
    assert _run(sched, a)[0] == "STARTING" and _run(sched, a)[2] == f"meshrun-{a}-2"


def test_reconcile_fails_a_running_run_whose_pinned_node_died(sched):
    from service import store
    from service.store.db import session_scope
    from service.cluster.head import NodeView

    stopped = []
    sched.jobs.stop = lambda job_id: stopped.append(job_id) or True
    a = _add_run(sched, "a", dp=2)
    sched.tick()
    job_id = _run(sched, a)[2]
    sched.jobs.states[job_id] = "RUNNING"
    with session_scope(sched.factory) as s:
        store.transition(s, run_id=a, to="RUNNING", reason="driver started", rank_nodes={"0": "n1", "1": "n2"})
    dead = NodeView(node_id="n2", alive=False, address=None, total={"CPU": 4.0})
    sched.cluster.nodes = lambda: [sched.cluster.node, dead]
    sched.tick()
    status, reason, _ = _run(sched, a)
    assert status == "FAILED" and reason.startswith("node lost: n2") and "resume" in reason
    assert stopped == [job_id]


def test_ray_worker_tp_check_matches_the_rank_order():
    from workers.ray_worker import check_tp_groups as worker_check

    assert worker_check(["a"] * 4 + ["b"] * 4, 4) is None
    msg = worker_check(["a", "a", "b", "b"], 4)
    assert msg is not None and "ranks 0..3" in msg and "tp=4" in msg


def test_a_sweep_trials_run_joins_the_same_queue_and_gets_no_ray_job_of_its_own(sched):
    """A trial's run (sweep_id set) waits in FIFO order like any run; admitted, it moves to STARTING with the
    reservation counted, and no Ray Job is submitted (its sweep's driver starts its workers). A queued trial whose
    sweep's Ray Job is gone is failed so it cannot block the queue."""
    from service import store
    from service.store.db import session_scope
    from service.store.models import Sweep

    with session_scope(sched.factory) as s:
        for sid in ("sw_a", "sw_b"):
            s.add(Sweep(id=sid, name=sid, project="default", status="RUNNING", objective="tokens_per_s", spec={}))
    big = _add_run(sched, "big", dp=8)  # waits: 6 CPUs
    trial = _add_run(sched, "trial", dp=2)
    gone = _add_run(sched, "gone-trial", dp=2)
    with session_scope(sched.factory) as s:
        for rid, sid, job in ((trial, "sw_a", "meshrun-sw_a-1"), (gone, "sw_b", "meshrun-sw_b-1")):
            r = store.get_run(s, run_id=rid)
            r.sweep_id, r.ray_job_id = sid, job
    sched.jobs.states["meshrun-sw_a-1"] = "RUNNING"  # sw_b's job: MISSING
    sched.tick()
    assert _run(sched, big)[:2] == ("QUEUED", "needs 8 worker slots of 1 CPU; 6 free")
    assert _run(sched, trial)[0] == "QUEUED" and "waiting behind run" in _run(sched, trial)[1]
    assert _run(sched, gone)[0] == "FAILED" and "meshrun-sw_b-1 is gone from the Ray cluster" in _run(sched, gone)[1]
    with session_scope(sched.factory) as s:
        store.transition(s, run_id=big, to="CANCELLED", reason="test")
    submitted = len(sched.jobs.submitted)
    sched.tick()
    status, reason, job = _run(sched, trial)
    assert status == "STARTING" and reason.startswith("admitted: starting in the sweep's Ray Job") \
        and job == "meshrun-sw_a-1"
    # its start-up phases: queued with the reason, once per new reason (not every tick), then admitted
    with session_scope(sched.factory) as s:
        phases = [e.reason for e in store.list_events(s, run_id=trial, kinds=["phase"])]
    assert [p.split(" [+")[0].split(" run-")[0] for p in phases] == [
        "queued: waiting behind run", "admitted: starting in the sweep's Ray Job"], phases
    assert len(sched.jobs.submitted) == submitted and trial in sched.pending

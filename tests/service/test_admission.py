"""Admission decides on plain data (``service.control.admission.decide``): no database, no Ray, no side effects."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from service.cluster.placement import NodeCapacity
from service.control.admission import Candidate, admission_order, decide

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def plan(world: int, *, tp: int = 1, cpus: float = 1.0) -> dict:
    return {"world_size": world, "tp": tp, "device": "cpu", "resources_per_worker": {"CPU": cpus}}


def run(i: int, world: int = 1, *, priority: int = 0, **kw) -> Candidate:
    return Candidate(id=f"run-{i}", plan=plan(world, **kw), priority=priority, queued_at=T0 + timedelta(seconds=i))


def node(name: str, free: float, total: float | None = None) -> NodeCapacity:
    return NodeCapacity(node_id=name, total={"CPU": total if total is not None else free}, free={"CPU": free})


def actions(p) -> list[tuple[str, str]]:
    return [(d.candidate.id, d.action) for d in p.decisions]


def test_admits_in_priority_then_fifo_order_and_counts_what_it_admits():
    queue = [run(1, 4), run(2, 2), run(3, 1, priority=5)]
    p = decide(queue, [node("n1", 6)])
    # run-3 first (priority), then run-1 (4 CPUs: 5 left -> 1), then run-2 needs 2: waits
    assert actions(p) == [("run-3", "admit"), ("run-1", "admit"), ("run-2", "wait")]
    assert p.of("wait")[0].reason == "needs 2 worker slots of 1 CPU; 1 free"
    assert p.reserved == {"n1": {"CPU": 5.0}}
    admitted = p.of("admit")[0]
    assert admitted.placement is not None and admitted.placement.rank_nodes == ["n1"]
    assert admitted.reason == "admitted: 1 workers (n1: 1)"


def test_no_overtaking_once_one_waits():
    p = decide([run(1, 8), run(2, 1)], [node("n1", 6)])
    assert actions(p) == [("run-1", "wait"), ("run-2", "wait")]
    assert p.decisions[1].reason == "waiting behind run run-1 (FIFO within priority)"


def test_reservations_of_runs_admitted_earlier_count_as_used():
    p = decide([run(1, 4)], [node("n1", 6)], reserved={"n1": {"CPU": 3.0}})
    assert actions(p) == [("run-1", "wait")] and "3 free" in p.decisions[0].reason
    assert decide([run(1, 3)], [node("n1", 6)], reserved={"n1": {"CPU": 3.0}}).of("admit")


def test_tensor_parallel_groups_stay_on_one_node():
    # 2 nodes with 3 free CPUs each: a tp=2 run of 4 workers needs 2 groups of 2 -> one group per node
    p = decide([run(1, 4, tp=2)], [node("a", 3), node("b", 3)])
    (d,) = p.decisions
    assert d.action == "admit" and d.placement is not None
    assert d.placement.rank_nodes in (["a", "a", "b", "b"], ["b", "b", "a", "a"])
    # tp=4 cannot fit on either node
    p = decide([run(1, 4, tp=4)], [node("a", 3), node("b", 3)])
    assert p.decisions[0].action == "wait" and "tensor-parallel group" in p.decisions[0].reason


def test_a_candidate_without_a_plan_fails_and_does_not_block():
    queue = [Candidate(id="run-1", plan=None, queued_at=T0), run(2, 1)]
    p = decide(queue, [node("n1", 1)])
    assert actions(p) == [("run-1", "fail"), ("run-2", "admit")]
    assert p.decisions[0].reason == "the run has no plan"


def test_trials_can_be_candidates_in_the_same_queue():
    trial = Candidate(id="7", plan=plan(2), queued_at=T0, kind="trial", label="trial 7 of sweep sweep-1")
    p = decide([trial, run(5, 2)], [node("n1", 3)])
    assert actions(p) == [("7", "admit"), ("run-5", "wait")]
    assert p.decisions[1].reason == "needs 2 worker slots of 1 CPU; 1 free"
    p = decide([trial, run(5, 2)], [node("n1", 1)])
    assert p.decisions[1].reason == "waiting behind trial 7 of sweep sweep-1 (FIFO within priority)"


def test_decide_has_no_side_effects_on_its_inputs():
    queue = [run(1, 2), run(2, 2)]
    nodes = [node("n1", 4)]
    reserved = {"n1": {"CPU": 1.0}}
    first = decide(queue, nodes, reserved)
    assert reserved == {"n1": {"CPU": 1.0}} and nodes[0].free == {"CPU": 4.0}
    assert actions(decide(queue, nodes, reserved)) == actions(first)


def test_admission_order():
    a, b, c = run(1), run(2, priority=1), Candidate(id="run-0", plan=plan(1), queued_at=None)
    assert [x.id for x in admission_order([a, b, c])] == ["run-2", "run-1", "run-0"]

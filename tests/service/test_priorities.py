"""service.control.priorities: project quotas and the choice of runs to preempt (pure, no database or Ray)."""

from __future__ import annotations

from datetime import UTC, datetime

from api.spec import RunSpec
from api.spec.validation import build_plan
from service.cluster.placement import NodeCapacity
from service.control.admission import Candidate
from service.control.priorities import Holding, choose_victims, plan_admission, quota_waits


def _plan(dp: int, cpus: float = 1) -> dict:
    spec = RunSpec.model_validate(
        {"layout": {"dp": dp}, "batch": {"global_batch_size": 4 * dp, "micro_batch_size": 2},
         "model": {"preset": "tiny"}, "resources": {"device": "cpu", "cpus_per_worker": cpus}}
    )
    return build_plan(spec).model_dump(mode="json")


NODES = [NodeCapacity("n1", total={"CPU": 4.0}, free={"CPU": 0.0})]


def _holding(rid: str, project: str, priority: int, dp: int, started: int) -> Holding:
    return Holding(rid, project, priority, _plan(dp), {str(r): "n1" for r in range(dp)},
                   datetime(2026, 1, 1, 0, started, tzinfo=UTC))


def test_quota_names_the_project_and_does_not_block_other_projects() -> None:
    queue = [Candidate("a2", _plan(2), queued_at=datetime(2026, 1, 1, tzinfo=UTC)),
             Candidate("b1", _plan(2), queued_at=datetime(2026, 1, 2, tzinfo=UTC))]
    holding = [_holding("a1", "team-a", 0, 2, 0)]
    waits = quota_waits(queue, {"a2": "team-a", "b1": "team-b"}, holding, {"team-a": 3})
    assert list(waits) == ["a2"]
    assert "project 'team-a' quota: at most 3 workers at once; 2 in use, this run needs 2" in waits["a2"]
    # "*" covers every project without its own quota; runs of one pass count against it in order
    two = [Candidate("b1", _plan(2), queued_at=datetime(2026, 1, 1, tzinfo=UTC)),
           Candidate("b2", _plan(2), queued_at=datetime(2026, 1, 2, tzinfo=UTC))]
    assert list(quota_waits(two, {"b1": "team-b", "b2": "team-b"}, [], {"*": 3})) == ["b2"]
    assert quota_waits(queue, {}, holding, {}) == {}


def test_victims_are_the_fewest_lowest_priority_newest_runs_that_make_room() -> None:
    high = Candidate("hi", _plan(2), priority=10)
    holding = [_holding("old", "p", 0, 2, 0), _holding("new", "p", 0, 2, 5), _holding("mid", "p", 5, 2, 9)]
    victims = choose_victims(high, "p", NODES, {}, holding, "any")
    assert [v.id for v in victims or []] == ["new"]  # priority 0 before 5; the most recently started first
    big = Candidate("big", _plan(4), priority=10)
    assert [v.id for v in choose_victims(big, "p", NODES, {}, holding, "any") or []] == ["new", "old"]


def test_no_preemption_when_off_not_lower_priority_or_another_project() -> None:
    high = Candidate("hi", _plan(2), priority=10)
    holding = [_holding("x", "other", 0, 4, 0)]
    assert choose_victims(high, "p", NODES, {}, holding, "off") is None
    assert choose_victims(high, "p", NODES, {}, holding, "project") is None  # another project's run
    assert [v.id for v in choose_victims(high, "p", NODES, {}, holding, "any") or []] == ["x"]
    same = Candidate("same", _plan(2), priority=0)
    assert choose_victims(same, "other", NODES, {}, holding, "any") is None  # equal priority never preempts
    huge = Candidate("huge", _plan(8), priority=10)
    assert choose_victims(huge, "p", NODES, {}, holding, "any") is None  # nothing makes room for 8 workers


def test_an_admission_pass_is_decided_without_writing() -> None:
    """``plan_admission`` returns every reason, decision and victim of a pass as data (no session, no Ray)."""
    t = [datetime(2026, 1, d, tzinfo=UTC) for d in (1, 2, 3, 4)]
    queue = [Candidate("held", _plan(1), priority=10, queued_at=t[0]),
             Candidate("over", _plan(2), priority=10, queued_at=t[1]),
             Candidate("hi", _plan(2), priority=10, queued_at=t[2]),
             Candidate("lo", _plan(1), priority=0, queued_at=t[3])]
    projects = {"held": "p", "over": "q", "hi": "p", "lo": "p"}
    holding = [_holding("victim", "p", 0, 2, 0), _holding("q-run", "q", 0, 2, 1)]
    nodes = [NodeCapacity("n1", total={"CPU": 4.0}, free={"CPU": 0.0})]
    plan = plan_admission(queue, projects, holding, {"held": "meshrun-held-1"}, nodes, {},
                          quotas={"q": 2}, preemption="any")
    assert plan.reasons["held"] == "re-planned: waiting for its previous Ray Job meshrun-held-1 to stop"
    assert "project 'q' quota" in plan.reasons["over"]
    assert [(d.candidate.id, d.action) for d in plan.decisions] == [("hi", "wait"), ("lo", "wait")]
    assert plan.preempt_for is not None and plan.preempt_for.id == "hi"
    assert [v.id for v in plan.victims] == ["q-run"]  # the most recently started run of the lowest priority
    assert plan.decisions[0].reason.endswith("; preempting lower-priority q-run (they checkpoint first)")
    off = plan_admission(queue, projects, holding, {}, nodes, {}, quotas={}, preemption="off")
    assert off.victims == [] and off.preempt_for is None and "preempting" not in off.decisions[0].reason

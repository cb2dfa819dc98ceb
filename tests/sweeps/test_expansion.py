"""Search-space expansion: validation, planner predictions, infeasible/unplaceable/over-budget candidates, auto."""

from __future__ import annotations

import pytest

from api.spec import Layout, SweepCreate
from api.spec.validation import SpecError, check_spec
from service.sweeps import TrialStatus, best_trial, expand, trial_spec
from tests.sweeps.conftest import FakeRuntime, cpu_cluster, tiny_base

LAYOUTS = [{"dp": 2}, {"tp": 2}, {"pp": 2}, {"dp": 2, "tp": 2}, {"tp": 3}]


def make(**over) -> SweepCreate:
    body = {
        "name": "sw",
        "base": tiny_base(),
        "search": {"layouts": LAYOUTS, "micro_batch_sizes": [1, 2]},
        "budget": {"max_trials": 16, "steps_per_trial": 6, "warmup_steps": 2},
    }
    body.update(over)
    return SweepCreate.model_validate(body)


def test_trial_spec_overrides_layout_batch_steps_and_checkpointing():
    create = make(base=tiny_base(checkpoint={"every_steps": 5}))
    spec = trial_spec(create, {"dp": 2, "tp": 2}, 1, name="sw-t3", labels={"trial": "3"})
    assert spec.layout == Layout(dp=2, tp=2)
    assert spec.batch.micro_batch_size == 1 and spec.batch.global_batch_size == 8
    assert spec.train.steps == 6 and spec.checkpoint.every_steps == 0
    assert spec.name == "sw-t3" and spec.labels["trial"] == "3"
    assert check_spec(spec).ok


def test_explicit_grid_skips_invalid_with_the_field_and_predicts_the_rest():
    drafts = expand(make(), cluster=cpu_cluster(), never_fits=None)
    assert len(drafts) == 10
    by = {(d.layout.dp, d.layout.tp, d.layout.pp, d.micro_batch_size): d for d in drafts}
    for mb in (1, 2):
        bad = by[(1, 3, 1, mb)]
        assert bad.status == TrialStatus.SKIPPED
        assert "layout.tp" in bad.reason and "tp=3" in bad.reason
    runnable = [d for d in drafts if d.status == TrialStatus.PENDING]
    assert len(runnable) == 8
    assert all(d.predicted is not None and d.predicted.tokens_per_s > 0 and d.predicted.feasible for d in runnable)


def test_without_a_cluster_nothing_is_predicted_and_auto_is_refused():
    drafts = expand(make(), cluster=None)
    assert all(d.predicted is None for d in drafts)
    with pytest.raises(SpecError) as e:
        expand(make(search={"layouts": "auto"}), cluster=None)
    assert e.value.param == "search.layouts"


def test_predicted_oom_is_skipped_unless_skip_memory_check():
    tiny_mem = cpu_cluster(memory_bytes=1 << 20)  # 1 MiB per worker: nothing fits
    drafts = expand(make(search={"layouts": [{"dp": 2}]}), cluster=tiny_mem)
    assert [d.status for d in drafts] == [TrialStatus.SKIPPED]
    assert drafts[0].reason.startswith("predicted not to fit") and "skip_memory_check" in drafts[0].reason
    forced = expand(make(search={"layouts": [{"dp": 2}]}, base=tiny_base(skip_memory_check=True)), cluster=tiny_mem)
    assert forced[0].status == TrialStatus.PENDING and "run anyway" in forced[0].reason


def test_unplaceable_layout_is_skipped_with_the_capacity_reason(tmp_path):
    rt = FakeRuntime(None, None, cpus=4)
    drafts = expand(
        make(search={"layouts": [{"dp": 2}, {"dp": 8}], "micro_batch_sizes": [1]}),
        cluster=cpu_cluster(4),
        never_fits=rt.never_fits,
    )
    assert drafts[0].status == TrialStatus.PENDING
    assert drafts[1].status == TrialStatus.SKIPPED and drafts[1].reason.startswith("cannot be placed")


def test_budget_keeps_the_predicted_fastest():
    create = make(budget={"max_trials": 3, "steps_per_trial": 6, "warmup_steps": 2})
    drafts = expand(create, cluster=cpu_cluster())
    kept = [d for d in drafts if d.status == TrialStatus.PENDING]
    over = [d for d in drafts if d.reason and d.reason.startswith("over budget")]
    assert len(kept) == 3 and len(over) == 5
    assert min(d.predicted.tokens_per_s for d in kept) >= max(d.predicted.tokens_per_s for d in over)


def test_warmup_must_leave_measured_steps():
    with pytest.raises(SpecError) as e:
        expand(make(budget={"steps_per_trial": 4, "warmup_steps": 4}), cluster=None)
    assert e.value.param == "budget.warmup_steps"


def test_auto_gives_feasible_planner_candidates_best_first():
    create = make(search={"layouts": "auto"}, budget={"max_trials": 4, "steps_per_trial": 6, "warmup_steps": 2})
    drafts = expand(create, cluster=cpu_cluster(4))
    assert 1 <= len(drafts) <= 4 * 3  # top_k per world size, merged
    pending = [d for d in drafts if d.status == TrialStatus.PENDING]
    assert 1 <= len(pending) <= 4
    preds = [d.predicted.tokens_per_s for d in pending]
    assert preds == sorted(preds, reverse=True)
    for d in pending:
        assert d.layout.world_size <= 4 and d.predicted.feasible
        assert check_spec(trial_spec(create, d.layout, d.micro_batch_size)).ok


def test_auto_keeps_the_base_world_size():
    create = make(base=tiny_base(layout={"dp": 2}), search={"layouts": "auto"})
    drafts = expand(create, cluster=cpu_cluster(6))
    assert drafts and all(d.layout.world_size == 2 for d in drafts)


def test_auto_with_the_cost_objective_puts_the_most_tokens_per_device_second_first():
    budget = {"max_trials": 8, "steps_per_trial": 6, "warmup_steps": 2}
    by_cost = expand(make(search={"layouts": "auto"}, objective="cost", budget=budget), cluster=cpu_cluster(4))
    by_time = expand(make(search={"layouts": "auto"}, budget=budget), cluster=cpu_cluster(4))
    per_device = [d.predicted.tokens_per_s / d.layout.world_size for d in by_cost if d.status == TrialStatus.PENDING]
    assert len(per_device) >= 2 and per_device == sorted(per_device, reverse=True)
    assert {d.layout.world_size for d in by_cost} == {2, 4}  # both worlds compete
    fastest = max((d for d in by_time if d.status == TrialStatus.PENDING), key=lambda d: d.predicted.tokens_per_s)
    assert per_device[0] >= fastest.predicted.tokens_per_s / fastest.layout.world_size


class _T:
    def __init__(self, id, status, tps, mfu=None, layout=None):
        self.id, self.status, self.measured_tokens_per_s, self.measured_mfu = id, status, tps, mfu
        self.layout = layout or {"dp": 1}


def test_best_trial_is_the_highest_measured_among_finished_ones():
    trials = [
        _T(1, "SUCCEEDED", 100.0, 0.2),
        _T(2, "FAILED", 500.0, 0.9),
        _T(3, "EARLY_STOPPED", 40.0, 0.5),
        _T(4, "SUCCEEDED", 300.0, 0.1),
        _T(5, "SKIPPED", None),
    ]
    assert best_trial(trials, "tokens_per_s").id == 4
    assert best_trial(trials, "mfu").id == 3
    assert best_trial([_T(1, "FAILED", 10.0)], "tokens_per_s") is None
    # cost: tokens per device-second, so 300 tokens/s on 4 workers loses to 100 on 1
    cheap = [_T(1, "SUCCEEDED", 100.0, layout={"dp": 1}), _T(2, "SUCCEEDED", 300.0, layout={"dp": 4})]
    assert best_trial(cheap, "cost").id == 1 and best_trial(cheap, "tokens_per_s").id == 2


def test_a_candidate_that_cannot_sit_beside_the_sweeps_trial_drivers_is_skipped_before_it_starts():
    """6 CPU slots: dp=6 fits an empty cluster, not beside the trial drivers' CPU slivers (the hang of issue 19)."""
    rt = FakeRuntime(None, None, cpus=6)
    drafts = expand(
        make(
            search={"layouts": [{"dp": 6}, {"dp": 2}], "micro_batch_sizes": [1]},
            base=tiny_base(batch={"global_batch_size": 12, "micro_batch_size": 1}),
        ),
        cluster=cpu_cluster(),
        never_fits=lambda plan: rt.never_fits(plan, reserved_cpu=0.01),
    )
    six, two = drafts
    assert six.status == TrialStatus.SKIPPED and six.reason.startswith("cannot be placed on this cluster: needs 6")
    assert "trial drivers hold" in six.reason
    assert two.status == TrialStatus.PENDING


def test_add_auto_keeps_the_listed_layouts_first_and_adds_the_planners():
    create = make(search={"layouts": [{"dp": 2}], "micro_batch_sizes": [1], "add_auto": True})
    drafts = expand(create, cluster=cpu_cluster(4), never_fits=None)
    assert (drafts[0].layout, drafts[0].micro_batch_size) == (Layout(dp=2), 1) and drafts[0].explicit
    assert len(drafts) > 1 and not any(d.explicit for d in drafts[1:])
    keys = [(d.layout.model_dump_json(), d.micro_batch_size) for d in drafts]
    assert len(keys) == len(set(keys))  # the listed layout is not repeated by auto


def test_auto_measures_exactly_the_candidates_within_the_best_ones_uncertainty():
    from service.sweeps.expansion import auto_candidates, within_best

    create = make(search={"layouts": "auto"}, budget={"max_trials": 8, "steps_per_trial": 6, "warmup_steps": 2})
    cands = auto_candidates(create, cpu_cluster(4))
    assert cands and all(c.step_time_interval.kernels == "eager" for c in cands)  # meshrun's loop prices its trials
    best = cands[0]
    lo0 = best.tokens_per_s / (1 + best.step_time_interval.above)
    assert all(c.tokens_per_s / (1 - c.step_time_interval.below) >= lo0 for c in cands)
    # by hand: 100, 85 and 70 tokens/s, each interval -10 % / +10 % of the step time: the best's objective may be as
    # low as 100 / 1.1 = 90.9; 85 / 0.9 = 94.4 reaches it, 70 / 0.9 = 77.8 does not
    iv = best.step_time_interval.model_copy(update={"below": 0.1, "above": 0.1})
    made = [best.model_copy(update={"tokens_per_s": v, "step_time_interval": iv}) for v in (100.0, 85.0, 70.0)]
    assert [c.tokens_per_s for c in within_best(made, "tokens_per_s")] == [100.0, 85.0]
    assert within_best([], "tokens_per_s") == []

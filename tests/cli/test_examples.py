"""Every example run spec validates and resolves to a plan; the sweep and plan examples parse as their models."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from api.spec import PlanRequest, RunSpec, SweepCreate
from api.spec.validation import build_plan

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
RUN_SPECS = sorted(p for p in EXAMPLES.glob("*.yaml") if p.name not in ("sweep.yaml", "plan-7b.yaml"))


def test_there_is_an_example_per_strategy():
    layouts = [RunSpec.model_validate(yaml.safe_load(p.read_text())).layout for p in RUN_SPECS]
    assert any(l.dp > 1 and l.zero_stage == 0 and l.tp == l.pp == 1 for l in layouts)  # DDP
    for stage in (1, 2, 3):
        assert any(l.zero_stage == stage for l in layouts)
    assert any(l.shard_group_size for l in layouts)  # HSDP
    assert any(l.tp > 1 and l.sequence_parallel for l in layouts)
    assert {l.pp_schedule for l in layouts if l.pp > 1} >= {"gpipe", "1f1b", "interleaved_1f1b"}
    assert any(l.dp > 1 and l.tp > 1 and l.pp > 1 for l in layouts)  # 3-D
    assert any(RunSpec.model_validate(yaml.safe_load(p.read_text())).data.source == "text" for p in RUN_SPECS)
    assert {l.sync for l in layouts} >= {"sync", "async_ps", "local_sgd", "diloco"}


@pytest.mark.parametrize("path", RUN_SPECS, ids=lambda p: p.name)
def test_example_run_spec_builds_a_plan(path):
    spec = RunSpec.model_validate(yaml.safe_load(path.read_text()))
    plan = build_plan(spec)
    assert plan.world_size == spec.layout.dp * spec.layout.tp * spec.layout.pp
    assert plan.world_size <= 8  # runs on a laptop


def test_gpt_3d_demo_is_dp2_tp2_pp2():
    spec = RunSpec.model_validate(yaml.safe_load((EXAMPLES / "gpt-3d-demo.yaml").read_text()))
    assert (spec.layout.dp, spec.layout.tp, spec.layout.pp) == (2, 2, 2)


def test_cli_embedded_demo_spec_matches_the_example_file():
    from api.cli._common import DEMO_SPEC

    assert yaml.safe_load((EXAMPLES / "demo.yaml").read_text()) == DEMO_SPEC


def test_sweep_and_plan_examples_parse():
    sweep = SweepCreate.model_validate(yaml.safe_load((EXAMPLES / "sweep.yaml").read_text()))
    build_plan(sweep.base)
    for lay in sweep.search.layouts:
        build_plan(sweep.base.model_copy(update={"layout": lay}))
    PlanRequest.model_validate(yaml.safe_load((EXAMPLES / "plan-7b.yaml").read_text()))


def test_quickstart_compiles():
    compile((EXAMPLES / "quickstart.py").read_text(), "quickstart.py", "exec")

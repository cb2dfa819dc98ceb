"""One layout type end to end (issue 30): the spec's ``Layout`` resolves once into ``api.spec.ResolvedLayout``,
which the planner, placement, the stored plan, the workers and the console all use."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from api.spec import Layout, LayoutError, Plan, ResolvedLayout, RunSpec, build_plan, layout_label

ROOT = Path(__file__).resolve().parents[1]


def resolve(**kw) -> ResolvedLayout:
    return ResolvedLayout.of(Layout(**kw))


def spec(**layout) -> RunSpec:
    dp = layout.get("dp", 1)
    return RunSpec.model_validate(
        {
            "model": {"name": "gpt", "preset": "tiny"},
            "layout": layout,
            "batch": {"global_batch_size": 4 * dp, "micro_batch_size": 1},
            "resources": {"device": "cpu"},
        }
    )


# ------------------------------------------------------------------------------------------- one class
def test_planner_placement_workers_console_use_the_one_layout_class():
    """Each consumer's module names ``ResolvedLayout`` and gets it from ``api.spec`` -- the same class object."""
    import importlib

    mods = {
        name: importlib.import_module(name)  # ``import a.b.c as x`` would give the planner's search() function
        for name in (
            "service.planner.core",
            "service.planner.search",
            "service.cluster.placement",
            "workers.parallel_dims",
            "workers.parallelize",
            "service.app.console.web",
            "api.spec.layout",
        )
    }
    for name in list(mods)[:4]:  # planner, placement, workers
        assert mods[name].ResolvedLayout is ResolvedLayout, name
    assert mods["workers.parallelize"].ParallelDims is mods["workers.parallel_dims"].ParallelDims
    assert mods["workers.parallel_dims"].ParallelDims.__dataclass_fields__["layout"].type == "ResolvedLayout"
    console = mods["service.app.console.web"]  # the console's layout filter is str(ResolvedLayout)
    assert console.templates.env.filters["layout"](Layout(dp=2, tp=2)) == str(ResolvedLayout.of(Layout(dp=2, tp=2)))
    assert console.layout_label is mods["api.spec.layout"].layout_label
    assert ResolvedLayout.__module__ == "api.spec.layout"


def test_no_positional_layout_tuple_and_no_private_sdk_import_in_the_service():
    src = {p: p.read_text() for p in (ROOT / "service").rglob("*.py")}
    assert not [p for p, s in src.items() if "Lay(" in s or "class Lay" in s]
    assert not [p for p, s in src.items() if "api.sdk._" in s]
    for path, text in src.items():  # the layout's own text is the only formatter: no layout_str / short_layout
        names = {n.name for n in ast.walk(ast.parse(text)) if isinstance(n, ast.FunctionDef)}
        assert not names & {"layout_str", "short_layout"}, path


def test_api_layout_module_imports_no_torch():
    code = "import sys, api.spec.layout, api.spec; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# ------------------------------------------------------------------------------------------ resolution
def test_degrees_world_size_and_shard_degree():
    lay = resolve(dp=8, tp=2, pp=2, zero_stage=3, shard_group_size=4)
    assert (lay.pp, lay.dp_replicate, lay.dp_shard, lay.tp) == (2, 2, 4, 2)
    assert lay.mesh_shape == (2, 2, 4, 2) and lay.dp == 8 and lay.world_size == 32
    assert lay.shard_degree == 4 and lay.shard_group_size == 4
    full = resolve(dp=8, zero_stage=3)  # FSDP over all of dp: no replicas
    assert (full.dp_replicate, full.dp_shard, full.shard_degree, full.shard_group_size) == (1, 8, 8, None)
    z1 = resolve(dp=4, zero_stage=1)  # optimizer states sharded over dp, parameters replicated
    assert (z1.dp_replicate, z1.dp_shard, z1.shard_degree) == (4, 1, 4)
    z0 = resolve(dp=4)
    assert (z0.dp_replicate, z0.dp_shard, z0.shard_degree) == (4, 1, 1)


@pytest.mark.parametrize(
    "layout,wrapper,hsdp,mesh_dims",
    [
        (dict(dp=1), "none", False, ("dp_shard",)),
        (dict(dp=4), "ddp", False, ("dp_shard",)),
        (dict(dp=4, zero_stage=1), "ddp", False, ("dp_shard",)),
        (dict(dp=2, tp=2), "fsdp", True, ("dp_replicate", "dp_shard")),  # replicated FSDP2: DDP takes no DTensor
        (dict(dp=4, zero_stage=3), "fsdp", False, ("dp_shard",)),
        (dict(dp=4, zero_stage=2, shard_group_size=2), "fsdp", True, ("dp_replicate", "dp_shard")),
        (dict(dp=4, zero_stage=3, shard_group_size=2, sync="diloco"), "fsdp", False, ("dp_shard",)),
        (dict(dp=4, sync="local_sgd"), "none", False, ("dp_shard",)),
    ],
)
def test_data_parallel_flavour_is_decided_by_the_layout(layout, wrapper, hsdp, mesh_dims):
    lay = resolve(**layout)
    assert (lay.dp_wrapper, lay.hsdp, lay.fsdp_mesh_dims) == (wrapper, hsdp, mesh_dims)


def test_flavours_travel_with_the_degrees():
    lay = resolve(dp=2, tp=2, pp=2, sequence_parallel=True, pp_schedule="interleaved_1f1b", pp_virtual_stages=2)
    assert lay.sequence_parallel and lay.pp_schedule == "interleaved_1f1b" and lay.pp_stages_total == 4
    assert resolve(dp=2, zero_stage=2).reshard_after_forward is False
    assert resolve(dp=2, zero_stage=3, cpu_offload=True).cpu_offload
    assert resolve(dp=2, grad_compression="bf16").ddp_compression == "bf16"
    assert resolve(dp=2, zero_stage=1, grad_compression="bf16").ddp_compression == "none"
    assert resolve(dp=4, sync="diloco", sync_every_steps=16).periodic


def test_round_trip_to_the_spec_layout():
    for kw in (dict(dp=8, tp=2, zero_stage=3, shard_group_size=4, sequence_parallel=True), dict(dp=2, pp=2)):
        assert resolve(**kw).to_layout() == Layout(**kw)


def test_immutable():
    lay = resolve(dp=2)
    with pytest.raises(ValidationError):
        lay.tp = 2  # type: ignore[misc]
    assert lay.replace(tp=2).tp == 2 and lay.tp == 1


@pytest.mark.parametrize(
    "layout,text",
    [
        (dict(dp=2), "dp2"),
        (dict(dp=1, tp=2), "dp1 tp2"),
        (dict(dp=2, tp=2, pp=2), "dp2 tp2 pp2 1f1b"),
        (dict(dp=4, zero_stage=3, shard_group_size=2, sequence_parallel=True, tp=2), "dp4 tp2 zero3 hsdp/2 sp"),
        (dict(dp=1, pp=2, pp_schedule="interleaved_1f1b", pp_virtual_stages=2), "dp1 pp2 interleaved_1f1bx2"),
        (dict(dp=2, grad_compression="fp16"), "dp2 gc:fp16"),
        (dict(dp=2, zero_stage=3, cpu_offload=True), "dp2 zero3 offload"),
        (dict(dp=4, sync="diloco", sync_every_steps=16), "dp4 diloco/16"),
        (dict(dp=4, sync="async_ps"), "dp4 async_ps"),
    ],
)
def test_str_is_the_layout_text(layout, text):
    assert str(resolve(**layout)) == text
    assert layout_label(layout) == text and layout_label(Layout(**layout)) == text


def test_unresolvable_layout_text_names_the_field():
    assert layout_label(None) == "–"
    text = layout_label({"dp": 4, "zero_stage": 3, "shard_group_size": 3})
    assert text.startswith("invalid layout") and "layout.shard_group_size" in text


# ---------------------------------------------------------------------------------------- validation errors
def test_resolution_errors_name_the_field():
    with pytest.raises(LayoutError) as e:
        resolve(dp=4, zero_stage=3, shard_group_size=3)
    assert e.value.param == "layout.shard_group_size" and "does not divide dp=4" in str(e.value)
    with pytest.raises(LayoutError) as e:
        resolve(dp=4, shard_group_size=2)
    assert e.value.param == "layout.shard_group_size" and "zero_stage 2 or 3" in str(e.value)


def test_degrees_must_multiply_to_the_world_size():
    lay = resolve(dp=2, tp=2)
    lay.check_world_size(4)
    with pytest.raises(LayoutError) as e:
        lay.check_world_size(6)
    assert e.value.param == "world_size" and "= 4 but the world size is 6" in str(e.value)


def test_construction_errors_name_the_field():
    with pytest.raises(ValidationError) as e:
        ResolvedLayout(tp=0)
    assert e.value.errors()[0]["loc"] == ("tp",)
    with pytest.raises(ValidationError) as e:
        ResolvedLayout(dp_shard=2, zero_stage=0)
    assert "dp_shard=2" in str(e.value) and "zero_stage 2 or 3" in str(e.value)


# ------------------------------------------------------------------------------------------------- plan
def test_plan_carries_the_layout_and_serves_the_flat_degrees_as_before():
    plan = build_plan(spec(dp=4, tp=1, zero_stage=3, shard_group_size=2, sequence_parallel=False))
    assert plan.layout == resolve(dp=4, zero_stage=3, shard_group_size=2)
    body = plan.model_dump(mode="json")
    flat = {k: body[k] for k in ("world_size", "dp", "tp", "pp", "dp_replicate", "dp_shard", "zero_stage")}
    assert flat == {"world_size": 4, "dp": 4, "tp": 1, "pp": 1, "dp_replicate": 2, "dp_shard": 2, "zero_stage": 3}
    assert body["pp_stages_total"] == 1 and body["layout"]["dp_shard"] == 2
    assert Plan.model_validate(body) == plan  # served JSON loads back


def test_a_plan_stored_before_the_layout_field_still_loads():
    s = spec(dp=2, tp=2, pp=2, sequence_parallel=True, pp_schedule="gpipe")
    plan = build_plan(s)
    old = {k: v for k, v in plan.model_dump(mode="json").items() if k != "layout"}  # the JSON stored until now
    loaded = Plan.model_validate(old)
    assert (loaded.world_size, loaded.dp, loaded.tp, loaded.pp, loaded.dp_replicate) == (8, 2, 2, 2, 2)
    assert loaded.model_dump(mode="json") | {"layout": None} == old | {"layout": None}  # looks the same
    assert Plan.stored(old, s.layout).layout == plan.layout  # the run's spec gives back its flavours
    bad = old | {"world_size": 6}
    with pytest.raises(ValidationError) as e:
        Plan.model_validate(bad)
    assert "world_size=6" in str(e.value)


# --------------------------------------------------------------------------------------- workers, placement
def test_parallel_dims_is_a_view_of_the_plan_layout():
    from workers.parallel_dims import ParallelDims

    plan = build_plan(spec(dp=2, tp=2))
    dims = ParallelDims.from_plan(plan, world_size=4, device_type="cpu")
    assert dims.layout is plan.layout and (dims.dp_size, dims.dp_enabled, dims.tp_enabled) == (2, True, True)
    assert [dims._coords(r) for r in range(4)] == [(0, 0, 0, 0), (0, 0, 0, 1), (0, 1, 0, 0), (0, 1, 0, 1)]
    with pytest.raises(ValueError, match="world size is 8"):
        ParallelDims.from_plan(plan, world_size=8, device_type="cpu")


def test_placement_places_the_plan_layout():
    from service.cluster.placement import NodeCapacity, Placement, place

    plan = build_plan(spec(dp=2, tp=2))
    nodes = [NodeCapacity("a", {"CPU": 2.0}, {"CPU": 2.0}), NodeCapacity("b", {"CPU": 2.0}, {"CPU": 2.0})]
    p = place(plan, nodes)
    assert p.fits and p.layout is plan.layout and p.world_size == 4 and p.rank_nodes == ["a", "a", "b", "b"]
    assert place(plan.model_dump(mode="json"), nodes).layout == plan.layout  # a stored plan's JSON
    assert Placement.from_json(p.to_json()).layout == plan.layout
    legacy = {k: v for k, v in p.to_json().items() if k != "layout"}  # written before Placement.layout
    assert Placement.from_json(legacy).scaling_kwargs() == p.scaling_kwargs()

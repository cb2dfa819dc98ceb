"""spec.compile: each transformer block is compiled in place, so parameter names (and checkpoints) do not change."""

from __future__ import annotations

from api.spec import RunSpec, build_plan
from workers.models import build_model, materialize
from workers.parallelize import apply_compile, find_blocks


def test_compile_wraps_every_block_in_place_and_keeps_parameter_names() -> None:
    spec = RunSpec.model_validate({"model": {"name": "gpt", "preset": "tiny"}, "compile": True})
    plan = build_plan(spec)
    model = materialize(build_model(plan.model), device="cpu", seed=0)
    names = [n for n, _ in model.named_parameters()]
    apply_compile(model)
    blocks = find_blocks(model)
    assert len(blocks) == plan.model.n_layers
    assert all(b._compiled_call_impl is not None for _, _, b in blocks)  # nn.Module.compile()
    assert [n for n, _ in model.named_parameters()] == names

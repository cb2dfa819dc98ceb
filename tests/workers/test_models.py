"""Built-in models: exact parameter counts (meta device), shapes, pipeline splits, deterministic init."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from api.spec import ModelSpec
from api.spec.presets import PRESETS
from api.spec.validation import resolve_model
from workers.models import build_model, count_params, init_weights, materialize, register_model, registered_models


@pytest.mark.parametrize("family,preset", [(f, p) for f, ps in PRESETS.items() for p in ps])
def test_param_count_matches_presets_on_meta(family: str, preset: str) -> None:
    cfg = resolve_model(ModelSpec(name=family, preset=preset))
    model = build_model(cfg)  # meta: even 175b costs nothing
    assert all(p.is_meta for p in model.parameters())
    assert count_params(model) == cfg.n_params


@pytest.mark.parametrize("overrides", [dict(d_ff=100), dict(n_layers=3, seq_len=17, vocab_size=300)])
def test_param_count_with_overrides(overrides: dict) -> None:
    for family in ("gpt", "mlp"):
        cfg = resolve_model(ModelSpec(name=family, preset="tiny", **overrides))
        assert count_params(build_model(cfg)) == cfg.n_params


def _tiny(name: str = "gpt", **kw):
    cfg = resolve_model(ModelSpec(name=name, preset="tiny", **kw))
    return cfg, materialize(build_model(cfg), device="cpu", seed=3)


@pytest.mark.parametrize("name", ["gpt", "mlp"])
def test_forward_shapes_and_initial_loss(name: str) -> None:
    cfg, m = _tiny(name)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    logits = m(x)
    assert logits.shape == (2, cfg.seq_len, cfg.vocab_size)
    loss = F.cross_entropy(logits.flatten(0, 1), x.flatten())
    assert abs(loss.item() - torch.log(torch.tensor(float(cfg.vocab_size))).item()) < 0.2  # ~ uniform at init


def test_gpt_is_causal() -> None:
    cfg, m = _tiny()
    x = torch.randint(0, cfg.vocab_size, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % cfg.vocab_size
    torch.testing.assert_close(m(x)[:, :10], m(y)[:, :10])
    assert not torch.allclose(m(x)[:, 10:], m(y)[:, 10:])


@pytest.mark.parametrize("name", ["gpt", "mlp"])
@pytest.mark.parametrize("n_stages", [2, 3])
def test_pipeline_split_composes_to_full_model(name: str, n_stages: int) -> None:
    cfg, m = _tiny(name, n_layers=3)
    x = torch.randint(0, cfg.vocab_size, (2, 8))
    h = x
    seen: list[str] = []
    for i in range(n_stages):
        part = m.split_for_pipeline(i, n_stages)
        seen += list(part.layers.keys())
        assert (part.tok_emb is not None) == (i == 0)
        assert (part.output is not None) == (i == n_stages - 1)
        h = part(h)
    assert seen == ["0", "1", "2"]
    torch.testing.assert_close(h, m(x))
    assert m.stage_layer_keys(2) == [["0", "1"], ["2"]]
    with pytest.raises(ValueError, match="pipeline stages"):
        m.stage_layer_keys(4)


def test_init_is_a_function_of_seed_and_name() -> None:
    cfg = resolve_model(ModelSpec(name="gpt", preset="tiny"))
    a = materialize(build_model(cfg), device="cpu", seed=5)
    b = build_model(cfg, device="cpu")
    init_weights(b, seed=5)
    c = materialize(build_model(cfg), device="cpu", seed=6)
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), n
        if pa.dim() >= 2:
            assert not torch.equal(pa, pc), n
    # a pipeline part built from the meta model gets the same values as the full model
    part = materialize(build_model(cfg).split_for_pipeline(1, 2), device="cpu", seed=5)
    full = dict(a.named_parameters())
    for n, p in part.named_parameters():
        assert torch.equal(p, full[n]), n
    sd = dict(a.named_parameters())
    assert torch.all(sd["layers.0.ln_1.weight"] == 1) and torch.all(sd["layers.0.attn.wq.bias"] == 0)
    assert sd["layers.0.attn.wo.weight"].std() < sd["layers.0.attn.wq.weight"].std()  # residual scaling


def test_tp_plan_names_real_modules() -> None:
    for name in ("gpt", "mlp"):
        cfg = resolve_model(ModelSpec(name=name, preset="tiny"))
        m = build_model(cfg)
        modules = dict(m.named_modules())
        for sp in (False, True):
            plan = m.tp_plan(sequence_parallel=sp, loss_parallel=True)
            assert plan and all(k in modules for k in plan), set(plan) - set(modules)


def test_registry_and_custom_entrypoint() -> None:
    assert {"gpt", "mlp", "custom"} <= set(registered_models())

    @register_model("toy-test")
    def _toy(cfg):
        return torch.nn.Linear(cfg.d_model, 2)

    cfg = resolve_model(ModelSpec(name="gpt", preset="tiny")).model_copy(update={"name": "toy-test"})
    assert isinstance(build_model(cfg), torch.nn.Linear)
    cfg = resolve_model(
        ModelSpec(name="custom", preset=None, entrypoint="torch.nn:Linear", args={"in_features": 3, "out_features": 4})
    )
    m = build_model(cfg)
    assert m.weight.is_meta and m.weight.shape == (4, 3)
    with pytest.raises(ValueError, match="unknown model"):
        build_model(cfg.model_copy(update={"name": "nope", "entrypoint": None}))


def test_workers_import_torch_only() -> None:
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys, workers.loop, workers.parallelize, workers.data, workers.models, workers.parallel_dims, "
        "workers.metrics, workers.optim, workers.__main__; "
        "bad = sorted(m for m in ('fastapi', 'sqlalchemy', 'ray', 'uvicorn') if m in sys.modules); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    root = Path(__file__).resolve().parents[2]
    p = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr

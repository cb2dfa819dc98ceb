"""workers.user_code and the data/model hooks for user code (single process, no distributed)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

from api.spec import DataSpec, ModelConfig, RunSpec
from tests.byo.conftest import PKG, ROOT
from workers.data import StepBatches, make_source
from workers.models import build_model, materialize
from workers.parallelize import find_blocks
from workers.user_code import (UserCodeError, add_code_path, block_classes, build_user_model, check_split_points,
                               check_tp_plan, import_entrypoint, inspect_model, sequential_split_points, tp_styles)

MODEL = {"name": "custom", "preset": None, "entrypoint": f"{PKG}.models:build",
         "args": {"d": 32, "n_layers": 3, "n_heads": 2, "seq_len": 16}, "seq_len": 16}


def test_import_errors_name_the_field_and_the_fix(on_path) -> None:
    with pytest.raises(UserCodeError, match=r"model.entrypoint: cannot import 'nope_pkg.models'.*code.working_dir"):
        import_entrypoint("nope_pkg.models:build")
    with pytest.raises(UserCodeError, match=rf"module '{PKG}.models' has no attribute 'missing'"):
        import_entrypoint(f"{PKG}.models:missing")
    with pytest.raises(UserCodeError, match="data.entrypoint.*package.module:function"):
        import_entrypoint("os.system; rm -rf /:x", param="data.entrypoint")
    with pytest.raises(UserCodeError, match="not a function"):
        import_entrypoint(f"{PKG}.models:TP_PLAN")
    with pytest.raises(UserCodeError, match="is not a directory"):
        add_code_path("/definitely/not/here")


def test_user_model_on_meta_keeps_real_buffers_and_materialises(on_path) -> None:
    cfg = ModelConfig(name="custom", n_layers=1, d_model=1, n_heads=1, vocab_size=256, seq_len=16, d_ff=4,
                      n_params=0, entrypoint=MODEL["entrypoint"], args=MODEL["args"])
    model = build_model(cfg, device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert torch.equal(model.embed.positions, torch.arange(16))  # a buffer holds its real value
    materialize(model, device="cpu", seed=3)
    assert not any(p.is_meta for p in model.parameters())
    assert torch.equal(model.embed.positions, torch.arange(16))  # kept across to_empty
    assert torch.equal(model.norm.weight, torch.ones(32)) and float(model.head.weight.detach().std()) > 0.01
    logits = model(torch.randint(0, 256, (2, 16)))
    assert logits.shape == (2, 16, 256) and torch.isfinite(logits).all()


def test_inspection_counts_parameters_on_meta_and_finds_blocks(on_path) -> None:
    info = inspect_model(RunSpec.model_validate({"model": MODEL}))
    real = build_user_model(MODEL["entrypoint"], MODEL["args"], device="cpu")
    assert info["n_params"] == sum(p.numel() for p in real.parameters())
    assert info["n_blocks"] == 3 and info["block_classes"] == ["Block"]
    assert info["block_params"] == sum(p.numel() for p in real.blocks[0].parameters())
    assert info["d_model"] == 32 and info["vocab_size"] == 256 and info["errors"] == []


def test_inspection_reports_layout_problems(on_path) -> None:
    spec = RunSpec.model_validate({"model": {**MODEL, "tp_plan": {"blocks.*.nothing": "colwise"},
                                             "pp_split_points": ["blocks.9"], "vocab_size": 1000},
                                   "layout": {"tp": 2, "pp": 2}, "batch": {"global_batch_size": 8}})
    errors = inspect_model(spec)["errors"]
    assert any("'blocks.*.nothing' matches no module" in e for e in errors)
    assert any("'blocks.9' is not a top-level module" in e for e in errors)
    assert any("model.vocab_size=1000 exceeds" in e for e in errors)


def test_tp_plan_checks(on_path) -> None:
    model = build_user_model(MODEL["entrypoint"], MODEL["args"])
    assert check_tp_plan(model, {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}) == []
    errs = check_tp_plan(model, {"blocks.*": "colwise"})
    assert errs and "applies to nn.Linear / nn.Embedding" in errs[0]
    with pytest.raises(UserCodeError, match="model.tp_plan pattern 'head2' matches no module.*blocks.0"):
        tp_styles(model, {"head2": "colwise"})


def test_blocks_found_automatically_or_named(on_path) -> None:
    model = build_user_model(MODEL["entrypoint"], MODEL["args"])
    assert block_classes(model) == ["Block"]
    assert len(find_blocks(model)) == 3  # the largest ModuleList
    assert len(find_blocks(model, ["Attention"])) == 3
    with pytest.raises(UserCodeError, match="model.block_classes"):
        block_classes(model, ["NoSuchBlock"])


def test_split_points(on_path) -> None:
    model = build_user_model(MODEL["entrypoint"], MODEL["args"])
    assert check_split_points(model, ["blocks.2"], 2) == []
    assert "2 split points make 3 stages" in check_split_points(model, ["blocks.1", "blocks.2"], 2)[0]
    seq = nn.Sequential(*(nn.Linear(4, 4) for _ in range(5)))
    assert sequential_split_points(seq, 2) == ["3"] and check_split_points(seq, ["3"], 2) == []


def test_huggingface_models_build_on_meta_with_their_blocks(on_path) -> None:
    pytest.importorskip("transformers")
    gpt2 = build_user_model(f"{PKG}.hf:gpt2", {"n_layer": 2})
    assert all(p.is_meta for p in gpt2.parameters())
    assert block_classes(gpt2) == ["GPT2Block"] and len(find_blocks(gpt2)) == 2
    llama = build_user_model(f"{PKG}.hf:llama", {})
    assert not llama.model.rotary_emb.inv_freq.is_meta  # rotary table kept real
    materialize(llama, device="cpu", seed=0)
    out = llama(torch.randint(0, 256, (1, 8)))
    assert isinstance(out, torch.Tensor) and out.shape == (1, 8, 256)  # ModelOutput -> logits
    assert float(llama.model.norm.weight.detach().mean()) == 1.0  # RMSNorm weight initialised to 1, not 0


def test_custom_data_pairs_and_token_files(on_path, tmp_path) -> None:
    src = make_source(DataSpec(source="custom", entrypoint=f"{PKG}.data:build", args={"n": 64}), seq_len=16,
                      vocab_size=50, seed=0)
    b = StepBatches(src, global_batch_size=8, micro_batch_size=2, dp_rank=1, dp_size=2, seed=0)
    x, y = b.batch(0)
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # next-token targets from the dataset's (input, target) pairs
    full = StepBatches(src, global_batch_size=8, micro_batch_size=2, dp_rank=0, dp_size=1, seed=0).batch(0)[0]
    assert torch.equal(full[4:], x)  # rank 1 of dp2 = the second half of the global batch
    with pytest.raises(UserCodeError, match="data.args"):
        make_source(DataSpec(source="custom", entrypoint=f"{PKG}.data:build", args={"bogus": 1}), seq_len=16,
                    vocab_size=50, seed=0)
    (tmp_path / "a.bin").write_bytes(np.arange(100, dtype=np.uint16).tobytes())
    np.save(tmp_path / "b.npy", np.arange(100, 200, dtype=np.uint32))
    tok = make_source(DataSpec(source="tokens", path=str(tmp_path)), seq_len=9, vocab_size=1000, seed=0)
    assert len(tok) == 22 and tok[0].tolist() == list(range(10)) and tok[11][0] == 100


def test_inspect_cli_runs_user_code_in_a_subprocess(user_code_dir) -> None:
    spec = {"model": MODEL, "code": {"working_dir": str(user_code_dir)}}
    out = subprocess.run([sys.executable, "-m", "workers.user_code", "inspect", "--spec", "-"],
                         input=json.dumps(spec), capture_output=True, text=True, cwd=ROOT, timeout=120)
    info = json.loads(out.stdout)
    assert out.returncode == 0 and info["ok"] and info["n_blocks"] == 3, out.stderr
    bad = {"model": {**MODEL, "entrypoint": f"{PKG}.models:nothing"}, "code": {"working_dir": str(user_code_dir)}}
    out = subprocess.run([sys.executable, "-m", "workers.user_code", "inspect", "--spec", "-"],
                         input=json.dumps(bad), capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 2 and "has no attribute 'nothing'" in json.loads(out.stdout)["error"]


def test_service_inspection_updates_the_plan(user_code_dir) -> None:
    from api.spec.validation import build_plan
    from service.runs.inspect import apply_inspection, inspect_with_subprocess

    spec = RunSpec.model_validate({"model": MODEL, "code": {"working_dir": str(user_code_dir)}})
    plan = build_plan(spec)
    assert plan.model.n_params == 0
    info = inspect_with_subprocess(spec, code_dir=str(user_code_dir), timeout_s=120)
    new = apply_inspection(plan, info)
    assert new.model.n_params == info["n_params"] > 0 and new.model.n_layers == 3 and new.model.d_model == 32
    assert (new.model.seq_len, new.model.vocab_size) == (plan.model.seq_len, plan.model.vocab_size)


@pytest.mark.parametrize("path", sorted((ROOT / "examples" / "byo").glob("*.yaml")), ids=lambda p: p.name)
def test_example_specs_plan_and_inspect_cleanly(path) -> None:
    import yaml

    from api.spec.validation import build_plan

    spec = RunSpec.model_validate(yaml.safe_load(path.read_text()))
    assert build_plan(spec).world_size == 2
    if ".hf:" in spec.model.entrypoint:
        pytest.importorskip("transformers")
    add_code_path(ROOT / spec.code.working_dir)
    info = inspect_model(spec)
    assert info["errors"] == [] and info["n_params"] > 50_000 and info["n_blocks"] == 2

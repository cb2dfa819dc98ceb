"""Hugging Face models train under meshrun's layouts (two gloo ranks): a tiny Llama (GQA, RoPE, SwiGLU) and GPT-2
with dp2 (DDP), FSDP (zero 3), tp2 with sequence parallel, and pp2; each run's checkpoint exports to a directory
that transformers loads with the logits of meshrun's model loaded from that checkpoint."""

from __future__ import annotations

import pytest
import torch

from api.spec import RunSpec
from api.spec.validation import build_plan
from tests.workers.dist_utils import run_world, tiny_spec
from tests.workers.hf_models import batch, hf_logits, save_tiny
from workers.checkpoint import checkpoint_path
from workers.export import export_hf, load_full_model_state
from workers.models import build_model

pytestmark = pytest.mark.slow
TOL = 1e-4
LAYOUTS = {"dp2": dict(dp=2), "fsdp2": dict(dp=2, zero=3), "tp2sp": dict(tp=2, layout={"sequence_parallel": True})}
LAYOUTS["pp2"] = dict(pp=2, gbs=8, mbs=2)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_hf_model_trains_in_every_layout_and_exports(tmp_path, kind) -> None:
    src = save_tiny(kind, tmp_path / "src")
    model = {"name": "hf", "path": str(src), "seq_len": 16, "preset": None}
    specs = []
    for name, kw in LAYOUTS.items():
        spec = tiny_spec(steps=3, model=model, checkpoint={"every_steps": 3}, **kw)
        spec["_job"] = {"checkpoint_dir": str(tmp_path / name)}
        specs.append(spec)
    results = run_world(2, specs)
    x = batch()
    before = hf_logits(src, x)
    losses = {name: r["losses"] for name, r in zip(LAYOUTS, results)}
    for step in range(3):  # the same pretrained start and the same steps in every layout (loss parity)
        at = [v[step] for v in losses.values()]
        assert max(at) - min(at) < 1e-4, (step, losses)
    for (name, _), spec_d in zip(LAYOUTS.items(), specs):
        ck = checkpoint_path(tmp_path / name, 3)
        info = export_hf(ck, tmp_path / f"{name}_hf")
        assert info["files"] == ["config.json", "model.safetensors"]
        spec = RunSpec.model_validate({k: v for k, v in spec_d.items() if not k.startswith("_")})
        mine = build_model(build_plan(spec, device="cpu").model, device="cpu")
        mine.load_state_dict(load_full_model_state(ck))
        with torch.no_grad():
            ours = mine.eval()(x)
        theirs = hf_logits(tmp_path / f"{name}_hf", x)
        assert (theirs - ours).abs().max().item() < TOL, name
        assert (theirs - before).abs().max().item() > 1e-3, name  # it trained

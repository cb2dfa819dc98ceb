"""A Hugging Face model end to end on the session's local Ray cluster: a tiny random Llama (grouped-query
attention, RoPE, SwiGLU) saved with transformers, trained through REST with tp2 + sequence parallel, exported
with ``meshrun export`` (CLI -> SDK -> REST) and reloaded with transformers, whose logits equal meshrun's."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from typer.testing import CliRunner

from api.cli import app
from api.spec import RunSpec
from api.spec.validation import build_plan
from tests.ray.helpers import submit, tiny_spec, wait_for
from tests.workers.hf_models import batch, hf_logits, save_tiny
from workers.export import load_full_model_state
from workers.models import build_model

pytestmark = pytest.mark.ray


def test_hf_llama_trains_with_tp2_and_exports_to_transformers(live_service, tmp_path):
    url = live_service.url
    src = save_tiny("llama", tmp_path / "llama")
    spec = tiny_spec(
        "e2e-hf-llama",
        tp=2,
        steps=3,
        model={"name": "hf", "path": str(src), "seq_len": 16, "preset": None},
        layout={"sequence_parallel": True},
        checkpoint={"every_steps": 3},
    )
    run = submit(url, spec)
    assert run["plan"]["model"]["args"]["arch"] == "llama" and run["plan"]["model"]["d_ff"] == 64
    done = wait_for(url, run["id"], {"SUCCEEDED"}, timeout_s=240)
    assert done["summary"]["steps_done"] == 3

    out = tmp_path / "exported"
    r = CliRunner().invoke(app, ["--url", url, "export", run["id"], "--format", "hf", "--out", str(out), "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.output)
    assert res["step"] == 3 and res["files"] == ["config.json", "model.safetensors"]

    # meshrun's model from the run's checkpoint vs transformers' model from the export: the same logits
    cks = httpx.get(f"{url}/v1/runs/{run['id']}/checkpoints", timeout=30).json()["items"]
    cks = [c for c in cks if c["step"] == 3]
    mine = build_model(build_plan(RunSpec.model_validate(done["spec"]), device="cpu").model, device="cpu")
    mine.load_state_dict(load_full_model_state(cks[-1]["path"]))
    x = batch()
    with torch.no_grad():
        ours = mine.eval()(x)
    theirs = hf_logits(out, x)
    assert (theirs - ours).abs().max().item() < 1e-4
    assert (theirs - hf_logits(src, x)).abs().max().item() > 1e-3  # the run changed the weights

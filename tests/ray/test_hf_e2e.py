"""A Hugging Face model end to end on the session's local Ray cluster: a tiny random Llama (grouped-query
attention, RoPE, SwiGLU) and a tiny GPT-2 saved with transformers, trained through REST (the Llama with tp2 + sequence
parallel, GPT-2 with dp2), exported with ``meshrun export`` (CLI -> SDK -> REST) and reloaded with transformers, whose
logits equal meshrun's."""

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


CASES = {  # architecture -> layout; both runs go at once (the cluster has room for both)
    "llama": {"tp": 2, "layout": {"sequence_parallel": True}},
    "gpt2": {"dp": 2},
}


def test_hf_llama_tp2_and_gpt2_dp2_train_and_export_to_transformers(live_service, tmp_path):
    url = live_service.url
    runs, sources = {}, {}
    for kind, layout in CASES.items():
        sources[kind] = save_tiny(kind, tmp_path / kind)
        spec = tiny_spec(
            f"e2e-hf-{kind}",
            steps=3,
            model={"name": "hf", "path": str(sources[kind]), "seq_len": 16, "preset": None},
            checkpoint={"every_steps": 3},
            **layout,
        )
        runs[kind] = submit(url, spec)
    assert runs["llama"]["plan"]["model"]["args"]["arch"] == "llama" and runs["llama"]["plan"]["model"]["d_ff"] == 64

    for kind, run in runs.items():
        done = wait_for(url, run["id"], {"SUCCEEDED"}, timeout_s=300)
        assert done["summary"]["steps_done"] == 3

        out = tmp_path / f"exported-{kind}"
        args = ["--url", url, "export", run["id"], "--format", "hf", "--out", str(out), "--json"]
        r = CliRunner().invoke(app, args)
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
        assert (theirs - ours).abs().max().item() < 1e-4, kind
        assert (theirs - hf_logits(sources[kind], x)).abs().max().item() > 1e-3, kind  # the run changed the weights

"""``POST /v1/runs/{id}/export`` and ``model: {name: hf}`` through HTTP against a real database and real files:
a GPT-2 shaped Hugging Face directory written here (meshrun's own safetensors writer, no transformers), a run
submitted with it, a real checkpoint of that model, and the export read back; the 4xx cases name their field."""

from __future__ import annotations

import json

import torch

from api.spec import RunSpec
from api.spec.validation import build_plan
from service import store
from tests.api.test_runs import SPEC, _error, _submit
from workers.checkpoint import checkpoint_path, save_checkpoint
from workers.models import build_model, materialize
from workers.models.hf import to_hf_state
from workers.models.safetensors_io import SafetensorsFile, save_file

GPT2 = {
    "architectures": ["GPT2LMHeadModel"],
    "model_type": "gpt2",
    "n_embd": 16,
    "n_layer": 1,
    "n_head": 2,
    "n_positions": 32,
    "vocab_size": 64,
    "tie_word_embeddings": True,
}


def _hf_dir(tmp_path):
    """A GPT-2 directory as save_pretrained lays it out (tied head: no lm_head.weight)."""
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(GPT2))
    spec = RunSpec.model_validate(
        {
            "model": {
                "name": "gpt",
                "preset": None,
                "n_layers": 1,
                "d_model": 16,
                "n_heads": 2,
                "vocab_size": 64,
                "seq_len": 32,
            }
        }
    )
    # meshrun's GPT of these sizes, random: only the tensors' names and shapes matter here
    model = materialize(build_model(build_plan(spec, device="cpu").model), device="cpu", seed=3)
    state = to_hf_state(dict(model.state_dict()), arch="gpt2")
    state.pop("lm_head.weight")
    save_file(state, d / "model.safetensors")
    return d


def _hf_spec(path) -> dict:
    return {
        **SPEC,
        "name": "hf-export",
        "model": {"name": "hf", "path": str(path), "seq_len": 16, "preset": None},
        "layout": {"dp": 1},
        "batch": {"global_batch_size": 2, "micro_batch_size": 1},
    }


def test_export_writes_a_hugging_face_directory_of_the_checkpoint(client, tmp_path):
    src = _hf_dir(tmp_path)
    run = _submit(client, _hf_spec(src))
    assert run["plan"]["model"]["name"] == "hf" and run["plan"]["model"]["d_model"] == 16
    assert run["plan"]["model"]["args"]["arch"] == "gpt2"
    spec = RunSpec.model_validate(run["spec"])
    plan = build_plan(spec, device="cpu")
    model = materialize(build_model(plan.model), device="cpu")  # loads the HF weights
    with torch.no_grad():
        model.output.weight.add_(0.5)  # untie, as training does
    opt = torch.optim.AdamW(model.parameters())
    ck = checkpoint_path(tmp_path / "ck", 4)
    save_checkpoint(ck, model_parts=[model], optimizers=[opt], schedulers=[], step=4, plan=plan, spec=spec)
    _error(client.post(f"/v1/runs/{run['id']}/export", json={"out": str(tmp_path / "o")}), 422)  # no checkpoint yet
    with client.app.state.session_factory.begin() as s:
        store.add_checkpoint(s, run_id=run["id"], attempt=1, step=4, path=str(ck), size_bytes=1)

    r = client.post(f"/v1/runs/{run['id']}/export", json={"format": "hf", "out": str(tmp_path / "out")})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["step"] == 4 and body["files"] == ["config.json", "model.safetensors"]
    assert body["n_params"] == plan.model.n_params
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False and cfg["n_embd"] == 16
    got = SafetensorsFile(tmp_path / "out" / "model.safetensors")
    want = to_hf_state(dict(model.state_dict()), arch="gpt2")
    assert sorted(got.keys()) == sorted(want)
    assert all(torch.equal(got.get(k), want[k]) for k in want)
    assert not torch.equal(got.get("lm_head.weight"), got.get("transformer.wte.weight"))

    # the same again (same files) is fine; a directory with other files, a step that does not exist, bad paths
    ok = client.post(f"/v1/runs/{run['id']}/export", json={"out": str(tmp_path / "out"), "checkpoint": 4})
    assert ok.status_code == 200, ok.text
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("x")
    assert (
        _error(client.post(f"/v1/runs/{run['id']}/export", json={"out": str(tmp_path / "busy")}), 409)["param"] == "out"
    )
    err = _error(client.post(f"/v1/runs/{run['id']}/export", json={"out": str(tmp_path / "o"), "checkpoint": 9}), 422)
    assert err["param"] == "checkpoint" and "[4]" in err["message"]
    err = _error(client.post(f"/v1/runs/{run['id']}/export", json={"out": str(tmp_path / "a/../b")}), 422)
    assert err["param"] == "out"
    err = _error(client.post(f"/v1/runs/{run['id']}/export", json={"out": "x", "format": "onnx"}), 422)
    assert "format" in err["param"]
    _error(client.post("/v1/runs/run-nope/export", json={"out": str(tmp_path / "o")}), 404)


def test_export_of_a_run_that_did_not_train_a_hf_model_names_format(client, tmp_path):
    run = _submit(client)
    err = _error(client.post(f"/v1/runs/{run['id']}/export", json={"out": str(tmp_path / "o")}), 422)
    assert err["param"] == "format" and "name: hf" in err["message"]


def test_hf_submissions_with_a_bad_path_name_model_path(client, tmp_path):
    err = _error(client.post("/v1/runs", json=_hf_spec(tmp_path / "missing")), 422)
    assert err["param"] == "model.path" and "not a directory" in err["message"]
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    (tmp_path / "bert" / "model.safetensors").write_bytes(b"")
    err = _error(client.post("/v1/runs", json=_hf_spec(tmp_path / "bert")), 422)
    assert err["param"] == "model.path" and "BertModel" in err["message"]
    err = _error(client.post("/v1/runs", json=_hf_spec(tmp_path / "x/../bert")), 422)
    assert err["param"] == "model.path"
    src = _hf_dir(tmp_path)
    err = _error(client.post("/v1/runs", json={**_hf_spec(src), "layout": {"tp": 4}}), 422)
    assert err["param"] == "layout.tp"
    r = client.post("/v1/plans", json={"model": {"name": "hf", "path": str(tmp_path / "nope")}, "global_batch_size": 8})
    assert _error(r, 422)["param"] == "model.path"
    # the planner plans the model of config.json: its sizes and exact parameter count
    r = client.post("/v1/plans", json={"model": {"name": "hf", "path": str(src)}, "global_batch_size": 8, "top_k": 2})
    assert r.status_code == 200, r.text
    m = r.json()["model"]
    assert (m["n_layers"], m["d_model"], m["n_heads"], m["vocab_size"], m["d_ff"]) == (1, 16, 2, 64, 64)
    assert m["n_params"] == 5872 and r.json()["candidates"]

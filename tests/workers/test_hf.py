"""Hugging Face weights in and out, in one process: a tiny random Llama, Qwen2 and GPT-2 built with transformers
load into meshrun's GPT blocks with the same logits, and meshrun's (changed) weights export back to a directory
that transformers loads with meshrun's logits."""

from __future__ import annotations

import json

import pytest
import torch

from api.spec import ModelSpec, resolve_model
from api.spec.validation import SpecError
from tests.workers.hf_models import KINDS, batch, hf_logits, save_tiny
from workers.models import build_model, count_params, materialize
from workers.models.hf import write_hf_model
from workers.models.safetensors_io import SafetensorsFile, save_file

TOL = 1e-4


@pytest.mark.slow  # imports transformers (seconds)
@pytest.mark.parametrize("kind", KINDS)
def test_hf_weights_in_and_out_keep_the_logits(tmp_path, kind) -> None:
    src = save_tiny(kind, tmp_path / "src")
    cfg = resolve_model(ModelSpec(name="hf", path=str(src), seq_len=16))
    model = materialize(build_model(cfg), device="cpu").eval()
    assert count_params(model) == cfg.n_params
    x = batch()
    ref = hf_logits(src, x)
    with torch.no_grad():
        mine = model(x)
        assert (mine - ref).abs().max().item() < TOL
        # change every weight (the head apart from the embedding), as training would, then export
        g = torch.Generator().manual_seed(3)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
        changed = model(x)
    assert (changed - ref).abs().max().item() > 100 * TOL
    source_config = json.loads((src / "config.json").read_text())
    write_hf_model(tmp_path / "out", model.state_dict(), source_config=source_config)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"] is False
    assert (hf_logits(tmp_path / "out", x) - changed).abs().max().item() < TOL


def test_safetensors_round_trip_is_exact_for_every_dtype(tmp_path) -> None:
    ts = {
        "a": torch.randn(3, 5),
        "b": torch.randn(7).to(torch.bfloat16),
        "c": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "d": torch.zeros(0, 4),
    }
    save_file(ts, tmp_path / "x.safetensors")
    f = SafetensorsFile(tmp_path / "x.safetensors")
    assert sorted(f.keys()) == sorted(ts)
    for k, v in ts.items():
        assert torch.equal(f.get(k), v) and f.get(k).dtype == v.dtype
    from safetensors.torch import load_file  # the reference reader agrees

    ref = load_file(str(tmp_path / "x.safetensors"))
    assert all(torch.equal(ref[k], v) for k, v in ts.items())


def test_unsupported_or_missing_hf_directories_name_model_path(tmp_path) -> None:
    with pytest.raises(SpecError) as e:
        resolve_model(ModelSpec(name="hf", path=str(tmp_path / "nope")))
    assert e.value.param == "model.path" and "not a directory" in str(e.value)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"], "hidden_size": 8}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(SpecError) as e:
        resolve_model(ModelSpec(name="hf", path=str(tmp_path)))
    assert e.value.param == "model.path" and "BertForMaskedLM" in str(e.value)
    with pytest.raises(SpecError) as e:
        resolve_model(ModelSpec(name="hf"))
    assert e.value.param == "model.path"

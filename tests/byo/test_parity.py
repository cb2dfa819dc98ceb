"""Loss parity of user models (a package outside meshrun's tree, and Hugging Face transformers models) under
parallel layouts with single-process training: workers engine directly, multi-process gloo, fp32, 4 steps.

Bounds: 1e-5 absolute on every step's loss for the user package (as the built-in parity tests), 1e-4 for the
Hugging Face models (observed <= 1e-6 for all of these layouts; 0 to 2.4e-7 for most).
"""

from __future__ import annotations

import sys

import pytest

from tests.byo.conftest import PKG
from tests.workers.dist_utils import run_world, tiny_spec

pytestmark = pytest.mark.slow

BYO_TOL = 1e-5
HF_TOL = 1e-4

BYO_TP_PLAN = {"embed.tok": "vocab_parallel", "blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise",
               "blocks.*.attn.v": "colwise", "blocks.*.attn.o": "rowwise", "blocks.*.up": "colwise",
               "blocks.*.down": "rowwise"}
LLAMA_TP_PLAN = {"model.embed_tokens": "vocab_parallel",
                 "model.layers.*.self_attn.[qkv]_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise",
                 "model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
                 "model.layers.*.mlp.down_proj": "rowwise"}


def _custom(entrypoint: str, args: dict, **model) -> dict:
    return {"name": "custom", "preset": None, "entrypoint": f"{PKG}.{entrypoint}", "args": args, "seq_len": 32,
            **model}


BYO = {"model": _custom("models:build", {"d": 32, "n_layers": 2, "n_heads": 2, "seq_len": 32}),
       "data": {"source": "custom", "entrypoint": f"{PKG}.data:build", "args": {"n": 256}}}
GPT2 = {"model": _custom("hf:gpt2", {"n_positions": 32, "n_embd": 32, "n_layer": 2, "n_head": 2})}
LLAMA = {"model": _custom("hf:llama", {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
                                       "num_key_value_heads": 2})}


def _with_model(base: dict, **model) -> dict:
    return {**base, "model": {**base["model"], **model}}


SINGLE = {"byo": tiny_spec(**BYO), "gpt2": tiny_spec(**GPT2), "llama": tiny_spec(**LLAMA)}
LAYOUTS_2 = {
    "byo_tp2_plan": tiny_spec(tp=2, **_with_model(BYO, tp_plan=BYO_TP_PLAN)),
    "byo_dp2_zero3_ac": tiny_spec(dp=2, zero=3, activation_checkpointing="full", **BYO),
    "byo_pp2_split": tiny_spec(pp=2, mbs=1, **_with_model(BYO, pp_split_points=["blocks.1"])),
    "gpt2_dp2_ddp": tiny_spec(dp=2, zero=0, **GPT2),
    "gpt2_dp2_zero3": tiny_spec(dp=2, zero=3, **GPT2),
    "llama_tp2_plan": tiny_spec(tp=2, **_with_model(LLAMA, tp_plan=LLAMA_TP_PLAN)),
}


@pytest.fixture(scope="module")
def results(user_code_dir) -> dict[str, dict]:
    pytest.importorskip("transformers")
    sys.path.insert(0, str(user_code_dir))  # spawned ranks inherit sys.path
    try:
        single = dict(zip(SINGLE, run_world(1, list(SINGLE.values()))))
        multi = dict(zip(LAYOUTS_2, run_world(2, list(LAYOUTS_2.values()))))
    finally:
        sys.path.remove(str(user_code_dir))
    return {"single": single, "multi": multi}


def _max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) == 4
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.mark.parametrize("name", list(LAYOUTS_2))
def test_user_model_layouts_match_single_process(results, name: str) -> None:
    family = name.split("_")[0]
    ref = results["single"][family]["losses"]
    got = results["multi"][name]["losses"]
    assert ref[-1] < ref[0]  # the reference learns
    assert _max_diff(got, ref) < (BYO_TOL if family == "byo" else HF_TOL), (got, ref)

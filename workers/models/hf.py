"""Hugging Face weights in and out of meshrun's GPT blocks (``workers.models.gpt``).

``model: {name: hf, path: DIR}`` resolves (``api.spec.hf``) to a ``ModelConfig`` whose ``args`` carry the block
flavour; ``build_hf`` builds meshrun's ``GPT`` with that ``Arch``, and ``init_weights`` then fills every parameter
(a whole one, or this rank's slice of it under TP/FSDP, or only this pipeline stage's) from DIR's safetensors
through ``HFSource.full``. ``to_hf_state`` maps a full meshrun state dict back to Hugging Face names and
``write_hf_model`` writes ``config.json`` + ``model.safetensors`` that ``transformers`` loads.

Names (meshrun <- Hugging Face), Llama/Mistral/Qwen2: ``tok_emb`` <- ``model.embed_tokens``, ``layers.i.ln_1`` <-
``model.layers.i.input_layernorm``, ``attn.w{q,k,v,o}`` <- ``self_attn.{q,k,v,o}_proj``, ``ln_2`` <-
``post_attention_layernorm``, ``mlp.w1/w3/w2`` <- ``mlp.gate/up/down_proj``, ``norm`` <- ``model.norm``, ``output``
<- ``lm_head`` (or the embedding when tied). GPT-2: ``transformer.wte/wpe/h.i/ln_f``; its Conv1D weights are
stored (in, out) and ``c_attn`` holds q, k and v side by side, so they are transposed and split. The head is
untied in meshrun (each layout may shard it differently from the embedding); exports say
``tie_word_embeddings: false``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from api.spec import ModelConfig
from workers.models.gpt import GPT, Arch
from workers.models.safetensors_io import SafetensorsDir, save_file


def arch_of(args: dict[str, Any]) -> Arch:
    if args["arch"] == "gpt2":
        return Arch(norm="layer", norm_eps=float(args["norm_eps"]), act="gelu_tanh", rope_theta=None)
    return Arch(
        norm="rms",
        norm_eps=float(args["norm_eps"]),
        act="swiglu",
        rope_theta=float(args["rope_theta"]),
        n_kv_heads=int(args["n_kv_heads"]),
        qkv_bias=bool(args["qkv_bias"]),
        o_bias=bool(args["o_bias"]),
        mlp_bias=bool(args["mlp_bias"]),
    )


def build_hf(cfg: ModelConfig) -> GPT:
    """meshrun's GPT in the flavour of ``cfg.args`` (from config.json); its weights come from ``cfg.args['path']``."""
    return GPT(
        n_layers=cfg.n_layers,
        d_model=cfg.d_model,
        n_heads=cfg.n_heads,
        vocab_size=cfg.vocab_size,
        seq_len=cfg.seq_len,
        d_ff=cfg.d_ff,
        arch=replace(arch_of(cfg.args), attention=cfg.attention),
        n_positions=int(cfg.args["n_positions"]) if cfg.args["arch"] == "gpt2" else None,
        pretrained=str(cfg.args["path"]),
    )


# ------------------------------------------------------------------------------------------- name maps
_LLAMA_LAYER = {
    "ln_1.weight": "input_layernorm.weight",
    "ln_2.weight": "post_attention_layernorm.weight",
    "mlp.w1": "mlp.gate_proj",
    "mlp.w2": "mlp.down_proj",
    "mlp.w3": "mlp.up_proj",
    "attn.wq": "self_attn.q_proj",
    "attn.wk": "self_attn.k_proj",
    "attn.wv": "self_attn.v_proj",
    "attn.wo": "self_attn.o_proj",
}
_GPT2_LAYER = {
    "ln_1": "ln_1",
    "ln_2": "ln_2",
    "attn.wo": "attn.c_proj",
    "mlp.w1": "mlp.c_fc",
    "mlp.w2": "mlp.c_proj",
}


def _prefix(keys: list[str], arch: str) -> str:
    """'model.' / 'transformer.' as saved by the *ForCausalLM classes, '' for a bare base model."""
    want = "model." if arch == "llama" else "transformer."
    return want if any(k.startswith(want) for k in keys) else ""


@dataclass(frozen=True)
class Src:
    """Where a meshrun parameter lives in Hugging Face weights: ``key``; GPT-2 Conv1D weights are stored
    (in, out) (``conv1d``: transpose); ``part`` 0/1/2 picks q/k/v out of GPT-2's fused ``c_attn``."""

    key: str
    conv1d: bool = False
    part: int | None = None


def hf_source(name: str, *, arch: str, prefix: str, tied: bool) -> Src | None:
    """Where the full value of meshrun parameter ``name`` lives in Hugging Face weights (None: nowhere)."""
    p = prefix
    if arch == "llama":
        top = {"tok_emb.weight": f"{p}embed_tokens.weight", "norm.weight": f"{p}norm.weight"}
        if name in top:
            return Src(top[name])
        if name == "output.weight":
            return Src(f"{p}embed_tokens.weight" if tied else "lm_head.weight")
        if name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            for mine, theirs in _LLAMA_LAYER.items():
                if rest == mine or rest.startswith(mine + "."):
                    return Src(f"{p}layers.{i}.{theirs}{rest[len(mine) :]}")
        return None
    top = {
        "tok_emb.weight": f"{p}wte.weight",
        "pos_emb.weight": f"{p}wpe.weight",
        "norm.weight": f"{p}ln_f.weight",
        "norm.bias": f"{p}ln_f.bias",
    }
    if name in top:
        return Src(top[name])
    if name == "output.weight":
        return Src(f"{p}wte.weight" if tied else "lm_head.weight")
    if name.startswith("layers.") and name.count(".") >= 3:
        _, i, rest = name.split(".", 2)
        mod, leaf = rest.rsplit(".", 1)
        base = f"{p}h.{i}."
        if mod in _QKV:
            return Src(f"{base}attn.c_attn.{leaf}", conv1d=True, part=_QKV.index(mod))
        if mod in ("ln_1", "ln_2"):
            return Src(f"{base}{mod}.{leaf}")
        if mod in _GPT2_LAYER:
            return Src(f"{base}{_GPT2_LAYER[mod]}.{leaf}", conv1d=True)
    return None


_QKV = ("attn.wq", "attn.wk", "attn.wv")


class HFSource:
    """The full tensors of a Hugging Face directory, by meshrun parameter name (``init_weights`` slices them)."""

    def __init__(self, path: str, model: GPT):
        self.path = path
        self.st = SafetensorsDir(path)
        cfg = json.loads((Path(path) / "config.json").read_text())
        self.arch = "gpt2" if model.arch.rope_theta is None else "llama"
        self.prefix = _prefix(self.st.keys(), self.arch)
        self.d_model = model.d_model
        lm_head = "lm_head.weight" in self.st
        self.tied = bool(cfg.get("tie_word_embeddings", self.arch == "gpt2")) or not lm_head

    def full(self, name: str, shape: torch.Size) -> torch.Tensor:
        src = hf_source(name, arch=self.arch, prefix=self.prefix, tied=self.tied)
        if src is None:
            raise KeyError(f"meshrun parameter '{name}' has no counterpart in the Hugging Face weights at {self.path}")
        t = self.st.get(src.key).float()
        if src.part is not None:
            t = t[..., src.part * self.d_model : (src.part + 1) * self.d_model]
        if src.conv1d and t.dim() == 2:
            t = t.t()
        if tuple(t.shape) != tuple(shape):
            raise ValueError(
                f"Hugging Face tensor for '{name}' has shape {tuple(t.shape)}, meshrun expects {tuple(shape)}; "
                f"config.json and the weights at {self.path} disagree"
            )
        return t

    def close(self) -> None:
        self.st.close()


# ------------------------------------------------------------------------------------------- export
def to_hf_state(state: dict[str, torch.Tensor], *, arch: str) -> dict[str, torch.Tensor]:
    """A full meshrun model state dict (canonical names) -> Hugging Face *ForCausalLM names and layouts."""
    prefix = "model." if arch == "llama" else "transformer."
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for name, t in state.items():
        src = hf_source(name, arch=arch, prefix=prefix, tied=False)
        if src is None:
            raise KeyError(f"meshrun parameter '{name}' has no Hugging Face name")
        if src.conv1d and t.dim() == 2:
            t = t.t()
        if src.part is not None:
            fused.setdefault(src.key, []).append((src.part, t))
        else:
            out[src.key] = t
    for key, parts in fused.items():
        out[key] = torch.cat([t for _, t in sorted(parts, key=lambda x: x[0])], dim=-1)
    return {k: v.contiguous() for k, v in out.items()}


def hf_config_for_export(source_config: dict[str, Any]) -> dict[str, Any]:
    """The exported config.json: the source's, with an untied head and float32 weights."""
    cfg = dict(source_config)
    cfg["tie_word_embeddings"] = False
    cfg["torch_dtype"] = "float32"
    cfg.pop("dtype", None)
    return cfg


def write_hf_model(out_dir: str | Path, state: dict[str, torch.Tensor], *, source_config: dict[str, Any]) -> list[Path]:
    """Write ``config.json`` + ``model.safetensors`` (float32) of a full meshrun state dict into ``out_dir``."""
    arch = "gpt2" if "GPT2LMHeadModel" in (source_config.get("architectures") or []) else "llama"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf = to_hf_state({k: v.detach().float().cpu() for k, v in state.items()}, arch=arch)
    weights, config = out / "model.safetensors", out / "config.json"
    save_file(hf, weights, metadata={"format": "pt"})
    config.write_text(json.dumps(hf_config_for_export(source_config), indent=2, sort_keys=True) + "\n")
    return [config, weights]

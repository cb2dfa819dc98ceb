"""Hugging Face checkpoints as meshrun models: ``model: {name: hf, path: DIR}`` (pure Python, standard library).

``read_hf_config(path)`` reads ``DIR/config.json`` (no hub download: a local directory the service and the
workers can read) and returns the numbers meshrun needs: the sizes the planner uses (n_layers, d_model, n_heads,
vocab_size, d_ff, the longest context) and the flags the workers' model is built with (``ModelConfig.args``):

- ``arch``: ``llama`` (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM: RMSNorm, SwiGLU, RoPE, grouped
  query attention; Qwen2 has q/k/v biases) or ``gpt2`` (GPT2LMHeadModel: LayerNorm, tanh-GELU, learned positions);
- ``n_kv_heads``, ``norm_eps``, ``rope_theta``, ``qkv_bias``, ``o_bias``, ``mlp_bias``, ``n_positions``.

Anything else (rope scaling, a head_dim other than hidden/heads, MoE, another architecture) is refused with an
``HFConfigError`` naming ``model.path``; the API turns it into a 422.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

LLAMA_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
GPT2_ARCHS = ("GPT2LMHeadModel",)
SUPPORTED_ARCHS = LLAMA_ARCHS + GPT2_ARCHS
_MAX_CONFIG_BYTES = 1 << 20


class HFConfigError(ValueError):
    """config.json is missing, unreadable or describes a model meshrun cannot build (param: ``model.path``)."""


def _int(cfg: dict[str, Any], *keys: str, default: int | None = None) -> int:
    for k in keys:
        v = cfg.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    if default is not None:
        return default
    raise HFConfigError(f"config.json has no positive integer {keys[0]!r}; it is not a complete model config")


def load_config_json(path: str) -> dict[str, Any]:
    """The parsed ``config.json`` of the directory ``path`` (HFConfigError if it is missing or not JSON)."""
    d = Path(path).expanduser()
    f = d / "config.json"
    if not d.is_dir():
        raise HFConfigError(f"'{path}' is not a directory; give the local directory of a saved Hugging Face model")
    if not f.is_file():
        raise HFConfigError(f"'{path}' has no config.json; give a directory written by save_pretrained")
    if f.stat().st_size > _MAX_CONFIG_BYTES:
        raise HFConfigError(f"{f} is larger than 1 MiB; it is not a model config")
    try:
        cfg = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise HFConfigError(f"{f} is not readable JSON ({e.__class__.__name__}); re-save the model") from e
    if not isinstance(cfg, dict):
        raise HFConfigError(f"{f} is not a JSON object; re-save the model")
    if not any(p.suffix == ".safetensors" for p in d.iterdir()):
        raise HFConfigError(
            f"'{path}' has no *.safetensors weights; save with save_pretrained(safe_serialization=True)"
        )
    return cfg


def hf_model_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Sizes and flags of a parsed config.json: ``{"sizes": {...}, "args": {...}}`` (HFConfigError if unsupported)."""
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHS), None) if isinstance(archs, list) else None
    if arch is None:
        raise HFConfigError(
            f"architecture {archs!r} is not supported; meshrun maps {list(SUPPORTED_ARCHS)} onto its own blocks"
        )
    if arch in GPT2_ARCHS:
        h = _int(cfg, "n_embd", "hidden_size")
        heads = _int(cfg, "n_head", "num_attention_heads")
        act = cfg.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise HFConfigError(f"GPT-2 activation_function {act!r} is not supported; meshrun builds gelu_new")
        if cfg.get("scale_attn_by_inverse_layer_idx") or cfg.get("reorder_and_upcast_attn"):
            raise HFConfigError("GPT-2 scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not supported")
        if cfg.get("scale_attn_weights", True) is False:
            raise HFConfigError("GPT-2 scale_attn_weights=false is not supported; meshrun scales by 1/sqrt(d)")
        n_pos = _int(cfg, "n_positions", "max_position_embeddings")
        sizes = dict(n_layers=_int(cfg, "n_layer", "num_hidden_layers"), d_model=h, n_heads=heads)
        sizes.update(vocab_size=_int(cfg, "vocab_size"), d_ff=_int(cfg, "n_inner", default=4 * h))
        eps = float(cfg.get("layer_norm_epsilon", 1e-5))
        args: dict[str, Any] = dict(arch="gpt2", n_kv_heads=heads, norm_eps=eps, n_positions=n_pos)
        args.update(qkv_bias=True, o_bias=True, mlp_bias=True, rope_theta=None)
    else:
        h = _int(cfg, "hidden_size")
        heads = _int(cfg, "num_attention_heads")
        kv = _int(cfg, "num_key_value_heads", default=heads)
        if h % heads or heads % kv:
            raise HFConfigError(f"hidden_size={h}, {heads} heads and {kv} key/value heads do not divide evenly")
        head_dim = cfg.get("head_dim")
        if head_dim not in (None, h // heads):
            raise HFConfigError(f"head_dim={head_dim} differs from hidden_size/heads={h // heads}; not supported yet")
        if cfg.get("rope_scaling") not in (None, {}) and (cfg["rope_scaling"] or {}).get("rope_type") != "default":
            raise HFConfigError(f"rope_scaling {cfg.get('rope_scaling')!r} is not supported; only plain RoPE is")
        if cfg.get("hidden_act", "silu") != "silu":
            raise HFConfigError(f"hidden_act {cfg.get('hidden_act')!r} is not supported; meshrun builds SwiGLU (silu)")
        theta = cfg.get("rope_theta")
        if theta is None and isinstance(cfg.get("rope_parameters"), dict):
            theta = cfg["rope_parameters"].get("rope_theta")
        qwen = arch == "Qwen2ForCausalLM"
        bias = bool(cfg.get("attention_bias", False))
        n_pos = _int(cfg, "max_position_embeddings", default=2048)
        sizes = dict(n_layers=_int(cfg, "num_hidden_layers"), d_model=h, n_heads=heads)
        sizes.update(vocab_size=_int(cfg, "vocab_size"), d_ff=_int(cfg, "intermediate_size"))
        args = dict(arch="llama", n_kv_heads=kv, norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), n_positions=n_pos)
        args.update(qkv_bias=qwen or bias, o_bias=bias, mlp_bias=bool(cfg.get("mlp_bias", False)))
        args.update(rope_theta=float(theta if theta is not None else 10000.0))
    args["hf_architecture"] = arch
    args["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", arch in GPT2_ARCHS))
    return {"sizes": sizes, "args": args}


def read_hf_config(path: str) -> dict[str, Any]:
    """``hf_model_fields(load_config_json(path))`` with the path in ``args["path"]``."""
    out = hf_model_fields(load_config_json(path))
    out["args"]["path"] = str(path)
    return out


def hf_param_count(
    *, n_layers: int, d_model: int, n_heads: int, vocab_size: int, d_ff: int, args: dict[str, Any]
) -> int:
    """Exact parameter count of the workers' model for these sizes (untied head; see workers.models.gpt)."""
    h, f = d_model, d_ff
    kvd = h // n_heads * int(args["n_kv_heads"])
    attn = 2 * h * h + 2 * h * kvd + (h + 2 * kvd if args["qkv_bias"] else 0) + (h if args["o_bias"] else 0)
    if args["arch"] == "gpt2":
        mlp = 2 * h * f + (f + h if args["mlp_bias"] else 0)
        norms = 4 * h
        extra = int(args["n_positions"]) * h + 2 * h
    else:
        mlp = 3 * h * f + (2 * f + h if args["mlp_bias"] else 0)
        norms = 2 * h
        extra = h
    return n_layers * (attn + mlp + norms) + 2 * vocab_size * h + extra

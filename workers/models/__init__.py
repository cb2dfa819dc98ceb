"""Model registry: ``name -> builder(cfg) -> nn.Module``; built-ins 'gpt' and 'mlp', user code via entrypoint.

``build_model(cfg, device="meta")`` builds on the meta device by default (no memory); materialise with
``materialize(model, device=..., seed=...)`` (before or after sharding), which gives the same full weights
for every layout because each parameter is drawn from its own generator seeded by (seed, parameter name).

Every built-in model class declares:
- ``tp_plan(sequence_parallel=, loss_parallel=) -> {module pattern: ParallelStyle}``
- ``stage_layer_keys(n_stages) -> [[layer keys of stage 0], ...]`` and ``split_for_pipeline(i, n)``
- ``block_class`` (the FSDP / activation-checkpointing unit) and ``flops_per_token()``.
"""

from __future__ import annotations

import logging
import math
import zlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from api.spec import ModelConfig
from workers.models.gpt import GPT, Arch, Block
from workers.models.mlp import MLPBlock, MLPModel

log = logging.getLogger(__name__)

ModelBuilder = Callable[[ModelConfig], nn.Module]
_REGISTRY: dict[str, ModelBuilder] = {}

# name fragments that wrappers add to parameter names; stripped so init and checkpoints see one name
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "module.", "_fsdp_wrapped_module.")


def register_model(name: str) -> Callable[[ModelBuilder], ModelBuilder]:
    def deco(fn: ModelBuilder) -> ModelBuilder:
        _REGISTRY[name] = fn
        return fn

    return deco


def registered_models() -> list[str]:
    return sorted(_REGISTRY)


@register_model("gpt")
def _build_gpt(cfg: ModelConfig) -> nn.Module:
    return GPT(
        n_layers=cfg.n_layers,
        d_model=cfg.d_model,
        n_heads=cfg.n_heads,
        vocab_size=cfg.vocab_size,
        seq_len=cfg.seq_len,
        d_ff=cfg.d_ff,
        arch=Arch(attention=cfg.attention),
    )


@register_model("hf")
def _build_hf(cfg: ModelConfig) -> nn.Module:
    from workers.models.hf import build_hf

    return build_hf(cfg)


@register_model("mlp")
def _build_mlp(cfg: ModelConfig) -> nn.Module:
    return MLPModel(
        n_layers=cfg.n_layers, d_model=cfg.d_model, vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, d_ff=cfg.d_ff
    )


def load_entrypoint(entrypoint: str, *, param: str = "model.entrypoint") -> Callable[..., Any]:
    """'package.module:function' -> the callable (see ``workers.user_code.import_entrypoint``)."""
    from workers.user_code import import_entrypoint

    return import_entrypoint(entrypoint, param=param)


@register_model("custom")
def _build_custom(cfg: ModelConfig) -> nn.Module:
    if not cfg.entrypoint:
        raise ValueError("model 'custom' needs model.entrypoint 'package.module:function'")
    from workers.user_code import call_model_entrypoint

    return call_model_entrypoint(cfg.entrypoint, cfg.args)


def build_model(cfg: ModelConfig, *, device: str | torch.device = "meta") -> nn.Module:
    """Build the model ``cfg`` names on ``device`` (meta by default: no memory, init later).

    User models (entrypoint) on meta get their parameters on meta and their buffers real (see
    ``workers.user_code.build_user_model``)."""
    name = "custom" if cfg.entrypoint else cfg.name
    if name == "custom" and cfg.entrypoint:
        from workers.user_code import build_user_model

        return build_user_model(cfg.entrypoint, cfg.args, device=device)
    builder = _REGISTRY.get(name)
    if builder is None:
        raise ValueError(f"unknown model '{cfg.name}'; registered: {registered_models()}")
    with torch.device(device):
        return builder(cfg)


def canonical_name(name: str) -> str:
    for p in _WRAPPER_PREFIXES:
        name = name.replace(p, "")
    return name


def _param_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def _is_norm(module: nn.Module) -> bool:
    """Normalisation layers of user models (nn.RMSNorm, GroupNorm, Hugging Face LlamaRMSNorm, ...): weight 1,
    bias 0 (a zero norm weight would silence the whole model)."""
    return isinstance(module, (nn.RMSNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase)) or type(
        module
    ).__name__.lower().endswith("norm")


def _full_init(
    module: nn.Module, pname: str, full_name: str, shape: torch.Size, *, seed: int, n_layers: int
) -> torch.Tensor:
    """The full (unsharded) initial value of one parameter, a pure function of (seed, name, shape)."""
    g = torch.Generator().manual_seed(_param_seed(seed, full_name))
    if isinstance(module, nn.LayerNorm) or _is_norm(module):
        return torch.ones(shape) if pname == "weight" else torch.zeros(shape)
    if pname == "bias":
        return torch.zeros(shape)
    std = 0.02
    if isinstance(module, nn.Linear) and full_name.rsplit(".", 2)[-2] in ("wo", "w2"):
        std = 0.02 / math.sqrt(2 * max(n_layers, 1))  # GPT-2 residual projection scaling
    if not isinstance(module, (nn.Linear, nn.Embedding)) and len(shape) < 2:
        return torch.zeros(shape)
    return torch.empty(shape).normal_(0.0, std, generator=g)


def _local_slice(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return full
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local_shape, offset = compute_local_shape_and_global_offset(full.shape, p.device_mesh, p.placements)
        idx = tuple(slice(o, o + n) for o, n in zip(offset, local_shape))
        out = full[idx]
        if tuple(out.shape) == tuple(p.to_local().shape):
            return out
    except Exception:  # pragma: no cover - fall back to the public API
        pass
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()


@torch.no_grad()
def init_weights(model: nn.Module, *, seed: int = 0) -> None:
    """Deterministic in-place init of every parameter, sharded (DTensor) or not.

    Each parameter's full value depends only on (seed, canonical parameter name), so single-process,
    pipeline stages, TP, FSDP and any combination hold slices of the same full weights. Linear/Embedding
    weights ~ N(0, 0.02) (residual projections ``wo``/``w2`` scaled by 1/sqrt(2L)), biases 0, LayerNorm 1/0;
    other parameters of user models: N(0, 0.02) if 2-D+, else 0.
    """
    n_layers = getattr(model, "n_layers", 1)
    source = _pretrained_source(model)
    try:
        for mname, module in model.named_modules():
            for pname, p in module.named_parameters(recurse=False):
                full_name = canonical_name(f"{mname}.{pname}" if mname else pname)
                if source is not None:
                    full = source.full(full_name, p.shape)
                else:
                    full = _full_init(module, pname, full_name, p.shape, seed=seed, n_layers=n_layers)
                local = _local_slice(full, p)
                target = p.to_local() if hasattr(p, "to_local") else p
                target.copy_(local.to(dtype=target.dtype, device=target.device))
    finally:
        if source is not None:
            source.close()


def _pretrained_source(model: nn.Module) -> Any:
    """The Hugging Face weights a built-in GPT was built from (``model: {name: hf}``), or None: random init."""
    gpt = next((m for m in model.modules() if isinstance(m, GPT)), None)
    if gpt is None or gpt.pretrained is None:
        return None
    from workers.models.hf import HFSource

    log.info("loading Hugging Face weights from %s", gpt.pretrained)
    return HFSource(gpt.pretrained, gpt)


def materialize(model: nn.Module, *, device: str | torch.device, seed: int = 0) -> nn.Module:
    """meta -> real storage on ``device`` (``to_empty``), then ``init_weights``. Works before or after sharding.

    Buffers that already hold values (user models build theirs for real: rotary tables, masks) keep them."""
    kept = {canonical_name(n): b.detach().clone() for n, b in model.named_buffers() if not b.is_meta}
    model.to_empty(device=device)
    if kept:
        with torch.no_grad():
            for n, b in model.named_buffers():
                src = kept.get(canonical_name(n))
                if src is not None and src.shape == b.shape:
                    b.copy_(src.to(device=b.device, dtype=b.dtype))
    init_weights(model, seed=seed)
    return model


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


__all__ = [
    "GPT",
    "Block",
    "MLPModel",
    "MLPBlock",
    "build_model",
    "register_model",
    "registered_models",
    "init_weights",
    "materialize",
    "canonical_name",
    "count_params",
    "load_entrypoint",
]

"""AdamW (or ZeRO-1 sharded AdamW) over all model parts, and the warmup + decay LR schedule."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from api.spec import Plan, RunSpec
from api.spec.schedule import lr_factor

__all__ = ["build_optimizer", "build_scheduler", "lr_factor", "param_groups"]

log = logging.getLogger(__name__)


def param_groups(model_parts: list[nn.Module], weight_decay: float) -> list[dict]:
    """nanoGPT rule: decay every >= 2-D parameter (matrices, embeddings), not biases or norms."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for part in model_parts:
        for p in part.parameters():
            if p.requires_grad:
                (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model_parts: list[nn.Module], spec: RunSpec, plan: Plan, *, dp_group=None) -> torch.optim.Optimizer:
    """One optimizer (AdamW, or SGD with momentum) over every part's parameters.
    zero_stage 1: ``ZeroRedundancyOptimizer`` over dp."""
    o = spec.optimizer
    groups = param_groups(model_parts, o.weight_decay)
    kw: dict[str, Any] = dict(lr=o.lr, betas=tuple(o.betas), eps=1e-8)
    cls: type[torch.optim.Optimizer] = torch.optim.AdamW
    if o.name == "sgd":
        cls, kw = torch.optim.SGD, dict(lr=o.lr, momentum=o.momentum)
    if plan.zero_stage == 1 and plan.dp > 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(
            groups[0]["params"],
            optimizer_class=cls,
            process_group=dp_group,
            parameters_as_bucket_view=False,
            weight_decay=o.weight_decay,
            **kw,
        )
        if groups[1]["params"]:
            opt.add_param_group({"params": groups[1]["params"], "weight_decay": 0.0})
        return opt
    params = [p for g in groups for p in g["params"]]
    if params and all(p.is_cuda and type(p.data) is torch.Tensor for p in params):
        kw["fused"] = True  # one kernel for the whole step on CUDA (plain tensors; DTensor shards use foreach)
    return cls(groups, **kw)


def build_scheduler(optimizer: torch.optim.Optimizer, spec: RunSpec) -> torch.optim.lr_scheduler.LambdaLR:
    o = spec.optimizer

    def fn(s: int) -> float:
        return lr_factor(
            s,
            warmup_steps=o.warmup_steps,
            total_steps=spec.train.steps,
            schedule=o.schedule,
            min_lr_ratio=o.min_lr_ratio,
            anchor=(o.lr_anchor_step, o.lr_anchor_factor or 0.0) if o.lr_anchor_step is not None else None,
        )

    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)

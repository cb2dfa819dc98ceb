"""The pieces of one training step (``workers.loop.train_step`` runs them in its phases): the loss, forward and
backward over the rank's micro-batches (gradient accumulation), and the optimizer step (clip, step, schedule).
Nothing here synchronises the device or logs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F

from workers.comm_hooks import Tracker
from workers.parallelize import Parallelized, clip_grad_norm_


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy; logits (B, T, V) (a vocab-sharded DTensor under loss_parallel)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def forward_backward(
    part: Parallelized,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
    scaler: Any,
    tracker: Tracker,
) -> torch.Tensor:
    """Gradient accumulation over the rank's micro-batches; returns the rank's mean loss (detached, on device).
    Gradients are reduced across data-parallel ranks on the last micro-batch only (``Parallelized.grad_sync``)."""
    m = len(micro_batches)
    total = torch.zeros((), device=device)
    for i, (x, y) in enumerate(micro_batches):
        with part.grad_sync(i == m - 1):
            lp_ctx: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
            if part.loss_parallel:
                from torch.distributed.tensor.parallel import loss_parallel

                lp_ctx = loss_parallel()
            with lp_ctx:
                with (
                    torch.autocast(device.type, dtype=part.autocast)
                    if part.autocast is not None
                    else contextlib.nullcontext()
                ):
                    logits = part.model(x)
                loss = loss_fn(logits, y) / m
                loss_plain = loss.detach()
                full = getattr(loss_plain, "full_tensor", None)
                if callable(full):
                    loss_plain = full()
                (scaler.scale(loss) if scaler is not None else loss).backward()
            tracker.after_backward()
        total += loss_plain.float()
    return total


def optimizer_step(
    optimizers: list[torch.optim.Optimizer],
    schedulers: list[Any],
    params: Iterable[torch.Tensor],
    *,
    scaler: Any,
    grad_clip: float | None,
    pp_group: Any,
) -> tuple[torch.Tensor, float]:
    """Unscale (fp16), clip the global gradient norm, step every optimizer and LR scheduler, zero the gradients.
    Returns (the gradient norm before clipping, the learning rate this step used)."""
    if scaler is not None:
        for o in optimizers:
            scaler.unscale_(o)
    grad_norm = clip_grad_norm_(params, grad_clip, pp_group=pp_group)
    lr = optimizers[0].param_groups[0]["lr"]
    for o in optimizers:
        if scaler is not None:
            scaler.step(o)
        else:
            o.step()
    if scaler is not None:
        scaler.update()
    for o, sch in zip(optimizers, schedulers):
        sch.step()
        o.zero_grad(set_to_none=True)
    return grad_norm, lr

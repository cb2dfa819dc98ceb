"""Local SGD and DiLoCo: data-parallel replicas train on their own and agree every H steps (``layout.sync``).

Each replica is one data-parallel group member of ``dp_replicate`` (its tensor-parallel ranks, and its FSDP
shard group when ``zero_stage >= 2`` with ``shard_group_size``); ``workers.parallelize`` leaves the replicas
unwrapped (no DDP, no FSDP across them), so the inner optimizer steps without any cross-replica traffic.

Every ``sync_every_steps`` (H) steps, and after the last step, ``PeriodicAverager.maybe_sync``:

1. outer gradient of this replica: ``delta = anchor - local`` (anchor: the parameters at the start of the
   round, the same on every replica), one flat fp32 buffer per rank (local shards of DTensors);
2. ONE all-reduce of that buffer over ``dp_replicate`` (the only cross-group traffic), divided by the replicas;
3. divergence before the sync: ``||local - mean local|| / ||mean local||`` over all replicas and shards (one
   two-number all-reduce over the world);
4. the outer optimizer steps the anchor with the mean delta as its gradient (DiLoCo: Nesterov, lr 0.7,
   momentum 0.9; local SGD: SGD lr 1 momentum 0 = plain averaging), and the anchor is copied into the model.

A divergence that grew at ``GROWING_SYNCS`` syncs in a row puts a ``sync_alert`` into the row (a run event).

The inner optimizer's state (AdamW moments) stays per replica, as in DiLoCo. With an inner SGD, H = 1 and an
outer SGD with lr 1 and no momentum this is exactly synchronous data parallelism (mean of the replicas' SGD steps
= the SGD step of the mean gradient); with AdamW it is not (Adam is not linear in the gradient).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from api.spec import RunSpec
from api.spec.metrics import SYNC_ALERT
from workers.metrics import CROSS_GROUP
from workers.parallel_dims import ParallelDims

log = logging.getLogger(__name__)

GROWING_SYNCS = 3  # a divergence that grew at this many syncs in a row raises a run event (sync_alert)


def _local(p: torch.Tensor) -> torch.Tensor:
    """The rank's own storage of a parameter (the local shard of a DTensor)."""
    to_local = getattr(p, "to_local", None)
    return to_local() if callable(to_local) else p


def outer_optimizer(anchor: list[torch.Tensor], spec: RunSpec) -> torch.optim.SGD:
    """The outer optimizer of ``layout.sync`` over the round's anchor: DiLoCo's (``layout.outer_optimizer``: Nesterov,
    lr 0.7, momentum 0.9 by default) or local SGD's plain averaging (SGD lr 1, no momentum)."""
    outer = spec.layout.outer_optimizer
    if spec.layout.sync == "local_sgd":
        return torch.optim.SGD(anchor, lr=1.0, momentum=0.0)
    nesterov = outer.name == "nesterov" and outer.momentum > 0
    return torch.optim.SGD(anchor, lr=outer.lr, momentum=outer.momentum, nesterov=nesterov)


def divergence_alert(divergences: list[float]) -> dict[str, Any]:
    """A ``sync_alert`` row key when the replicas' divergence grew at ``GROWING_SYNCS`` syncs in a row, else {}."""
    last = divergences[-(GROWING_SYNCS + 1) :]
    if len(last) == GROWING_SYNCS + 1 and all(a < b for a, b in zip(last, last[1:])):
        return {
            SYNC_ALERT: f"replica divergence grew at {GROWING_SYNCS} syncs in a row ({last[0]:.3g} -> {last[-1]:.3g}): "
            "lower layout.sync_every_steps or the learning rate"
        }
    return {}


class PeriodicAverager:
    def __init__(self, model_parts: list[nn.Module], *, dims: ParallelDims, spec: RunSpec) -> None:
        lay = dims.layout  # the resolved layout's flavours (the outer optimizer is the spec's optimizer config)
        self.every = lay.sync_every_steps
        self.last_step = spec.train.steps
        self.group = dims.mesh["dp_replicate"].get_group()
        self.replicas = dims.dp_replicate
        with torch.no_grad():
            self.params = [_local(p.data) for m in model_parts for p in m.parameters() if p.requires_grad]
            self.anchor = [t.detach().clone().float() for t in self.params]
        self.outer = outer_optimizer(self.anchor, spec)
        self.divergences: list[float] = []
        log.info("%s: %d replicas average every %d steps (outer %s)", lay.sync, self.replicas, self.every, self.outer)

    def due(self, step: int) -> bool:
        return step % self.every == 0 or step == self.last_step

    @torch.no_grad()
    def maybe_sync(self, step: int, *, force: bool = False) -> dict[str, Any]:
        """After the inner step ``step``: average if a round ends here (or ``force``: a checkpoint follows).
        Returns the row's extra keys."""
        if not (force or self.due(step)):
            return {}
        deltas = [a - p.float() for a, p in zip(self.anchor, self.params)]
        flat = _flatten_dense_tensors(deltas)
        mine = flat.clone()
        CROSS_GROUP.send(flat.numel() * flat.element_size())
        dist.all_reduce(flat, group=self.group)
        flat /= self.replicas
        # divergence before the sync: the replicas' distance from their mean, relative to the mean's size
        mean_delta = _unflatten_dense_tensors(flat, deltas)
        mean_params_sq = sum(float((a - d).pow(2).sum()) for a, d in zip(self.anchor, mean_delta))
        two = torch.tensor([float((mine - flat).pow(2).sum()), mean_params_sq], dtype=torch.float64, device=flat.device)
        dist.all_reduce(two)  # sum over replicas and the shards of each replica
        divergence = math.sqrt(float(two[0]) / max(float(two[1]), 1e-30))
        self.divergences.append(divergence)
        for a, d in zip(self.anchor, mean_delta):
            a.grad = d
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)
        for p, a in zip(self.params, self.anchor):
            p.copy_(a)
        return {"replica_divergence": divergence, **divergence_alert(self.divergences)}

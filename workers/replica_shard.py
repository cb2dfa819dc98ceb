"""Multi-worker replicas of ``fault_tolerance.mode: replica``: HSDP's replicate dimension across torchft.

A layout with ``zero_stage`` 2 or 3 and ``shard_group_size`` (``dp_shard``) below ``dp`` is ``dp_replicate``
replicas of ``dp_shard`` workers each. Inside a replica the workers are one torch process group (gloo on CPU, NCCL
on GPUs, on the replica's own ``TCPStore``) and FSDP2 shards the model, the gradients and the optimizer state over
it, as the shard dimension of group-mode HSDP does. Across replicas, worker ``j`` of every replica is tied to worker
``j`` of the others by torchft (each worker runs a torchft ``Manager`` with ``rank=j``, ``world_size=dp_shard``;
the replica's rank-0 Manager talks to the lighthouse): the cross-replica all-reduce of gradient shards is
torchft's, so a lost replica shrinks the quorum instead of failing the others, and a replacement's worker ``j``
heals from a live replica's worker ``j`` (its own shards).

This module: the replica's process group and FSDP2, and the local (per-worker shard) form of the state that
torchft's checkpoint transport sends to a healing peer and that a checkpoint on storage holds (plain tensors:
a DTensor names a process group of another process)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from api.spec import Plan

STORE_PREFIX = "meshrun/replica"  # the replica's process group on its TCPStore (beside torchft's keys)


def state_file(rank: int) -> str:
    """The file of worker ``rank`` of a replica in a checkpoint's ``step_XXXXXXXX/`` (rank 0's marks it whole)."""
    return "state.pt" if rank == 0 else f"state.{rank}.pt"


class ShardGroup:
    """The workers of one replica: their process group on the replica's store, and FSDP2 over it."""

    def __init__(self, store: Any, rank: int, size: int, device: torch.device) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.PrefixStore(STORE_PREFIX, store), rank=rank, world_size=size)
        self.rank, self.size = rank, size
        self.mesh = init_device_mesh(device.type, (size,), mesh_dim_names=("dp_shard",))

    def shard(self, model: nn.Module, plan: Plan) -> nn.Module:
        """FSDP2 over the replica's workers (``zero_stage`` 3: reshard after forward; 2: keep them gathered)."""
        from workers.parallelize import apply_fsdp

        return apply_fsdp(
            model,
            self.mesh,
            reshard_after_forward=plan.zero_stage >= 3,
            cpu_offload=plan.layout.cpu_offload,
        )

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the replica's workers, in place."""
        dist.all_reduce(t)
        return t

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def local(t: torch.Tensor) -> torch.Tensor:
    """This worker's shard of ``t`` (``t`` itself when it is not a DTensor), sharing its storage."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        with torch.no_grad():
            return t.to_local()
    return t


def to_local(obj: Any) -> Any:
    """``obj`` (a state dict, nested) with every DTensor replaced by this worker's shard (a copy: the peer
    receiving it, or a checkpoint, must not see later steps)."""
    if isinstance(obj, torch.Tensor):
        return local(obj).detach().clone()
    if isinstance(obj, dict):
        return {k: to_local(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_local(v) for v in obj)
    return obj


@torch.no_grad()
def load_local(model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict, optim_state: dict) -> None:
    """Load ``to_local`` states into this worker's (possibly sharded) model and optimizer: each tensor is copied
    into the shard it came from; the optimizer's per-parameter tensors become DTensors like their parameters."""
    from torch.distributed.tensor import DTensor

    own = dict(model.named_parameters()) | dict(model.named_buffers())
    for name, v in model_state.items():
        if name in own:
            local(own[name]).copy_(v)
    params: list[torch.Tensor] = [p for g in optimizer.param_groups for p in g["params"]]
    state: dict[Any, dict[str, Any]] = {}
    for idx, st in optim_state.get("state", {}).items():
        p = params[int(idx)]
        state[idx] = {k: _like(p, v) if isinstance(p, DTensor) else v for k, v in st.items()}
    optimizer.load_state_dict({**optim_state, "state": state})


def _like(p: Any, v: Any) -> Any:
    """``v`` as a DTensor laid out like parameter ``p`` when it is ``p``'s shard (Adam's moments), else ``v``
    (a step count)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(v, torch.Tensor) or v.dim() == 0 or v.shape != p.to_local().shape:
        return v
    return DTensor.from_local(
        v.to(p.device), p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )


def flat_local(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """This worker's shards of ``tensors``, flattened into one fp32 vector."""
    return torch.cat([local(t).reshape(-1).float() for t in tensors])

"""ParallelDims: owns every piece of device-mesh logic (torchtitan style). Model code never computes ranks.

Mesh dims (always all four, size-1 dims kept so slicing never depends on the layout):
``("pp", "dp_replicate", "dp_shard", "tp")`` — pp outermost, tp innermost, so consecutive ranks form a
tensor-parallel group. A flattened ``"dp"`` (= dp_replicate x dp_shard) serves data loading and loss
averaging.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.distributed as dist

from api.spec import Plan

log = logging.getLogger(__name__)

MESH_DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "tp")


def default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    world_size: int
    device_type: str = field(default_factory=default_device_type)

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "tp", "pp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        prod = self.dp_replicate * self.dp_shard * self.tp * self.pp
        if prod != self.world_size:
            raise ValueError(
                f"pp x dp_replicate x dp_shard x tp = {self.pp} x {self.dp_replicate} x "
                f"{self.dp_shard} x {self.tp} = {prod} but the world size is {self.world_size}; "
                "launch exactly that many processes or change the layout"
            )

    @classmethod
    def from_plan(cls, plan: Plan, *, world_size: int | None = None, device_type: str | None = None) -> ParallelDims:
        ws = world_size if world_size is not None else plan.world_size
        return cls(
            dp_replicate=plan.dp_replicate,
            dp_shard=plan.dp_shard,
            tp=plan.tp,
            pp=plan.pp,
            world_size=ws,
            device_type=device_type or default_device_type(),
        )

    # --------------------------------------------------------------------------------------------- mesh
    @cached_property
    def mesh(self):
        """The 4-D world mesh (built on first use; needs an initialised process group)."""
        from torch.distributed.device_mesh import init_device_mesh

        shape = (self.pp, self.dp_replicate, self.dp_shard, self.tp)
        mesh = init_device_mesh(self.device_type, shape, mesh_dim_names=MESH_DIM_NAMES)
        mesh["dp_replicate", "dp_shard"]._flatten("dp")
        log.info("device mesh %s over %d ranks", dict(zip(MESH_DIM_NAMES, shape)), self.world_size)
        return mesh

    def __getitem__(self, names):
        return self.mesh[names]

    @property
    def dp_mesh(self):
        return self.mesh["dp"]

    @property
    def tp_mesh(self):
        return self.mesh["tp"]

    @property
    def pp_mesh(self):
        return self.mesh["pp"]

    @property
    def fsdp_mesh(self):
        """Mesh FSDP2 shards over: 2-D (replicate, shard) for HSDP, else the shard dim."""
        if self.dp_replicate > 1:
            return self.mesh["dp_replicate", "dp_shard"]
        return self.mesh["dp_shard"]

    # -------------------------------------------------------------------------------------- sizes/ranks
    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_enabled(self) -> bool:
        return self.dp_size > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard > 1

    def _coords(self, rank: int | None = None) -> tuple[int, int, int, int]:
        """(pp, dp_replicate, dp_shard, tp) coordinates of a global rank (pure arithmetic, no mesh)."""
        r = dist.get_rank() if rank is None else rank
        r, tp = divmod(r, self.tp)
        r, dps = divmod(r, self.dp_shard)
        pp, dpr = divmod(r, self.dp_replicate)
        return pp, dpr, dps, tp

    @property
    def dp_rank(self) -> int:
        _, dpr, dps, _ = self._coords()
        return dpr * self.dp_shard + dps

    @property
    def tp_rank(self) -> int:
        return self._coords()[3]

    @property
    def pp_rank(self) -> int:
        return self._coords()[0]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def dp_rank_of(self, rank: int) -> int:
        _, dpr, dps, _ = self._coords(rank)
        return dpr * self.dp_shard + dps

    def describe(self) -> str:
        return (
            f"pp={self.pp} dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} tp={self.tp} "
            f"world={self.world_size} device={self.device_type}"
        )

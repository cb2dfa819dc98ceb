"""ParallelDims: the torch side of a ``ResolvedLayout`` (``api.spec.layout``) -- the device mesh and this rank's
coordinates in it. Degrees and flavours (FSDP or DDP, HSDP, ...) are the layout's; this class only builds the
mesh and reads ranks from it. Model code never computes ranks.

Mesh dims (always all four, size-1 dims kept so slicing never depends on the layout): ``MESH_DIMS`` =
``("pp", "dp_replicate", "dp_shard", "tp")`` -- pp outermost, tp innermost, so consecutive ranks form a
tensor-parallel group. A flattened ``"dp"`` (= dp_replicate x dp_shard) serves data loading and loss averaging.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.distributed as dist

from api.spec import MESH_DIMS, Plan, ResolvedLayout

log = logging.getLogger(__name__)

MESH_DIM_NAMES = MESH_DIMS


def default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class ParallelDims:
    """``layout`` over ``world_size`` processes on ``device_type``; the degrees must multiply to the world size
    (``LayoutError``, a ``ValueError``, naming ``world_size`` otherwise)."""

    layout: ResolvedLayout
    world_size: int
    device_type: str = field(default_factory=default_device_type)

    def __post_init__(self) -> None:
        self.layout.check_world_size(self.world_size)

    @classmethod
    def from_plan(cls, plan: Plan, *, world_size: int | None = None, device_type: str | None = None) -> ParallelDims:
        ws = world_size if world_size is not None else plan.world_size
        return cls(plan.layout, ws, device_type or default_device_type())

    # --------------------------------------------------------------------------------------------- mesh
    @cached_property
    def mesh(self):
        """The 4-D world mesh (built on first use; needs an initialised process group)."""
        from torch.distributed.device_mesh import init_device_mesh

        shape = self.layout.mesh_shape
        mesh = init_device_mesh(self.device_type, shape, mesh_dim_names=MESH_DIMS)
        mesh["dp_replicate", "dp_shard"]._flatten("dp")
        log.info("device mesh %s over %d ranks", dict(zip(MESH_DIMS, shape)), self.world_size)
        return mesh

    @property
    def tp_mesh(self):
        return self.mesh["tp"]

    @property
    def pp_mesh(self):
        return self.mesh["pp"]

    @property
    def fsdp_mesh(self):
        """The mesh FSDP2 shards over (the layout's ``fsdp_mesh_dims``): 2-D (replicate, shard) for HSDP, else
        the shard dim."""
        dims = self.layout.fsdp_mesh_dims
        return self.mesh[dims] if len(dims) > 1 else self.mesh[dims[0]]

    # -------------------------------------------------------------------------------------- sizes/ranks
    @property
    def dp_replicate(self) -> int:
        return self.layout.dp_replicate

    @property
    def dp_size(self) -> int:
        return self.layout.dp

    @property
    def dp_enabled(self) -> bool:
        return self.layout.dp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.layout.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.layout.pp > 1

    def _coords(self, rank: int | None = None) -> tuple[int, int, int, int]:
        """(pp, dp_replicate, dp_shard, tp) coordinates of a global rank (pure arithmetic, no mesh)."""
        lay = self.layout
        r = dist.get_rank() if rank is None else rank
        r, tp = divmod(r, lay.tp)
        r, dps = divmod(r, lay.dp_shard)
        pp, dpr = divmod(r, lay.dp_replicate)
        return pp, dpr, dps, tp

    @property
    def dp_rank(self) -> int:
        _, dpr, dps, _ = self._coords()
        return dpr * self.layout.dp_shard + dps

    @property
    def tp_rank(self) -> int:
        return self._coords()[3]

    def describe(self) -> str:
        shape = " x ".join(map(str, self.layout.mesh_shape))
        return (
            f"{self.layout} (mesh {' x '.join(MESH_DIMS)} = {shape}) world={self.world_size} device={self.device_type}"
        )

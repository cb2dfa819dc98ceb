"""The resolved layout: ``ResolvedLayout``, the ONE shape a parallelism layout has once the spec's ``Layout`` is
resolved (``ResolvedLayout.of``). The planner prices it, placement places it, the ``Plan`` stored with a run
carries it (``Plan.layout``), the workers build their device mesh from it (``workers.parallel_dims``) and read
their data-parallel flavour from it (``workers.parallelize``), and the console and the CLI print it (``str``).

Degrees are the mesh dimensions, outermost first (``MESH_DIMS``): ``pp``, ``dp_replicate``, ``dp_shard``,
``tp``; consecutive ranks form a tensor-parallel group. ``dp = dp_replicate x dp_shard`` and
``world_size = pp x dp x tp``. A new dimension (context parallel ``cp``, expert parallel ``ep``) is one field
here, one entry in ``MESH_DIMS`` and one factor in ``world_size``.

Flavours (how each dimension is run) sit next to the degrees: ZeRO stage, sequence parallel, the pipeline schedule,
gradient compression, CPU offload and the replica synchronisation mode. What follows from them -- the ZeRO
shard degree, FSDP or DDP, HSDP -- is computed here once (properties), never restated by a caller.

Pydantic only: no torch (``api`` is the bottom layer everybody imports).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from api.spec._base import MAX_WORLD_SIZE
from api.spec.run import GradCompression, PPSchedule, SyncMode

if TYPE_CHECKING:
    from api.spec.run import Layout

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")  # outermost first: tp innermost, so a TP group is contiguous
PERIODIC_SYNC = ("local_sgd", "diloco")


class LayoutError(ValueError):
    """A layout that cannot be resolved or run; ``param`` names the field (``layout.shard_group_size``)."""

    def __init__(self, param: str, message: str) -> None:
        self.param = param
        self.message = message
        super().__init__(f"{param}: {message}")


class ResolvedLayout(BaseModel):
    """Degrees and flavours of one layout, immutable. Build it with ``ResolvedLayout.of(layout)``."""

    model_config = ConfigDict(frozen=True, extra="ignore", protected_namespaces=())

    # degrees (the mesh dimensions, MESH_DIMS order)
    pp: int = Field(1, ge=1, le=MAX_WORLD_SIZE, description="Pipeline stages (outermost mesh dimension).")
    dp_replicate: int = Field(
        1, ge=1, le=MAX_WORLD_SIZE, description="Data-parallel replicas (HSDP outer dim; dp for zero 0/1)."
    )
    dp_shard: int = Field(1, ge=1, le=MAX_WORLD_SIZE, description="Data-parallel shard degree (FSDP; 1 for zero 0/1).")
    tp: int = Field(1, ge=1, le=MAX_WORLD_SIZE, description="Tensor-parallel degree (innermost: one node).")
    # flavours
    zero_stage: int = Field(0, ge=0, le=3, description="0 DDP, 1 sharded optimizer, 2 + grads, 3 FSDP full shard.")
    sequence_parallel: bool = False
    pp_schedule: PPSchedule = "1f1b"
    pp_virtual_stages: int = Field(1, ge=1, le=64)
    grad_compression: GradCompression = "none"
    cpu_offload: bool = False
    sync: SyncMode = "sync"
    ps_shards: int = Field(1, ge=1, le=64)
    max_staleness: int = Field(4, ge=0, le=1000)
    sync_every_steps: int = Field(8, ge=1, le=100_000)

    @model_validator(mode="after")
    def _consistent(self) -> ResolvedLayout:
        if self.dp_shard > 1 and self.zero_stage < 2:
            raise ValueError(
                f"dp_shard={self.dp_shard} shards parameters (FSDP), which needs zero_stage 2 or 3 (got "
                f"{self.zero_stage}); use dp_shard=1 and dp_replicate={self.dp} or zero_stage 3"
            )
        return self

    # ------------------------------------------------------------------------------------------- resolution
    @classmethod
    def of(cls, layout: Layout) -> ResolvedLayout:
        """Resolve the spec's layout: split ``dp`` into (``dp_replicate``, ``dp_shard``). Raises ``LayoutError``
        naming the field when it cannot be split."""
        sgs = layout.shard_group_size
        if layout.zero_stage >= 2:
            if sgs is not None and layout.dp % sgs:
                raise LayoutError("layout.shard_group_size", f"shard_group_size={sgs} does not divide dp={layout.dp}")
            dp_shard = sgs or layout.dp
        elif sgs is not None:
            raise LayoutError(
                "layout.shard_group_size",
                "HSDP shard groups need zero_stage 2 or 3; set zero_stage: 3 or remove shard_group_size",
            )
        else:
            dp_shard = 1
        return cls(
            pp=layout.pp,
            dp_replicate=layout.dp // dp_shard,
            dp_shard=dp_shard,
            tp=layout.tp,
            zero_stage=layout.zero_stage,
            sequence_parallel=layout.sequence_parallel,
            pp_schedule=layout.pp_schedule,
            pp_virtual_stages=layout.pp_virtual_stages,
            grad_compression=layout.grad_compression,
            cpu_offload=layout.cpu_offload,
            sync=layout.sync,
            ps_shards=layout.ps_shards,
            max_staleness=layout.max_staleness,
            sync_every_steps=layout.sync_every_steps,
        )

    def to_layout(self) -> Layout:
        """The spec form (``api.spec.Layout``) of this layout, e.g. for a planner answer."""
        from api.spec.run import Layout

        return Layout(
            dp=self.dp,
            tp=self.tp,
            pp=self.pp,
            zero_stage=self.zero_stage,
            shard_group_size=self.shard_group_size,
            sequence_parallel=self.sequence_parallel,
            pp_schedule=self.pp_schedule,
            pp_virtual_stages=self.pp_virtual_stages,
            grad_compression=self.grad_compression,
            cpu_offload=self.cpu_offload,
            sync=self.sync,
            ps_shards=self.ps_shards,
            max_staleness=self.max_staleness,
            sync_every_steps=self.sync_every_steps,
        )

    def replace(self, **changes: Any) -> ResolvedLayout:
        """A validated copy with ``changes`` applied (``model_copy`` would skip validation)."""
        return type(self).model_validate({**self.model_dump(), **changes})

    def check_world_size(self, world_size: int) -> None:
        """Raise ``LayoutError`` (param ``world_size``) unless the degrees multiply to ``world_size``."""
        if self.world_size != world_size:
            expr = " x ".join(f"{d}" for d in MESH_DIMS)
            vals = " x ".join(str(n) for n in self.mesh_shape)
            raise LayoutError(
                "world_size",
                f"{expr} = {vals} = {self.world_size} but the world size is {world_size}; launch exactly "
                f"{self.world_size} processes or change the layout",
            )

    # -------------------------------------------------------------------------------------------- degrees
    @property
    def dp(self) -> int:
        """Data-parallel degree: replicas x shards."""
        return self.dp_replicate * self.dp_shard

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """Degrees in ``MESH_DIMS`` order (the device mesh's shape)."""
        return tuple(getattr(self, d) for d in MESH_DIMS)

    @property
    def world_size(self) -> int:
        n = 1
        for d in self.mesh_shape:
            n *= d
        return n

    @property
    def pp_stages_total(self) -> int:
        return self.pp * self.pp_virtual_stages

    @property
    def shard_degree(self) -> int:
        """Ranks each rank's ZeRO-sharded model states are split over: the FSDP shard group (``dp_shard``) for
        zero 2/3, all of data parallel for zero 1 (the optimizer states), 1 for zero 0."""
        if self.zero_stage >= 2:
            return self.dp_shard
        return self.dp if self.zero_stage == 1 else 1

    @property
    def shard_group_size(self) -> int | None:
        """The spec's HSDP shard group (``dp_shard`` when FSDP shards within groups smaller than dp), else None."""
        return self.dp_shard if self.zero_stage >= 2 and self.dp_replicate > 1 else None

    # ------------------------------------------------------------------------------------------- flavours
    @property
    def periodic(self) -> bool:
        """local_sgd / diloco: the replicas step alone and are averaged every ``sync_every_steps``."""
        return self.sync in PERIODIC_SYNC

    @property
    def dp_wrapper(self) -> Literal["fsdp", "ddp", "none"]:
        """How a model part is wrapped for data parallelism: FSDP2 for zero 2/3 (and, for zero 0, when tp or pp
        shard the model too: DDP does not take DTensor parameters, so FSDP2 replicates over (dp_replicate,
        dp_shard=1)); DDP for zero 0/1 otherwise; nothing without data parallelism or across periodic replicas."""
        if self.zero_stage >= 2 or (
            not self.periodic and self.zero_stage == 0 and self.dp > 1 and (self.tp > 1 or self.pp > 1)
        ):
            return "fsdp"
        if self.dp > 1 and not self.periodic:
            return "ddp"
        return "none"

    @property
    def hsdp(self) -> bool:
        """FSDP over the 2-D (dp_replicate, dp_shard) mesh: shard within groups, replicate across them (never
        across periodic replicas: those are averaged by ``workers.periodic``)."""
        return self.dp_wrapper == "fsdp" and self.dp_replicate > 1 and not self.periodic

    @property
    def fsdp_mesh_dims(self) -> tuple[str, ...]:
        """The mesh dimensions FSDP shards (and, HSDP, replicates) over."""
        return ("dp_replicate", "dp_shard") if self.hsdp else ("dp_shard",)

    @property
    def reshard_after_forward(self) -> bool:
        """ZeRO-3 frees the gathered parameters after the forward pass; ZeRO-2 keeps them for the backward."""
        return self.zero_stage != 2

    @property
    def ddp_compression(self) -> GradCompression:
        """The DDP gradient-compression hook (zero 0 only)."""
        return self.grad_compression if self.zero_stage == 0 else "none"

    # ------------------------------------------------------------------------------------------------ text
    def __str__(self) -> str:
        """The one human form of a layout: ``dp2 tp2 pp2 zero3 hsdp/4 sp 1f1b``."""
        parts = [f"dp{self.dp}"] + [f"{k}{getattr(self, k)}" for k in ("tp", "pp") if getattr(self, k) > 1]
        if self.zero_stage:
            parts.append(f"zero{self.zero_stage}")
        if self.shard_group_size:
            parts.append(f"hsdp/{self.shard_group_size}")
        if self.sequence_parallel:
            parts.append("sp")
        if self.pp > 1:
            v = self.pp_virtual_stages
            parts.append(self.pp_schedule + (f"x{v}" if v > 1 else ""))
        if self.grad_compression != "none":
            parts.append(f"gc:{self.grad_compression}")
        if self.cpu_offload:
            parts.append("offload")
        if self.periodic:
            parts.append(f"{self.sync}/{self.sync_every_steps}")
        elif self.sync != "sync":
            parts.append(self.sync)
        return " ".join(parts)


def layout_label(layout: Any) -> str:
    """``str(ResolvedLayout)`` of a stored layout (a ``Layout``, a ``ResolvedLayout`` or their JSON); '–' for
    none. A layout that does not resolve (a skipped sweep trial's) reads as ``invalid layout (<why>)``."""
    from api.spec.run import Layout

    if not layout:
        return "–"
    if isinstance(layout, ResolvedLayout):
        return str(layout)
    try:
        return str(ResolvedLayout.of(layout if isinstance(layout, Layout) else Layout.model_validate(layout)))
    except (LayoutError, ValueError) as e:
        return f"invalid layout ({e})"

"""Calibration factors: per-term corrections of the planner's physics, fitted to measured runs.

Every time factor multiplies one term of the model (1.0 = the device table and the model as they are), so a
calibration that measured, say, slow tensor-parallel collectives corrects ``tp_*`` and nothing else. Plain data
(``to_dict``/``from_dict``) so that a calibration (``service.store.calibrations.fit_factors``) can fit them and pass
them back through every planner function's ``factors=`` keyword.

Which step-time term each factor moves (``TERM_FACTORS``; the names of ``api.spec.StepTimeBreakdown``):
- compute: ``compute_efficiency`` (GEMM and attention throughput), ``memory_efficiency`` (memory-bound kernels),
  ``launch_scale`` (host launch time per kernel and fixed per-kernel device time), ``recompute_scale`` (host time of
  activation recomputation: checkpointing frameworks add their own bookkeeping to the re-run forward)
- tp_comm: ``tp_bandwidth_efficiency``, ``tp_latency_scale``
- pp_comm: ``pp_bandwidth_efficiency``, ``pp_latency_scale``
- pp_bubble: ``bubble_scale``
- dp_comm: ``dp_bandwidth_efficiency``, ``dp_latency_scale``, ``dp_overlap_fraction`` (share of the backward pass
  that can hide data-parallel communication: 0.5 by default, between frameworks that overlap gradient buckets and
  FSDP prefetches with compute (PyTorch DDP/FSDP) and Megatron-LM's default of reducing after the backward pass)
- optimizer: ``optimizer_scale``
- other: ``step_overhead_s`` (fixed seconds per step: logging, clipping, data, Python)
Non-time settings: ``flash_attention`` (fused attention: no ``s^2`` memory, flash kernels), ``memory_overhead_fraction``
(added to the device's allocator slack), ``bucket_bytes`` (DDP bucket size), ``offload_bandwidth_bytes_per_s``.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, fields
from typing import Any

log = logging.getLogger(__name__)

MiB = 1 << 20

TERM_FACTORS: dict[str, tuple[str, ...]] = {
    "compute": ("compute_efficiency", "memory_efficiency", "launch_scale", "recompute_scale"),
    "tp_comm": ("tp_bandwidth_efficiency", "tp_latency_scale"),
    "pp_comm": ("pp_bandwidth_efficiency", "pp_latency_scale"),
    "pp_bubble": ("bubble_scale",),
    "dp_comm": ("dp_bandwidth_efficiency", "dp_latency_scale", "dp_overlap_fraction"),
    "optimizer": ("optimizer_scale",),
    "other": ("step_overhead_s",),
}

# keys of the single-scalar factors of earlier versions: dropped when read back (their model is gone)
LEGACY_KEYS = frozenset(
    {
        "gemm_fraction",
        "intra_bandwidth_fraction",
        "inter_bandwidth_fraction",
        "intra_latency_s",
        "inter_latency_s",
        "layer_overhead_s",
    }
)


@dataclass(frozen=True)
class Factors:
    """Per-term multipliers (1.0 = uncalibrated) and a few settings. See the module docstring."""

    compute_efficiency: float = 1.0
    memory_efficiency: float = 1.0
    launch_scale: float = 1.0
    recompute_scale: float = 1.0
    tp_bandwidth_efficiency: float = 1.0
    tp_latency_scale: float = 1.0
    pp_bandwidth_efficiency: float = 1.0
    pp_latency_scale: float = 1.0
    dp_bandwidth_efficiency: float = 1.0
    dp_latency_scale: float = 1.0
    dp_overlap_fraction: float = 0.5
    bubble_scale: float = 1.0
    optimizer_scale: float = 1.0
    step_overhead_s: float = 0.0
    flash_attention: bool = True
    memory_overhead_fraction: float = 0.0
    bucket_bytes: int = 25 * MiB
    offload_bandwidth_bytes_per_s: float = 25e9

    def __post_init__(self) -> None:
        for name in (
            "compute_efficiency",
            "memory_efficiency",
            "tp_bandwidth_efficiency",
            "pp_bandwidth_efficiency",
            "dp_bandwidth_efficiency",
        ):
            v = getattr(self, name)
            if not 0 < v <= 4:
                raise ValueError(f"factors.{name}={v} must be in (0, 4]")
        if not 0 <= self.dp_overlap_fraction <= 1:
            raise ValueError(f"factors.dp_overlap_fraction={self.dp_overlap_fraction} must be in [0, 1]")
        for name in (
            "launch_scale",
            "recompute_scale",
            "tp_latency_scale",
            "pp_latency_scale",
            "dp_latency_scale",
            "bubble_scale",
            "optimizer_scale",
            "step_overhead_s",
            "memory_overhead_fraction",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"factors.{name} must be >= 0")
        if self.bucket_bytes < 1 or self.offload_bandwidth_bytes_per_s <= 0:
            raise ValueError("factors.bucket_bytes and offload_bandwidth_bytes_per_s must be > 0")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Factors:
        """Factors from a dict (e.g. a calibration); missing keys keep their defaults, keys of the earlier
        single-scalar model are dropped (logged), other unknown keys are an error naming the known ones."""
        data = dict(data or {})
        legacy = sorted(set(data) & LEGACY_KEYS)
        if legacy:
            log.info("ignoring planner factors of an earlier model: %s", legacy)
            for k in legacy:
                data.pop(k)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown planner factors {unknown}; known: {sorted(known)}")
        return cls(**data)


DEFAULT_FACTORS = Factors()
# CPU workers (gloo, eager torch): no flash kernels; DDP overlap is poor on few cores.
CPU_FACTORS = Factors(dp_overlap_fraction=0.3, flash_attention=False)


def default_factors(*, is_cpu: bool) -> Factors:
    return CPU_FACTORS if is_cpu else DEFAULT_FACTORS

"""Efficiency factors: what fraction of the catalogue figures a real run achieves.

Plain data (``to_dict``/``from_dict``) so that a calibration step (sweeps) can fit them from measurements and
pass them back through every planner function's ``factors=`` keyword.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

MiB = 1 << 20


@dataclass(frozen=True)
class Factors:
    """Achieved fractions and fixed costs. Defaults are typical of NCCL/cuBLAS on NVLink + InfiniBand nodes.

    - ``gemm_fraction``: achieved fraction of peak FLOP/s in the model's GEMMs (Megatron reaches 0.5-0.7).
    - ``intra_bandwidth_fraction`` / ``inter_bandwidth_fraction``: achieved collective bandwidth as a
      fraction of the link figure, per tier (measured NCCL bus bandwidth is usually 60-80 % of it).
    - ``dp_overlap_fraction``: the share of data-parallel communication that can hide under backward
      compute when there is enough compute to hide it under (see ``service.planner.core``).
    - ``intra_latency_s`` / ``inter_latency_s``: fixed cost per collective / point-to-point message.
    - ``layer_overhead_s``: host/launch overhead per transformer layer per micro-batch (forward + backward);
      ``step_overhead_s``: fixed cost per optimizer step (optimizer, clipping, logging). Both matter only for
      tiny models (CPU), where they dominate.
    - ``flash_attention``: attention does not store the ``5 a s^2 b`` softmax term (SDPA/flash kernels).
    - ``memory_overhead_fraction``: allocator fragmentation and workspace, a fraction of states + activations.
    - ``bucket_bytes``: DDP/ZeRO gradient bucket size (two buckets are alive at once).
    - ``offload_bandwidth_bytes_per_s``: host<->device bandwidth for ``cpu_offload`` (PCIe).
    """

    gemm_fraction: float = 0.6
    intra_bandwidth_fraction: float = 0.8
    inter_bandwidth_fraction: float = 0.7
    dp_overlap_fraction: float = 0.8
    intra_latency_s: float = 10e-6
    inter_latency_s: float = 30e-6
    layer_overhead_s: float = 0.0
    step_overhead_s: float = 0.0
    flash_attention: bool = True
    memory_overhead_fraction: float = 0.08
    bucket_bytes: int = 25 * MiB
    offload_bandwidth_bytes_per_s: float = 25e9

    def __post_init__(self) -> None:
        for name in ("gemm_fraction", "intra_bandwidth_fraction", "inter_bandwidth_fraction"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise ValueError(f"factors.{name}={v} must be in (0, 1]")
        if not 0 <= self.dp_overlap_fraction <= 1:
            raise ValueError(f"factors.dp_overlap_fraction={self.dp_overlap_fraction} must be in [0, 1]")
        for name in ("intra_latency_s", "inter_latency_s", "layer_overhead_s", "step_overhead_s",
                     "memory_overhead_fraction"):
            if getattr(self, name) < 0:
                raise ValueError(f"factors.{name} must be >= 0")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Factors:
        """Factors from a dict (e.g. a sweep's calibration); missing keys keep their defaults, unknown keys
        are an error naming the known ones."""
        data = dict(data or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown planner factors {unknown}; known: {sorted(known)}")
        return cls(**data)


DEFAULT_FACTORS = Factors()
# A CPU's peak is measured with a matmul, so GEMMs reach most of it; gloo collectives and Python overhead
# dominate tiny models.
CPU_FACTORS = Factors(gemm_fraction=0.7, intra_bandwidth_fraction=0.5, inter_bandwidth_fraction=0.5,
                      dp_overlap_fraction=0.3, intra_latency_s=200e-6, inter_latency_s=500e-6,
                      layer_overhead_s=1e-3, step_overhead_s=5e-3, flash_attention=False,
                      memory_overhead_fraction=0.1)


def default_factors(*, is_cpu: bool) -> Factors:
    return CPU_FACTORS if is_cpu else DEFAULT_FACTORS

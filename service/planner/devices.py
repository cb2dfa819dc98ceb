"""Accelerator figures the planner prices layouts with, and their resolution from a ``ClusterSpec``.

Units: FLOP/s are dense (no 2:4 sparsity); memory is the HBM capacity in bytes (GiB-based, as vendors count
it); bandwidths are per GPU and per direction: ``intra_node_bandwidth_bytes_per_s`` is the GPU's
NVLink/fabric bandwidth to its node peers (NVIDIA quotes the bidirectional sum: A100 600 GB/s -> 300 GB/s
here), ``inter_node_bandwidth_bytes_per_s`` the typical NIC share per GPU (one 200 Gb/s HDR NIC per A100 ->
25 GB/s; one 400 Gb/s NDR NIC per H100 -> 50 GB/s). The efficiency factors (``service.planner.factors``)
turn these link figures into achieved ones; ``ClusterSpec`` overrides replace them.

A CPU "device" has no fixed figures: give its measured peak and memory
(``ClusterSpec(device="cpu", peak_flops_per_s=..., memory_bytes=...)``); one worker per "gpu" slot.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from api.schemas import ClusterSpec
from api.validation import SpecError, SpecIssue

GiB = 1 << 30


@dataclass(frozen=True)
class Device:
    """Figures of one accelerator (per device)."""

    name: str
    peak_flops_per_s_16bit: float | None  # bf16/fp16 dense tensor-core peak; None = no native 16-bit matmul
    peak_flops_per_s_fp32: float  # plain fp32 (no TF32)
    memory_bytes: int
    intra_node_bandwidth_bytes_per_s: float
    inter_node_bandwidth_bytes_per_s: float
    reserved_bytes: int = 1 * GiB  # GPU: CUDA/ROCm context + NCCL buffers; CPU: the runtime's resident size
    is_cpu: bool = False
    bf16: bool = True  # native bf16 support (V100 has fp16 only)

    def peak_flops_per_s(self, precision: str) -> float:
        """Peak FLOP/s for the matmul precision (``fp32`` | ``bf16`` | ``fp16``)."""
        if precision == "fp32" or self.is_cpu:
            return self.peak_flops_per_s_fp32
        if precision == "bf16" and not self.bf16:
            raise SpecError([SpecIssue("precision", f"{self.name} has no native bf16; use precision fp16 or fp32",
                                       "unsupported_precision")])
        return self.peak_flops_per_s_16bit or self.peak_flops_per_s_fp32


DEVICES: dict[str, Device] = {d.name: d for d in (
    Device("A100-40GB", 312e12, 19.5e12, 40 * GiB, 300e9, 25e9),
    Device("A100-80GB", 312e12, 19.5e12, 80 * GiB, 300e9, 25e9),
    Device("H100", 989e12, 67e12, 80 * GiB, 450e9, 50e9),          # SXM5, NVLink 4
    Device("H100-PCIe", 756e12, 51e12, 80 * GiB, 64e9, 25e9),       # PCIe Gen5 x16 between GPUs
    Device("H200", 989e12, 67e12, 141 * GiB, 450e9, 50e9),          # H100 compute, 141 GB HBM3e
    Device("B200", 2250e12, 80e12, 180 * GiB, 900e9, 50e9),         # NVLink 5
    Device("L4", 121e12, 30.3e12, 24 * GiB, 32e9, 12.5e9),          # PCIe Gen4, no NVLink
    Device("L40S", 362e12, 91.6e12, 48 * GiB, 32e9, 25e9),          # PCIe Gen4, no NVLink
    Device("A10G", 125e12, 31.2e12, 24 * GiB, 32e9, 12.5e9),        # AWS g5 (GA102 like A10), PCIe Gen4
    Device("V100", 125e12, 15.7e12, 32 * GiB, 150e9, 12.5e9, bf16=False),  # SXM2 32GB, NVLink 2, fp16 only
    Device("V100-16GB", 125e12, 15.7e12, 16 * GiB, 150e9, 12.5e9, bf16=False),
    Device("MI300X", 1307e12, 163.4e12, 192 * GiB, 448e9, 50e9),    # Infinity Fabric 7 x 64 GB/s
    # CPU: peak and memory must come from the ClusterSpec (measured); shared-memory gloo within a node.
    # reserved: the resident torch + gloo runtime of a worker process (~330 MiB RSS measured with torch 2.x on
    # x86; bench/bench_planner_accuracy.py reports it), since the workers report peak RSS on CPU.
    Device("cpu", None, 0.0, 0, 10e9, 1.25e9, reserved_bytes=320 * (1 << 20), is_cpu=True),
)}

_ALIASES: dict[str, str] = {
    "a100": "A100-80GB", "a100-80g": "A100-80GB", "a100-sxm": "A100-80GB", "a100-sxm4": "A100-80GB",
    "a100-sxm4-80gb": "A100-80GB", "a100-40g": "A100-40GB", "a100-sxm4-40gb": "A100-40GB",
    "h100-sxm": "H100", "h100-sxm5": "H100", "h100-80gb": "H100", "h100-sxm5-80gb": "H100", "h100-80gb-hbm3": "H100",
    "h100-pcie-80gb": "H100-PCIe", "h200-sxm": "H200", "h200-141gb": "H200", "b200-sxm": "B200",
    "l4-24gb": "L4", "l40s-48gb": "L40S", "a10g-24gb": "A10G", "a10": "A10G",
    "v100-32gb": "V100", "v100-sxm2": "V100", "v100-sxm2-32gb": "V100", "v100-sxm2-16gb": "V100-16GB",
    "mi300": "MI300X", "instinct-mi300x": "MI300X", "amd-instinct-mi300x": "MI300X",
}
_BY_KEY: dict[str, str] = {name.lower(): name for name in DEVICES}


def _key(name: str) -> str:
    k = name.strip().lower().replace("_", "-").replace(" ", "-")
    for prefix in ("nvidia-", "amd-"):
        if k.startswith(prefix):
            k = k[len(prefix):]
    return k


def device_names() -> list[str]:
    """The canonical device names the table knows (aliases resolve to these)."""
    return list(DEVICES)


def lookup_device(name: str) -> Device:
    """A device by name, case-insensitive, with aliases ("h100", "H100-SXM", "a100" -> A100-80GB, and
    ``torch.cuda.get_device_name`` spellings such as "NVIDIA H100 80GB HBM3").

    Raises ``SpecError`` (param ``cluster.device``) naming the known devices.
    """
    k = _key(name)
    canonical = _BY_KEY.get(k) or _ALIASES.get(k)
    if canonical is None:
        raise SpecError([SpecIssue(
            "cluster.device", f"unknown device '{name}'; use one of {device_names()} (case-insensitive), "
            "'live' for the service's Ray cluster, or 'cpu' with peak_flops_per_s and memory_bytes",
            "unknown_device")])
    return DEVICES[canonical]


def resolve_device(cluster: ClusterSpec) -> Device:
    """The device of a cluster with the ClusterSpec's overrides (peak, memory, bandwidths) applied.

    ``cpu`` needs ``peak_flops_per_s`` and ``memory_bytes`` (measure them; a CPU has no catalogue figure).
    ``live`` must be resolved to a concrete ClusterSpec before it gets here.
    """
    if cluster.device.strip().lower() == "live":
        raise SpecError([SpecIssue("cluster.device", "device 'live' needs the service's Ray cluster description, "
                                   "which is not available here; name a device type such as 'H100'",
                                   "live_cluster_unavailable")])
    dev = lookup_device(cluster.device)
    if dev.is_cpu:
        missing = [f for f in ("peak_flops_per_s", "memory_bytes") if getattr(cluster, f) is None]
        if missing:
            raise SpecError([SpecIssue(f"cluster.{missing[0]}", "device 'cpu' has no catalogue figures: give "
                                       "cluster.peak_flops_per_s (a measured matmul peak) and cluster.memory_bytes "
                                       "(memory per worker)", "missing_device_figures")])
    over: dict = {}
    if cluster.peak_flops_per_s is not None:
        over["peak_flops_per_s_16bit"] = cluster.peak_flops_per_s
        over["peak_flops_per_s_fp32"] = cluster.peak_flops_per_s
        over["bf16"] = True
    if cluster.memory_bytes is not None:
        over["memory_bytes"] = int(cluster.memory_bytes)
    if cluster.intra_node_bandwidth_bytes_per_s is not None:
        over["intra_node_bandwidth_bytes_per_s"] = cluster.intra_node_bandwidth_bytes_per_s
    if cluster.inter_node_bandwidth_bytes_per_s is not None:
        over["inter_node_bandwidth_bytes_per_s"] = cluster.inter_node_bandwidth_bytes_per_s
    return replace(dev, **over) if over else dev

"""Accelerator figures the planner prices layouts with (achieved, not datasheet, where measured), their sources,
and their resolution from a ``ClusterSpec`` (whose fields replace any figure with a measured one).

Units: FLOP/s are dense (no 2:4 sparsity) datasheet peaks; ``matmul_efficiency`` is the achieved fraction of that
peak on large, well-shaped GEMMs, and ``service.planner.kernels`` lowers it for small shapes (tile and wave
quantisation over ``sms`` multiprocessors, a short reduction dimension, a fixed cost per kernel). Memory is the
HBM capacity in bytes. ``memory_bandwidth_bytes_per_s`` is the achieved device-memory bandwidth of a large copy
(bytes read + written per second). Collective bandwidths are ACHIEVED bus bandwidths per GPU (what nccl-tests
reports as busbw): ``intra_node_bandwidth_bytes_per_s`` over NVLink/NVSwitch inside a node,
``inter_node_bandwidth_bytes_per_s`` the GPU's share of the node's network (one NIC per GPU on DGX-class nodes).
Latencies are per step of a ring/tree (``service.planner.comm``); ``collective_base_s`` is the fixed cost of one
collective call. ``kernel_launch_s`` is the host time per kernel launch in an eager framework: when a layer's
kernels are shorter than that, the host, not the GPU, sets the pace.

Sources (the figure each supports):
- [meas-h100] measured by ``bench/measure_device.py`` on one H100 SXM5 80GB HBM3 (torch 2.11, CUDA 13.0, 132 SMs)
  on 2026-11-24: bf16 GEMMs up to 778 TFLOP/s (fit: 0.80 of 989 TFLOP/s on large shapes, efficiency
  ``k / (k + 192)`` in the reduction length, 2.4 us fixed per kernel, 128x128 output tiles over 132 SMs; mean
  |error| 7.6 % (max 27 %) over 141 shapes of 80 us or more); sustained 12 s GEMM loops at the 700 W limit run
  at 1.37-1.43 GHz and 660-688 TFLOP/s (large-shape efficiency 0.72, the table's figure); copy 2.93 TB/s; fused
  AdamW 11 ps per parameter; flash attention (SDPA) forward 0.49 of peak at s=2048, head dim 128 (0.32 at head
  dim 64), backward 3-4x the forward time; eager ``add_`` launch 11 us on the host. The raw figures are
  ``tests/service/data/h100_measured.json``.
- [nv-mm] NVIDIA, "Matrix Multiplication Background User's Guide" (docs.nvidia.com/deeplearning/performance,
  2023): tile quantisation and wave quantisation over the SM count (A100: 108 SMs), the functional form used for
  every GPU here.
- [nv-ds] NVIDIA datasheets: A100 (312 TFLOP/s bf16, 1.6/2.0 TB/s HBM2e, NVLink3 600 GB/s both directions),
  H100 SXM (989 TFLOP/s, 3.35 TB/s, NVLink4 900 GB/s), H200 (141 GB, 4.8 TB/s), B200 (2.25 PFLOP/s dense,
  8 TB/s, NVLink5 1.8 TB/s), L4, L40S, A10G, V100; AMD MI300X (1307 TFLOP/s, 5.3 TB/s).
- [nccl] nccl-tests all_reduce_perf bus bandwidth as published for DGX systems: about 230 GB/s on 8 A100 (NVLink3),
  about 370 GB/s on 8 H100 (NVLink4, without NVLS); across nodes about 90 % of the NIC line rate per GPU
  (HDR 200 Gb/s -> 23 GB/s, NDR 400 Gb/s -> 45 GB/s). Latencies: NVLink about 1 us per ring step,
  InfiniBand about 4 us, 8 us per call.
- [fa2] Dao, "FlashAttention-2" (2023): forward up to 73 % of A100 peak, backward about 63 %.
Figures marked ``assumed`` in comments have no measurement behind them: override them with measured ones.

A CPU "device" has no fixed figures: give its measured matmul peak and memory
(``ClusterSpec(device="cpu", peak_flops_per_s=..., memory_bytes=...)``); one worker per "gpu" slot.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from api.spec import ClusterSpec
from api.spec.validation import SpecError, SpecIssue

GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True)
class Device:
    """Figures of one accelerator (per device). See the module docstring for units and sources."""

    name: str
    peak_flops_per_s_16bit: float | None  # bf16/fp16 dense tensor-core peak; None = no native 16-bit matmul
    peak_flops_per_s_fp32: float  # plain fp32 (no TF32)
    memory_bytes: int
    memory_bandwidth_bytes_per_s: float
    intra_node_bandwidth_bytes_per_s: float
    inter_node_bandwidth_bytes_per_s: float
    sms: int = 0  # multiprocessors for wave quantisation; 0 = none (CPU)
    matmul_efficiency: float = 0.8
    matmul_k_half: float = 192.0  # reduction length at which a GEMM runs at half its large-shape rate
    matmul_tile: int = 128
    kernel_fixed_s: float = 2.4e-6  # device time of the smallest kernel (prologue, epilogue, tail)
    attention_efficiency: float = 0.65  # flash attention forward, head dim 128, long sequences
    intra_node_latency_s: float = 1e-6
    inter_node_latency_s: float = 4e-6
    collective_base_s: float = 8e-6
    kernel_launch_s: float = 12e-6
    reserved_bytes: int = 1 * GiB  # GPU: CUDA context + NCCL buffers + cuBLAS workspace; CPU: the runtime's RSS
    fragmentation_fraction: float = 0.10  # caching-allocator slack over the live peak ([meas-h100]: 2-14 %)
    is_cpu: bool = False
    bf16: bool = True  # native bf16 support (V100 has fp16 only)

    def peak_flops_per_s(self, precision: str) -> float:
        """Peak FLOP/s for the matmul precision (``fp32`` | ``bf16`` | ``fp16``)."""
        if precision == "fp32" or self.is_cpu:
            return self.peak_flops_per_s_fp32
        if precision == "bf16" and not self.bf16:
            raise SpecError(
                [
                    SpecIssue(
                        "precision",
                        f"{self.name} has no native bf16; use precision fp16 or fp32",
                        "unsupported_precision",
                    )
                ]
            )
        return self.peak_flops_per_s_16bit or self.peak_flops_per_s_fp32


def _gpu(name: str, peak: float, fp32: float, mem_gib: float, hbm: float, intra: float, inter: float, **kw) -> Device:
    return Device(name, peak, fp32, int(mem_gib * GiB), hbm, intra, inter, **kw)


_T = 1e12
_G = 1e9

DEVICES: dict[str, Device] = {
    d.name: d
    for d in (
        # A100 SXM4: [nv-ds] peak and HBM; [nv-mm] 108 SMs; [nccl] 230 GB/s NVLink3 busbw, HDR 23 GB/s per GPU;
        # [fa2] attention. Sustained large-GEMM efficiency 0.76 of peak in training (isolated cuBLAS GEMMs reach
        # 0.80-0.85; published end-to-end runs, tests/service/data/published_runs.json, need 0.72-0.80).
        _gpu("A100-40GB", 312 * _T, 19.5 * _T, 40, 1.37 * _T, 230 * _G, 23 * _G, sms=108, matmul_efficiency=0.76,
             attention_efficiency=0.70),
        _gpu("A100-80GB", 312 * _T, 19.5 * _T, 80, 1.79 * _T, 230 * _G, 23 * _G, sms=108, matmul_efficiency=0.76,
             attention_efficiency=0.70),
        # H100 SXM5: [meas-h100] compute, HBM, launch; [nccl] 370 GB/s NVLink4, NDR 45 GB/s per GPU. Short GEMM
        # bursts reach 0.80 of peak at 1980 MHz; sustained at the 700 W limit the clock falls to ~1.4 GHz and the
        # curve's large-shape efficiency is 0.72 (688 TFLOP/s at 8192^3, 660-667 on transformer shapes): the table
        # holds the sustained figure.
        _gpu("H100", 989 * _T, 67 * _T, 80, 2.93 * _T, 370 * _G, 45 * _G, sms=132, matmul_efficiency=0.72,
             attention_efficiency=0.65),
        # H100 PCIe: 114 SMs, HBM2e 2.0 TB/s; PCIe Gen5 between GPUs (assumed 40 GB/s busbw).
        _gpu("H100-PCIe", 756 * _T, 51 * _T, 80, 1.75 * _T, 40 * _G, 23 * _G, sms=114, matmul_efficiency=0.70,
             attention_efficiency=0.6, intra_node_latency_s=3e-6),
        # H200: H100 compute; HBM3e copy measured 4.3 TB/s on an H200 of this workplace (device notes).
        _gpu("H200", 989 * _T, 67 * _T, 141, 4.3 * _T, 370 * _G, 45 * _G, sms=132, matmul_efficiency=0.72,
             attention_efficiency=0.65),
        # B200: [nv-ds]; 148 SMs; NVLink5 (assumed 750 GB/s busbw); efficiency assumed like H100.
        _gpu("B200", 2250 * _T, 80 * _T, 180, 6.5 * _T, 750 * _G, 45 * _G, sms=148, matmul_efficiency=0.66,
             attention_efficiency=0.6),
        # PCIe cards without NVLink: all-reduce through the host bridge (assumed 10-20 GB/s busbw).
        _gpu("L4", 121 * _T, 30.3 * _T, 24, 0.25 * _T, 10 * _G, 10 * _G, sms=58, matmul_efficiency=0.6,
             attention_efficiency=0.5, intra_node_latency_s=5e-6, inter_node_latency_s=8e-6),
        _gpu("L40S", 362 * _T, 91.6 * _T, 48, 0.75 * _T, 20 * _G, 20 * _G, sms=142, matmul_efficiency=0.6,
             attention_efficiency=0.55, intra_node_latency_s=5e-6, inter_node_latency_s=8e-6),
        _gpu("A10G", 125 * _T, 31.2 * _T, 24, 0.53 * _T, 10 * _G, 10 * _G, sms=80, matmul_efficiency=0.55,
             attention_efficiency=0.5, intra_node_latency_s=5e-6, inter_node_latency_s=8e-6),
        # V100 SXM2: 80 SMs, NVLink2 hybrid cube mesh (about 130 GB/s all-reduce busbw), fp16 only.
        _gpu("V100", 125 * _T, 15.7 * _T, 32, 0.8 * _T, 130 * _G, 11 * _G, sms=80, matmul_efficiency=0.72,
             attention_efficiency=0.45, bf16=False),
        _gpu("V100-16GB", 125 * _T, 15.7 * _T, 16, 0.8 * _T, 130 * _G, 11 * _G, sms=80, matmul_efficiency=0.72,
             attention_efficiency=0.45, bf16=False),
        # MI300X: [nv-ds] AMD; 304 CUs; Infinity Fabric (assumed 300 GB/s busbw); hipBLASLt about 0.6 of peak.
        _gpu("MI300X", 1307 * _T, 163.4 * _T, 192, 4.2 * _T, 300 * _G, 45 * _G, sms=304, matmul_efficiency=0.55,
             attention_efficiency=0.45),
        # CPU: peak and memory must come from the ClusterSpec (measured); gloo over shared memory in a node.
        # reserved: the resident torch + gloo runtime of a worker process (~330 MiB RSS measured with torch 2.x on
        # x86; bench/bench_planner_accuracy.py reports it). meshrun's eager loop on a CPU spends ~60-80 us of
        # framework time per op (forward + autograd; tiny-GPT runs of bench/bench_calibration.py --local); gloo
        # collectives ~100 us per call (assumed; calibration fits both per cluster).
        Device("cpu", None, 0.0, 0, 8 * _G, 5 * _G, 1.25 * _G, sms=0, matmul_efficiency=0.7, matmul_k_half=16.0,
               kernel_fixed_s=1e-6, attention_efficiency=0.3, intra_node_latency_s=30e-6, inter_node_latency_s=100e-6,
               collective_base_s=100e-6, kernel_launch_s=60e-6, reserved_bytes=320 * MiB,
               fragmentation_fraction=0.1, is_cpu=True),
    )
}  # fmt: skip

_ALIASES: dict[str, str] = {
    "a100": "A100-80GB",
    "a100-80g": "A100-80GB",
    "a100-sxm": "A100-80GB",
    "a100-sxm4": "A100-80GB",
    "a100-sxm4-80gb": "A100-80GB",
    "a100-40g": "A100-40GB",
    "a100-sxm4-40gb": "A100-40GB",
    "h100-sxm": "H100",
    "h100-sxm5": "H100",
    "h100-80gb": "H100",
    "h100-sxm5-80gb": "H100",
    "h100-80gb-hbm3": "H100",
    "h100-pcie-80gb": "H100-PCIe",
    "h200-sxm": "H200",
    "h200-141gb": "H200",
    "b200-sxm": "B200",
    "l4-24gb": "L4",
    "l40s-48gb": "L40S",
    "a10g-24gb": "A10G",
    "a10": "A10G",
    "v100-32gb": "V100",
    "v100-sxm2": "V100",
    "v100-sxm2-32gb": "V100",
    "v100-sxm2-16gb": "V100-16GB",
    "mi300": "MI300X",
    "instinct-mi300x": "MI300X",
    "amd-instinct-mi300x": "MI300X",
}
_BY_KEY: dict[str, str] = {name.lower(): name for name in DEVICES}

# ClusterSpec field -> Device field it replaces (besides peak_flops_per_s, which sets both precisions)
OVERRIDES: dict[str, str] = {
    "memory_bytes": "memory_bytes",
    "intra_node_bandwidth_bytes_per_s": "intra_node_bandwidth_bytes_per_s",
    "inter_node_bandwidth_bytes_per_s": "inter_node_bandwidth_bytes_per_s",
    "memory_bandwidth_bytes_per_s": "memory_bandwidth_bytes_per_s",
    "matmul_efficiency": "matmul_efficiency",
    "intra_node_latency_s": "intra_node_latency_s",
    "inter_node_latency_s": "inter_node_latency_s",
    "kernel_launch_s": "kernel_launch_s",
    "attention_efficiency": "attention_efficiency",
}


def _key(name: str) -> str:
    k = name.strip().lower().replace("_", "-").replace(" ", "-")
    for prefix in ("nvidia-", "amd-"):
        if k.startswith(prefix):
            k = k[len(prefix) :]
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
        raise SpecError(
            [
                SpecIssue(
                    "cluster.device",
                    f"unknown device '{name}'; use one of {device_names()} (case-insensitive), "
                    "'live' for the service's Ray cluster, or 'cpu' with peak_flops_per_s and memory_bytes",
                    "unknown_device",
                )
            ]
        )
    return DEVICES[canonical]


def resolve_device(cluster: ClusterSpec) -> Device:
    """The device of a cluster with the ClusterSpec's overrides (peak, memory, bandwidths, latencies, matmul
    efficiency, launch cost) applied.

    ``cpu`` needs ``peak_flops_per_s`` and ``memory_bytes`` (measure them; a CPU has no catalogue figure).
    ``live`` must be resolved to a concrete ClusterSpec before it gets here.
    """
    if cluster.device.strip().lower() == "live":
        raise SpecError(
            [
                SpecIssue(
                    "cluster.device",
                    "device 'live' needs the service's Ray cluster description, "
                    "which is not available here; name a device type such as 'H100'",
                    "live_cluster_unavailable",
                )
            ]
        )
    dev = lookup_device(cluster.device)
    if dev.is_cpu:
        missing = [f for f in ("peak_flops_per_s", "memory_bytes") if getattr(cluster, f) is None]
        if missing:
            raise SpecError(
                [
                    SpecIssue(
                        f"cluster.{missing[0]}",
                        "device 'cpu' has no catalogue figures: give "
                        "cluster.peak_flops_per_s (a measured matmul peak) and cluster.memory_bytes "
                        "(memory per worker)",
                        "missing_device_figures",
                    )
                ]
            )
    over: dict = {}
    if cluster.peak_flops_per_s is not None:
        over["peak_flops_per_s_16bit"] = cluster.peak_flops_per_s
        over["peak_flops_per_s_fp32"] = cluster.peak_flops_per_s
        over["bf16"] = True
    for field, attr in OVERRIDES.items():
        value = getattr(cluster, field, None)
        if value is not None:
            over[attr] = int(value) if attr == "memory_bytes" else float(value)
    return replace(dev, **over) if over else dev


def device_figures(dev: Device, precision: str) -> dict[str, float | int | str | bool]:
    """The figures a plan was priced with (``PlanResponse.cluster``)."""
    return {
        "device": dev.name,
        "peak_flops_per_s": dev.peak_flops_per_s(precision),
        "memory_bytes": dev.memory_bytes,
        "memory_bandwidth_bytes_per_s": dev.memory_bandwidth_bytes_per_s,
        "matmul_efficiency": dev.matmul_efficiency,
        "intra_node_bandwidth_bytes_per_s": dev.intra_node_bandwidth_bytes_per_s,
        "inter_node_bandwidth_bytes_per_s": dev.inter_node_bandwidth_bytes_per_s,
        "intra_node_latency_s": dev.intra_node_latency_s,
        "inter_node_latency_s": dev.inter_node_latency_s,
        "kernel_launch_s": dev.kernel_launch_s,
    }

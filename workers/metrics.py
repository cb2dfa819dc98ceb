"""Peak memory and device peak FLOP/s (for MFU). Step timing and the communication breakdown live in
``workers.timeline`` / ``workers.comm_hooks``; ``workers.reporting`` reads these once per report.

Peak memory per rank: GPU: ``torch.cuda.max_memory_allocated`` (tensors) and ``max_memory_reserved`` (the caching
allocator), reset with ``reset_peak_memory_stats``. CPU: the process's peak resident set (``VmHWM``), reset by
writing "5" to ``/proc/self/clear_refs``. Both are host-side counters (no device sync) and are read and reset once
per report, never per step; the allocator is never trimmed (glibc keeps freed heap, so RSS is what the process
really holds).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------- memory
def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


def _vm_hwm_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def peak_memory(device: torch.device) -> tuple[int, int | None]:
    """(peak bytes, peak reserved bytes or None) since the last reset. GPU: allocated, reserved. CPU: peak RSS
    of the process (the torch runtime included, a few hundred MB), None."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), int(torch.cuda.max_memory_reserved(device))
    return _vm_hwm_bytes(), None


def peak_memory_bytes(device: torch.device) -> int:
    return peak_memory(device)[0]


# ------------------------------------------------------------------------------------------ FLOP/s
# dense peak FLOP/s: (bf16/fp16 tensor cores, plain fp32 — the loop leaves TF32 off so fp32 runs stay exact)
GPU_PEAK_FLOPS = {
    "H200": (989e12, 67e12),
    "H100": (989e12, 67e12),
    "H800": (989e12, 67e12),
    "GH200": (989e12, 67e12),
    "B200": (2250e12, 80e12),
    "A100": (312e12, 19.5e12),
    "A800": (312e12, 19.5e12),
    "A10G": (125e12, 31.2e12),
    "A10": (125e12, 31.2e12),
    "L40S": (362e12, 91.6e12),
    "L40": (181e12, 90.5e12),
    "L4": (121e12, 30.3e12),
    "V100": (125e12, 15.7e12),
    "T4": (65e12, 8.1e12),
    "RTX 4090": (165e12, 82.6e12),
    "RTX 3090": (71e12, 35.6e12),
}
_cpu_peak: float | None = None


CPU_PEAK_CACHE_S = 3600.0  # a measurement is reused this long on the same host (restarts skip the 0.3 s)


def _cpu_peak_cache() -> Path:
    return Path(tempfile.gettempdir()) / f"meshrun-cpu-peak-flops-{os.getuid() if hasattr(os, 'getuid') else 0}.json"


def _cpu_peak_key(threads: int, n: int) -> str:
    return f"{platform.node()}|{platform.machine()}|{os.cpu_count()}|{threads}|{n}|{torch.__version__}"


def measured_cpu_peak_flops(*, seconds: float = 0.3, n: int = 1024, threads: int | None = None) -> float:
    """fp32 matmul FLOP/s this process reaches (cached per process, and for ``CPU_PEAK_CACHE_S`` in a file per
    host, thread count and matrix size, so a restarted worker does not measure again): with its current thread
    count, or with ``threads`` threads for the measurement (the service measures one core, i.e. a 1-CPU worker)."""
    global _cpu_peak
    if _cpu_peak is not None:
        return _cpu_peak
    key = _cpu_peak_key(threads if threads is not None else torch.get_num_threads(), n)
    cache = _cpu_peak_cache()
    known: dict = {}
    try:
        known = dict(json.loads(cache.read_text()))
        saved = known.get(key)
        if saved and 0 <= time.time() - float(saved["at"]) < CPU_PEAK_CACHE_S and float(saved["flops"]) > 0:
            _cpu_peak = float(saved["flops"])
            return _cpu_peak
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        pass
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        for _ in range(2):  # warm up the BLAS threads
            a @ b
        iters, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            a @ b
            iters += 1
        _cpu_peak = 2.0 * n**3 * iters / (time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    try:  # best effort: one small JSON file, replaced atomically
        tmp = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
        known[key] = {"flops": _cpu_peak, "at": time.time()}  # other thread counts' entries kept
        tmp.write_text(json.dumps(known))
        os.replace(tmp, cache)
    except OSError:
        pass
    return _cpu_peak


def device_peak_flops(device: torch.device, precision: str) -> float:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, (half, full) in GPU_PEAK_FLOPS.items():
            if key in name:
                return half if precision in ("bf16", "fp16") else full
        log.warning("unknown GPU %r: MFU assumes 312 TFLOP/s", name)
        return 312e12
    return measured_cpu_peak_flops()


class CrossGroupLink:
    """Bytes this process sent over the link between data-parallel groups (DDP gradient buckets, local SGD /
    DiLoCo averagings, parameter-server pushes and pulls), and an optional artificial slowdown of that link
    for benchmarks: ``MESHRUN_LINK_DELAY_S`` seconds per transfer plus bytes / ``MESHRUN_LINK_BYTES_PER_S``."""

    def __init__(self) -> None:
        self.bytes = 0
        self.reload()

    def reload(self) -> None:
        self.delay_s = float(os.environ.get("MESHRUN_LINK_DELAY_S", "0") or 0)
        self.bytes_per_s = float(os.environ.get("MESHRUN_LINK_BYTES_PER_S", "0") or 0)

    def send(self, nbytes: int) -> None:
        self.bytes += int(nbytes)
        wait = self.delay_s + (nbytes / self.bytes_per_s if self.bytes_per_s > 0 else 0.0)
        if wait > 0:
            time.sleep(wait)

    def take(self) -> int:
        """Bytes sent since the previous call."""
        out, self.bytes = self.bytes, 0
        return out


CROSS_GROUP = CrossGroupLink()

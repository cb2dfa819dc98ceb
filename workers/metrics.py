"""Per-step measurements: collective time, peak memory, device peak FLOP/s (for MFU).

comm_fraction counts the wall time during which at least one data-parallel collective was in flight
(union of intervals), divided by the step time:
- FSDP2 / ZeRO-1 / loss-free collectives called through ``torch.distributed`` (``all_gather_into_tensor``,
  ``reduce_scatter_tensor``, ``all_reduce``, ``all_gather``, ``broadcast``, ...): timed around the call,
  plus until ``.wait()`` for async work. On CPU (gloo) FSDP2 calls them synchronously, so this is the real
  collective time including waiting for the slowest peer.
- DDP buckets: from the comm hook's start until its future completes.
- NOT counted: TP/SP functional collectives (DTensor), pipeline send/recv, and the metric all-gathers the
  loop itself makes. On GPUs, NCCL calls are asynchronous, so the wrappers time launches and waits only.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
import time

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

_TIMED = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce_scatter",
          "all_gather_single", "reduce_scatter_single",
          "broadcast", "all_to_all_single", "_all_gather_base", "_reduce_scatter_base")


class CommTimer:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._intervals: list[tuple[float, float]] = []
        self._orig: dict[str, object] = {}
        self.enabled = True

    def add_interval(self, t0: float, t1: float) -> None:
        if self.enabled:
            with self._lock:
                self._intervals.append((t0, t1))

    def _wrap(self, fn):
        timer = self

        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            t0 = time.perf_counter()
            work = fn(*args, **kwargs)
            if work is not None and hasattr(work, "wait"):
                orig_wait = work.wait

                def wait(*a, **k):
                    r = orig_wait(*a, **k)
                    timer.add_interval(t0, time.perf_counter())
                    return r
                try:
                    work.wait = wait
                except (AttributeError, TypeError):
                    timer.add_interval(t0, time.perf_counter())
            else:
                timer.add_interval(t0, time.perf_counter())
            return work
        return wrapped

    def install(self) -> "CommTimer":
        for name in _TIMED:
            fn = getattr(dist, name, None)
            if fn is not None and name not in self._orig:
                self._orig[name] = fn
                setattr(dist, name, self._wrap(fn))
        return self

    def uninstall(self) -> None:
        for name, fn in self._orig.items():
            setattr(dist, name, fn)
        self._orig.clear()

    def reset(self) -> None:
        with self._lock:
            self._intervals.clear()

    def total_s(self) -> float:
        """Union length of the recorded intervals."""
        with self._lock:
            iv = sorted(self._intervals)
        total, cur_s, cur_e = 0.0, None, None
        for s, e in iv:
            if cur_e is None or s > cur_e:
                if cur_e is not None:
                    total += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        if cur_e is not None:
            total += cur_e - cur_s
        return total

    def __enter__(self):
        return self.install()

    def __exit__(self, *exc):
        self.uninstall()


# ------------------------------------------------------------------------------------------- memory
_libc = None


def _malloc_trim() -> None:
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL("libc.so.6")
        _libc.malloc_trim(0)
    except OSError:
        pass


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    _malloc_trim()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


def peak_memory_bytes(device: torch.device) -> int:
    """GPU: max_memory_allocated since the last reset. CPU: process peak RSS (VmHWM) since the last reset
    (includes the torch runtime itself, a few hundred MB)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


# ------------------------------------------------------------------------------------------ FLOP/s
# dense peak FLOP/s: (bf16/fp16 tensor cores, plain fp32 — the loop leaves TF32 off so fp32 runs stay exact)
GPU_PEAK_FLOPS = {
    "H200": (989e12, 67e12), "H100": (989e12, 67e12), "H800": (989e12, 67e12), "GH200": (989e12, 67e12),
    "B200": (2250e12, 80e12), "A100": (312e12, 19.5e12), "A800": (312e12, 19.5e12), "A10G": (125e12, 31.2e12),
    "A10": (125e12, 31.2e12), "L40S": (362e12, 91.6e12), "L40": (181e12, 90.5e12), "L4": (121e12, 30.3e12),
    "V100": (125e12, 15.7e12), "T4": (65e12, 8.1e12), "RTX 4090": (165e12, 82.6e12), "RTX 3090": (71e12, 35.6e12),
}
_cpu_peak: float | None = None


def measured_cpu_peak_flops(*, seconds: float = 0.3, n: int = 1024, threads: int | None = None) -> float:
    """fp32 matmul FLOP/s this process reaches (cached per process): with its current thread count, or with
    ``threads`` threads for the measurement (the service measures one core, i.e. a 1-CPU worker)."""
    global _cpu_peak
    if _cpu_peak is None:
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
            _cpu_peak = 2.0 * n ** 3 * iters / (time.perf_counter() - t0)
        finally:
            torch.set_num_threads(before)
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

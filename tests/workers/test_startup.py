"""What a (re)starting worker pays before its first step: a run without pp or ZeRO does not import torch's
pipelining or distributed optimizers, a warm worker does not import Ray Train (nor Ray Data and pandas with it), and
the CPU peak-FLOP/s measurement (for MFU) is reused from a file."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch

import workers.metrics as metrics

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, sys
from workers.__main__ import main
rc = main(["--spec", sys.argv[1], "--log-level", "WARNING"])
print(json.dumps({"rc": rc, "loaded": [m for m in ("torch.distributed.pipelining", "torch.distributed.optim")
                                        if m in sys.modules]}))
"""


def _run(tmp_path: Path, layout: dict, optimizer: dict | None = None) -> dict:
    spec = {
        "name": "startup",
        "model": {"name": "gpt", "preset": "tiny", "seq_len": 16},
        "data": {"source": "synthetic"},
        "layout": layout,
        "batch": {"global_batch_size": 2, "micro_batch_size": 2},
        "train": {"steps": 2},
        "optimizer": optimizer or {},
        "resources": {"device": "cpu"},
    }
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(path)], capture_output=True, text=True, cwd=ROOT, timeout=240
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_run_without_pp_or_zero_imports_neither(tmp_path) -> None:
    got = _run(tmp_path, {"dp": 1})
    assert got == {"rc": 0, "loaded": []}


WARM_PROBE = """
import sys
from workers.warm import WarmWorker
cls = WarmWorker.__ray_actor_class__  # the class under Ray's actor wrapper: its __init__ is the warm imports
cls.__init__(cls.__new__(cls))
print(sorted(m for m in ("ray.train", "ray.data", "pandas", "pyarrow") if m in sys.modules))
"""


def test_a_warm_worker_imports_neither_ray_train_nor_ray_data() -> None:
    """A warm worker trains through ``workers.loop`` and the channel's hooks, never through a Ray Train session:
    ``ray.train`` (with Ray Data, pandas and pyarrow: about 1 CPU second of every warm worker's start here) is
    imported only by the Ray Train entry's functions."""
    out = subprocess.run([sys.executable, "-c", WARM_PROBE], capture_output=True, text=True, cwd=ROOT, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_the_pipeline_schedules_are_patched_only_when_asked() -> None:
    """A pp run installs the tracker with ``pipeline=True`` (the pp breakdown tests check what it measures)."""
    from torch.distributed.pipelining import schedules

    from workers.comm_hooks import Tracker
    from workers.timeline import make_clock

    orig = schedules._batch_p2p
    for pipeline in (False, True):
        tracker = Tracker(clock=make_clock("cpu"), state=None, dims=None).install(pipeline=pipeline)
        try:
            assert (schedules._batch_p2p is not orig) is pipeline
        finally:
            tracker.uninstall()
        assert schedules._batch_p2p is orig


def test_cpu_peak_flops_are_measured_once_per_host_and_thread_count(tmp_path, monkeypatch) -> None:
    cache = tmp_path / "peak.json"
    monkeypatch.setattr(metrics, "_cpu_peak_cache", lambda: cache)
    monkeypatch.setattr(metrics, "_cpu_peak", None)
    first = metrics.measured_cpu_peak_flops(seconds=0.05, n=128)
    assert first > 0 and cache.exists()
    monkeypatch.setattr(metrics, "_cpu_peak", None)
    other = metrics.measured_cpu_peak_flops(seconds=0.05, n=128, threads=torch.get_num_threads() + 1)  # its own entry
    assert other > 0 and len(json.loads(cache.read_text())) == 2
    monkeypatch.setattr(metrics, "_cpu_peak", None)  # a new process
    assert metrics.measured_cpu_peak_flops(seconds=0.05, n=128) == first  # read back, not measured again
    # a stale entry is measured again (a new float: another measurement is never bit-identical in practice)
    saved = json.loads(cache.read_text())
    for v in saved.values():
        v["at"] = time.time() - metrics.CPU_PEAK_CACHE_S - 1
    cache.write_text(json.dumps(saved))
    monkeypatch.setattr(metrics, "_cpu_peak", None)
    again = metrics.measured_cpu_peak_flops(seconds=0.05, n=128)
    assert again > 0 and again != first
    # a broken file is ignored and replaced
    cache.write_text("{not json")
    monkeypatch.setattr(metrics, "_cpu_peak", None)
    assert metrics.measured_cpu_peak_flops(seconds=0.05, n=128) > 0
    assert json.loads(cache.read_text())

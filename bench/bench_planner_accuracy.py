"""How well does the planner predict real runs? Tiny GPT layouts on this CPU machine.

For each layout it runs the workers' standalone launcher

    torchrun --standalone --nproc-per-node N -m workers --spec spec.yaml --metrics-out m.jsonl

(rank 0 writes one JSON row per step with peak_memory_bytes, step_time_s, tokens_per_s), and prints the
planner's predicted peak memory per rank vs the measured one (relative error) and the predicted vs measured
step-time ranking (Spearman rank correlation).

CPU figures for the planner are measured here (the planner itself imports no torch): the fp32 matmul peak a
worker reaches with its share of the cores, and the memory per worker. The measured peak is the process peak
RSS, which includes the torch + gloo runtime; the planner's CPU device reserves an allowance for it, and the
bench also prints the runtime footprint the measurements imply (median of measured minus predicted model
memory) and the memory ranking's Spearman correlation, which does not depend on that constant.

    python bench/bench_planner_accuracy.py                  # all layouts, 6 steps each
    python bench/bench_planner_accuracy.py --dry-run        # predictions only, no torchrun
    python bench/bench_planner_accuracy.py --max-world 1 --steps 4
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from api.spec import ClusterSpec, Layout, ModelSpec, RunSpec  # noqa: E402
from api.spec.validation import build_plan, check_spec  # noqa: E402
from service.store.calibrations import spearman  # noqa: E402
from service.planner import evaluate  # noqa: E402

MiB = 1 << 20

# (label, layout kwargs, micro_batch_size, activation_checkpointing)
LAYOUTS: list[tuple[str, dict, int, str]] = [
    ("dp1 mb2", dict(), 2, "none"),
    ("dp1 mb8", dict(), 8, "none"),
    ("dp1 mb2 full-ckpt", dict(), 2, "full"),
    ("dp1 mb8 selective", dict(), 8, "selective"),
    ("dp2 z0 mb2", dict(dp=2), 2, "none"),
    ("dp2 z0 mb8", dict(dp=2), 8, "none"),
    ("dp2 z1 mb2", dict(dp=2, zero_stage=1), 2, "none"),
    ("dp2 z2 mb2", dict(dp=2, zero_stage=2), 2, "none"),
    ("dp2 z3 mb2", dict(dp=2, zero_stage=3), 2, "none"),
    ("tp2 mb2", dict(tp=2), 2, "none"),
    ("tp2 sp mb2", dict(tp=2, sequence_parallel=True), 2, "none"),
    ("pp2 1f1b mb2", dict(pp=2), 2, "none"),
    ("pp2 gpipe mb2", dict(pp=2, pp_schedule="gpipe"), 2, "none"),
    ("pp2 interleaved mb2", dict(pp=2, pp_schedule="interleaved_1f1b", pp_virtual_stages=2), 2, "none"),
]


def measure_matmul_peak(threads: int, *, n: int = 1024, seconds: float = 0.5) -> float:
    """fp32 matmul FLOP/s with ``threads`` threads (what one worker gets when N share the cores)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        for _ in range(2):
            a @ b
        iters, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            a @ b
            iters += 1
        return 2.0 * n ** 3 * iters / (time.perf_counter() - t0)
    finally:
        torch.set_num_threads(old)


def total_memory_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 8 << 30


def _model_bytes(c) -> int:
    """Predicted bytes that are the model's (states + activations), i.e. without the buffer allowance."""
    m = c.memory_bytes
    return m.params + m.grads + m.optimizer + m.activations


def run_layout(spec: RunSpec, world: int, threads: int, workdir: Path, *, timeout_s: int) -> list[dict]:
    spec_path, metrics = workdir / "spec.yaml", workdir / "metrics.jsonl"
    spec_path.write_text(yaml.safe_dump(spec.model_dump(mode="json", exclude_defaults=True)))
    metrics.unlink(missing_ok=True)
    torchrun = shutil.which("torchrun")
    launcher = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    cmd = launcher + ["--standalone", f"--nproc-per-node={world}", "-m", "workers", "--spec", str(spec_path),
                      "--metrics-out", str(metrics)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads), "MESHRUN_LOG_LEVEL": "WARNING"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-600:]}")
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def _rho(pairs: list[tuple[float, float]]) -> str:
    rho = spearman(*map(list, zip(*pairs)))
    return "n/a" if rho is None else f"{rho:.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small", help="GPT preset (api.spec.presets)")
    ap.add_argument("--global-batch-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the timing")
    ap.add_argument("--max-world", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=300, help="seconds per run")
    ap.add_argument("--threads", type=int, default=None, help="threads per worker (default: cores / N)")
    ap.add_argument("--dry-run", action="store_true", help="print the predictions only")
    args = ap.parse_args()

    cores = os.cpu_count() or 1
    mem_total = total_memory_bytes()
    model = ModelSpec(name="gpt", preset=args.preset)
    peaks: dict[int, float] = {}
    launcher_ok = (ROOT / "workers" / "__main__.py").exists()
    if not launcher_ok and not args.dry_run:
        print("workers/__main__.py does not exist yet: showing predictions only (--dry-run)")
    dry = args.dry_run or not launcher_ok

    rows = []
    with tempfile.TemporaryDirectory(prefix="meshrun-acc-") as tmp:
        for label, lay_kw, mb, ckpt in LAYOUTS:
            layout = Layout(**lay_kw)
            world = layout.world_size
            if world > args.max_world:
                continue
            spec = RunSpec(name="acc-" + label.replace(" ", "-"), model=model, layout=layout, precision="fp32",
                           batch={"global_batch_size": args.global_batch_size, "micro_batch_size": mb},
                           activation_checkpointing=ckpt, train={"steps": args.steps, "seed": 0},
                           optimizer={"warmup_steps": 0}, resources={"device": "cpu"})
            chk = check_spec(spec)
            if not chk.ok:
                print(f"skip {label}: {chk.errors[0].param}: {chk.errors[0].message}")
                continue
            plan = build_plan(spec, device="cpu")
            threads = args.threads or max(1, cores // world)
            if world not in peaks:
                peaks[world] = measure_matmul_peak(threads)
            cluster = ClusterSpec(device="cpu", gpus_per_node=world, nodes=1, peak_flops_per_s=peaks[world],
                                  memory_bytes=mem_total // world)
            pred = evaluate(plan.model, cluster, layout=layout, micro_batch_size=mb,
                            global_batch_size=args.global_batch_size, precision="fp32",
                            activation_checkpointing=ckpt)
            row = {"label": label, "world": world, "pred_mem": pred.memory_bytes.total,
                   "reserved": pred.memory_bytes.total - _model_bytes(pred),
                   "pred_step": pred.step_time_s.total, "meas_mem": None, "meas_step": None, "error": None}
            if not dry:
                t0 = time.perf_counter()
                try:
                    steps = run_layout(spec, world, threads, Path(tmp), timeout_s=args.timeout)
                    timed = steps[args.warmup:] or steps
                    row["meas_step"] = statistics.median(r["step_time_s"] for r in timed)
                    row["meas_mem"] = max(r["peak_memory_bytes"] for r in steps)
                except (RuntimeError, subprocess.TimeoutExpired, OSError, KeyError, ValueError) as e:
                    row["error"] = str(e).strip().splitlines()[-1][:160] if str(e).strip() else type(e).__name__
                print(f"  ran {label} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
            rows.append(row)

    print(f"\nplanner accuracy: gpt/{args.preset}, global batch {args.global_batch_size}, fp32, {cores} cores, "
          f"matmul peak per worker: " + ", ".join(f"N={w}: {p / 1e9:.1f} GFLOP/s" for w, p in sorted(peaks.items())))
    hdr = f"{'layout':<22} {'N':>2} {'pred MiB':>9} {'meas MiB':>9} {'rel err':>8} {'pred s':>8} {'meas s':>8}"
    print(hdr)
    print("-" * len(hdr))
    mem_errs, mem_pairs, step_pairs, implied = [], [], [], []
    for r in rows:
        meas_mem, meas_step = r["meas_mem"], r["meas_step"]
        err = None
        if meas_mem:
            err = (r["pred_mem"] - meas_mem) / meas_mem
            mem_errs.append(abs(err))
            mem_pairs.append((r["pred_mem"], meas_mem))
            implied.append(meas_mem - (r["pred_mem"] - r["reserved"]))
        if meas_step:
            step_pairs.append((r["pred_step"], meas_step))
        fmt = lambda v, f: format(v, f) if v is not None else "-"  # noqa: E731
        print(f"{r['label']:<22} {r['world']:>2} {r['pred_mem'] / MiB:>9.1f} "
              f"{fmt(meas_mem and meas_mem / MiB, '9.1f'):>9} {fmt(err, '+8.0%'):>8} "
              f"{r['pred_step']:>8.3f} {fmt(meas_step, '8.3f'):>8}" + (f"  FAILED: {r['error']}" if r["error"] else ""))
    if mem_errs:
        reserved = rows[0]["reserved"]
        print(f"\npeak memory: mean |relative error| {statistics.fmean(mem_errs):.1%}, max "
              f"{max(mem_errs):.1%}; runtime footprint implied by the measurements (median of measured minus "
              f"predicted model memory) {statistics.median(implied) / MiB:.0f} MiB, planner allowance incl. "
              f"buffers {reserved / MiB:.0f} MiB")
    if len(mem_pairs) >= 3:
        print(f"peak memory ranking: Spearman rho = {_rho(mem_pairs)} over "
              f"{len(mem_pairs)} layouts")
    if len(step_pairs) >= 3:
        print(f"step time ranking: Spearman rho = {_rho(step_pairs)} over "
              f"{len(step_pairs)} layouts")
    elif not dry:
        print("too few successful runs for a ranking")
    return 0


if __name__ == "__main__":
    sys.exit(main())

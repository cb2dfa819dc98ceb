"""tokens/s of sync DP vs async_ps vs DiLoCo on the same layout with an artificially slowed cross-group link.

    python bench/bench_sync_modes.py [--dp 2] [--steps 24] [--delay-s 0.2] [--h 8] [--staleness 4]

Every transfer between data-parallel groups sleeps ``--delay-s`` (``MESHRUN_LINK_DELAY_S``: DDP's gradient
buckets and DiLoCo's averagings in the sending rank, the parameter servers' pushes and pulls on the server side,
where the worker's compute goes on). sync and diloco run under ``torchrun`` (gloo, CPU); async_ps on a local Ray
instance this script starts and stops. The first quarter of the steps is left out of the means (warm-up). Prints
one table: mode, tokens/s, mean step time, cross-group bytes per step, final loss.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _spec(dp: int, steps: int, layout: dict) -> dict:
    return {
        "name": "bench-sync-modes",
        "model": {"name": "gpt", "preset": "tiny"},
        "layout": {"dp": dp, **layout},
        "batch": {"global_batch_size": 4 * dp, "micro_batch_size": 4},
        "optimizer": {"lr": 1e-3, "warmup_steps": 0, "schedule": "constant", "grad_clip": 1.0},
        "train": {"steps": steps, "seed": 0},
        "metrics": {"breakdown_every_steps": 0},
        "resources": {"device": "cpu"},
    }


def _summarise(rows: list[dict], steps: int) -> dict:
    rows = [r for r in rows if r["step"] > steps // 4]
    n = max(1, len(rows))
    time_s = sum(r["step_time_s"] for r in rows)
    tokens = sum(r["tokens_per_s"] * r["step_time_s"] for r in rows)
    return {
        "tokens_per_s": tokens / time_s if time_s > 0 else 0.0,  # total tokens / total time (not a mean of rates)
        "step_time_s": time_s / n,
        "cross_group_bytes": sum(r.get("cross_group_bytes") or 0 for r in rows) / n,
        "final_loss": rows[-1]["loss"] if rows else float("nan"),
    }


def run_torchrun(spec: dict, nproc: int, delay_s: float) -> dict:
    with tempfile.TemporaryDirectory() as d:
        sp, out = Path(d) / "spec.json", Path(d) / "metrics.jsonl"
        sp.write_text(json.dumps(spec))
        env = {**os.environ, "MESHRUN_LINK_DELAY_S": str(delay_s), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        cmd += ["-m", "workers", "--spec", str(sp), "--metrics-out", str(out)]
        subprocess.run(cmd, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
        rows = [json.loads(x) for x in out.read_text().splitlines() if x.strip()]
    return _summarise(rows, spec["train"]["steps"])


def run_async_ps_local(spec_d: dict, delay_s: float) -> dict:
    import ray

    from api.spec import RunSpec
    from api.spec.validation import build_plan
    from workers.async_ps import run_async_ps

    spec = RunSpec.model_validate(spec_d)
    plan = build_plan(spec, device="cpu")
    env = {"MESHRUN_LINK_DELAY_S": str(delay_s), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    ray.init(num_cpus=max(2, spec.layout.dp), runtime_env={"env_vars": env}, logging_level="WARNING")
    try:
        rows: list[dict] = []
        run_async_ps(spec, plan, sink=rows.append, worker_options={"num_cpus": 1})
    finally:
        ray.shutdown()
    return _summarise(rows, spec.train.steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--delay-s", type=float, default=0.2, help="seconds added to every cross-group transfer")
    ap.add_argument("--h", type=int, default=8, help="DiLoCo sync_every_steps")
    ap.add_argument("--staleness", type=int, default=4, help="async_ps max_staleness")
    a = ap.parse_args()
    results = {
        "sync": run_torchrun(_spec(a.dp, a.steps, {}), a.dp, a.delay_s),
        f"diloco H={a.h}": run_torchrun(
            _spec(a.dp, a.steps, {"sync": "diloco", "sync_every_steps": a.h}), a.dp, a.delay_s
        ),
        f"async_ps s={a.staleness}": run_async_ps_local(
            _spec(a.dp, a.steps, {"sync": "async_ps", "max_staleness": a.staleness}), a.delay_s
        ),
    }
    print(f"dp={a.dp}, tiny GPT, CPU, cross-group link delay {a.delay_s} s per transfer, {a.steps} steps")
    print(f"{'mode':<16}{'tokens/s':>12}{'step s':>10}{'xgroup B/step':>16}{'final loss':>12}")
    for name, r in results.items():
        print(
            f"{name:<16}{r['tokens_per_s']:>12.0f}{r['step_time_s']:>10.3f}{r['cross_group_bytes']:>16.0f}"
            f"{r['final_loss']:>12.4f}"
        )


if __name__ == "__main__":
    main()

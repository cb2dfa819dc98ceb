"""Launcher overhead: the standalone torchrun launcher vs the same run through meshrun on Ray, side by side.

    python bench/bench_launcher.py                       # tiny GPT, dp=2, 40 steps, CPU
    python bench/bench_launcher.py --spec examples/x.yaml --warmup 5
    python bench/bench_launcher.py --ray-address HOST:PORT --dashboard-url http://HOST:8265

For each launcher it measures, from the per-step rows' wall-clock times:
- steady-state steps/s: steps after ``--warmup`` divided by the time they took (first to last row);
- time from submit to first step: launch (torchrun started / run POSTed) until step 1's row was written.
meshrun goes the whole way: REST API -> database -> scheduler -> Ray Job -> driver -> Ray Train workers. The
target is a steps/s ratio (meshrun / torchrun) >= 0.95. The two run one after the other, never together.
Without ``--ray-address`` a local Ray head is started (and stopped) for the benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def default_spec(steps: int, dp: int) -> dict[str, Any]:
    return {"name": "bench-launcher", "model": {"name": "gpt", "preset": "tiny"}, "data": {"source": "synthetic"},
            "layout": {"dp": dp}, "batch": {"global_batch_size": 8 * dp, "micro_batch_size": 4},
            "train": {"steps": steps, "seed": 0}, "optimizer": {"warmup_steps": 0, "schedule": "constant"},
            "resources": {"device": "cpu", "cpus_per_worker": 1}}


def steady(times: list[float], warmup: int) -> float:
    """Steps per second over the rows after ``warmup`` (times: wall clock of steps 1..n)."""
    t = times[warmup:] if len(times) > warmup + 1 else times
    if len(t) < 2 or t[-1] <= t[0]:
        return float("nan")
    return (len(t) - 1) / (t[-1] - t[0])


def mean_step_time(rows: list[dict[str, Any]], warmup: int) -> float:
    """Mean in-loop step time (compute + communication, as the loop measures it) after the warm-up."""
    t = [float(r["step_time_s"]) for r in rows[warmup:] if r.get("step_time_s")] or [float("nan")]
    return sum(t) / len(t)


def run_torchrun(spec: dict[str, Any], world: int, cpus_per_worker: float, warmup: int, tmp: Path) -> dict[str, Any]:
    import yaml

    spec_path, out = tmp / "spec.yaml", tmp / "torchrun-metrics.jsonl"
    spec_path.write_text(yaml.safe_dump(spec))
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, int(cpus_per_worker))), PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", "-m",
           "workers", "--spec", str(spec_path), "--metrics-out", str(out), "--log-level", "WARNING"]
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, cwd=str(ROOT), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"torchrun failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(ln) for ln in out.read_text().splitlines() if ln.strip()]
    times = [float(r["time"]) for r in rows]
    return {"launcher": "torchrun", "steps": len(rows), "first_step_s": times[0] - t0,
            "steps_per_s": steady(times, warmup), "total_s": time.time() - t0,
            "step_time_s": mean_step_time(rows, warmup), "final_loss": rows[-1]["loss"]}


def run_meshrun(spec: dict[str, Any], warmup: int, tmp: Path, *, ray_address: str | None,
                dashboard_url: str | None, num_cpus: int | None) -> dict[str, Any]:
    import httpx
    import uvicorn

    from api.server import create_app
    from service.ray_cluster import RayCluster, free_port
    from service.settings import Settings

    head = None
    if not ray_address:
        head = RayCluster(gcs_port=free_port(6393), dashboard_port=free_port(8268), metrics_export_port=None,
                          num_cpus=num_cpus, data_dir=Path(tempfile.mkdtemp(prefix="mr-bench-", dir="/tmp")))
        head.start()
        ray_address, dashboard_url = head.address, head.dashboard_url
    port = free_port(None)
    settings = Settings(ray_address=ray_address, ray_dashboard_url=dashboard_url, data_dir=tmp / "meshrun",
                        host="127.0.0.1", port=port, scheduler_interval_s=1.0, rate_limit_per_minute=0)
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    try:
        while not server.started:
            time.sleep(0.1)
        url = f"http://127.0.0.1:{port}"
        t0 = time.time()
        r = httpx.post(f"{url}/v1/runs", json=spec, timeout=60)
        r.raise_for_status()
        run_id = r.json()["id"]
        while True:
            run = httpx.get(f"{url}/v1/runs/{run_id}", timeout=30).json()
            if run["status"] in ("SUCCEEDED", "FAILED", "CANCELLED"):
                break
            time.sleep(0.5)
        if run["status"] != "SUCCEEDED":
            raise SystemExit(f"meshrun run {run_id} ended {run['status']}: {run.get('status_reason')}")
        rows = httpx.get(f"{url}/v1/runs/{run_id}/metrics", timeout=30).json()["items"]
        from datetime import datetime

        times = [datetime.fromisoformat(x["time"]).timestamp() for x in rows]
        return {"launcher": "meshrun+ray", "steps": len(rows), "first_step_s": times[0] - t0,
                "steps_per_s": steady(times, warmup), "total_s": time.time() - t0,
                "step_time_s": mean_step_time(rows, warmup), "final_loss": rows[-1]["loss"], "run_id": run_id}
    finally:
        server.should_exit = True
        th.join(timeout=60)
        if head is not None:
            head.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", help="RunSpec YAML/JSON (default: tiny GPT dp=2 on CPU)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=5, help="steps excluded from steps/s")
    ap.add_argument("--ray-address")
    ap.add_argument("--dashboard-url")
    ap.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray head (default: world size)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args(argv)
    if args.spec:
        import yaml

        spec = yaml.safe_load(Path(args.spec).read_text())
        spec.setdefault("train", {})["steps"] = args.steps
    else:
        spec = default_spec(args.steps, args.dp)
    from api.schemas import RunSpec
    from api.validation import build_plan

    plan = build_plan(RunSpec.model_validate(spec))
    cpw = RunSpec.model_validate(spec).resources.cpus_per_worker
    with tempfile.TemporaryDirectory(prefix="mr-bench-") as d:
        tmp = Path(d)
        a = run_torchrun(spec, plan.world_size, cpw, args.warmup, tmp)
        b = run_meshrun(spec, args.warmup, tmp, ray_address=args.ray_address, dashboard_url=args.dashboard_url,
                        num_cpus=args.num_cpus or max(plan.world_size, int(plan.world_size * cpw)))
    ratio = b["steps_per_s"] / a["steps_per_s"] if a["steps_per_s"] else float("nan")
    if args.json:
        print(json.dumps({"torchrun": a, "meshrun": b, "steps_per_s_ratio": ratio}))
        return 0
    print(f"spec: {spec.get('name')} world={plan.world_size} steps={args.steps} (warm-up {args.warmup} excluded)")
    print(f"{'launcher':<14}{'steps/s':>10}{'step time (ms)':>16}{'submit->step 1 (s)':>22}{'total (s)':>12}"
          f"{'final loss':>12}")
    for r in (a, b):
        print(f"{r['launcher']:<14}{r['steps_per_s']:>10.2f}{r['step_time_s'] * 1e3:>16.1f}{r['first_step_s']:>22.1f}"
              f"{r['total_s']:>12.1f}{r['final_loss']:>12.4f}")
    print(f"steady-state steps/s ratio meshrun/torchrun = {ratio:.3f} (target >= 0.95)"
          f" -> {'OK' if ratio >= 0.95 else 'BELOW TARGET'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

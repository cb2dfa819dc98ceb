"""Launcher overhead: the standalone torchrun launcher vs the same run through meshrun on Ray, interleaved.

    python bench/bench_launcher.py                       # tiny GPT, dp=2, 40 steps, CPU, 5 repeats
    python bench/bench_launcher.py --spec examples/x.yaml --warmup 5 --repeats 3
    python bench/bench_launcher.py --ray-address HOST:PORT --dashboard-url http://HOST:8265

The meshrun service (and, without ``--ray-address``, a local Ray head) starts once; then ``--repeats`` rounds
each run the spec once under torchrun and once through meshrun (REST API -> database -> scheduler -> Ray Job ->
driver -> Ray Train workers), in alternating order, never together. From the per-step rows' wall-clock end times:

- steady-state steps/s: steps after ``--warmup`` divided by the time they took (first to last row);
- submit -> step 1: launch (torchrun started / run POSTed) until step 1 ended.

Printed: median [min-max] over the rounds, and the ratio of the medians (target: steps/s meshrun / torchrun
>= 0.97).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
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
    return {
        "name": "bench-launcher",
        "model": {"name": "gpt", "preset": "tiny"},
        "data": {"source": "synthetic"},
        "layout": {"dp": dp},
        "batch": {"global_batch_size": 8 * dp, "micro_batch_size": 4},
        "train": {"steps": steps, "seed": 0},
        "optimizer": {"warmup_steps": 0, "schedule": "constant"},
        "resources": {"device": "cpu", "cpus_per_worker": 1},
    }


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

    spec_path, out = tmp / "spec.yaml", tmp / f"torchrun-{time.time_ns()}.jsonl"  # the launcher appends
    spec_path.write_text(yaml.safe_dump(spec))
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, int(cpus_per_worker))), PYTHONPATH=str(ROOT))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world}",
        "-m",
        "workers",
        "--spec",
        str(spec_path),
        "--metrics-out",
        str(out),
        "--log-level",
        "WARNING",
    ]
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, cwd=str(ROOT), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"torchrun failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(ln) for ln in out.read_text().splitlines() if ln.strip()]
    times = [float(r["time"]) for r in rows]
    return {
        "launcher": "torchrun",
        "steps": len(rows),
        "first_step_s": times[0] - t0,
        "steps_per_s": steady(times, warmup),
        "total_s": time.time() - t0,
        "step_time_s": mean_step_time(rows, warmup),
        "final_loss": rows[-1]["loss"],
    }


@contextlib.contextmanager
def meshrun_service(
    tmp: Path, *, ray_address: str | None, dashboard_url: str | None, num_cpus: int | None, **overrides: Any
) -> Any:
    """A meshrun service (and a local Ray head unless ``ray_address``) for the whole benchmark; yields its URL."""
    import uvicorn

    from service.app.server import create_app
    from service.cluster.head import RayCluster, free_port
    from service.settings import Settings

    head = None
    if not ray_address:
        head = RayCluster(
            gcs_port=free_port(6393),
            dashboard_port=free_port(8268),
            metrics_export_port=None,
            num_cpus=num_cpus,
            data_dir=Path(tempfile.mkdtemp(prefix="mr-bench-", dir="/tmp")),
        )
        head.start()
        ray_address, dashboard_url = head.address, head.dashboard_url
    port = free_port(None)
    settings = Settings(
        ray_address=ray_address,
        ray_dashboard_url=dashboard_url,
        data_dir=tmp / "meshrun",
        host="127.0.0.1",
        port=port,
        scheduler_interval_s=1.0,
        rate_limit_per_minute=0,
        **overrides,
    )
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    try:
        while not server.started:
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        th.join(timeout=60)
        if head is not None:
            head.stop()


def run_meshrun(spec: dict[str, Any], warmup: int, url: str) -> dict[str, Any]:
    import httpx

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
    return {
        "launcher": "meshrun+ray",
        "steps": len(rows),
        "first_step_s": times[0] - t0,
        "steps_per_s": steady(times, warmup),
        "total_s": time.time() - t0,
        "step_time_s": mean_step_time(rows, warmup),
        "final_loss": rows[-1]["loss"],
        "run_id": run_id,
    }


def _fmt(xs: list[float], digits: int = 2) -> str:
    return f"{statistics.median(xs):.{digits}f} [{min(xs):.{digits}f}-{max(xs):.{digits}f}]"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", help="RunSpec YAML/JSON (default: tiny GPT dp=2 on CPU)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=5, help="steps excluded from steps/s")
    ap.add_argument("--ray-address")
    ap.add_argument("--dashboard-url")
    ap.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray head (default: world size)")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved rounds (one run of each launcher per round)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args(argv)
    if args.spec:
        import yaml

        spec = yaml.safe_load(Path(args.spec).read_text())
        spec.setdefault("train", {})["steps"] = args.steps
    else:
        spec = default_spec(args.steps, args.dp)
    from api.spec import RunSpec
    from api.spec.validation import build_plan

    plan = build_plan(RunSpec.model_validate(spec))
    cpw = RunSpec.model_validate(spec).resources.cpus_per_worker
    runs: dict[str, list[dict[str, Any]]] = {"torchrun": [], "meshrun+ray": []}
    with tempfile.TemporaryDirectory(prefix="mr-bench-") as d:
        tmp = Path(d)
        cpus = args.num_cpus or max(plan.world_size, int(plan.world_size * cpw))
        with meshrun_service(tmp, ray_address=args.ray_address, dashboard_url=args.dashboard_url, num_cpus=cpus) as url:
            for rep in range(args.repeats):
                order = ("torchrun", "meshrun+ray") if rep % 2 == 0 else ("meshrun+ray", "torchrun")
                for which in order:
                    if which == "torchrun":
                        runs[which].append(run_torchrun(spec, plan.world_size, cpw, args.warmup, tmp))
                    else:
                        runs[which].append(run_meshrun(spec, args.warmup, url))
    med = {k: statistics.median(r["steps_per_s"] for r in v) for k, v in runs.items()}
    ratio = med["meshrun+ray"] / med["torchrun"] if med["torchrun"] else float("nan")
    if args.json:
        print(json.dumps({"runs": runs, "steps_per_s_ratio": ratio}))
        return 0
    print(
        f"spec: {spec.get('name')} world={plan.world_size} steps={args.steps} (warm-up {args.warmup} excluded), "
        f"{args.repeats} interleaved rounds; median [min-max]"
    )
    print(f"{'launcher':<13}{'steps/s':>24}{'step time (ms)':>26}{'submit->step 1 (s)':>24}{'final loss':>12}")
    for name, rs in runs.items():
        print(
            f"{name:<13}{_fmt([r['steps_per_s'] for r in rs]):>24}"
            f"{_fmt([r['step_time_s'] * 1e3 for r in rs], 1):>26}{_fmt([r['first_step_s'] for r in rs], 1):>24}"
            f"{rs[-1]['final_loss']:>12.4f}"
        )
    print(
        f"steady-state steps/s ratio meshrun/torchrun = {ratio:.3f} (target >= 0.97)"
        f" -> {'OK' if ratio >= 0.97 else 'BELOW TARGET'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

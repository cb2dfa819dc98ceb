"""Submit -> first step: a run through meshrun (warm and cold) vs a bare Ray ``TorchTrainer`` with the same number of
workers.

    python bench/bench_first_step.py                    # dp=2 tiny GPT, 2 rounds, a local Ray head
    python bench/bench_first_step.py --workers 4 --repeats 3
    python bench/bench_first_step.py --ray-address HOST:PORT --dashboard-url http://HOST:8265
    python bench/bench_first_step.py --no-warm          # a service without a warm pool: cold and bare only

One Ray head and one meshrun service with a warm pool of ``--workers`` workers (``MESHRUN_WARM_WORKERS``) start
first (not timed; the bench waits until the pool's group is up). Then each round, in rotating order, never
together, ``--pause`` seconds apart (the last run's processes exit before the next is timed):

- meshrun warm: ``POST /v1/runs`` (tiny GPT, ``--workers`` data-parallel CPU workers, 3 steps) until the first
  metric row's time, the run starting in the service's warm pool; the run's phase events say where the time went;
- meshrun cold: the same with ``resources.warm_start: false`` (queued -> starting the Ray Job -> placing the workers
  in a new Ray Train worker group -> workers ready -> first step);
- bare Ray Train: a Ray Job (the same Jobs API meshrun uses) whose entrypoint is this file in ``--bare-driver``
  mode: ``ray.init`` and a ``TorchTrainer`` of ``--workers`` CPU workers whose loop does one DDP step of a small
  linear model; rank 0 writes the time of its first step to a file.

Printed side by side: submit -> first step for both, meshrun's extra, and meshrun's phases. The difference is
meshrun's share: the database, the scheduler's tick (``scheduler_interval_s``), the driver's start-up (imports,
the run channel actor), and the model (a GPT with its parallel plan instead of one linear layer).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_launcher import meshrun_service  # noqa: E402


def spec(workers: int, warm: bool = True) -> dict[str, Any]:
    return {
        "name": f"bench-first-step-{uuid.uuid4().hex[:6]}",
        "model": {"name": "gpt", "preset": "tiny"},
        "data": {"source": "synthetic"},
        "layout": {"dp": workers},
        "batch": {"global_batch_size": 2 * workers, "micro_batch_size": 2},
        "train": {"steps": 3, "seed": 0},
        "optimizer": {"warmup_steps": 0, "schedule": "constant"},
        "resources": {"device": "cpu", "cpus_per_worker": 1, "warm_start": warm},
    }


def run_meshrun(url: str, workers: int, warm: bool = True) -> tuple[float, list[str]]:
    import httpx

    t0 = time.time()
    r = httpx.post(f"{url}/v1/runs", json=spec(workers, warm), timeout=60)
    r.raise_for_status()
    run_id = r.json()["id"]
    while True:
        rows = httpx.get(f"{url}/v1/runs/{run_id}/metrics", timeout=30).json()["items"]
        if rows:
            first = datetime.fromisoformat(rows[0]["time"]).timestamp() - t0
            break
        run = httpx.get(f"{url}/v1/runs/{run_id}", timeout=30).json()
        if run["status"] in ("SUCCEEDED", "FAILED", "CANCELLED"):
            if httpx.get(f"{url}/v1/runs/{run_id}/metrics", timeout=30).json()["items"]:
                continue  # its rows and its end were written between the two reads: the next pass reads them
            raise SystemExit(f"meshrun run {run_id} ended {run['status']} before a step: {run.get('status_reason')}")
        time.sleep(0.2)
    phases = [
        e["reason"]
        for e in httpx.get(f"{url}/v1/runs/{run_id}/events", timeout=30).json()["items"]
        if e["kind"] == "phase"
    ]
    return first, phases


def run_bare(dashboard_url: str, gcs_address: str, workers: int, tmp: Path) -> float:
    from ray.job_submission import JobSubmissionClient

    out = tmp / f"bare-{uuid.uuid4().hex[:6]}.txt"
    client = JobSubmissionClient(dashboard_url)
    t0 = time.time()
    job = client.submit_job(
        entrypoint=f"{sys.executable} {Path(__file__).resolve()} --bare-driver --workers {workers} --out {out}",
        runtime_env={"env_vars": {"RAY_ADDRESS": gcs_address, "PYTHONPATH": str(ROOT)}},
    )
    while not out.exists():
        status = str(client.get_job_status(job))
        if status.endswith(("FAILED", "STOPPED")):
            raise SystemExit(f"bare Ray Train job {job} {status}:\n{client.get_job_logs(job)[-3000:]}")
        time.sleep(0.2)
    while not out.read_text().strip():
        time.sleep(0.05)
    return float(out.read_text()) - t0


def bare_driver(workers: int, out: str) -> None:
    """The bare Ray Train run: one DDP step of a linear model on ``workers`` CPU workers."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    def loop(config: dict[str, Any]) -> None:
        import torch
        from ray import train
        from ray.train.torch import prepare_model

        model = prepare_model(torch.nn.Linear(64, 64))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loss = model(torch.randn(8, 64)).pow(2).mean()
        loss.backward()
        opt.step()
        if train.get_context().get_world_rank() == 0:
            Path(config["out"]).write_text(f"{time.time()}")

    ray.init(address=os.environ.get("RAY_ADDRESS"))
    TorchTrainer(
        loop,
        train_loop_config={"out": out},
        scaling_config=ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name=f"bare-{uuid.uuid4().hex[:8]}", storage_path=str(Path(out).parent / "train")),
    ).fit()


def _fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):6.1f} s [{min(xs):.1f}-{max(xs):.1f}]"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--ray-address")
    ap.add_argument("--dashboard-url")
    ap.add_argument("--num-cpus", type=int, default=None, help="CPU slots of the local head (default: meshrun's)")
    ap.add_argument("--no-warm", action="store_true", help="no warm pool: meshrun cold vs bare only")
    ap.add_argument("--pause", type=float, default=10.0, help="seconds between two measurements (teardown settles)")
    ap.add_argument("--bare-driver", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.bare_driver:
        bare_driver(args.workers, args.out)
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="mr-first-step-", dir="/tmp"))
    kinds = ["cold", "bare"] if args.no_warm else ["warm", "cold", "bare"]
    times: dict[str, list[float]] = {k: [] for k in kinds}
    phases: dict[str, list[str]] = {}
    load: list[float] = []
    with contextlib.ExitStack() as stack:
        gcs, dash = args.ray_address, args.dashboard_url
        if not gcs:  # our own head: the bare job needs Ray's dashboard itself (meshrun's /ray/ proxy is read-only)
            from service.cluster.head import RayCluster, free_port, local_cpu_slots

            head = RayCluster(
                gcs_port=free_port(6393),
                dashboard_port=free_port(8268),
                num_cpus=local_cpu_slots(args.num_cpus)[0],
                data_dir=Path(tempfile.mkdtemp(prefix="mr-bench-", dir="/tmp")),
            )
            head.start()
            stack.callback(head.stop)
            gcs, dash = head.address, head.dashboard_url
        warm = 0 if args.no_warm else args.workers
        url = stack.enter_context(
            meshrun_service(tmp, ray_address=gcs, dashboard_url=dash, num_cpus=None, warm_workers=warm)
        )
        if warm:
            wait_warm_pool(dash)
        for i in range(args.repeats):
            order = kinds[i % len(kinds) :] + kinds[: i % len(kinds)]
            for which in order:
                time.sleep(args.pause)  # the last run's processes exit before the next is timed
                load.append(os.getloadavg()[0])
                if which == "bare":
                    times[which].append(run_bare(dash, gcs, args.workers, tmp))
                else:
                    t, phases[which] = run_meshrun(url, args.workers, warm=which == "warm")
                    times[which].append(t)
                print(f"round {i + 1} {which:5s} submit -> first step {times[which][-1]:.1f} s", flush=True)
    print()
    print(f"submit -> first step, {args.workers} CPU workers, median [min-max] of {args.repeats} rounds")
    print(f"load average during the rounds: {min(load):.1f}-{max(load):.1f} ({os.cpu_count()} CPUs)")
    labels = {
        "warm": "meshrun warm (REST -> DB -> scheduler -> Ray Job -> driver -> warm pool)",
        "cold": "meshrun cold (REST -> DB -> scheduler -> Ray Job -> driver -> Ray Train)",
        "bare": "bare Ray TorchTrainer (Ray Job -> driver -> Ray Train)",
    }
    for k in kinds:
        print(f"  {labels[k]:74s} {_fmt(times[k])}")
    if "warm" in times:
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"  warm target: <= 5 s; warm / bare: {med['warm'] / med['bare']:.2f}")
    extra = statistics.median(times["cold"]) - statistics.median(times["bare"])
    print(f"  meshrun cold's extra over bare: {extra:+.1f} s")
    for k, ps in phases.items():
        print(f"  meshrun {k}'s phases (last round):")
        for p in ps:
            print(f"    {p}")
    print(json.dumps({**{f"{k}_s": v for k, v in times.items()}, "workers": args.workers, "load": load}))
    return 0


def wait_warm_pool(dashboard_url: str, timeout_s: float = 300) -> None:
    """Until the service's warm pool job says its group is up."""
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(dashboard_url)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for job in client.list_jobs():
            if (job.metadata or {}).get("meshrun") == "warm" and "ready on node" in client.get_job_logs(
                job.submission_id
            ):
                return
        time.sleep(0.5)
    raise SystemExit("the warm pool did not come up within 300 s")


if __name__ == "__main__":
    sys.exit(main())

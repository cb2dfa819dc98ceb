"""Goodput under failure: one CPU training run while a worker is killed on a schedule; prints the run's goodput.

Starts ``meshrun serve`` (its own local Ray head, a throw-away data dir) unless ``--url`` names a running service,
submits a checkpointing dp2 run of the tiny GPT sized to take about ``--duration-s`` seconds, and every
``--kill-every-s`` seconds (each interval drawn uniformly within +-``--jitter-s``, so a kill does not land at the
same point between two checkpoints every time: with a fixed interval the restart time and the checkpoint interval
lock that phase, and the recomputed steps measure luck) sends ``--signal`` to one of its workers (ranks taken in
turn, pids from the run's latest placement event):

- ``KILL``: a crash; Ray Train restarts the worker group from the latest checkpoint (``max_failures`` unlimited);
- ``TERM``: a preemption notice; the run checkpoints at its next report, goes back to the queue and resumes.

At the end it prints ``GET /v1/runs/{id}/goodput``: productive step time / wall time since submission and the time
lost per cause. Exit status 0 when the run SUCCEEDED with every step once and goodput >= ``--min-goodput``.

    python bench/bench_goodput.py                                    # 10 min, a worker killed every 60 s
    python bench/bench_goodput.py --duration-s 120 --kill-every-s 30 --signal TERM
    python bench/bench_goodput.py --url http://127.0.0.1:8000 --min-goodput 0.8
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_service(data_dir: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
    cmd = [sys.executable, "-m", "api.cli", "serve", "--port", str(port), "--data-dir", str(data_dir)]
    log = open(data_dir / "serve.log", "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/healthz", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(1)
    proc.terminate()
    raise SystemExit(f"the service did not come up; see {data_dir / 'serve.log'}")


def _pids(url: str, run_id: str) -> dict[int, int]:
    ev = httpx.get(f"{url}/v1/runs/{run_id}/events", params={"kind": "placement"}, timeout=30).json()["items"]
    if not ev:
        return {}
    return {int(r): int(p) for r, p in re.findall(r'"(\d+)": "[0-9a-f]+ pid (\d+)"', ev[-1]["reason"])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running meshrun service (default: start one)")
    ap.add_argument("--duration-s", type=float, default=600.0, help="target length of the run")
    ap.add_argument("--kill-every-s", type=float, default=60.0, help="mean time between two signals")
    ap.add_argument("--jitter-s", type=float, default=5.0, help="each interval is kill-every-s +- this (uniform)")
    ap.add_argument("--seed", type=int, default=None, help="of the intervals' jitter (default: random)")
    ap.add_argument("--signal", choices=["KILL", "TERM"], default="KILL")
    ap.add_argument(
        "--checkpoint-every",
        type=int,
        default=300,
        help="steps between checkpoints (300 of ~11 ms: about Young's optimum sqrt(2 x save cost x time between "
        "failures) for a 0.08 s save and a failure a minute)",
    )
    ap.add_argument(
        "--step-s", type=float, default=0.01, help="one step's time, to size the run (tiny GPT, dp2, CPU: ~10 ms)"
    )
    ap.add_argument("--min-goodput", type=float, default=0.0)
    args = ap.parse_args()

    proc = None
    if args.url is None:
        proc, url = _start_service(Path(tempfile.mkdtemp(prefix="meshrun-goodput-")))
    else:
        url = args.url.rstrip("/")
    try:
        steps = max(50, int(args.duration_s / args.step_s))
        spec = {
            "name": "bench-goodput",
            "model": {"name": "gpt", "preset": "tiny"},
            "data": {"source": "synthetic"},
            "layout": {"dp": 2},
            "batch": {"global_batch_size": 8, "micro_batch_size": 4},
            "train": {"steps": steps, "seed": 0},
            "optimizer": {"lr": 3e-3, "warmup_steps": 0, "schedule": "constant"},
            "checkpoint": {"every_steps": args.checkpoint_every, "keep": 2},
            "resources": {"device": "cpu", "cpus_per_worker": 1, "max_failures": -1},
        }
        run = httpx.post(f"{url}/v1/runs", json=spec, timeout=60).json()
        rid = run["id"]
        print(f"run {rid}: {steps} steps, {args.signal} to a worker every {args.kill_every_s:.0f} s", flush=True)
        t0, next_kill, victim, kills = time.monotonic(), None, 1, 0
        rng = random.Random(args.seed)

        def interval() -> float:
            return max(1.0, args.kill_every_s + rng.uniform(-args.jitter_s, args.jitter_s))

        while True:
            r = httpx.get(f"{url}/v1/runs/{rid}", timeout=30).json()
            if r["status"] in TERMINAL:
                break
            if r["status"] == "RUNNING" and next_kill is None:
                next_kill = time.monotonic() + interval()
            if next_kill is not None and time.monotonic() >= next_kill:
                pids = _pids(url, rid)
                if r["status"] == "RUNNING" and pids:
                    pid = pids[victim % len(pids)]
                    try:
                        os.kill(pid, getattr(signal, f"SIG{args.signal}"))
                        kills += 1
                        print(f"  {time.monotonic() - t0:6.0f} s: SIG{args.signal} to rank {victim % len(pids)}")
                    except ProcessLookupError:
                        pass
                    victim += 1
                next_kill = time.monotonic() + interval()
            time.sleep(1)
        g = httpx.get(f"{url}/v1/runs/{rid}/goodput", timeout=30).json()
        steps_seen, cursor = [], None
        while True:  # every page (a long run has more rows than one page holds)
            page = httpx.get(
                f"{url}/v1/runs/{rid}/metrics", params={"limit": 5000, "cursor": cursor}, timeout=60
            ).json()
            steps_seen += [x["step"] for x in page["items"]]
            cursor = page.get("next_cursor")
            if not cursor or not page["items"]:
                break
        continuous = steps_seen == list(range(1, steps + 1))
        print(f"status {r['status']}, {kills} signals, {g['attempts']} attempts, steps continuous: {continuous}")
        print(f"goodput {100 * (g['goodput'] or 0):.1f}% (productive {g['productive_s']:.0f} s of {g['wall_s']:.0f} s)")
        for cause, s in g["lost_s"].items():
            print(f"  lost to {cause.replace('_', ' '):18s} {s:7.1f} s")
        print(f"  recomputed steps: {g['recomputed_steps']}")
        print(json.dumps(g))
        ok = r["status"] == "SUCCEEDED" and continuous and (g["goodput"] or 0) >= args.min_goodput
        return 0 if ok else 1
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)


if __name__ == "__main__":
    sys.exit(main())

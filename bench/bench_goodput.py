"""Goodput under failure: one CPU training run while a worker is killed on a schedule; prints the run's goodput.

Starts ``meshrun serve`` (its own local Ray head, a throw-away data dir) unless ``--url`` names a running service,
submits a checkpointing dp2 run of the tiny GPT sized to take about ``--duration-s`` seconds, and every
``--kill-every-s`` seconds (each interval drawn uniformly within +-``--jitter-s``, so a kill does not land at the
same point between two checkpoints every time: with a fixed interval the restart time and the checkpoint interval
lock that phase, and the recomputed steps measure luck) sends ``--signal`` to one of its workers (ranks taken in
turn, pids from the run's latest placement event):

- ``KILL``: a crash; Ray Train restarts the worker group from the latest checkpoint (``max_failures`` unlimited);
- ``TERM``: a preemption notice; the run checkpoints at its next report, goes back to the queue and resumes.

- ``--modes replica,group`` (default): the same run twice, one after the other, first with
  ``fault_tolerance.mode: replica`` (torchft replicas: the live replica keeps training, the killed one is replaced
  and heals from it), then with whole-group restarts, and a table of both at the end with the machine's load.

At the end of each it prints ``GET /v1/runs/{id}/goodput``: productive step time / wall time since submission and
the time lost per cause (per replica in replica mode), and the same run's goodput at the full-quorum pace (a step a
lone replica trained at half speed counts at that speed). Exit status 0 when every run SUCCEEDED with every step
once and the first mode's goodput >= ``--min-goodput``.

    python bench/bench_goodput.py                                    # 2 x 10 min, a worker killed every 60 s
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
    """rank -> pid now: the latest attempt's placement, updated by later ones (replica mode: a replacement replica
    has a placement event of its own)."""
    ev = httpx.get(f"{url}/v1/runs/{run_id}/events", params={"kind": "placement"}, timeout=30).json()["items"]
    pids: dict[int, int] = {}
    for e in ev:
        found = {int(r): int(p) for r, p in re.findall(r'"(\d+)": "[0-9a-f]+ pid (\d+)"', e["reason"])}
        pids = found if len(found) > 1 or not pids else {**pids, **found}
    return pids


def _run_once(url: str, args: argparse.Namespace, mode: str, rng: random.Random) -> dict:
    """One run of ``mode`` (group: whole-group restarts; replica: fault_tolerance replica) under the kill schedule."""
    steps = max(50, int(args.duration_s / args.step_s))
    spec = {
        "name": f"bench-goodput-{mode}",
        "model": {"name": "gpt", "preset": "tiny"},
        "data": {"source": "synthetic"},
        "layout": {"dp": 2},
        "batch": {"global_batch_size": 8, "micro_batch_size": 4},
        "train": {"steps": steps, "seed": 0},
        "optimizer": {"lr": 3e-3, "warmup_steps": 0, "schedule": "constant"},
        "checkpoint": {"every_steps": args.checkpoint_every, "keep": 2},
        "resources": {"device": "cpu", "cpus_per_worker": 1, "max_failures": -1},
        "fault_tolerance": {"mode": mode},
    }
    run = httpx.post(f"{url}/v1/runs", json=spec, timeout=60).json()
    rid = run["id"]
    print(f"[{mode}] run {rid}: {steps} steps, {args.signal} to a worker every {args.kill_every_s:.0f} s", flush=True)
    t0, next_kill, victim, kills = time.monotonic(), None, 1, 0

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
                rank = victim % len(pids)
                try:
                    os.kill(pids[rank], getattr(signal, f"SIG{args.signal}"))
                    kills += 1
                    print(f"  {time.monotonic() - t0:6.0f} s: SIG{args.signal} to rank {rank}", flush=True)
                except ProcessLookupError:
                    pass
                victim += 1
            next_kill = time.monotonic() + interval()
        time.sleep(1)
    g = httpx.get(f"{url}/v1/runs/{rid}/goodput", timeout=30).json()
    rows, cursor = [], None
    while True:  # every page (a long run has more rows than one page holds)
        page = httpx.get(f"{url}/v1/runs/{rid}/metrics", params={"limit": 5000, "cursor": cursor}, timeout=60).json()
        rows += page["items"]
        cursor = page.get("next_cursor")
        if not cursor or not page["items"]:
            break
    continuous = [x["step"] for x in rows] == list(range(1, steps + 1))
    full = [x["step_time_s"] for x in rows if x.get("step_time_s") and (x.get("replicas") or 2) == 2]
    ideal = sum(full) / len(full) if full else None  # the mean step with every replica
    # throughput goodput: the steps done at the full-quorum pace over the wall time (a step a lone replica trained
    # at half speed counts as time spent, not as lost, in the goodput above; here it counts at the pace it kept)
    pace = len(rows) * ideal / g["wall_s"] if ideal and g["wall_s"] else None
    print(f"[{mode}] status {r['status']}, {kills} signals, {g['attempts']} attempts, steps continuous: {continuous}")
    head = f"[{mode}] goodput {100 * (g['goodput'] or 0):.1f}% "
    head += f"(productive {g['productive_s']:.0f} s of {g['wall_s']:.0f} s)"
    print(head + (f"; at the full-quorum pace {100 * pace:.1f}%" if pace else ""))
    for cause, secs in g["lost_s"].items():
        print(f"  lost to {cause.replace('_', ' '):18s} {secs:7.1f} s")
    print(f"  recomputed steps: {g['recomputed_steps']}")
    for rep in g.get("replicas") or []:
        print(f"  replica {rep['replica']}: {rep['steps']} steps, out {rep['absent_s']:.1f} s, lost {rep['losses']}x")
    print(json.dumps(g), flush=True)
    return {"mode": mode, "status": r["status"], "continuous": continuous, "goodput": g["goodput"] or 0.0,
            "pace": pace, "kills": kills, "final_loss": rows[-1]["loss"] if rows else None,
            "wall_s": g["wall_s"]}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running meshrun service (default: start one)")
    ap.add_argument("--duration-s", type=float, default=600.0, help="target length of each run")
    ap.add_argument("--kill-every-s", type=float, default=60.0, help="mean time between two signals")
    ap.add_argument("--jitter-s", type=float, default=5.0, help="each interval is kill-every-s +- this (uniform)")
    ap.add_argument("--seed", type=int, default=None, help="of the intervals' jitter (default: random)")
    ap.add_argument("--signal", choices=["KILL", "TERM"], default="KILL")
    ap.add_argument(
        "--modes",
        default="replica,group",
        help="fault_tolerance modes to run one after the other, each with the same kill schedule's statistics",
    )
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
    ap.add_argument("--min-goodput", type=float, default=0.0, help="of the first mode")
    args = ap.parse_args()

    proc = None
    if args.url is None:
        proc, url = _start_service(Path(tempfile.mkdtemp(prefix="meshrun-goodput-")))
    else:
        url = args.url.rstrip("/")
    try:
        load0 = os.getloadavg()
        out = [_run_once(url, args, m.strip(), random.Random(args.seed)) for m in args.modes.split(",") if m.strip()]
        load1 = os.getloadavg()
        print(f"machine load (1/5/15 min) before {load0[0]:.2f}/{load0[1]:.2f}/{load0[2]:.2f}, "
              f"after {load1[0]:.2f}/{load1[1]:.2f}/{load1[2]:.2f}; {os.cpu_count()} CPUs")  # fmt: skip
        print(f"{'mode':8s} {'status':10s} {'kills':>5s} {'wall':>7s} {'goodput':>8s} {'pace':>7s} {'final loss':>10s}")
        for o in out:
            pace = f"{100 * o['pace']:.1f}%" if o["pace"] else "-"
            loss = f"{o['final_loss']:.4f}" if o["final_loss"] is not None else "-"
            wall, good = f"{o['wall_s']:.0f} s", f"{100 * o['goodput']:.1f}%"
            print(f"{o['mode']:8s} {o['status']:10s} {o['kills']:5d} {wall:>7s} {good:>8s} {pace:>7s} {loss:>10s}")
        ok = all(o["status"] == "SUCCEEDED" and o["continuous"] for o in out)
        return 0 if ok and out and out[0]["goodput"] >= args.min_goodput else 1
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)


if __name__ == "__main__":
    sys.exit(main())

"""Search cost: a sweep of 8 layouts of the tiny GPT on 4 CPU workers, warm worker groups vs one launch per trial.

    python bench/bench_sweep.py                  # warm, cold (one round); a local Ray head with 6 CPU slots
    python bench/bench_sweep.py --rounds 2       # warm, cold, cold, warm: interleaved, so drift hits both

One Ray head and one meshrun service start first (not timed). Each sweep is the same request but for
``budget.warm_workers``: true (the trials re-mesh one warm worker group in place) or false (every trial is its own
Ray Train worker group: placement group, processes, torch imports, process group). Printed per sweep and as the
median per mode: total wall time (the sweep's creation to its end), time per trial, the gap between two trials (the
last step row of one trial to the first of the next, median), the worker-group starts its events record, and the
best layout each found (they should agree: the same measurement, only the start-up differs). With the machine's
load before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_launcher import meshrun_service  # noqa: E402

LAYOUTS = [
    {"dp": 4},
    {"tp": 4},
    {"pp": 4},
    {"dp": 2, "tp": 2},
    {"dp": 2, "pp": 2},
    {"tp": 2, "pp": 2},
    {"dp": 4, "zero_stage": 3},
    {"dp": 2, "tp": 2, "sequence_parallel": True},
]


def body(warm: bool, steps: int) -> dict[str, Any]:
    return {
        "name": f"bench-sweep-{'warm' if warm else 'cold'}",
        "base": {
            "name": "tiny",
            "model": {"name": "gpt", "preset": "tiny", "n_layers": 4},
            "data": {"source": "synthetic"},
            "batch": {"global_batch_size": 16, "micro_batch_size": 2},
            "train": {"steps": 100, "seed": 0},
            "optimizer": {"lr": 3e-3, "warmup_steps": 0, "schedule": "constant"},
            "resources": {"device": "cpu", "cpus_per_worker": 1},
        },
        "search": {"layouts": LAYOUTS, "micro_batch_sizes": [2]},
        "objective": "tokens_per_s",
        "budget": {"max_trials": len(LAYOUTS), "steps_per_trial": steps, "warmup_steps": 2, "warm_workers": warm},
        "early_stopping": False,
    }


def _ts(s: str) -> float:
    return datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()


def one_sweep(url: str, warm: bool, steps: int) -> dict[str, Any]:
    t0 = time.monotonic()
    sw = httpx.post(f"{url}/v1/sweeps", json=body(warm, steps), timeout=60).json()
    while True:
        sw = httpx.get(f"{url}/v1/sweeps/{sw['id']}", timeout=30).json()
        if sw["status"] in ("SUCCEEDED", "FAILED", "CANCELLED"):
            break
        time.sleep(1)
    wall = time.monotonic() - t0
    spans = []
    for t in sw["trials"]:
        if not t.get("run_id"):
            continue
        rows = httpx.get(f"{url}/v1/runs/{t['run_id']}/metrics", timeout=30).json()["items"]
        if rows:
            first = _ts(rows[0]["time"]) - (rows[0].get("step_time_s") or 0.0)
            spans.append((first, _ts(rows[-1]["time"])))
    spans.sort()
    gaps = [b[0] - a[1] for a, b in zip(spans, spans[1:])]
    parts = _gap_parts(url, sw["trials"], spans)
    evs = httpx.get(f"{url}/v1/sweeps/{sw['id']}/events", timeout=30).json()["items"]
    starts = sum(1 for e in evs if e["kind"] == "worker_group" and " started: " in e["reason"])
    ran = [t for t in sw["trials"] if t["status"] in ("SUCCEEDED", "EARLY_STOPPED")]
    best = sw.get("best_trial") or {}
    lay = best.get("layout") or {}
    label = f"dp{lay.get('dp')} tp{lay.get('tp')} pp{lay.get('pp')} z{lay.get('zero_stage')}" if lay else "-"
    if lay.get("sequence_parallel"):
        label += " sp"
    return {
        "mode": "warm" if warm else "cold",
        "status": sw["status"],
        "wall_s": wall,
        "trials": len(ran),
        "per_trial_s": wall / max(1, len(ran)),
        "gap_s": statistics.median(gaps) if gaps else None,
        "group_starts": starts if warm else len(ran),
        "best": label,
        "parts": parts,
    }


GAP_PARTS = ("run created", "admitted", "worker group", "workers ready", "first step")


def _gap_parts(url: str, trials: list[dict[str, Any]], spans: list[tuple[float, float]]) -> dict[str, float]:
    """Where a gap goes, median over the trials after the first: from the previous trial's last step row to the next
    trial's run created (Tune's turn and the trial's set-up), admitted (the scheduler), its worker group (placed,
    re-meshing or started), workers ready (attempt registered) and its first step's start."""
    out: dict[str, list[float]] = {k: [] for k in GAP_PARTS}
    ends = sorted(b for _, b in spans)
    for t in trials:
        if not t.get("run_id"):
            continue
        run = httpx.get(f"{url}/v1/runs/{t['run_id']}", timeout=30).json()
        evs = httpx.get(f"{url}/v1/runs/{t['run_id']}/events", timeout=30).json()["items"]
        rows = httpx.get(f"{url}/v1/runs/{t['run_id']}/metrics", timeout=30).json()["items"]
        if not rows:
            continue
        first = _ts(rows[0]["time"]) - (rows[0].get("step_time_s") or 0.0)
        before = [e for e in ends if e < first]
        if not before:
            continue
        prev = before[-1]

        def at(pred: Any, evs: list[dict[str, Any]] = evs) -> float | None:
            hit = [_ts(e["time"]) for e in evs if pred(e)]
            return min(hit) if hit else None

        marks = {
            "run created": _ts(run["created_at"]),
            "admitted": at(lambda e: e.get("to_status") == "STARTING"),
            "worker group": at(lambda e: e["kind"] == "phase" and "worker group" in (e["reason"] or "")),
            "workers ready": at(lambda e: e["kind"] == "phase" and (e["reason"] or "").startswith("workers ready")),
            "first step": first,
        }
        for k, v in marks.items():
            if v is not None:
                out[k].append(v - prev)
    return {k: statistics.median(v) for k, v in out.items() if v}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=1, help="warm/cold pairs, alternating which goes first")
    ap.add_argument("--steps", type=int, default=8, help="steps per trial (2 of them warm-up)")
    ap.add_argument("--num-cpus", type=int, default=6, help="CPU slots of the local Ray head (4 workers + drivers)")
    ap.add_argument("--modes", default="warm,cold", help="which sweeps a round runs: warm,cold (default) or one")
    args = ap.parse_args()
    load0 = os.getloadavg()
    out = []
    with meshrun_service(Path(tempfile.mkdtemp()), ray_address=None, dashboard_url=None, num_cpus=args.num_cpus) as url:
        for r in range(args.rounds):
            modes = [m == "warm" for m in args.modes.split(",")]
            for warm in modes if r % 2 == 0 else modes[::-1]:
                res = one_sweep(url, warm, args.steps)
                out.append(res)
                gap = f"{res['gap_s']:.1f} s" if res["gap_s"] is not None else "-"
                print(f"{res['mode']}: {res['status']}, {res['trials']} trials in {res['wall_s']:.0f} s "
                      f"({res['per_trial_s']:.1f} s per trial, gap {gap}), {res['group_starts']} worker-group "
                      f"start(s), best {res['best']}", flush=True)  # fmt: skip
                parts = ", ".join(f"{k} +{v:.1f} s" for k, v in res["parts"].items())
                print(f"  a gap, from the last step row of one trial (medians): {parts}", flush=True)
    load1 = os.getloadavg()
    print(f"machine load (1/5/15 min) before {load0[0]:.2f}/{load0[1]:.2f}/{load0[2]:.2f}, "
          f"after {load1[0]:.2f}/{load1[1]:.2f}/{load1[2]:.2f}; {os.cpu_count()} CPUs")  # fmt: skip
    print(f"{'mode':6s} {'wall':>8s} {'per trial':>10s} {'gap':>7s} {'starts':>7s}  best")
    for mode in ("warm", "cold"):
        mine = [o for o in out if o["mode"] == mode]
        if not mine:
            continue
        gaps = [o["gap_s"] for o in mine if o["gap_s"] is not None]
        gap = f"{statistics.median(gaps):.1f} s" if gaps else "-"
        wall = statistics.median(o["wall_s"] for o in mine)
        per = statistics.median(o["per_trial_s"] for o in mine)
        starts = statistics.median(o["group_starts"] for o in mine)
        print(f"{mode:6s} {wall:7.0f}s {per:9.1f}s {gap:>7s} {starts:7.0f}  {', '.join(o['best'] for o in mine)}")
    ok = all(o["status"] == "SUCCEEDED" for o in out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

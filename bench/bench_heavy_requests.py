"""Heavy requests against a real service (issue 20, "bounded work"): the CPU each costs, and what four of them at
once do to everybody else's latency.

Starts the service (``start_scheduler=False``, auth off, no rate limit, SQLite in a throw-away data directory) in a
subprocess on 127.0.0.1 with a few runs stored, then:

1. each of the audit's heavy requests alone, ``--repeat`` times: its answer and the service process's CPU time it
   cost (user + system time of the service process before and after, nothing else in flight);
2. ``GET /v1/runs`` ``--gets`` times from one client with nothing else running (idle), then again while four
   connections of another client process send the four heavy requests in a loop, one each, so that four are in
   flight all the time (loaded); p50/p99 of both, side by side, and their ratio (the issue's bar: loaded p99
   within 2x of idle). A control column runs four ordinary ``POST /v1/plans`` loops instead: what four busy
   clients cost whatever they send.
3. the same idle and heavy phases on a second service with reads-first off (no write lane, no read priority:
   ``service/app/overload.py``), to show what it buys.

    python bench/bench_heavy_requests.py                 # 300 GETs per phase, each heavy request 20 times alone
    python bench/bench_heavy_requests.py --gets 100 --repeat 5

Figures only (no pass/fail): they depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from _service import api_service

ROOT = Path(__file__).resolve().parent.parent

SPEC = {
    "name": "bench-heavy",
    "layout": {"dp": 2},
    "batch": {"global_batch_size": 8, "micro_batch_size": 2},
    "train": {"steps": 10},
}
JSON = {"Content-Type": "application/json"}

# (name, path, body bytes, content type): the audit's requests (issue 20, items 3-5)
HEAVY: list[tuple[str, str, bytes, str]] = [
    (
        "huge-cluster plan",
        "/v1/plans",
        json.dumps(
            {
                "model": {"name": "gpt", "preset": "7b"},
                "cluster": {"gpus_per_node": 1024, "nodes": 100000},
                "global_batch_size": 10000000,
                "top_k": 1000,
            }
        ).encode(),
        "application/json",
    ),
    ("deep YAML (30k '[')", "/v1/runs", ("[" * 30000 + "]" * 30000).encode(), "application/yaml"),
    (
        "4,000-digit integer",
        "/v1/runs",
        json.dumps({**SPEC, "model": {"args": {"x": int("1" + "0" * 4000)}}}).encode(),
        "application/json",
    ),
    (
        "lone surrogates",
        "/v1/plans",
        json.dumps(
            {
                "model": {"name": "gpt", "preset": "\ud800", "args": {"\ud800": "\udfff"}},
                "cluster": {"device": "\ud800", "gpus_per_node": 8, "nodes": 1},
                "global_batch_size": 64,
            }
        ).encode(),
        "application/json",
    ),
]


# the control: an ordinary plan request (a real, small search), four at once instead of the heavy ones
LIGHT = [
    (
        "ordinary plan",
        "/v1/plans",
        json.dumps(
            {
                "model": {"name": "gpt", "preset": "tiny"},
                "cluster": {"gpus_per_node": 8, "nodes": 1},
                "global_batch_size": 64,
            }
        ).encode(),
        "application/json",
    )
] * 4


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (its threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# reads-first off: writes share the general slots and start at once (service/app/overload.py)
OFF = {
    "MESHRUN_MAX_CONCURRENT_WRITES": "1000",
    "MESHRUN_MAX_CONCURRENT_REQUESTS": "1000",
    "MESHRUN_READ_PRIORITY_MS": "0",
}


@contextmanager
def _service(extra_env: dict[str, str] | None = None) -> Iterator[tuple[str, int]]:
    data_dir = tempfile.mkdtemp(prefix="meshrun-bench-heavy-")
    with api_service(data_dir=data_dir, quiet=True, extra_env=extra_env) as (base, proc):
        yield base, proc.pid


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def heavy_alone(base: str, pid: int, repeat: int) -> None:
    print(f"{'heavy request (alone)':<24} {'status':>8} {'code':<16} {'wall ms':>9} {'CPU ms (mean)':>15}")
    with httpx.Client(base_url=base, timeout=300) as http:
        for name, path, body, ctype in HEAVY:
            walls, cpus, answers = [], [], Counter()
            for _ in range(repeat):
                c0, t0 = _cpu_s(pid), time.perf_counter()
                r = http.post(path, content=body, headers={"Content-Type": ctype})
                walls.append(time.perf_counter() - t0)
                time.sleep(0.05)  # let the worker thread account its last tick
                cpus.append(_cpu_s(pid) - c0)
                try:
                    code = r.json()["error"]["code"]
                except (ValueError, KeyError, TypeError):
                    code = "-"
                answers[(r.status_code, code)] += 1
            (status, code), _ = answers.most_common(1)[0]
            print(
                f"{name:<24} {status:>8} {code:<16} {statistics.median(walls) * 1e3:>9.1f} "
                f"{sum(cpus) / repeat * 1e3:>15.1f}  (wall: median of {repeat}; CPU: total / {repeat}, "
                f"the clock ticks {1e3 / os.sysconf('SC_CLK_TCK'):.0f} ms)"
            )


async def _gets(http: httpx.AsyncClient, n: int) -> tuple[list[float], Counter]:
    lat, statuses = [], Counter()
    for _ in range(n):
        t0 = time.perf_counter()
        r = await http.get("/v1/runs", params={"limit": 20})
        lat.append(time.perf_counter() - t0)
        statuses[r.status_code] += 1
    return lat, statuses


async def _heavy_loop(
    http: httpx.AsyncClient, req: tuple[str, str, bytes, str], stop: asyncio.Event, sent: Counter
) -> None:
    name, path, body, ctype = req
    while not stop.is_set():
        r = await http.post(path, content=body, headers={"Content-Type": ctype})
        sent[(name, r.status_code)] += 1


def _background(base: str, background: list[tuple[str, str, bytes, str]], stop, ready, out) -> None:
    """A client process of its own: each of ``background`` sent in a loop (one connection each) until ``stop``."""

    async def run() -> Counter:
        sent: Counter = Counter()
        done = asyncio.Event()
        clients = [httpx.AsyncClient(base_url=base, timeout=300) for _ in background]
        loops = [asyncio.create_task(_heavy_loop(c, h, done, sent)) for c, h in zip(clients, background, strict=True)]
        await asyncio.sleep(0.5)  # in flight
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.05)
        done.set()
        await asyncio.gather(*loops)
        for c in clients:
            await c.aclose()
        return sent

    out.put(dict(asyncio.run(run())))


async def _phase(base: str, gets: int, background: list[tuple[str, str, bytes, str]]) -> tuple[list, Counter, Counter]:
    """``gets`` GETs from one client while each of ``background`` is sent in a loop, four at once, by another client
    process (its CPU is a client's, not the service's: on one process the GETs would also wait for the client's own
    event loop)."""
    ctx = mp.get_context("spawn")
    stop, ready, out = ctx.Event(), ctx.Event(), ctx.Queue()
    proc = None
    if background:
        proc = ctx.Process(target=_background, args=(base, background, stop, ready, out))
        proc.start()
        while not ready.is_set():
            await asyncio.sleep(0.05)
    async with httpx.AsyncClient(base_url=base, timeout=300) as http:
        lat, statuses = await _gets(http, gets)
    sent: Counter = Counter()
    if proc is not None:
        stop.set()
        sent = Counter(out.get(timeout=60))
        proc.join(timeout=30)
    return lat, statuses, sent


async def _phases(base: str, gets: int, *, control: bool) -> dict[str, tuple[list, Counter, Counter]]:
    async with httpx.AsyncClient(base_url=base, timeout=300) as http:
        for _ in range(5):  # warm up
            await http.get("/v1/runs")
    out = {"idle": await _phase(base, gets, [])}
    if control:
        out["4 ordinary plans"] = await _phase(base, gets, LIGHT)
    out["4 heavy at once"] = await _phase(base, gets, HEAVY)
    return out


def _table(title: str, phases: dict[str, tuple[list, Counter, Counter]]) -> None:
    print()
    print(f"{title:<42}" + "".join(f" {name:>17}" for name in phases))
    for label, q in (("p50 ms", 0.50), ("p99 ms", 0.99), ("max ms", 1.0)):
        print(f"  {label:<40}" + "".join(f" {_pct(lat, q) * 1e3:>17.1f}" for lat, _, _ in phases.values()))
    print(f"  {'statuses':<40}" + "".join(f" {dict(st)!s:>17}" for _, st, _ in phases.values()))
    p99 = _pct(phases["idle"][0], 0.99)
    print(
        "  p99 / idle p99: "
        + ", ".join(
            f"{_pct(lat, 0.99) / p99:.2f}x with {name}" for name, (lat, _, _) in phases.items() if name != "idle"
        )
        + " (the issue's bar for the heavy ones: within 2x)"
    )
    for name, (_, _, sent) in phases.items():
        if sent:
            answered = sum(sent.values())
            print(
                f"  {name}: {answered} answered meanwhile ("
                + ", ".join(f"{n} -> {st}: {k}" for (n, st), k in sorted(sent.items()))
                + ")"
            )


def _store_runs(base: str, runs: int) -> None:
    with httpx.Client(base_url=base, timeout=60) as http:
        for i in range(runs):
            r = http.post("/v1/runs", json={**SPEC, "name": f"bench-heavy-{i}"})
            assert r.status_code in (200, 201), r.text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gets", type=int, default=300, help="GET /v1/runs per phase")
    ap.add_argument("--repeat", type=int, default=20, help="times each heavy request is sent alone")
    ap.add_argument("--runs", type=int, default=20, help="runs stored before measuring")
    args = ap.parse_args()
    with _service() as (base, pid):
        _store_runs(base, args.runs)
        print(f"service pid {pid} at {base}, {args.runs} runs stored, {os.cpu_count()} cores\n")
        heavy_alone(base, pid, args.repeat)
        phases = asyncio.run(_phases(base, args.gets, control=True))
    # the same service without the write lane and read priority: what reads-first buys, side by side
    with _service(OFF) as (base, _):
        _store_runs(base, args.runs)
        off = asyncio.run(_phases(base, args.gets, control=False))
    _table(f"GET /v1/runs ({args.gets} requests, one client)", phases)
    _table("the same, reads-first off", off)
    return 0


if __name__ == "__main__":
    sys.exit(main())

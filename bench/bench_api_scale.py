"""The API at scale on the default SQLite: latency of reading a run with a long history, of its chart series, and of
the list endpoints as the history grows.

Seeds a throw-away SQLite database (a run with ``--rows`` metric rows, 100,000 by default, plus events and
checkpoints), starts the service on 127.0.0.1 (no scheduler, auth off, no rate limit) in a subprocess and prints
p50/p99 latencies:

- ``GET /v1/runs/{id}`` with ``--clients`` concurrent clients (50), each polling every ``--interval-s`` (1 s, what
  the SDK's ``wait()`` does), for ``--duration-s``; then the same clients with no pause at all (closed loop: the
  service's throughput bound on this machine);
- ``GET /v1/runs/{id}/metrics?points=500`` (the console's chart series) and a 1,000-row page, one client;
- ``GET /v1/runs``, ``/events``, ``/checkpoints``, ``/metrics`` first pages with a small history, then again after
  ``--more-runs`` runs (and as many events) were added: a list whose cost does not grow with history keeps its
  latency.

    python bench/bench_api_scale.py                    # about 1-2 minutes on 2 cores
    python bench/bench_api_scale.py --rows 20000 --duration-s 5 --more-runs 2000

Targets (issue 21): run p99 < 50 ms at 50 clients, a 500-point series < 100 ms, lists independent of history.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
from _service import api_service

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SPEC = {
    "name": "bench-scale",
    "layout": {"dp": 2},
    "batch": {"global_batch_size": 8, "micro_batch_size": 2},
    "train": {"steps": 100_000},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _fmt(name: str, lat_s: list[float], extra: str = "") -> str:
    return (
        f"{name:<52} n={len(lat_s):>6}  p50 {statistics.median(lat_s) * 1000:7.1f} ms  "
        f"p99 {_pct(lat_s, 0.99) * 1000:7.1f} ms{extra}"
    )


@contextmanager
def _service(database_url: str, port: int, data_dir: str):
    with api_service(data_dir=data_dir, database_url=database_url, port=port, timeout_s=60) as (base, _proc):
        yield base


def _seed(database_url: str, rows: int) -> str:
    """One run with ``rows`` metric rows, 200 events and 100 checkpoints; returns its id."""
    from service import store
    from service.store import migrate
    from service.store.db import make_engine, make_sessionmaker

    migrate.upgrade(database_url)
    engine = make_engine(database_url)
    factory = make_sessionmaker(engine)
    rng = random.Random(0)
    with factory.begin() as s:
        run, _ = store.create_run(s, spec=SPEC, plan=None, name="bench-scale")
        rid = run.id
        for i in range(200):
            store.add_event(s, run_id=rid, kind="note", reason=f"event {i}")
        for i in range(100):
            store.add_checkpoint(s, run_id=rid, attempt=1, step=(i + 1) * 1000, path=f"/ck/{i}")
    t0 = time.perf_counter()
    for lo in range(1, rows + 1, 2000):
        with factory.begin() as s:
            store.add_metrics(
                s,
                run_id=rid,
                attempt=1,
                rows=[
                    {
                        "step": i,
                        "loss": 5.0 / (1 + i / 5000) + rng.uniform(-0.02, 0.02),
                        "tokens_per_s": 9000.0,
                        "step_time_s": 0.2,
                        "mfu": 0.4,
                        "peak_memory_bytes": 2**30,
                        "comm_fraction": 0.1,
                    }
                    for i in range(lo, min(rows, lo + 1999) + 1)
                ],
            )
    print(f"seeded run {rid}: {rows} metric rows in {time.perf_counter() - t0:.1f} s (summary kept on write)")
    engine.dispose()
    return rid


def _grow(database_url: str, runs: int) -> None:
    """Add ``runs`` queued runs (the history the lists must not pay for)."""
    from service import store
    from service.store.db import make_engine, make_sessionmaker

    engine = make_engine(database_url)
    factory = make_sessionmaker(engine)
    for lo in range(0, runs, 500):
        with factory.begin() as s:
            for _ in range(min(500, runs - lo)):
                store.create_run(s, spec=SPEC, plan=None, name="bench-history")
    engine.dispose()


def _grow_events(database_url: str, run_id: str, events: int) -> None:
    from service import store
    from service.store.db import make_engine, make_sessionmaker

    engine = make_engine(database_url)
    factory = make_sessionmaker(engine)
    for lo in range(0, events, 1000):
        with factory.begin() as s:
            for i in range(min(1000, events - lo)):
                store.add_event(s, run_id=run_id, kind="note", reason=f"history {lo + i}")
    engine.dispose()


async def _poll(base: str, path: str, clients: int, duration_s: float, interval_s: float) -> tuple[list[float], int]:
    lat: list[float] = []
    errors = 0
    deadline = time.monotonic() + duration_s
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)

    async def one(i: int) -> None:
        nonlocal errors
        async with httpx.AsyncClient(base_url=base, timeout=30, limits=limits) as http:
            if interval_s:
                await asyncio.sleep(interval_s * i / clients)  # spread the clients over one interval
            while time.monotonic() < deadline:
                t0 = time.perf_counter()
                try:
                    r = await http.get(path)
                    ok = r.status_code == 200
                except httpx.HTTPError:
                    ok = False
                dt = time.perf_counter() - t0
                if ok:
                    lat.append(dt)
                else:
                    errors += 1
                if interval_s:
                    await asyncio.sleep(max(0.0, interval_s - dt))

    await asyncio.gather(*(one(i) for i in range(clients)))
    return lat, errors


def _server_histogram(base: str, route: str) -> dict[float, float]:
    """Cumulative counts per latency bucket (le, seconds) of GET ``route``, from the service's own /metrics."""
    text = httpx.get(f"{base}/metrics", timeout=30).text
    out: dict[float, float] = {}
    for line in text.splitlines():
        if line.startswith("meshrun_http_request_duration_seconds_bucket{") and f'route="{route}"' in line:
            if 'method="GET"' in line:
                le = line.split('le="', 1)[1].split('"', 1)[0]
                out[float("inf") if le == "+Inf" else float(le)] = float(line.rsplit(" ", 1)[1])
    return out


def _server_shares(before: dict[float, float], after: dict[float, float]) -> str:
    total = after.get(float("inf"), 0) - before.get(float("inf"), 0)
    if not total:
        return "no server-side figures"
    parts = []
    for le in (0.01, 0.025, 0.05, 0.1):
        n = after.get(le, 0) - before.get(le, 0)
        parts.append(f"{100 * n / total:.1f}% <= {le * 1000:.0f} ms")
    return "inside the service: " + ", ".join(parts)


def _serial(base: str, path: str, n: int) -> list[float]:
    lat = []
    with httpx.Client(base_url=base, timeout=30) as http:
        http.get(path).raise_for_status()  # warm
        for _ in range(n):
            t0 = time.perf_counter()
            http.get(path).raise_for_status()
            lat.append(time.perf_counter() - t0)
    return lat


def _lists(base: str, rid: str, n: int) -> dict[str, list[float]]:
    paths = {
        "GET /v1/runs?limit=50": "/v1/runs?limit=50",
        "GET /v1/runs?limit=50&status=QUEUED": "/v1/runs?limit=50&status=QUEUED",
        "GET /v1/runs/{id}/events?limit=100": f"/v1/runs/{rid}/events?limit=100",
        "GET /v1/runs/{id}/checkpoints?limit=100": f"/v1/runs/{rid}/checkpoints?limit=100",
        "GET /v1/runs/{id}/metrics?limit=1000 (a page)": f"/v1/runs/{rid}/metrics?limit=1000",
    }
    return {name: _serial(base, p, n) for name, p in paths.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--interval-s", type=float, default=1.0)
    ap.add_argument("--duration-s", type=float, default=15.0)
    ap.add_argument("--more-runs", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=30, help="Requests per single-client measurement.")
    args = ap.parse_args(argv)
    if not 0 < args.duration_s <= 300 or not 1 <= args.clients <= 200:
        ap.error("--duration-s must be in (0, 300] and --clients in [1, 200]")

    with tempfile.TemporaryDirectory(prefix="meshrun-bench-scale-") as tmp:
        url = f"sqlite:///{tmp}/meshrun.db"
        rid = _seed(url, args.rows)
        _grow(url, 59)  # full first pages (50 runs) before and after the history grows
        print(
            f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; SQLite; service and clients here"
        )
        with _service(url, _free_port(), tmp) as base:
            path = f"/v1/runs/{rid}"
            route = "/v1/runs/{run_id}"
            before = _server_histogram(base, route)
            lat, errors = asyncio.run(_poll(base, path, args.clients, args.duration_s, args.interval_s))
            after = _server_histogram(base, route)
            print(
                _fmt(
                    f"GET /v1/runs/{{id}}, {args.clients} clients every {args.interval_s:g} s",
                    lat,
                    f"  ({len(lat) / args.duration_s:.0f} req/s, {errors} errors)",
                )
            )
            print(f"{'':<52} {_server_shares(before, after)}")
            lat, errors = asyncio.run(_poll(base, path, args.clients, min(args.duration_s, 10), 0.0))
            print(
                _fmt(
                    f"GET /v1/runs/{{id}}, {args.clients} clients, closed loop",
                    lat,
                    f"  ({len(lat) / min(args.duration_s, 10):.0f} req/s, {errors} errors)",
                )
            )
            print(_fmt("GET /v1/runs/{id}, 1 client", _serial(base, path, args.repeats)))
            for points in (500, 2000):
                lat = _serial(base, f"/v1/runs/{rid}/metrics?points={points}", args.repeats)
                print(_fmt(f"GET /v1/runs/{{id}}/metrics?points={points} ({args.rows} rows)", lat))
            small = _lists(base, rid, args.repeats)
        _grow(url, args.more_runs)
        _grow_events(url, rid, args.more_runs)
        with _service(url, _free_port(), tmp) as base:
            big = _lists(base, rid, args.repeats)
        print(f"lists with 60 runs, then with {args.more_runs + 60} runs (p50 / p99 in ms):")
        for name in small:
            a, b = small[name], big[name]
            print(
                f"  {name:<50} {statistics.median(a) * 1000:6.1f} / {_pct(a, 0.99) * 1000:6.1f}   ->   "
                f"{statistics.median(b) * 1000:6.1f} / {_pct(b, 0.99) * 1000:6.1f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

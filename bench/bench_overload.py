"""Overload benchmark (issue 34 item 5): many concurrent clients against the API-only service on SQLite and on
PostgreSQL, loopback only, bounded in time. Does overload answer with waiting, not errors?

Starts the service (``bench/_service.py``: no scheduler, auth off, no rate limit) once per database, seeds a few
runs, then runs ``--clients`` clients (default 200, each on its own keep-alive connection) for ``--duration-s``
seconds (default 60). Client ``i`` sends one kind of request in a loop, round-robin over the kinds: ``GET /v1/runs``,
``POST /v1/runs`` without and with an ``Idempotency-Key``, ``POST /v1/plans``. After a 503 it waits ``Retry-After``
as the SDK does (``api/sdk``), then sends the next request. Prints, per database and request kind: count, p50, p99
and max latency, the 503 share, dropped connections (transport errors: reset, closed), other errors, 503s without
``Retry-After``, and the longest wait against the documented queue bound (``request_queue_timeout_s``: a request
starts within it or is answered 503; ``service/app/overload.py``). Latency = send to full answer; an answered
request's latency is its queue wait plus its own work, so only a 503's latency is held against the bound.

PostgreSQL: a throw-away database on 127.0.0.1:5432 (created from the ``test`` database and dropped afterwards), so
the test suite's database is not touched.

    python bench/bench_overload.py                               # 200 clients, 60 s, SQLite then PostgreSQL
    python bench/bench_overload.py --clients 50 --duration-s 15 --db sqlite
    python bench/bench_overload.py --setting MESHRUN_MAX_CONCURRENT_REQUESTS=4

Figures only (exit 1 only when a connection was dropped or a 503 lacked Retry-After); they depend on the machine
and its load.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import re
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from _service import api_service

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PG_ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
SPEC = {
    "name": "bench-overload",
    "layout": {"dp": 2},
    "batch": {"global_batch_size": 8, "micro_batch_size": 2},
    "train": {"steps": 10},
}
PLAN = {"model": {"name": "gpt", "preset": "7b"}, "cluster": {"device": "H100", "nodes": 1}, "global_batch_size": 64}
KINDS = ("GET /v1/runs", "POST /v1/runs", "POST /v1/runs +key", "POST /v1/plans")


@dataclass
class KindStats:
    latencies_s: list[float] = field(default_factory=list)  # every answered request
    busy_latencies_s: list[float] = field(default_factory=list)  # the 503s
    busy_held_s: list[float] = field(default_factory=list)  # the 503s, as the service measured them (Server-Timing)
    ok: int = 0
    busy: int = 0
    busy_without_retry_after: int = 0
    other: dict[int, int] = field(default_factory=dict)
    dropped: int = 0


@contextmanager
def _postgres() -> Iterator[str]:
    import psycopg

    name = f"meshrun_bench_overload_{os.getpid()}_{secrets.token_hex(3)}"
    dsn = PG_ADMIN_URL.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + name
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def _send(http: httpx.AsyncClient, kind: str) -> httpx.Response:
    if kind == "GET /v1/runs":
        return await http.get("/v1/runs", params={"limit": 20})
    if kind == "POST /v1/runs":
        return await http.post("/v1/runs", json=SPEC)
    if kind == "POST /v1/runs +key":
        return await http.post("/v1/runs", json=SPEC, headers={"Idempotency-Key": f"ov-{secrets.token_hex(8)}"})
    return await http.post("/v1/plans", json=PLAN)


async def _client(base: str, kind: str, deadline: float, stats: KindStats, timeout_s: float) -> None:
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    async with httpx.AsyncClient(base_url=base, timeout=timeout_s, limits=limits) as http:
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            try:
                r = await _send(http, kind)
            except httpx.TransportError:
                stats.dropped += 1
                await asyncio.sleep(0.1)
                continue
            dt = time.perf_counter() - t0
            stats.latencies_s.append(dt)
            if 200 <= r.status_code < 300:
                stats.ok += 1
            elif r.status_code == 503:
                stats.busy += 1
                stats.busy_latencies_s.append(dt)
                held = re.search(r"queue;dur=(\d+)", r.headers.get("Server-Timing", ""))
                if held:
                    stats.busy_held_s.append(int(held.group(1)) / 1000)
                retry_after = r.headers.get("Retry-After")
                if not retry_after:
                    stats.busy_without_retry_after += 1
                await asyncio.sleep(float(retry_after or 1))  # what the SDK does
            else:
                stats.other[r.status_code] = stats.other.get(r.status_code, 0) + 1


def _pct(xs: list[float], q: int) -> float:
    if len(xs) < 2:
        return xs[0] if xs else float("nan")
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1]


async def _load(base: str, kinds: list[str], duration_s: float, bound_s: float) -> dict[str, KindStats]:
    stats = {k: KindStats() for k in KINDS}
    deadline = time.monotonic() + duration_s
    timeout_s = bound_s + 120  # the client never gives up before the server's bound (that would count as dropped)
    await asyncio.gather(*(_client(base, k, deadline, stats[k], timeout_s) for k in kinds))
    return stats


def _load_in_process(args: tuple[str, list[str], float, float]) -> dict[str, KindStats]:
    return asyncio.run(_load(*args))


def _load_spread(base: str, clients: int, duration_s: float, bound_s: float) -> dict[str, KindStats]:
    """The clients over several processes (at most 50 each), so that the clients' own event loop adds little to
    the latencies they measure."""
    kinds = [KINDS[i % len(KINDS)] for i in range(clients)]
    procs = max(1, min(8, -(-clients // 50)))
    shares = [kinds[i::procs] for i in range(procs)]
    with mp.get_context("spawn").Pool(procs) as pool:
        parts = pool.map(_load_in_process, [(base, share, duration_s, bound_s) for share in shares])
    total = {k: KindStats() for k in KINDS}
    for part in parts:
        for k, s in part.items():
            t = total[k]
            t.latencies_s += s.latencies_s
            t.busy_latencies_s += s.busy_latencies_s
            t.busy_held_s += s.busy_held_s
            t.ok, t.busy, t.dropped = t.ok + s.ok, t.busy + s.busy, t.dropped + s.dropped
            t.busy_without_retry_after += s.busy_without_retry_after
            for code, n in s.other.items():
                t.other[code] = t.other.get(code, 0) + n
    return total


def _report(db: str, stats: dict[str, KindStats], bound_s: float, wall_s: float) -> bool:
    print(f"\n== {db}: {wall_s:.0f} s; documented queue bound request_queue_timeout_s = {bound_s:g} s")
    print(
        f"{'request':<20} {'n':>6} {'p50 s':>8} {'p99 s':>8} {'max s':>8} {'503 share':>10} {'503 max s':>10} "
        f"{'dropped':>8} {'no R-A':>7} {'other':>10}"
    )
    total = busy = dropped = no_ra = 0
    worst_busy = worst_held = 0.0
    for kind, s in stats.items():
        n = len(s.latencies_s)
        total += n
        busy += s.busy
        dropped += s.dropped
        no_ra += s.busy_without_retry_after
        bmax = max(s.busy_latencies_s, default=0.0)
        worst_busy = max(worst_busy, bmax)
        worst_held = max([worst_held, *s.busy_held_s])
        print(
            f"{kind:<20} {n:>6} {_pct(s.latencies_s, 50):>8.3f} {_pct(s.latencies_s, 99):>8.3f} "
            f"{max(s.latencies_s, default=float('nan')):>8.3f} {(s.busy / n if n else 0):>10.1%} {bmax:>10.3f} "
            f"{s.dropped:>8} {s.busy_without_retry_after:>7} {dict(s.other) or '-'!s:>10}"
        )
    print(
        f"all: {total} answered, 503 share {busy / total if total else 0:.1%}, dropped connections {dropped}, "
        f"503 without Retry-After {no_ra}; the longest wait answered 503: {worst_busy:.2f} s "
        f"(bound {bound_s:g} s: {'within' if worst_busy <= bound_s else f'over by {worst_busy - bound_s:.2f} s'}; "
        "the clock runs from the client's send, so a busy event loop's lag on either side counts)"
    )
    print(
        f"as the service measured it (Server-Timing, from the request reaching its gate to the 503): longest "
        f"{worst_held:.2f} s ({'within' if worst_held <= bound_s + 1 else 'over'} the bound); the rest of the "
        "client's wait was spent before the service read the request or after it answered"
    )
    return dropped == 0 and no_ra == 0


def _seed(base: str) -> None:
    with httpx.Client(base_url=base, timeout=60) as http:
        for _ in range(5):
            http.post("/v1/runs", json=SPEC).raise_for_status()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--duration-s", type=float, default=60.0)
    ap.add_argument("--db", choices=("both", "sqlite", "postgres"), default="both")
    ap.add_argument("--queue-timeout-s", type=float, default=30.0, help="the service's request_queue_timeout_s")
    ap.add_argument(
        "--setting", action="append", default=[], metavar="NAME=VALUE", help="another MESHRUN_* setting, repeatable"
    )
    args = ap.parse_args()
    env = {"MESHRUN_REQUEST_QUEUE_TIMEOUT_S": str(args.queue_timeout_s)}
    env.update(kv.split("=", 1) for kv in args.setting)
    print(
        f"bench_overload: {args.clients} clients for {args.duration_s:g} s, loopback; cpus={os.cpu_count()}, "
        f"load average {os.getloadavg()[0]:.1f} (other processes on the machine count)"
    )
    good = True
    for db in ("sqlite", "postgres"):
        if args.db not in ("both", db):
            continue
        with tempfile.TemporaryDirectory(prefix="meshrun-bench-overload-") as tmp:
            with _postgres() if db == "postgres" else _null() as url:
                with api_service(data_dir=tmp, database_url=url, quiet=True, extra_env=env) as (base, _proc):
                    _seed(base)
                    t0 = time.monotonic()
                    stats = _load_spread(base, args.clients, args.duration_s, args.queue_timeout_s)
                    good &= _report(db, stats, args.queue_timeout_s, time.monotonic() - t0)
    return 0 if good else 1


@contextmanager
def _null() -> Iterator[None]:
    yield None


if __name__ == "__main__":
    sys.exit(main())

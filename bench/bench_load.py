"""Load benchmark of the meshrun API (loopback only, bounded in time) against PostgreSQL.

Starts the service (``start_scheduler=False``, auth off, no rate limit) in a subprocess on 127.0.0.1, runs many
concurrent httpx clients for ``--duration-s`` seconds that submit runs (each with an Idempotency-Key; a share of
them retried with the same key, as a client would after a timeout) and read runs (get, list, events), then prints
requests/s, p50/p99 latency and errors, and verifies in the database that every acknowledged submission is
stored exactly once (one row per idempotency key, every acknowledged id present, nothing extra).

    python bench/bench_load.py                      # 20 s, 32 clients, a throw-away database on 127.0.0.1:5432
    python bench/bench_load.py --duration-s 5 --clients 8 --database-url postgresql+psycopg://postgres@127.0.0.1/x

Exit status 0 when the verification passes (and no request failed with a 5xx or a transport error).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import secrets
import statistics
import sys
import tempfile
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from _service import api_service

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PG_ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
SPEC = {"name": "bench", "layout": {"dp": 2}, "batch": {"global_batch_size": 8, "micro_batch_size": 2},
        "train": {"steps": 10}}


@dataclass
class Stats:
    latencies_s: list[float] = field(default_factory=list)
    statuses: Counter = field(default_factory=Counter)
    transport_errors: int = 0
    acked: dict[str, str] = field(default_factory=dict)  # idempotency key -> run id
    unacked_keys: set[str] = field(default_factory=set)  # sent, no answer (may or may not be stored)
    replays: int = 0


@contextmanager
def _database(url: str | None):
    if url:
        yield url
        return
    import psycopg
    name = f"meshrun_bench_{os.getpid()}_{secrets.token_hex(3)}"
    dsn = PG_ADMIN_URL.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + name
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def _client(base: str, deadline: float, stats: Stats, rng: random.Random) -> None:
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        mine: list[str] = []
        while time.monotonic() < deadline:
            roll = rng.random()
            t0 = time.perf_counter()
            key = None
            try:
                if roll < 0.4 or not mine:
                    retry = bool(stats.acked) and rng.random() < 0.2
                    key = rng.choice(list(stats.acked)) if retry else f"bench-{secrets.token_hex(8)}"
                    known = stats.acked.get(key)
                    if known is None:
                        stats.unacked_keys.add(key)
                    r = await http.post("/v1/runs", json=SPEC, headers={"Idempotency-Key": key})
                    if r.status_code in (200, 201):
                        rid = r.json()["id"]
                        if known is not None:
                            stats.replays += 1
                            if known != rid:
                                stats.statuses["replay-mismatch"] += 1
                        else:
                            stats.acked[key] = rid
                            stats.unacked_keys.discard(key)
                            mine.append(rid)
                elif roll < 0.75:
                    r = await http.get(f"/v1/runs/{rng.choice(mine)}")
                elif roll < 0.9:
                    r = await http.get("/v1/runs", params={"limit": 20})
                else:
                    r = await http.get(f"/v1/runs/{rng.choice(mine)}/events")
                stats.statuses[r.status_code] += 1
            except httpx.HTTPError:
                stats.transport_errors += 1
                continue
            stats.latencies_s.append(time.perf_counter() - t0)


def _verify(database_url: str, stats: Stats) -> list[str]:
    from sqlalchemy import func, select

    from service.store.db import make_engine
    from service.store.models import Run
    problems = []
    engine = make_engine(database_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(select(Run.id, Run.idempotency_key)).all()
            dup_keys = conn.execute(select(Run.idempotency_key, func.count()).group_by(Run.idempotency_key)
                                    .having(func.count() > 1)).all()
    finally:
        engine.dispose()
    by_key = {k: rid for rid, k in rows}
    if dup_keys:
        problems.append(f"{len(dup_keys)} idempotency keys stored more than once")
    missing = [k for k, rid in stats.acked.items() if by_key.get(k) != rid]
    if missing:
        problems.append(f"{len(missing)} acknowledged submissions are missing or stored under another id")
    extra = set(by_key) - set(stats.acked) - stats.unacked_keys
    if extra:
        problems.append(f"{len(extra)} stored runs were never submitted")
    print(f"database: {len(rows)} runs; {len(stats.acked)} acknowledged submissions, each stored exactly once: "
          f"{'yes' if not (missing or dup_keys) else 'NO'}; {len(stats.unacked_keys)} unanswered submissions "
          f"({len(set(by_key) & stats.unacked_keys)} of them stored)")
    return problems


async def _run_clients(base: str, clients: int, duration_s: float, seed: int) -> tuple[Stats, float]:
    stats = Stats()
    start = time.monotonic()
    deadline = start + duration_s
    await asyncio.gather(*(_client(base, deadline, stats, random.Random(seed + i)) for i in range(clients)))
    return stats, time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration-s", type=float, default=20.0)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--database-url", default=None, help="PostgreSQL URL (default: a throw-away database)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.duration_s <= 0 or args.duration_s > 600:
        ap.error("--duration-s must be in (0, 600]")

    with (
        _database(args.database_url) as db_url,
        api_service(data_dir=tempfile.mkdtemp(prefix="meshrun-bench-"), database_url=db_url, timeout_s=60) as (base, _),
    ):
        print(f"meshrun load benchmark: {args.clients} clients for {args.duration_s:.0f} s against {base} "
              f"(PostgreSQL)")
        stats, elapsed_s = asyncio.run(_run_clients(base, args.clients, args.duration_s, args.seed))
        problems = _verify(db_url, stats)

    n = len(stats.latencies_s)
    lat = sorted(stats.latencies_s)
    p50 = statistics.median(lat) if lat else float("nan")
    p99 = lat[min(n - 1, int(0.99 * n))] if lat else float("nan")
    errors_5xx = sum(c for s, c in stats.statuses.items() if isinstance(s, int) and s >= 500)
    errors_4xx = sum(c for s, c in stats.statuses.items() if isinstance(s, int) and 400 <= s < 500)
    print(f"requests: {n} in {elapsed_s:.1f} s = {n / elapsed_s:.1f} requests/s; latency p50 {p50 * 1000:.1f} ms, "
          f"p99 {p99 * 1000:.1f} ms")
    print(f"errors: {errors_5xx} 5xx, {errors_4xx} 4xx, {stats.transport_errors} transport, "
          f"{stats.statuses.get('replay-mismatch', 0)} idempotent replays with another id "
          f"({stats.replays} replays in all); statuses {dict(stats.statuses)}")
    if errors_5xx or stats.transport_errors or stats.statuses.get("replay-mismatch"):
        problems.append("requests failed")
    for p in problems:
        print(f"FAIL: {p}")
    print("OK" if not problems else "FAILED")
    return 0 if not problems else 1


if __name__ == "__main__":
    raise SystemExit(main())

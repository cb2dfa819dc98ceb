"""Concurrent HTTP submissions and cancels (threads through one app) on SQLite and PostgreSQL: every
acknowledged run is stored exactly once; retries with an Idempotency-Key never make a second run."""

from __future__ import annotations

import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from sqlalchemy import func, select

from service.store.models import Run, RunEvent

SPEC = {"name": "conc", "layout": {"dp": 2}, "batch": {"global_batch_size": 8, "micro_batch_size": 2}}
THREADS = 8


def _parallel(n, fn):
    barrier = threading.Barrier(n)

    def go(i):
        barrier.wait()
        return fn(i)

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(go, range(n)))


def test_concurrent_submissions_are_never_lost_or_duplicated(client):
    def submit(i):
        out = []
        for j in range(3):
            headers = {"Idempotency-Key": f"shared-{j}"} if i % 2 else {}  # odd threads retry 3 shared keys
            r = client.post("/v1/runs", json=SPEC, headers=headers)
            out.append((r.status_code, r.json().get("id"), bool(headers)))
        return out

    results = [x for chunk in _parallel(THREADS, submit) for x in chunk]
    assert {status for status, _, _ in results} <= {200, 201}, results
    keyed = {rid for status, rid, has_key in results if has_key}
    unkeyed = [rid for status, rid, has_key in results if not has_key]
    assert len(keyed) == 3  # one run per key, whatever the interleaving
    assert len(set(unkeyed)) == len(unkeyed) == (THREADS // 2) * 3
    assert Counter(s for s, _, k in results if k)[201] == 3  # exactly one "created" per key
    with client.app.state.session_factory() as s:
        stored = s.scalars(select(Run.id)).all()
    assert sorted(stored) == sorted(keyed | set(unkeyed))


def test_concurrent_cancels_have_one_winner(client):
    rid = client.post("/v1/runs", json=SPEC).json()["id"]
    codes = _parallel(THREADS, lambda i: client.post(f"/v1/runs/{rid}/cancel").status_code)
    assert sorted(codes) == [200] + [409] * (THREADS - 1), codes
    with client.app.state.session_factory() as s:
        n = s.scalar(select(func.count()).select_from(RunEvent).where(RunEvent.run_id == rid,
                                                                       RunEvent.to_status == "CANCELLED"))
    assert n == 1

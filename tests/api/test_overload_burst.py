"""Overload answers with waiting, not errors: a burst of concurrent clients (far more than the write lane) against a
real uvicorn server on loopback, mixing GET /v1/runs, POST /v1/runs with and without Idempotency-Key and POST
/v1/plans. Every response is 2xx or 503 with Retry-After, no connection is dropped, and nobody waits past the queue
bound without an answer. Not timed: the latencies are ``bench/bench_overload.py``'s business."""

from __future__ import annotations

import re
import socket
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import uvicorn

from service.app.overload import ANSWER_MARGIN

SPEC = {"name": "burst", "layout": {"dp": 2}, "batch": {"global_batch_size": 8, "micro_batch_size": 2}}
PLAN = {"model": {"name": "gpt", "preset": "7b"}, "cluster": {"device": "H100", "nodes": 1}, "global_batch_size": 64}
CLIENTS = 48
QUEUE_S = 3.0


@pytest.fixture
def server(tmp_path):
    from service.app.server import create_app
    from service.settings import Settings

    settings = Settings(
        start_scheduler=False,
        data_dir=tmp_path,
        database_url=f"sqlite:///{tmp_path}/burst.db",
        rate_limit_per_minute=0,
        max_concurrent_requests=8,
        max_concurrent_writes=1,
        request_queue_timeout_s=QUEUE_S,
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(
        uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning", timeout_keep_alive=60)
    )
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while not srv.started:
        assert time.monotonic() < deadline and t.is_alive(), "the server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    t.join(timeout=30)


def test_a_burst_larger_than_the_write_lane_gets_2xx_or_503_with_retry_after_and_no_drops(server):
    barrier = threading.Barrier(CLIENTS)

    def one(i: int) -> tuple[str, int | str, str | None, str | None]:
        kind = ("GET runs", "POST runs", "POST runs+key", "POST plans")[i % 4]
        with httpx.Client(base_url=server, timeout=QUEUE_S + 60) as c:
            barrier.wait()
            try:
                for _ in range(3):  # keep-alive reuse of each connection, back to back
                    if kind == "GET runs":
                        r = c.get("/v1/runs")
                    elif kind == "POST runs":
                        r = c.post("/v1/runs", json=SPEC)
                    elif kind == "POST runs+key":
                        r = c.post("/v1/runs", json=SPEC, headers={"Idempotency-Key": f"burst-{i}"})
                    else:
                        r = c.post("/v1/plans", json=PLAN)
                    if not (200 <= r.status_code < 300):
                        return kind, r.status_code, r.headers.get("Retry-After"), r.headers.get("Server-Timing")
                return kind, r.status_code, r.headers.get("Retry-After"), None
            except httpx.TransportError as e:  # a reset or closed connection: dropped
                return kind, f"dropped: {type(e).__name__}: {e}", None, None

    with ThreadPoolExecutor(CLIENTS) as pool:
        results = list(pool.map(one, range(CLIENTS)))
    dropped = [r for r in results if isinstance(r[1], str)]
    assert not dropped, dropped
    bad = [r for r in results if not (200 <= r[1] < 300 or (r[1] == 503 and r[2] and int(r[2]) >= 1))]
    assert not bad, bad
    # a 503 says how long the service held the request: its queue bound, measured from the gate
    for kind, status, _, timing in results:
        if status == 503:
            m = re.fullmatch(r'queue;dur=(\d+);desc="queued"', timing or "")
            assert m and int(m.group(1)) >= QUEUE_S * 1000 * (1 - ANSWER_MARGIN) - 5, (kind, timing)
    by_kind = Counter((kind, status) for kind, status, _, _ in results)
    assert any(200 <= s < 300 for (k, s) in by_kind if k == "POST plans"), by_kind  # the writes are served, in turn
    assert any(200 <= s < 300 for (k, s) in by_kind if k == "GET runs"), by_kind

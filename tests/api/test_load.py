"""Load without loss: 200 concurrent POST /v1/runs (100 Idempotency-Keys, each sent twice at once) on SQLite and
PostgreSQL: no 5xx, each key exactly one run, both answers of a key name the same run. Pool exhaustion and a busy
database are 503 with Retry-After (never 500), which the SDK honours."""

from __future__ import annotations

import threading
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor

import httpx
from sqlalchemy import select
from sqlalchemy.exc import TimeoutError as PoolTimeout

from api.sdk import Client
from service.store.models import Run

SPEC = {"name": "load", "layout": {"dp": 2}, "batch": {"global_batch_size": 8, "micro_batch_size": 2}}
CLIENTS = 200


def test_200_concurrent_submissions_lose_nothing(make_client):
    client = make_client(auth="on")
    from service.security import tokens as auth

    with client.app.state.session_factory.begin() as s:
        secret = auth.create_token(s, "p", "loader")
    headers = {"Authorization": f"Bearer {secret}"}  # token verification hits the database on every request too
    barrier = threading.Barrier(CLIENTS)

    def submit(i: int) -> tuple[str, int, str | None]:
        key = f"key-{i // 2}"  # every key twice: the second is the retry racing the first
        barrier.wait()
        r = client.post("/v1/runs", json=SPEC, headers={**headers, "Idempotency-Key": key})
        return key, r.status_code, r.json().get("id")

    with ThreadPoolExecutor(CLIENTS) as pool:
        results = list(pool.map(submit, range(CLIENTS)))
    statuses = Counter(status for _, status, _ in results)
    assert set(statuses) <= {200, 201}, statuses
    assert statuses[201] == CLIENTS // 2
    by_key: dict[str, set[str | None]] = defaultdict(set)
    for key, _, rid in results:
        by_key[key].add(rid)
    assert all(len(ids) == 1 for ids in by_key.values()) and len(by_key) == CLIENTS // 2
    with client.app.state.session_factory() as s:
        stored = Counter(s.scalars(select(Run.idempotency_key)).all())
    assert stored == Counter({key: 1 for key in by_key})


def test_overload_is_503_with_retry_after_and_the_sdk_waits_and_retries(make_client):
    client = make_client(max_concurrent_requests=1, request_queue_timeout_s=0.2)
    entered, release = threading.Event(), threading.Event()

    def block() -> dict:  # holds the only slot until released
        entered.set()
        assert release.wait(60)
        return {}

    def pool_exhausted() -> dict:
        raise PoolTimeout("QueuePool limit of size 5 overflow 10 reached, connection timed out")

    client.app.add_api_route("/v1/test-block", block)
    client.app.add_api_route("/v1/test-pool", pool_exhausted)
    holder = threading.Thread(target=client.get, args=("/v1/test-block",))
    holder.start()
    assert entered.wait(60)
    r = client.get("/v1/runs")
    assert r.status_code == 503 and r.headers["Retry-After"] == "1", r.text
    assert r.json()["error"]["code"] == "overloaded"
    assert client.get("/healthz").status_code == 200  # health is never queued

    seen = []

    def forward(req: httpx.Request) -> httpx.Response:
        r = client.request(req.method, req.url.path, content=req.content)
        seen.append(r.status_code)
        release.set()  # the slot frees while the SDK waits Retry-After
        holder.join(60)
        return httpx.Response(r.status_code, headers=r.headers, content=r.content)

    sdk = Client(base_url="http://testserver", transport=httpx.MockTransport(forward), max_retries=2)
    assert sdk.runs.list().total == 0
    assert seen == [503, 200]
    r = client.get("/v1/test-pool")
    assert r.status_code == 503 and r.headers["Retry-After"] == "1" and r.json()["error"]["code"] == "database_busy"

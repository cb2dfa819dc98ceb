"""Reads first (issue 20, bounded work): requests other than GET/HEAD/OPTIONS go through a narrow lane
(``max_concurrent_writes``) and wait, up to ``read_priority_ms``, while reads are in progress; reads never queue
behind writes. ``bench/bench_heavy_requests.py`` measures what this does to GET latency under looping heavy
requests; these tests pin the ordering on the real app."""

from __future__ import annotations

import threading
import time

import pytest


@pytest.fixture
def routes():
    """Test routes on the app: GET /v1/test-read and POST /v1/test-write, each blocking until released."""

    class Routes:
        def __init__(self):
            self.read_entered, self.read_release = threading.Event(), threading.Event()
            self.write_release = threading.Event()
            self.writes_started: list[float] = []
            self.lock = threading.Lock()

        def install(self, client):
            def read() -> dict:
                self.read_entered.set()
                assert self.read_release.wait(60)
                return {}

            def write() -> dict:
                with self.lock:
                    self.writes_started.append(time.monotonic())
                assert self.write_release.wait(60)
                return {}

            client.app.add_api_route("/v1/test-read", read, methods=["GET"])
            client.app.add_api_route("/v1/test-write", write, methods=["POST"])
            return client

    r = Routes()
    yield r
    r.read_release.set()
    r.write_release.set()


def _in_thread(fn, *args) -> tuple[threading.Thread, list]:
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True)
    t.start()
    return t, out


def _first_write_started(routes) -> None:
    deadline = time.monotonic() + 60
    while not routes.writes_started:
        assert time.monotonic() < deadline, "the first write never started"
        time.sleep(0.01)


def test_a_write_waits_while_a_read_is_in_progress(make_client, routes):
    client = routes.install(make_client(read_priority_ms=10_000))
    routes.write_release.set()
    reader, _ = _in_thread(client.get, "/v1/test-read")
    assert routes.read_entered.wait(60)
    writer, answer = _in_thread(client.post, "/v1/test-write")
    time.sleep(0.5)
    assert routes.writes_started == []  # held back: a read is in progress
    released = time.monotonic()
    routes.read_release.set()
    writer.join(60)
    reader.join(60)
    assert answer[0].status_code == 200
    assert len(routes.writes_started) == 1 and routes.writes_started[0] >= released


def test_the_wait_for_reads_is_bounded(make_client, routes):
    client = routes.install(make_client(read_priority_ms=200))
    routes.write_release.set()
    reader, _ = _in_thread(client.get, "/v1/test-read")
    assert routes.read_entered.wait(60)
    t0 = time.monotonic()
    r = client.post("/v1/test-write")  # the read is still in progress: the write goes ahead after 200 ms
    assert r.status_code == 200
    assert 0.15 <= routes.writes_started[0] - t0 < 10
    assert reader.is_alive()
    routes.read_release.set()
    reader.join(60)


def test_writes_queue_in_their_lane_and_reads_pass_them(make_client, routes):
    client = routes.install(make_client(max_concurrent_writes=1))
    first, a1 = _in_thread(client.post, "/v1/test-write")
    _first_write_started(routes)
    second, a2 = _in_thread(client.post, "/v1/test-write")
    time.sleep(0.5)
    assert len(routes.writes_started) == 1  # the second write waits for the lane
    r = client.get("/v1/runs")  # a read does not
    assert r.status_code == 200
    routes.write_release.set()
    first.join(60)
    second.join(60)
    assert [a[0].status_code for a in (a1, a2)] == [200, 200]
    assert len(routes.writes_started) == 2


def test_a_write_that_never_gets_the_lane_is_503_with_retry_after(make_client, routes):
    client = routes.install(make_client(max_concurrent_writes=1, request_queue_timeout_s=0.3))
    first, _ = _in_thread(client.post, "/v1/test-write")
    _first_write_started(routes)
    r = client.post("/v1/runs", json={"name": "x"})
    assert r.status_code == 503 and r.headers["Retry-After"] == "1", r.text
    assert r.json()["error"]["code"] == "overloaded"
    assert client.get("/v1/runs").status_code == 200
    routes.write_release.set()
    first.join(60)


def test_a_cancel_is_not_held_behind_a_write(make_client, routes):
    """A cancel may wait up to 20 s for its Ray Job; it must neither wait in the write lane nor block it."""
    client = routes.install(make_client(max_concurrent_writes=1))
    first, _ = _in_thread(client.post, "/v1/test-write")
    _first_write_started(routes)
    r = client.post("/v1/runs/run_missing/cancel")
    assert r.status_code == 404, r.text  # answered while the lane is held
    routes.write_release.set()
    first.join(60)

"""A live meshrun API (uvicorn on a free loopback port, in a thread) for SDK and CLI tests.

``api_server``: auth off, no scheduler (runs stay QUEUED unless a test plays the worker with ``FakeWorker``).
``auth_server``: auth on, with tokens of two projects. Real training goes through the Ray engineer's
``live_service`` fixture (tests/conftest.py), marked ``ray``.
"""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    url: str
    settings: Any
    tokens: dict[str, str]

    @contextmanager
    def session(self) -> Iterator[Any]:
        from service.store.db import make_engine, make_sessionmaker, session_scope

        engine = make_engine(self.settings.database_url)
        try:
            with session_scope(make_sessionmaker(engine)) as s:
                yield s
        finally:
            engine.dispose()


@contextmanager
def run_server(data_dir: Path, **overrides: Any) -> Iterator[LiveServer]:
    import uvicorn

    from service.app.server import create_app
    from service.settings import Settings

    port = free_port()
    settings = Settings(data_dir=data_dir, start_scheduler=False, host="127.0.0.1", port=port, **overrides)
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="on"))
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("test API server did not start")
        time.sleep(0.05)
    assert httpx.get(f"{url}/healthz", timeout=5).status_code == 200
    try:
        yield LiveServer(url=url, settings=settings, tokens={})
    finally:
        server.should_exit = True
        thread.join(timeout=15)


@pytest.fixture(scope="session")
def api_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with run_server(tmp_path_factory.mktemp("meshrun-api"), rate_limit_per_minute=0, webhook_poll_s=0.1) as srv:
        yield srv


@pytest.fixture(scope="session")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    from service.security.tokens import create_token

    with run_server(tmp_path_factory.mktemp("meshrun-auth"), auth="on", rate_limit_per_minute=0) as srv:
        with srv.session() as s:
            srv.tokens["a"] = create_token(s, "proj-a", "alice")
            srv.tokens["b"] = create_token(s, "proj-b", "bob")
            srv.tokens["coder"] = create_token(s, "proj-a", "carol", can_run_code=True)
        yield srv


@pytest.fixture()
def client(api_server: LiveServer):
    from api.client import Client

    with Client(api_server.url, max_retries=0, timeout=10) as c:
        yield c


class FakeWorker:
    """Plays the scheduler and the workers for one run through the store: QUEUED -> STARTING -> RUNNING,
    metric rows per step, then SUCCEEDED or FAILED. Lets lifecycle tests run in seconds without Ray."""

    def __init__(self, server: LiveServer, run_id: str, *, steps: int, fail_at: int | None = None,
                 step_s: float = 0.02) -> None:
        self.server, self.run_id, self.steps, self.fail_at, self.step_s = server, run_id, steps, fail_at, step_s
        self.thread = threading.Thread(target=self._play, daemon=True)

    def start(self) -> "FakeWorker":
        self.thread.start()
        return self

    def _play(self) -> None:
        from service import store

        with self.server.session() as s:
            store.transition(s, run_id=self.run_id, to="STARTING", reason="placed")
            store.start_attempt(s, run_id=self.run_id, cause="submitted")
        with self.server.session() as s:
            store.transition(s, run_id=self.run_id, to="RUNNING", reason="workers up")
        for step in range(1, self.steps + 1):
            time.sleep(self.step_s)
            if self.fail_at == step:
                with self.server.session() as s:
                    store.transition(s, run_id=self.run_id, to="FAILED", reason=f"worker 1 died at step {step}")
                return
            with self.server.session() as s:
                store.add_metrics(s, run_id=self.run_id, attempt=1, rows=[{
                    "step": step, "loss": 5.0 / step, "tokens_per_s": 1000.0 + step, "step_time_s": 0.02,
                    "mfu": 0.01, "peak_memory_bytes": 2**20 * step}])
        with self.server.session() as s:
            store.transition(s, run_id=self.run_id, to="SUCCEEDED", reason="finished")

    def join(self) -> None:
        self.thread.join(timeout=30)


def play_when_submitted(server: LiveServer, name: str, **kw: Any) -> threading.Thread:
    """Start a FakeWorker for the run named ``name`` as soon as it is submitted (by a CLI under test)."""

    def watch() -> None:
        from service import store

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with server.session() as s:
                rows, _, _ = store.list_runs(s, name=name, limit=1)
                run_id = rows[0].id if rows else None
            if run_id:
                worker = FakeWorker(server, run_id, **kw).start()
                worker.join()
                return
            time.sleep(0.05)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


@pytest.fixture(scope="session")
def ray_service_url(request: pytest.FixtureRequest) -> str:
    """URL of the Ray-backed live service: MESHRUN_TEST_URL (any running service with its scheduler), else the
    ``live_service`` fixture of tests/conftest.py (a real local Ray cluster)."""
    import os

    if os.environ.get("MESHRUN_TEST_URL"):
        return os.environ["MESHRUN_TEST_URL"]
    return str(request.getfixturevalue("live_service").url)

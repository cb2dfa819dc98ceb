"""Every 503 carries Retry-After and the SDK waits it out transparently (issue 34), against the real service in
this process: its only database connection is held by the test for a moment (what a burst of slow requests does
to the pool), so requests meanwhile get 503; the SDK sleeps what Retry-After says and then succeeds."""

from __future__ import annotations

import threading
import time

import httpx
import uvicorn

from api import client as sdk
from service.app.server import create_app
from service.settings import Settings

from .conftest import free_port


def _serve(tmp_path, **kw):
    port = free_port()
    settings = Settings(data_dir=tmp_path, start_scheduler=False, host="127.0.0.1", port=port,
                        rate_limit_per_minute=0, **kw)
    app = create_app(settings)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the service did not start"
        time.sleep(0.05)
    return app, server, thread, f"http://127.0.0.1:{port}"


def test_503s_carry_retry_after_and_the_sdk_retries_them(tmp_path):
    app, server, thread, url = _serve(tmp_path, db_pool_size=1, db_max_overflow=0, db_pool_timeout_s=0.2)
    try:
        # a 503 of a route (no Ray runtime in this process) carries Retry-After too
        r = httpx.get(f"{url}/v1/cluster", timeout=30)
        assert r.status_code == 503 and float(r.headers["Retry-After"]) > 0
        held = app.state.engine.connect()  # the pool's only connection
        try:
            r = httpx.get(f"{url}/v1/runs", timeout=30)
            assert r.status_code == 503, r.text
            assert float(r.headers["Retry-After"]) > 0
            # without retries the SDK raises the 503...
            try:
                sdk.Client(url, max_retries=0).runs.list()
            except sdk.APIStatusError as e:
                assert e.status_code == 503
            else:
                raise AssertionError("a 503 was not raised")
            # ...with them it waits what Retry-After says: the connection comes back meanwhile
            slept: list[float] = []
            client = sdk.Client(url, max_retries=5)
            client._sleep = lambda s: (slept.append(s), time.sleep(s))
            threading.Timer(0.5, held.close).start()
            page = client.runs.list()
        finally:
            held.close()
        assert page.total == 0 and slept and slept[0] >= 1, slept
    finally:
        server.should_exit = True
        thread.join(timeout=15)

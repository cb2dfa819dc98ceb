"""The API-only meshrun service the HTTP benchmarks start: loopback, no scheduler, no auth, no rate limit."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def api_service(
    *,
    data_dir: str,
    database_url: str | None = None,
    port: int | None = None,
    quiet: bool = False,
    timeout_s=120,
    extra_env: dict[str, str] | None = None,
) -> Iterator[tuple[str, subprocess.Popen]]:
    """Start ``service.app.server.serve`` in a child process; yield its base URL and process once ``/healthz``
    answers (200, or 503 when only Ray is absent); stop it afterwards. Without ``database_url``: SQLite in
    ``data_dir``. ``extra_env``: more MESHRUN_* settings."""
    port = port or free_port()
    env = {
        **os.environ,
        "MESHRUN_DATA_DIR": data_dir,
        "MESHRUN_HOST": "127.0.0.1",
        "MESHRUN_PORT": str(port),
        "MESHRUN_START_SCHEDULER": "false",
        "MESHRUN_AUTH": "off",
        "MESHRUN_RATE_LIMIT_PER_MINUTE": "0",
        "MESHRUN_LOG_LEVEL": "WARNING",
        "PYTHONPATH": str(ROOT),
    }
    env.update(extra_env or {})
    env.pop("MESHRUN_DATABASE_URL", None)
    if database_url:
        env["MESHRUN_DATABASE_URL"] = database_url
    out = subprocess.DEVNULL if quiet else None
    proc = subprocess.Popen(
        [sys.executable, "-c", "from service.app.server import serve; serve()"],
        env=env,
        cwd=ROOT,
        stdout=out,
        stderr=out,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(f"{base}/healthz", timeout=2).status_code in (200, 503):
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the service did not start")
            time.sleep(0.2)
        yield base, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

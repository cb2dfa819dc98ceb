"""``/healthz`` reports a dead Ray cluster: a service pointed at a small Ray head of its own answers 200 while the head
runs and 503 with the reason within seconds of the head's process group being killed.

The head and the service are subprocesses of this test (their own ports, token auth off): the test process never
becomes a Ray client of that head, and the shared session cluster is not touched.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from api.sdk import Client, ServerError
from service.cluster.head import free_port, kill_process_group, ray_cli
from tests.conftest import ROOT, _forget_pgid, _record_pgid

START_TIMEOUT_S = 180.0
DETECT_WITHIN_S = 10.0


def _get(url: str, *, timeout_s: float = 10.0) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, json.loads(r.read().decode())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0",
               PYTHONPATH=str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""))
    return env


@dataclass
class Proc:
    proc: subprocess.Popen
    log: Path

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


def _spawn(cmd: list[str], *, log: Path, env: dict[str, str], cwd: Path) -> Proc:
    with open(log, "ab") as fh:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    _record_pgid(proc.pid)
    return Proc(proc, log)


def _stop(p: Proc) -> None:
    kill_process_group(p.proc, timeout_s=15)
    _forget_pgid(p.proc.pid)


@dataclass
class Head:
    proc: Proc
    address: str
    dashboard_url: str


@pytest.fixture
def small_head() -> Iterator[Head]:
    tmp = Path(f"/tmp/mr_health_{secrets.token_hex(3)}")  # short: Ray's unix sockets live under it
    tmp.mkdir()
    gcs, dash = free_port(None), free_port(None)
    base = 45000 + secrets.randbelow(100) * 50
    cmd = [*ray_cli(), "start", "--head", "--block", "--disable-usage-stats", f"--port={gcs}", "--num-cpus=1",
           "--num-gpus=0", "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
           f"--metrics-export-port={free_port(None)}", f"--ray-client-server-port={free_port(None)}",
           f"--dashboard-agent-listen-port={free_port(None)}", f"--dashboard-agent-grpc-port={free_port(None)}",
           f"--runtime-env-agent-port={free_port(None)}", f"--min-worker-port={base}",
           f"--max-worker-port={base + 49}", f"--temp-dir={tmp / 'ray'}"]
    head = Head(_spawn(cmd, log=tmp / "head.log", env=_env(), cwd=tmp), f"127.0.0.1:{gcs}", f"http://127.0.0.1:{dash}")
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert head.proc.proc.poll() is None, head.proc.tail()
            try:
                if _get(f"{head.dashboard_url}/api/version", timeout_s=3)[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"the small Ray head did not start:\n{head.proc.tail()}"
            time.sleep(1.0)
        yield head
    finally:
        _stop(head.proc)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def service_on(small_head: Head, tmp_path: Path) -> Iterator[str]:
    port = free_port(None)
    env = _env()
    env.update(MESHRUN_RAY_ADDRESS=small_head.address, MESHRUN_RAY_DASHBOARD_URL=small_head.dashboard_url,
               MESHRUN_HOST="127.0.0.1", MESHRUN_PORT=str(port), MESHRUN_DATA_DIR=str(tmp_path / "data"),
               MESHRUN_DATABASE_URL=f"sqlite:///{tmp_path / 'm.db'}", MESHRUN_SCHEDULER_INTERVAL_S="0.5")
    svc = _spawn([sys.executable, "-m", "api.cli", "serve"], log=tmp_path / "service.log", env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert svc.proc.poll() is None, svc.tail()
            try:
                _get(f"{url}/healthz", timeout_s=3)
                break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"the service did not start:\n{svc.tail()}"
            time.sleep(0.5)
        yield url
    finally:
        svc.proc.send_signal(signal.SIGKILL)  # its Ray head is gone: no graceful shutdown to wait for
        _stop(svc)


def test_healthz_is_503_with_the_reason_when_the_ray_head_dies(small_head: Head, service_on: str) -> None:
    status, body = _get(f"{service_on}/healthz")
    assert status == 200, body
    assert body["status"] == "ok" and body["ray"] == "ok" and body["db"] == "ok" and "reason" not in body

    os.killpg(os.getpgid(small_head.proc.proc.pid), signal.SIGKILL)  # the head's whole process group
    t0 = time.monotonic()
    while True:
        status, body = _get(f"{service_on}/healthz")
        if status == 503:
            break
        assert time.monotonic() - t0 < DETECT_WITHIN_S, f"still {status} {body} {DETECT_WITHIN_S}s after the kill"
        time.sleep(0.2)
    detected_s = time.monotonic() - t0
    assert body["status"] == "degraded" and body["ray"] == "error" and body["db"] == "ok"
    assert small_head.address in body["reason"] and "does not answer" in body["reason"], body
    # the SDK (and `meshrun health`) say why
    with pytest.raises(ServerError, match="degraded: the Ray GCS at") as err:
        Client(service_on, max_retries=0).health()
    assert err.value.status_code == 503
    print(f"/healthz reported the dead head after {detected_s:.1f}s: {body['reason']}")

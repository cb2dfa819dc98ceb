"""A meshrun service that owns its Ray head, as a subprocess the chaos tests may kill (``kill -9``) and restart on
the same data directory and database.

``owned_service`` yields an ``OwnedService``: ``start()`` runs ``python -m api.cli serve`` in its own process group
with an embedded head on fixed, free ports (2 CPUs, loopback, token auth of its own); ``kill()`` SIGKILLs the service
process only (its Ray head lives in a session of its own and survives, as after a crash); ``stop()`` ends it
gracefully (SIGTERM: the service stops its head). Teardown stops whatever is left: the service's process group and
the head recorded in ``<data_dir>/ray/head.json``.
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
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from service.cluster import ownership
from service.cluster.head import free_port
from tests.conftest import ROOT, _forget_pgid, _record_pgid

START_TIMEOUT_S = 300.0


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/chaos/" in str(item.fspath):
            item.add_marker(pytest.mark.ray)
            item.add_marker(pytest.mark.slow)


def get_json(url: str, *, timeout_s: float = 10.0) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, json.loads(r.read().decode())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())


@dataclass
class OwnedService:
    data_dir: Path
    env: dict[str, str]
    url: str
    logs: list[Path] = field(default_factory=list)
    proc: subprocess.Popen | None = None

    @property
    def ray_dir(self) -> Path:
        return self.data_dir / "ray"

    def head(self) -> ownership.HeadRecord | None:
        return ownership.load_record(self.ray_dir)

    def placement_groups(self) -> list[dict]:
        """The placement groups of the owned cluster, as Ray's state API lists them (id, state, creator job)."""
        head = self.head()
        assert head is not None
        token = (self.ray_dir / "auth_token").read_text().strip()
        req = urllib.request.Request(
            f"http://127.0.0.1:{head.dashboard_port}/api/v0/placement_groups?limit=1000&detail=1",
            headers={"Authorization": f"Bearer {token}"},
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read().decode())["data"]["result"]["result"]

    def live_placement_groups(self, *, timeout_s: float = 60.0) -> list[dict]:
        """Placement groups not REMOVED, waiting up to ``timeout_s`` for Ray to remove those of ended jobs."""
        deadline = time.monotonic() + timeout_s
        while True:
            live = [pg for pg in self.placement_groups() if pg.get("state") != "REMOVED"]
            if not live or time.monotonic() > deadline:
                return live
            time.sleep(1.0)

    def log_tail(self) -> str:
        return "".join(p.read_text(errors="replace")[-4000:] for p in self.logs[-1:])

    def start(self) -> None:
        log = self.data_dir / f"service-{len(self.logs) + 1}.log"
        self.logs.append(log)
        with open(log, "ab") as fh:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "api.cli", "serve"],
                env=self.env,
                cwd=ROOT,
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        _record_pgid(self.proc.pid)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert self.proc.poll() is None, f"the service exited:\n{self.log_tail()}"
            try:
                if get_json(f"{self.url}/healthz", timeout_s=3)[0] == 200:
                    return
            except OSError:
                pass
            assert time.monotonic() < deadline, f"the service did not become healthy:\n{self.log_tail()}"
            time.sleep(1.0)

    def kill(self) -> None:
        """kill -9 of the service process alone (as a crash would)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        _forget_pgid(self.proc.pid)
        self.proc = None

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # anything left in its group
        except ProcessLookupError:
            pass
        _forget_pgid(self.proc.pid)
        self.proc = None


@pytest.fixture
def owned_service() -> Iterator[OwnedService]:
    data_dir = Path(f"/tmp/mr_chaos_{secrets.token_hex(3)}")  # short: Ray's unix sockets live under it
    data_dir.mkdir()
    port = free_port(None)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "MESHRUN_"))}
    env.update(
        PYTHONPATH=str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""),
        RAY_USAGE_STATS_ENABLED="0",
        MESHRUN_DATA_DIR=str(data_dir),
        MESHRUN_HOST="127.0.0.1",
        MESHRUN_PORT=str(port),
        MESHRUN_RAY_GCS_PORT=str(free_port(6420)),
        MESHRUN_RAY_DASHBOARD_PORT=str(free_port(8290)),
        MESHRUN_RAY_METRICS_EXPORT_PORT=str(free_port(None)),
        MESHRUN_RAY_NUM_CPUS="2",
        MESHRUN_SCHEDULER_INTERVAL_S="0.5",
        MESHRUN_RATE_LIMIT_PER_MINUTE="0",
        MESHRUN_TORCH_TIMEOUT_S="60",
    )
    svc = OwnedService(data_dir=data_dir, env=env, url=f"http://127.0.0.1:{port}")
    try:
        yield svc
    finally:
        svc.stop()
        rec = svc.head()
        if rec is not None:  # the service could not stop it: do not leave it behind
            ownership.stop_recorded(rec, timeout_s=10)
        shutil.rmtree(data_dir, ignore_errors=True)

"""``meshrun doctor`` and ``meshrun demo`` next to a running ``meshrun serve`` of the same data directory (the Quick
tour's order), as subprocesses: doctor reports that service (healthy, its URL, its Ray head) instead of "port in
use, stop that program"; demo runs on it instead of failing to start a second service, and a demo whose own
service cannot start says why in one line, without a traceback.

The fast tests use ``serve --no-scheduler`` (no Ray); the ``ray``/``slow`` one serves with its own Ray head."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.cluster.head import free_port
from tests.conftest import ROOT


def clean_env(data_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "MESHRUN_"))}
    env.update(
        PYTHONPATH=str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""),
        RAY_USAGE_STATS_ENABLED="0",
        MESHRUN_DATA_DIR=str(data_dir),
        COLUMNS="200",
    )
    env.update(extra)
    return env


def meshrun(env: dict[str, str], *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "api.cli", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s
    )


def start_serve(env: dict[str, str], url: str, *args: str, timeout_s: float = 300) -> subprocess.Popen[bytes]:
    log = open(Path(env["MESHRUN_DATA_DIR"]) / "serve.log", "ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "api.cli", "serve", *args],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, (Path(env["MESHRUN_DATA_DIR"]) / "serve.log").read_text()[-3000:]
        try:
            with urllib.request.urlopen(f"{url}/healthz", timeout=3) as r:
                if r.status == 200 and (Path(env["MESHRUN_DATA_DIR"]) / "service.json").exists():
                    return proc
        except OSError:
            pass
        assert time.monotonic() < deadline, "meshrun serve did not become healthy"
        time.sleep(0.5)


def stop_serve(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def checks_of(result: subprocess.CompletedProcess[str]) -> dict[str, dict]:
    return {c["name"]: c for c in json.loads(result.stdout)}


@pytest.fixture
def api_only(tmp_path: Path) -> Iterator[tuple[dict[str, str], str, int]]:
    """``meshrun serve --no-scheduler`` on its own data directory and port."""
    port = free_port(None)
    env = clean_env(tmp_path, MESHRUN_PORT=str(port), MESHRUN_RAY_NUM_CPUS="9")
    url = f"http://127.0.0.1:{port}"
    proc = start_serve(env, url, "--no-scheduler")
    try:
        yield env, url, port
    finally:
        stop_serve(proc)


def test_doctor_reports_the_data_directorys_own_service(api_only) -> None:
    env, url, port = api_only
    r = meshrun(env, "doctor", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    checks = checks_of(r)
    service = checks["service"]
    assert service["level"] == "ok" and f"{url}/" in service["detail"] and "healthy" in service["detail"]
    assert "no Ray runtime" in service["detail"]  # --no-scheduler: no head to report
    held = checks[f"port {port}"]
    assert held["level"] == "ok" and "this data directory's service" in held["detail"], held
    r = meshrun(env, "doctor")  # the table names it too, with no "stop that program"
    assert r.returncode == 0 and url in r.stdout and "stop that program" not in r.stdout


def test_doctor_after_serve_stopped_forgets_it(tmp_path: Path) -> None:
    port = free_port(None)
    env = clean_env(tmp_path, MESHRUN_PORT=str(port))
    proc = start_serve(env, f"http://127.0.0.1:{port}", "--no-scheduler")
    stop_serve(proc)
    assert not (tmp_path / "service.json").exists()  # removed on a clean stop
    checks = checks_of(meshrun(env, "doctor", "--json"))
    assert "service" not in checks and checks[f"port {port}"]["detail"].endswith("is free")


def test_doctor_names_a_foreign_port_holder_and_the_real_ray_port_rule(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        env = clean_env(tmp_path, MESHRUN_PORT=str(free_port(None)), MESHRUN_RAY_GCS_PORT=str(taken))
        c = checks_of(meshrun(env, "doctor", "--json"))[f"port {taken}"]
    assert c["level"] == "warn" and "another program" in c["detail"]
    assert "MESHRUN_RAY_GCS_PORT" in c["fix"] and "picks a free one" not in c["fix"]
    assert "never moves" in c["fix"]  # as the README says: a taken Ray port is an error, not a silent move


def test_demo_whose_service_cannot_start_says_why_in_one_line(tmp_path: Path) -> None:
    env = clean_env(tmp_path, MESHRUN_RAY_GCS_PORT="6379", COLUMNS="80")
    r = meshrun(env, "demo", "--set", "train.steps=2")
    assert r.returncode == 7, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "uvicorn" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "MESHRUN_RAY_GCS_PORT=6379 is Redis's port" in errors[0], r.stderr
    assert len(r.stderr.strip().splitlines()) <= 3, r.stderr


# ------------------------------------------------------------------------------------ with a Ray head
@pytest.fixture(scope="module")
def served() -> Iterator[tuple[dict[str, str], str, Path]]:
    """``meshrun serve`` with its own Ray head (the Quick tour's first command), on free ports."""
    data_dir = Path(f"/tmp/mr_doc_{secrets.token_hex(3)}")  # short: Ray's unix sockets live under it
    data_dir.mkdir()
    port = free_port(None)
    env = clean_env(
        data_dir,
        MESHRUN_PORT=str(port),
        MESHRUN_RAY_GCS_PORT=str(free_port(None)),
        MESHRUN_RAY_DASHBOARD_PORT=str(free_port(None)),
        MESHRUN_RAY_METRICS_EXPORT_PORT=str(free_port(None)),
        MESHRUN_RAY_NUM_CPUS="6",
    )
    url = f"http://127.0.0.1:{port}"
    proc = start_serve(env, url)
    try:
        yield env, url, data_dir
    finally:
        stop_serve(proc)
        from service.cluster import ownership

        rec = ownership.load_record(data_dir / "ray")
        if rec is not None:
            ownership.stop_recorded(rec, timeout_s=10)
        shutil.rmtree(data_dir, ignore_errors=True)


@pytest.mark.ray
@pytest.mark.slow
def test_doctor_and_demo_next_to_serve_with_its_ray_head(served) -> None:
    env, url, data_dir = served
    r = meshrun(env, "doctor", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    checks = checks_of(r)
    gcs, dash = env["MESHRUN_RAY_GCS_PORT"], env["MESHRUN_RAY_DASHBOARD_PORT"]
    service = checks["service"]["detail"]
    assert checks["service"]["level"] == "ok" and f"{url}/" in service and "healthy" in service
    assert f"own Ray head at 127.0.0.1:{gcs}" in service and f"127.0.0.1:{dash}" in service, service
    for port in (env["MESHRUN_PORT"], gcs, dash):
        assert checks[f"port {port}"]["level"] == "ok", checks[f"port {port}"]

    r = meshrun(env, "demo", "--set", "train.steps=3", "--set", "name=demo-next-to-serve", timeout_s=600)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "already serving this data directory" in r.stderr and url in r.stderr
    assert "Traceback" not in r.stderr and "SUCCEEDED" in r.stdout
    with urllib.request.urlopen(f"{url}/healthz", timeout=5) as h:  # the demo left the service running
        assert h.status == 200
    runs = json.loads(meshrun(env, "--url", url, "runs", "--json").stdout)
    assert any(run["name"] == "demo-next-to-serve" for run in runs["items"])

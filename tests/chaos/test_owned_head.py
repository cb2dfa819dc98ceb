"""Chaos on a service that owns its Ray head (issue 20): ``kill -9`` of the service during a run, of a run's driver
and of one Ray Train worker rank, then of the head.

One service, one head, checkpointing runs (tiny GPT, one rank each, 2 CPUs, a slowed rank 0 so each run lasts long
enough to be hit in the middle). The phases share the service (each would otherwise pay a head's start and stop):

1. kill -9 the service during run A and start it again on the same data directory and database: the head it
   recorded is adopted (the same pid and ports; no second head), run A's driver never stopped and the run ends
   SUCCEEDED with every step's metrics once and no row written after its attempt ended;
2. on the restarted service, kill -9 of run D's driver and of run W's rank 0 (``tests/chaos/run_kills.py``): both
   runs resume from a checkpoint by themselves and SUCCEED with every step once, leaving no process behind;
3. kill -9 the head's process group during run B (after its first checkpoint): the service keeps answering,
   ``/healthz`` says the cluster is down, the service starts the head again on the same GCS port and run B resumes
   from its latest checkpoint ("Ray head lost" event) and SUCCEEDS with every step's metrics once;
4. a graceful stop of the service leaves no process of its head behind.

After each phase no placement group is left (all REMOVED).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from service.cluster import ownership
from tests.chaos.conftest import OwnedService, get_json
from tests.chaos.run_kills import (
    STEPS,
    _every_step_once,
    _rows_after_end,
    _wait_checkpoint,
    chaos_spec,
    killed_driver_and_killed_worker_leave_no_loss_no_leak,
)
from tests.ray.helpers import events, submit, wait_for, wait_for_step

DOWN_TIMEOUT_S = 60.0


def _ray_heads_of(data_dir: Path) -> list[int]:
    """``ray start --head`` processes whose temp dir is under ``data_dir``."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and ownership.is_ray_head(int(entry.name)):
            try:
                cmd = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if f"--temp-dir={data_dir}" in cmd.replace("\0", " "):
                out.append(int(entry.name))
    return out


def _no_database_url_in_the_job(svc: OwnedService, head: ownership.HeadRecord, job_id: str) -> None:
    """The job's details and logs, as Ray's Jobs API serves them to anyone with dashboard access, hold the path of
    the driver's credential file, never the database URL."""
    token = (svc.ray_dir / "auth_token").read_text().strip()
    base = f"http://127.0.0.1:{head.dashboard_port}/api/jobs/{job_id}"
    auth = {"Authorization": f"Bearer {token}"}
    info = httpx.get(base, headers=auth, timeout=30).json()
    logs = httpx.get(f"{base}/logs", headers=auth, timeout=30).json()["logs"]
    env = info["runtime_env"]["env_vars"]
    assert "MESHRUN_DATABASE_URL" not in env and env["MESHRUN_DATABASE_URL_FILE"].startswith(str(svc.data_dir))
    assert "sqlite:" not in json.dumps(info) and "sqlite:" not in logs


def test_service_and_head_crashes_leave_one_head_and_finish_every_run(owned_service: OwnedService) -> None:
    svc = owned_service
    svc.start()
    head = svc.head()
    assert head is not None and head.address.startswith("127.0.0.1:"), head  # loopback, recorded
    assert _ray_heads_of(svc.data_dir) == [head.pid]

    # ---- 1. kill -9 of the service during a run; restart on the same database: the head is adopted
    a = submit(svc.url, chaos_spec("chaos-service-kill"))
    wait_for_step(svc.url, a["id"], 3, timeout_s=300)
    svc.kill()
    assert ownership.pid_alive(head.pid)  # the head (and run A's driver) outlive the service
    svc.start()
    assert svc.head() == head and _ray_heads_of(svc.data_dir) == [head.pid]  # adopted, not a second head
    done = wait_for(svc.url, a["id"], {"SUCCEEDED"}, timeout_s=600)
    _every_step_once(svc.url, a["id"])
    assert done["summary"]["steps_done"] == STEPS
    assert _rows_after_end(svc.data_dir, a["id"]) == []
    _no_database_url_in_the_job(svc, head, done["ray_job_id"])
    assert not (live := svc.live_placement_groups()), live  # run A's placement group went with its job

    # ---- 2. kill -9 of a run's driver and of another run's worker, on the service that adopted its head
    killed_driver_and_killed_worker_leave_no_loss_no_leak(svc)

    # ---- 3. kill -9 of the head during a checkpointing run: the service stays up, reports it, restarts it
    b = submit(svc.url, chaos_spec("chaos-head-kill"))
    _wait_checkpoint(svc.url, b["id"])
    os.killpg(head.pgid, signal.SIGKILL)
    deadline = time.monotonic() + DOWN_TIMEOUT_S
    while (health := get_json(f"{svc.url}/healthz"))[0] != 503:
        assert time.monotonic() < deadline, f"/healthz still {health} {DOWN_TIMEOUT_S}s after the head was killed"
        time.sleep(0.2)
    assert health[1]["ray"] == "error" and health[1]["reason"], health
    assert httpx.get(f"{svc.url}/v1/runs", timeout=30).status_code == 200  # the API answers meanwhile
    done = wait_for(svc.url, b["id"], {"SUCCEEDED"}, timeout_s=900)
    _every_step_once(svc.url, b["id"])
    assert _rows_after_end(svc.data_dir, b["id"]) == []
    evs = events(svc.url, b["id"])
    assert [e["kind"] for e in evs].count("head_lost") == 1, evs
    assert any(e.get("to_status") == "QUEUED" and (e["reason"] or "").startswith("Ray head lost") for e in evs), evs
    new_head = svc.head()
    assert new_head is not None and new_head.pid != head.pid and new_head.gcs_port == head.gcs_port
    assert _ray_heads_of(svc.data_dir) == [new_head.pid]
    assert get_json(f"{svc.url}/healthz")[0] == 200
    assert not (live := svc.live_placement_groups()), live  # none of the resumed run B's left on the new head

    # ---- 4. a graceful stop leaves nothing of the head behind
    svc.stop()
    assert svc.head() is None and _ray_heads_of(svc.data_dir) == []
    left = ownership.group_members(new_head.pgid)
    assert not left, [_cmdline(Path(f"/proc/{p}"))[:300] for p in left]
    assert new_head.session_dir and not [
        p for p in Path("/proc").iterdir() if p.name.isdigit() and new_head.session_dir.encode() in _cmdline(p)
    ]
    # nor a warm pool's driver: the first head's was orphaned by the kill (its job went with that head) and must have
    # left by itself (``service.cluster.warm_host.host_pool``), not spin on the lost GCS connection for good
    deadline = time.monotonic() + 60
    while left := _warm_hosts(svc.data_dir):
        assert time.monotonic() < deadline, [_cmdline(Path(f"/proc/{p}"))[:300] for p in left]
        time.sleep(1.0)


def _warm_hosts(data_dir: Path) -> list[int]:
    """Processes of ``service.cluster.warm_host`` started for the service of ``data_dir`` (by their environment)."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and b"service.cluster.warm_host" in _cmdline(p):
            try:
                env = (p / "environ").read_bytes()
            except OSError:
                continue
            if f"={data_dir}".encode() in env:
                out.append(int(p.name))
    return out


def _cmdline(p: Path) -> bytes:
    try:
        return (p / "cmdline").read_bytes()
    except OSError:
        return b""


pytestmark = pytest.mark.ray

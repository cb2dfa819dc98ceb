"""Chaos inside a run (issue 20): ``kill -9`` of a run's driver and of one Ray Train worker rank, during checkpointing
runs on a service that owns its Ray head. A phase of ``tests/chaos/test_owned_head.py`` (on its service, after the
service's own kill and restart), not a test of its own: a service of its own cost a head's start and stop.

Two runs at once (tiny GPT, one rank each, a slowed rank 0, a checkpoint every 5 steps, ``max_failures=2``):

- run D: its driver (``python -m service.runs.driver --run-id D``) is killed after the first checkpoint. Ray ends the
  job, and with it the Train controller, the workers and their placement group. The reconcile step counts it as a
  failure of the run and, within ``max_failures``, re-queues it by itself with one readable sentence ("driver lost:
  ...; resuming from the checkpoint of step N (failure 1 of max_failures=2)"); it continues from that checkpoint as
  a second Ray Job and SUCCEEDS with every step's metrics once;
- run W (``checkpoint.async``: saves written in the background): its rank 0 worker is killed after the first
  checkpoint is listed. Ray Train restarts the worker group from the latest listed checkpoint (a new attempt,
  counted against ``max_failures``) and the run SUCCEEDS with every step's metrics once, its last save listed.

Afterwards: no metric row stored after its attempt ended, no placement group left (all REMOVED), no driver or worker
process of either run alive.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import time
from pathlib import Path

import httpx

from tests.chaos.conftest import OwnedService
from tests.ray.helpers import events, get_run, metrics, submit, tiny_spec, wait_for
from tests.ray.test_runs import driver_pids, gone

STEPS = 30


def chaos_spec(name: str) -> dict:
    return tiny_spec(
        name,
        steps=STEPS,
        checkpoint={"every_steps": 5, "keep": 2},
        resources={"max_failures": 2},
        faults={"slow_rank": {"rank": 0, "delay_s": 0.25}},
    )


def _rows_after_end(data_dir: Path, run_id: str) -> list[tuple]:
    """Metric rows stored after their attempt or their run had ended."""
    with sqlite3.connect(data_dir / "meshrun.db") as db:
        return db.execute(
            "SELECT m.attempt, m.step, m.time FROM metrics m JOIN run_attempts a "
            "ON a.run_id = m.run_id AND a.attempt = m.attempt JOIN runs r ON r.id = m.run_id "
            "WHERE m.run_id = ? AND (m.time > a.finished_at OR m.time > r.finished_at)",
            (run_id,),
        ).fetchall()


def _every_step_once(url: str, run_id: str) -> None:
    assert [r["step"] for r in metrics(url, run_id)] == list(range(1, STEPS + 1))


def _wait_checkpoint(url: str, run_id: str, *, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not httpx.get(f"{url}/v1/runs/{run_id}/checkpoints", timeout=30).json()["items"]:
        assert get_run(url, run_id)["status"] in ("QUEUED", "STARTING", "RUNNING")
        assert time.monotonic() < deadline, "no checkpoint recorded"
        time.sleep(0.5)


def _rank_pids(url: str, run_id: str) -> list[int]:
    """The worker pids of the run's latest attempt (its ``placement`` event: rank -> "node pid N")."""
    found = [e["reason"] for e in events(url, run_id) if e["kind"] == "placement"]
    assert found, "no placement event"
    where = json.loads(found[-1].split(":", 1)[1])
    return [int(v.rsplit(" ", 1)[1]) for v in where.values()]


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _driver_process(run_id: str) -> int:
    """The run's one driver process: the Python process of its job's entrypoint (not the shell Ray runs it in)."""
    pids = driver_pids(run_id)
    python = [p for p in pids if _ppid(p) in pids or len(pids) == 1]
    assert len(python) == 1, [Path(f"/proc/{p}/cmdline").read_bytes() for p in pids]
    return python[0]


def _one_sentence(reason: str) -> None:
    assert reason and "\n" not in reason and "Traceback" not in reason and len(reason) <= 400, reason


def _wait_event(url: str, run_id: str, kind: str, timeout_s: float = 300) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [e["reason"] for e in events(url, run_id) if e["kind"] == kind]
        if found:
            return found[0]
        time.sleep(0.5)
    raise AssertionError(f"no {kind} event after {timeout_s}s: {events(url, run_id)}")


def killed_driver_and_killed_worker_leave_no_loss_no_leak(svc: OwnedService) -> None:
    d = submit(svc.url, chaos_spec("chaos-driver-kill"))
    w_spec = chaos_spec("chaos-worker-kill")
    w_spec["checkpoint"] = {**w_spec["checkpoint"], "async": True}  # written in the background, listed when complete
    w = submit(svc.url, w_spec)
    _wait_checkpoint(svc.url, d["id"])
    _wait_checkpoint(svc.url, w["id"])
    workers_d = _rank_pids(svc.url, d["id"])

    # ---- kill -9 of run D's driver: a failure of the run, resumed by itself (max_failures=2), nothing of it left
    os.kill(_driver_process(d["id"]), signal.SIGKILL)
    # ---- kill -9 of run W's rank 0: Ray Train restarts the worker group from the latest checkpoint
    killed_w = _rank_pids(svc.url, w["id"])
    os.kill(killed_w[0], signal.SIGKILL)

    lost = _wait_event(svc.url, d["id"], "driver_lost")
    assert lost.startswith("driver lost: Ray Job ") and "resuming from the checkpoint of step" in lost, lost
    assert "(failure 1 of max_failures=2)" in lost, lost
    _one_sentence(lost)
    assert not gone(workers_d, timeout_s=60), "run D's workers outlived its driver"

    done_w = wait_for(svc.url, w["id"], {"SUCCEEDED"}, timeout_s=900)
    assert done_w["spec"]["checkpoint"]["async"] is True
    listed = httpx.get(f"{svc.url}/v1/runs/{w['id']}/checkpoints", timeout=30).json()["items"]
    assert {c["step"] for c in listed} >= {STEPS}, listed  # the last background save was waited for and listed
    _every_step_once(svc.url, w["id"])
    assert done_w["summary"]["steps_done"] == STEPS
    assert done_w["attempts"] >= 2, done_w  # the worker's loss was a new attempt
    assert _rows_after_end(svc.data_dir, w["id"]) == []

    # ---- run D resumed without a manual resume: from its latest checkpoint, one driver, every step once
    done_d = wait_for(svc.url, d["id"], {"SUCCEEDED"}, timeout_s=900)
    assert any(e.get("to_status") == "QUEUED" and e["reason"] == lost for e in events(svc.url, d["id"]))
    assert done_d["attempts"] >= 2 and done_d["ray_job_id"].endswith("-2"), done_d
    _every_step_once(svc.url, d["id"])
    assert _rows_after_end(svc.data_dir, d["id"]) == []

    # ---- nothing of either run remains: processes, placement groups
    for run in (done_d, done_w):
        assert not gone(driver_pids(run["id"]) + _rank_pids(svc.url, run["id"]), timeout_s=60)
    assert not gone(killed_w, timeout_s=5)
    live = svc.live_placement_groups()
    assert not live, live

"""Runs on a warm service (``MESHRUN_WARM_WORKERS``) through REST on the session's Ray cluster: the service prestarts
one group of worker processes in a Ray Job of its own, a run starts in it (no worker start: a phase says so) and
trains exactly what the same spec trains in a new Ray Train worker group (the same losses, bit for bit), its
checkpoints are listed and on disk, the next run re-meshes the same processes, a worker killed mid-run fails only
that attempt (the run restarts as a Ray Train worker group from its latest checkpoint and SUCCEEDS with every step
once), a cancel stops the run's warm workers, the group of a driver killed mid-run is taken back by the pool (its
workers killed) while the run resumes, and an idle group of another shape is stopped after ``MESHRUN_WARM_IDLE_S``
while the standing group stays. Stopping the service stops its pool's job."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import start_live_service, stop_live_service
from tests.ray.helpers import events, metrics, submit, tiny_spec, wait_for, wait_for_step
from tests.ray.test_runs import driver_pids, gone

pytestmark = pytest.mark.ray
STEPS = 400  # tiny steps take tens of ms: enough of them to kill a worker mid-run
IDLE_S = 10  # the warm service's MESHRUN_WARM_IDLE_S (the pool looks every 15 s)


@pytest.fixture(scope="module")
def warm_service(ray_cluster, tmp_path_factory):
    svc = start_live_service(ray_cluster=ray_cluster, data_dir=tmp_path_factory.mktemp("meshrun-warm"), warm_workers=2,
                             warm_idle_s=IDLE_S)
    try:
        host = svc.runtime.warm
        assert host is not None and host.job_id, "the service did not start its warm pool's job"
        deadline = time.monotonic() + 180
        while "ready on node" not in host.jobs.logs(host.job_id):  # the prestarted group is up
            assert not host.jobs.state(host.job_id).terminal, host.jobs.logs(host.job_id)
            assert time.monotonic() < deadline, host.jobs.logs(host.job_id)
            time.sleep(0.5)
        yield svc
    finally:
        job = svc.runtime.warm.job_id if svc.runtime.warm else None
        jobs = svc.runtime.warm.jobs if svc.runtime.warm else None
        stop_live_service(svc)
        if job and jobs is not None:  # the service's stop stops its pool's job
            deadline = time.monotonic() + 60
            while not jobs.state(job).terminal and time.monotonic() < deadline:
                time.sleep(0.5)
            assert jobs.state(job).terminal, jobs.state(job)


def _placements(url: str, run_id: str) -> list[list[int]]:
    """Each attempt's worker pids, rank order (its ``placement`` event)."""
    return [[int(p) for _, p in sorted(re.findall(r'"(\d+)": "[0-9a-f]+ pid (\d+)"', e["reason"]))]
            for e in events(url, run_id) if e["kind"] == "placement"]


def _losses(url: str, run_id: str) -> list[float]:
    return [r["loss"] for r in metrics(url, run_id)]


def test_a_run_starts_in_the_warm_pool_and_trains_what_a_cold_run_trains(warm_service) -> None:
    url = warm_service.url
    spec = tiny_spec("warm-run", dp=2, steps=6, checkpoint={"every_steps": 2, "keep": 2})
    first = submit(url, spec)
    done = wait_for(url, first["id"], {"SUCCEEDED"}, timeout_s=240)
    assert done["attempts"] == 1
    evs = events(url, first["id"])
    phases = [e["reason"] for e in evs if e["kind"] == "phase"]
    assert any(p.startswith("re-meshing warm worker group #1 of the service's pool (2 workers, 0 job(s)") for p in
               phases), phases
    assert not any(p.startswith("placing ") for p in phases), phases  # no Ray Train worker group
    assert [r["step"] for r in metrics(url, first["id"])] == list(range(1, 7))
    cks = httpx.get(f"{url}/v1/runs/{first['id']}/checkpoints", timeout=30).json()["items"]
    assert sorted(c["step"] for c in cks) == [4, 6], cks  # keep 2: the driver pruned step 2 once it recorded 6
    for c in cks:
        assert c["path"].endswith(f"-warm/step_{c['step']:08d}") and (Path(c["path"]) / "meshrun.json").is_file()
    assert not (Path(cks[0]["path"]).parent / "step_00000002").exists()

    # the same spec in a new Ray Train worker group: the same losses, bit for bit
    cold = submit(url, {**spec, "name": "cold-run", "resources": {**spec["resources"], "warm_start": False}})
    wait_for(url, cold["id"], {"SUCCEEDED"}, timeout_s=240)
    assert any(e["kind"] == "phase" and e["reason"].startswith("placing ") for e in events(url, cold["id"]))
    assert _losses(url, first["id"]) == _losses(url, cold["id"])

    # the next run re-meshes the same worker processes
    again = submit(url, {**spec, "name": "warm-again", "checkpoint": {"every_steps": 0}})
    wait_for(url, again["id"], {"SUCCEEDED"}, timeout_s=240)
    pids = [_placements(url, first["id"]), _placements(url, again["id"])]
    assert len(pids[0]) == 1 and pids[0] == pids[1] and len(pids[0][0]) == 2, pids
    assert any(e["kind"] == "phase" and "(2 workers, 1 job(s) before this run)" in e["reason"]
               for e in events(url, again["id"]))


def test_a_killed_warm_worker_restarts_the_run_as_a_ray_train_group_from_its_checkpoint(warm_service) -> None:
    url = warm_service.url
    spec = tiny_spec("warm-kill", dp=2, steps=STEPS, checkpoint={"every_steps": 40},
                     resources={"max_failures": 1}, optimizer={"lr": 3e-3, "warmup_steps": 0, "schedule": "constant"})
    run = submit(url, spec)
    wait_for_step(url, run["id"], 50, timeout_s=240)  # a checkpoint (step 40) listed, many steps to go
    warm_pids = _placements(url, run["id"])[0]
    os.kill(warm_pids[1], signal.SIGKILL)
    done = wait_for(url, run["id"], {"SUCCEEDED"}, timeout_s=300)
    assert done["attempts"] == 2
    placed = _placements(url, run["id"])
    assert len(placed) == 2 and not set(placed[1]) & set(warm_pids), placed  # new processes: Ray Train's
    steps = [r["step"] for r in metrics(url, run["id"])]
    assert steps == list(range(1, STEPS + 1)), steps  # every step once: the restart resumed from a checkpoint
    assert any(e["kind"] == "phase" and e["reason"].startswith("placing ") for e in events(url, run["id"]))


def test_a_cancelled_warm_run_stops_its_workers(warm_service) -> None:
    url = warm_service.url
    run = submit(url, tiny_spec("warm-cancel", dp=2, steps=STEPS))
    wait_for_step(url, run["id"], 20, timeout_s=240)
    pids = _placements(url, run["id"])[0]
    r = httpx.post(f"{url}/v1/runs/{run['id']}/cancel", timeout=60)
    assert r.status_code == 200 and r.json()["status"] == "CANCELLED", r.text
    assert gone(pids, timeout_s=30) == [], "the cancelled run's warm workers still run"
    rows = len(metrics(url, run["id"]))
    time.sleep(2)
    assert len(metrics(url, run["id"])) == rows < STEPS  # nothing trains on


def test_a_warm_run_whose_driver_is_killed_gives_its_group_back_and_resumes(warm_service) -> None:
    """SIGKILL on the run's driver: nobody releases its warm group, so the pool reaps it (the group's owner, the run's
    channel, died with the driver): its workers are killed within the pool's reap interval; the run resumes by
    itself from its latest checkpoint and SUCCEEDS with every step once."""
    url = warm_service.url
    spec = tiny_spec("warm-driver-kill", dp=2, steps=STEPS, checkpoint={"every_steps": 40},
                     resources={"max_failures": 1}, optimizer={"lr": 3e-3, "warmup_steps": 0, "schedule": "constant"})
    run = submit(url, spec)
    wait_for_step(url, run["id"], 50, timeout_s=240)
    warm_pids = _placements(url, run["id"])[0]
    drivers = driver_pids(run["id"])
    assert drivers, "no driver process found"
    for pid in drivers:
        os.kill(pid, signal.SIGKILL)
    assert gone(warm_pids, timeout_s=90) == [], "the dead driver's warm workers still run"
    done = wait_for(url, run["id"], {"SUCCEEDED"}, timeout_s=300)
    steps = [r["step"] for r in metrics(url, run["id"])]
    assert steps == list(range(1, STEPS + 1)), steps
    assert done["attempts"] >= 2


def test_an_idle_group_of_another_shape_is_stopped_and_the_standing_group_stays(warm_service) -> None:
    """A one-worker run starts a group of its own shape; once idle for ``IDLE_S`` its worker process is stopped (it
    held about 500 MB and took CPU while idle). The standing two-worker group, idle at least as long, stays: the next
    dp2 run re-meshes it instead of starting one."""
    url = warm_service.url
    one = submit(url, tiny_spec("warm-one-worker", dp=1, steps=2))
    wait_for(url, one["id"], {"SUCCEEDED"}, timeout_s=240)
    assert any(e["kind"] == "phase" and e["reason"].startswith("starting warm worker group #")
               for e in events(url, one["id"])), events(url, one["id"])
    (pids,) = _placements(url, one["id"])
    assert len(pids) == 1
    # without the idle limit it would stay: the pool keeps two idle groups (MESHRUN_WARM_MAX_IDLE_GROUPS), this and
    # the standing one
    assert gone(pids, timeout_s=IDLE_S + 60) == [], "the idle one-worker group still runs"
    two = submit(url, tiny_spec("warm-standing", dp=2, steps=2))
    wait_for(url, two["id"], {"SUCCEEDED"}, timeout_s=240)
    phases = [e["reason"] for e in events(url, two["id"]) if e["kind"] == "phase"]
    assert any(p.startswith("re-meshing warm worker group #") for p in phases), phases

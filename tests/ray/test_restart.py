"""A service restart reconciles: a run whose driver still runs keeps going; one whose driver is gone -> FAILED
"driver lost", with its metrics kept."""

from __future__ import annotations

import os
import signal

import pytest
import ray  # noqa: F401 - ray vendors psutil

from tests.conftest import start_live_service, stop_live_service
from tests.ray.helpers import events, get_run, metrics, submit, tiny_spec, wait_for, wait_for_step
from tests.ray.test_runs import driver_pids

pytestmark = pytest.mark.ray


def test_restart_keeps_live_runs_and_fails_lost_ones(ray_cluster, tmp_path):
    svc = start_live_service(ray_cluster=ray_cluster, data_dir=tmp_path)
    try:
        keeps = submit(svc.url, tiny_spec("e2e-survives-restart", steps=25))
        lost = submit(svc.url, tiny_spec("e2e-driver-lost", steps=5000))
        wait_for_step(svc.url, lost["id"], 2, timeout_s=300)
        wait_for_step(svc.url, keeps["id"], 2, timeout_s=300)
    finally:
        stop_live_service(svc)
    pids = driver_pids(lost["id"])
    assert pids, "the driver of the run to lose is not running"
    for pid in pids:
        os.kill(pid, signal.SIGKILL)

    svc = start_live_service(ray_cluster=ray_cluster, data_dir=tmp_path)
    try:
        failed = wait_for(svc.url, lost["id"], {"FAILED"}, timeout_s=60)
        assert failed["status_reason"].startswith("driver lost"), failed["status_reason"]
        assert lost["id"] in failed["ray_job_id"]
        kept = metrics(svc.url, lost["id"])
        assert len(kept) >= 2 and [r["step"] for r in kept] == list(range(1, len(kept) + 1))
        assert any(e["to_status"] == "FAILED" and "driver lost" in (e["reason"] or "")
                   for e in events(svc.url, lost["id"]))
        done = wait_for(svc.url, keeps["id"], {"SUCCEEDED"}, timeout_s=300)
        assert [r["step"] for r in metrics(svc.url, keeps["id"])] == list(range(1, 26))
        assert done["summary"]["steps_done"] == 25
        assert get_run(svc.url, lost["id"])["status"] == "FAILED"
    finally:
        stop_live_service(svc)

"""Ray stays in its lane: with a second, unrelated Ray head on the host (started here, on free ports, stopped by its
process group at the end), a run on meshrun's cluster succeeds, its Ray Job runs the service's own interpreter with
``RAY_ADDRESS`` pinned to meshrun's cluster, Ray's job list shows the run's name, and the run's log holds no
"multiple active Ray instances" traceback (Ray Train's placement-group cleaner used to raise it)."""

from __future__ import annotations

import re
import shlex
import sys

import httpx
import pytest

from tests.ray.helpers import events, ray_job, submit, tiny_spec, wait_for
from tests.ray.test_health import Head, small_head  # noqa: F401 - the second head's fixture

pytestmark = pytest.mark.ray


def test_run_succeeds_beside_another_ray_head(live_service, small_head: Head) -> None:  # noqa: F811
    assert small_head.address != live_service.runtime.gcs_address
    url = live_service.url
    # a Ray Train worker group (not the warm pool): its placement-group cleaner is what used to pick another cluster
    run = submit(url, tiny_spec("lane-dp2", dp=2, steps=4, resources={"warm_start": False}))
    done = wait_for(url, run["id"], {"SUCCEEDED"}, timeout_s=300)
    logs = httpx.get(f"{url}/v1/runs/{run['id']}/logs", timeout=30).json()["logs"]
    assert "multiple active Ray instances" not in logs, logs[-3000:]
    job = ray_job(live_service, done["ray_job_id"])
    assert job.entrypoint.startswith(shlex.quote(sys.executable) + " -m service.runs.driver"), job.entrypoint
    env = (job.runtime_env or {}).get("env_vars", {})
    assert env["RAY_ADDRESS"] == live_service.runtime.gcs_address
    assert job.metadata["job_name"] == "lane-dp2"
    # start-up you can see: the phases, in order, each with its time since the run was queued
    phases = [e["reason"] for e in events(url, run["id"]) if e["kind"] == "phase"]
    order = ["starting Ray Job", "placing 2 workers", "workers ready: 2", "first step"]
    found = [next(i for i, p in enumerate(phases) if p.startswith(o)) for o in order]
    assert found == sorted(found), phases
    assert all(re.search(r"\[\+\d+\.\d s since queued\]$", p) for p in phases), phases


def test_cancelling_a_running_run_frees_every_slot(live_service) -> None:
    """Free CPU slots before the run == after its cancel (its workers and placement group are gone)."""
    from tests.ray.helpers import wait_for_step
    from tests.sweeps.test_sweep_ray import free_cpus, wait_free_cpus

    url = live_service.url
    total = sum(n.total.get("CPU", 0.0) for n in live_service.runtime.capacities())
    before = wait_free_cpus(live_service, total)
    run = submit(url, tiny_spec("lane-cancel", dp=2, steps=2000))
    wait_for_step(url, run["id"], 1, timeout_s=300)
    assert free_cpus(live_service) <= before - 2  # its two workers hold their slots while it trains
    r = httpx.post(f"{url}/v1/runs/{run['id']}/cancel", timeout=60)
    assert r.status_code == 200 and r.json()["status"] == "CANCELLED", r.text
    assert wait_free_cpus(live_service, before) == before

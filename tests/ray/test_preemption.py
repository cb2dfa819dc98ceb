"""Issue 22 on Ray: a preemption notice (SIGTERM to one worker) makes a checkpointing dp2 run save an emergency
checkpoint at its next report boundary, go PREEMPTED then QUEUED, and resume as a new Ray Job: it SUCCEEDS with every
step once, at most one step recomputed, and the uninterrupted run's losses."""

from __future__ import annotations

import os
import signal

import httpx
import pytest

from tests.ray.conftest import FT_STEPS, ft_spec
from tests.ray.helpers import events, metrics, submit, tiny_spec, wait_for, wait_for_step
from tests.ray.test_runs import worker_pids

pytestmark = pytest.mark.ray
LOW_STEPS = 100


def test_sigterm_to_a_worker_checkpoints_requeues_and_resumes(live_service, reference_dp2_run):
    url = live_service.url
    _, ref_rows = reference_dp2_run
    # max_failures 0: a plain failure would end the run; paced (0.3 s more per step on rank 0, the math unchanged)
    # so that the SIGTERM lands mid-run
    run = submit(url, ft_spec("e2e-preempt-sigterm", faults={"slow_rank": {"rank": 0, "delay_s": 0.3}}))
    wait_for_step(url, run["id"], 7, timeout_s=300)
    pids = worker_pids(url, run["id"])
    os.kill(pids[1], signal.SIGTERM)

    done = wait_for(url, run["id"], {"SUCCEEDED"}, timeout_s=400)
    states = [(e["from_status"], e["to_status"]) for e in events(url, run["id"]) if e["kind"] == "state"]
    assert ("RUNNING", "PREEMPTED") in states and ("PREEMPTED", "QUEUED") in states, states
    preempted = next(e for e in events(url, run["id"]) if e["to_status"] == "PREEMPTED")
    assert "SIGTERM on rank 1" in preempted["reason"], preempted
    assert done["attempts"] == 2

    rows = metrics(url, run["id"])
    assert [r["step"] for r in rows] == list(range(1, FT_STEPS + 1))  # continuous, each step once
    first, second = metrics(url, run["id"], attempt=1), metrics(url, run["id"], attempt=2)
    recomputed = {r["step"] for r in first} & {r["step"] for r in second}
    assert len(recomputed) <= 1, sorted(recomputed)
    stopped_at = max(r["step"] for r in first)
    # the emergency checkpoint was recorded (checkpoint.keep 2 has pruned it since: the listing holds 25 and 30)
    recorded = [e["reason"] for e in events(url, run["id"]) if e["kind"] == "checkpoint"]
    assert any(r.startswith(f"checkpoint of step {stopped_at} at ") for r in recorded), (stopped_at, recorded)
    cks = httpx.get(f"{url}/v1/runs/{run['id']}/checkpoints", timeout=30).json()["items"]
    assert [c["step"] for c in cks] == [25, 30]
    # the resumed run is the uninterrupted one (model, optimizer and data position restored)
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in ref_rows], rel=1e-5)


def test_a_higher_priority_run_preempts_a_lower_one_that_later_resumes(live_service, monkeypatch):
    url = live_service.url
    monkeypatch.setattr(live_service.settings, "preemption", "any")
    cpus = int(os.environ.get("MESHRUN_TEST_RAY_CPUS", "6"))  # the session cluster's CPUs: the low run takes all
    low = submit(
        url,
        ft_spec(
            "e2e-preempt-low",
            resources={"device": "cpu", "cpus_per_worker": cpus // 2},
            train={"steps": LOW_STEPS, "seed": 1, "deterministic": True},
            checkpoint={"every_steps": 50, "keep": 2},
            faults={"slow_rank": {"rank": 0, "delay_s": 0.2}},  # >= 20 s of steps: it cannot end before the preemption
        ),
    )
    wait_for_step(url, low["id"], 3, timeout_s=300)
    high = submit(
        url, tiny_spec("e2e-preempt-high", steps=4, resources={"device": "cpu", "cpus_per_worker": 2, "priority": 10})
    )
    wait_for(url, high["id"], {"SUCCEEDED"}, timeout_s=400)
    done = wait_for(url, low["id"], {"SUCCEEDED"}, timeout_s=400)

    ev = events(url, low["id"])
    states = [(e["from_status"], e["to_status"]) for e in ev if e["kind"] == "state"]
    assert ("RUNNING", "PREEMPTED") in states and ("PREEMPTED", "QUEUED") in states, states
    preempted = next(e for e in ev if e["to_status"] == "PREEMPTED")
    assert f"preempted by run {high['id']} (priority 10 > 0)" in preempted["reason"], preempted
    assert done["attempts"] == 2
    rows = metrics(url, low["id"])
    assert [r["step"] for r in rows] == list(range(1, LOW_STEPS + 1))
    first, second = metrics(url, low["id"], attempt=1), metrics(url, low["id"], attempt=2)
    assert len({r["step"] for r in first} & {r["step"] for r in second}) <= 1
    # the high run waited for the low one: admitted only after the low one was asked to yield (the low one's workers
    # free their slots before its driver writes PREEMPTED, so that write may come a moment after the admission)
    high_start = next(e["time"] for e in events(url, high["id"]) if e["to_status"] == "STARTING")
    asked = next(e["time"] for e in ev if e["kind"] == "preempt_request")
    assert asked <= high_start, (asked, high_start)

"""A sweep trial is watched like a run (end to end on the live service and the session's Ray cluster): its workers
get the same hooks as a run's, so a slow rank raises a straggler event on the trial's run, a profile requested
through the run's ``POST /profile`` gives a Chrome trace per rank, and a hung rank is diagnosed (the same fault
injection as ``tests/ray/test_observe.py``), its stacks dumped and the trial failed with the diagnosis."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.ray.helpers import events, get_run, metrics
from tests.sweeps.test_sweep_ray import sweep_body, wait_sweep

pytestmark = pytest.mark.ray

HANG_STEP = 60


def _artifacts(url: str, run_id: str, kind: str) -> list[dict]:
    r = httpx.get(f"{url}/v1/runs/{run_id}/artifacts", timeout=30)
    assert r.status_code == 200, r.text
    return [a for a in r.json()["items"] if a["kind"] == kind]


def _running_trial(url: str, sweep_id: str, *, timeout_s: float) -> str:
    """The run id of the sweep's trial once it reported two steps."""
    deadline = time.monotonic() + timeout_s
    while True:
        sw = httpx.get(f"{url}/v1/sweeps/{sweep_id}", timeout=30).json()
        running = [t for t in sw["trials"] if t["status"] == "RUNNING" and t["run_id"]]
        if running and len(metrics(url, running[0]["run_id"])) >= 2:
            return str(running[0]["run_id"])
        assert sw["status"] not in ("SUCCEEDED", "FAILED", "CANCELLED"), sw
        assert time.monotonic() < deadline, [(t["id"], t["status"], t.get("reason")) for t in sw["trials"]]
        time.sleep(1)


def test_a_sweep_trial_gets_the_hang_watch_stragglers_and_profiles_of_a_run(live_service):
    """One dp2 trial: rank 1 sleeps 0.25 s in compute every step (a straggler) and blocks in compute at step
    ``HANG_STEP`` (a hang, detected after ``hang_timeout_s``); a 2-step profile is requested once it trains."""
    url = live_service.url
    body = sweep_body("e2e-trial-watch", [{"dp": 2}], [2], max_trials=1, steps=100, warmup=2, early_stopping=False)
    body["base"]["faults"] = {"slow_rank": {"rank": 1, "delay_s": 0.25}, "hang_rank": {"rank": 1, "at_step": HANG_STEP}}
    body["base"]["resources"] = {"device": "cpu", "cpus_per_worker": 1, "max_failures": 0, "hang_timeout_s": 10}
    r = httpx.post(f"{url}/v1/sweeps", json=body, timeout=60)
    assert r.status_code == 201, r.text
    sw = r.json()

    run_id = _running_trial(url, sw["id"], timeout_s=300)
    r = httpx.post(f"{url}/v1/runs/{run_id}/profile", json={"steps": 2}, timeout=30)
    assert r.status_code in (200, 202), r.text

    done = wait_sweep(url, sw["id"], timeout_s=420)
    (trial,) = done["trials"]
    run = get_run(url, run_id)
    ev = events(url, run_id)
    # the hang: diagnosed by the trial's driver from the ranks' heartbeats, stacks dumped, the trial failed with it
    hangs = [e for e in ev if e["kind"] == "hang"]
    assert len(hangs) == 1, ev
    assert f"rank 1 stuck in compute at step {HANG_STEP}" in hangs[0]["reason"], hangs
    assert "rank 0 waiting in" in hangs[0]["reason"], hangs
    assert run["status"] == "FAILED" and "hang" in run["status_reason"], run["status_reason"]
    assert trial["status"] == "FAILED" and "hang" in trial["reason"], trial
    stacks = {a["name"] for a in _artifacts(url, run_id, "stacks")}
    assert stacks == {"stacks/rank0.txt", "stacks/rank1.txt"}, stacks
    # the straggler: rank 1 named, never rank 0, on the run's events and its breakdown
    stragglers = [e["reason"] for e in ev if e["kind"] == "straggler"]
    assert stragglers and all(s.startswith("rank 1 ") for s in stragglers), stragglers
    bd = httpx.get(f"{url}/v1/runs/{run_id}/breakdown", timeout=30).json()
    assert bd["stragglers"] and "rank 1" in bd["stragglers"][0], bd["stragglers"]
    # the profile: a Chrome trace per rank, served as the trial run's artifacts
    traces = _artifacts(url, run_id, "profile")
    assert sorted(a["rank"] for a in traces if a["name"].endswith(".trace.json")) == [0, 1], traces
    r = httpx.get(f"{url}/v1/runs/{run_id}/artifacts/{traces[0]['name']}", timeout=60)
    assert r.status_code == 200 and r.json()["traceEvents"], r.text[:300]

"""Where the time goes, end to end on the live service: the measured breakdown through REST, the SDK and the CLI;
a straggler event for a rank slowed by ``faults.slow_rank`` (its compute, not its step time, is compared); a
profile on demand (a Chrome trace per rank, as run artifacts); a hung rank diagnosed and recovered from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from api import client as sdk
from tests.ray.helpers import events, submit, tiny_spec, wait_for, wait_for_step

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]


def meshrun(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "api.cli", "--url", url, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "COLUMNS": "200"})


def _artifacts(url: str, run_id: str, kind: str) -> list[dict]:
    r = httpx.get(f"{url}/v1/runs/{run_id}/artifacts", timeout=30)
    assert r.status_code == 200, r.text
    return [a for a in r.json()["items"] if a["kind"] == kind]


@pytest.fixture(scope="module")
def slow_rank_run(live_service):
    """One long dp2 (zero 0) run where rank 1 sleeps 0.25 s inside its compute phase every step: once it ran a few
    steps, a profile of 2 steps is requested (CLI); when the traces and a straggler event are in, it is cancelled."""
    url = live_service.url
    spec = tiny_spec("obs-slow-rank", dp=2, steps=2000, faults={"slow_rank": {"rank": 1, "delay_s": 0.25}})
    run = submit(url, spec)
    wait_for_step(url, run["id"], 2, timeout_s=300)
    p = meshrun(url, "profile", run["id"], "--steps", "2")
    assert p.returncode == 0 and "profiling the next 2 steps" in p.stdout, p.stdout + p.stderr
    deadline = time.monotonic() + 300
    while len(_artifacts(url, run["id"], "profile")) < 2 or not [e for e in events(url, run["id"])
                                                                  if e["kind"] == "straggler"]:
        assert time.monotonic() < deadline, (_artifacts(url, run["id"], "profile"), events(url, run["id"]))
        time.sleep(1)
    assert httpx.post(f"{url}/v1/runs/{run['id']}/cancel", timeout=60).json()["status"] == "CANCELLED"
    return wait_for(url, run["id"], {"CANCELLED"}, timeout_s=120)


def test_breakdown_over_rest_sdk_and_cli(live_service, slow_rank_run):
    url, run_id = live_service.url, slow_rank_run["id"]
    r = httpx.get(f"{url}/v1/runs/{run_id}/breakdown", timeout=30)
    assert r.status_code == 200, r.text
    bd = r.json()
    terms = {t["term"]: t for t in bd["terms"]}
    assert list(terms) == ["compute", "tp_comm", "pp_comm", "pp_bubble", "dp_comm", "optimizer", "data_wait", "other"]
    assert bd["steps_measured"] >= 1 and bd["warmup_steps_excluded"] >= 1
    assert bd["first_step"] > 1  # the first step is warm-up
    # a dp2 layout: compute and data-parallel communication measured, no tensor or pipeline terms
    assert terms["compute"]["measured_s"] > 0 and terms["dp_comm"]["measured_total_s"] > 0
    for absent in ("tp_comm", "pp_comm", "pp_bubble"):
        assert terms[absent]["measured_s"] == 0, absent
    assert terms["compute"]["predicted_s"] is not None and bd["step_time_s"]["predicted_s"] > 0
    assert all(len(t["per_rank_s"]) == 2 for t in bd["terms"])
    ranks = bd["ranks"]
    assert [rk["rank"] for rk in ranks] == [0, 1] and all(rk["node_id"] for rk in ranks)
    assert ranks[1]["compute_s"] > ranks[0]["compute_s"]  # the injected sleep is compute of rank 1
    assert bd["stragglers"] and "rank 1" in bd["stragglers"][0]
    assert httpx.get(f"{url}/v1/runs/run-nope/breakdown", timeout=30).status_code == 404

    with sdk.Client(url, timeout=30) as c:
        b = c.runs.breakdown(run_id)
        assert b.steps_measured == bd["steps_measured"] and b.terms[0].term == "compute"
        assert c.runs.get(run_id).breakdown().run_id == run_id

    p = meshrun(url, "breakdown", run_id, "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["steps_measured"] == bd["steps_measured"]
    p = meshrun(url, "breakdown", run_id)
    assert p.returncode == 0, p.stderr
    for words in ("where the time goes", "compute", "dp comm", "step (total)", "█", "per rank", "straggler"):
        assert words in p.stdout, (words, p.stdout)
    p = meshrun(url, "show", run_id)
    assert p.returncode == 0 and "where the time goes" in p.stdout, p.stdout + p.stderr
    p = meshrun(url, "show", run_id, "--json")
    assert json.loads(p.stdout)["breakdown"]["run_id"] == run_id


def test_slow_rank_raises_a_straggler_event_naming_it(live_service, slow_rank_run):
    url, run_id = live_service.url, slow_rank_run["id"]
    r = httpx.get(f"{url}/v1/runs/{run_id}/events", params={"kind": "straggler"}, timeout=30)
    items = r.json()["items"]
    assert items and all(e["kind"] == "straggler" for e in items)
    assert all(e["reason"].startswith("rank 1 ") for e in items), items  # rank 1, and never rank 0
    node = slow_rank_run["rank_nodes"]["1"]
    assert f"on node {node[:12]}" in items[0]["reason"] and "x)" in items[0]["reason"]
    assert not [e for e in events(url, run_id) if e["kind"] == "straggler" and "rank 0" in e["reason"]]


def test_hung_rank_is_diagnosed_and_the_run_recovers(live_service):
    """faults.hang_rank blocks rank 1 in compute at step 5 (first attempt only): the driver sees no step for
    hang_timeout_s, dumps the stacks, fails the attempt naming where each rank is, and Ray Train restarts from the
    step-4 checkpoint; the run succeeds with every step once."""
    url = live_service.url
    spec = tiny_spec("obs-hang", dp=2, steps=8, faults={"hang_rank": {"rank": 1, "at_step": 5}},
                     checkpoint={"every_steps": 2, "keep": 2},
                     resources={"device": "cpu", "cpus_per_worker": 1, "max_failures": 1, "hang_timeout_s": 10})
    run = submit(url, spec)
    done = wait_for(url, run["id"], {"SUCCEEDED"}, timeout_s=500)
    assert done["attempts"] == 2
    ev = events(url, run["id"])
    hangs = [e for e in ev if e["kind"] == "hang"]
    assert len(hangs) == 1, ev
    reason = hangs[0]["reason"]
    assert "rank 1 stuck in compute at step 5" in reason and "injected hang_rank" in reason, reason
    assert "rank 0 waiting in" in reason, reason
    attempts = [e["reason"] for e in ev if e["kind"] == "attempt"]
    assert "restart after failure: hang" in attempts[1], attempts
    # detected within the timeout + 60 s of the last step before the hang (both server-side timestamps)
    rows = httpx.get(f"{url}/v1/runs/{run['id']}/metrics", params={"attempt": 1}, timeout=30).json()["items"]
    from datetime import datetime
    last = max(datetime.fromisoformat(r["time"]) for r in rows if r["step"] == 4)
    assert (datetime.fromisoformat(hangs[0]["time"]) - last).total_seconds() < 10 + 60
    steps = [r["step"] for r in httpx.get(f"{url}/v1/runs/{run['id']}/metrics", timeout=30).json()["items"]]
    assert steps == list(range(1, 9))
    arts = httpx.get(f"{url}/v1/runs/{run['id']}/artifacts", timeout=30).json()["items"]
    assert {a["name"] for a in arts if a["kind"] == "stacks"} == {"stacks/rank0.txt", "stacks/rank1.txt"}


def test_profile_on_demand_gives_a_chrome_trace_per_rank(live_service, slow_rank_run, tmp_path):
    url, run_id = live_service.url, slow_rank_run["id"]
    with sdk.Client(url, timeout=30) as c:
        traces = [a for a in c.runs.artifacts(run_id) if a.kind == "profile"]
        assert sorted(a.rank for a in traces) == [0, 1]
        for a in traces:
            assert a.name.startswith("profile/steps_") and a.name.endswith(f"rank{a.rank}.trace.json")
            r = httpx.get(f"{url}/v1/runs/{run_id}/artifacts/{a.name}", timeout=60)
            assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
            trace = r.json()
            assert isinstance(trace["traceEvents"], list) and trace["traceEvents"]
            assert any(e.get("ph") == "X" for e in trace["traceEvents"])  # complete events with a duration
            assert c.runs.artifact(run_id, a.name)["traceEvents"]
    p = meshrun(url, "artifact", run_id)
    assert p.returncode == 0 and "rank0.trace.json" in p.stdout, p.stdout + p.stderr
    p = meshrun(url, "artifact", run_id, traces[0].name, "-o", str(tmp_path))
    assert p.returncode == 0, p.stderr
    assert "traceEvents" in json.loads((tmp_path / Path(traces[0].name).name).read_text())
    r = httpx.post(f"{url}/v1/runs/{run_id}/profile", json={"steps": 2}, timeout=30)
    assert r.status_code == 409 and r.json()["error"]["param"] == "status"  # not running any more
    assert httpx.get(f"{url}/v1/runs/{run_id}/artifacts/nope.json", timeout=30).status_code == 404


def test_calibration_from_a_measured_run_lowers_the_planners_error_term_by_term(live_service):
    """A fault-free tp2 run's measured breakdown as a calibration observation: fitting the planner's factors to it
    lowers the error of its throughput and of its terms taken together (CPU, gloo). Runs with faults are left
    out."""
    from api.spec import Plan
    from service.store.calibrations import fit_factors
    from service.store.db import session_scope
    from service.store.run_calibration import observation_from_run

    url = live_service.url
    run = submit(url, tiny_spec("obs-calib-tp2", tp=2, steps=10))
    wait_for(url, run["id"], {"SUCCEEDED"}, timeout_s=400)
    cluster = live_service.runtime.planning_cluster()
    assert cluster is not None
    with session_scope(live_service.session_factory) as s:
        from service import store

        obs = observation_from_run(s, store.get_run(s, run_id=run["id"]))
        faulty = [observation_from_run(s, r) for r in store.list_runs(s, name="obs-hang", limit=5)[0]]
        start = Plan.model_validate(store.get_run(s, run_id=run["id"]).plan).predicted
    assert obs is not None and not any(faulty)
    assert obs.terms()["compute"] > 0 and obs.terms()["tp_comm"] > 0 and start is not None
    fit = fit_factors([obs], cluster)
    assert fit.error_after < fit.error_before
    assert fit.fitted  # the factors the measurement moved, named (what /v1/plans reports as measured)
    terms = set(fit.term_error_before)
    assert {"compute", "tp_comm"} <= terms
    assert sum(fit.term_error_after[t] for t in terms) < sum(fit.term_error_before[t] for t in terms)

"""Where the time goes, end to end on the live service: the measured breakdown through REST, the SDK and the CLI,
and a straggler event for a rank slowed by ``faults.slow_rank`` (its compute, not its step time, is compared)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from api import client as sdk
from tests.ray.helpers import events, submit, tiny_spec, wait_for

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]


def meshrun(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "api.cli", "--url", url, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "COLUMNS": "200"})


@pytest.fixture(scope="module")
def slow_rank_run(live_service):
    """dp2 (zero 0) where rank 1 sleeps 0.25 s inside its compute phase every step."""
    url = live_service.url
    spec = tiny_spec("obs-slow-rank", dp=2, steps=14, faults={"slow_rank": {"rank": 1, "delay_s": 0.25}})
    run = submit(url, spec)
    return wait_for(url, run["id"], {"SUCCEEDED"}, timeout_s=400)


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

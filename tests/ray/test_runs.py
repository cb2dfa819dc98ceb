"""End to end through the REST API on the session's local Ray cluster: runs succeed, fail, get cancelled."""

from __future__ import annotations

import re
import time

import httpx
import pytest
import ray  # noqa: F401 - puts ray's vendored psutil on the path
import psutil  # noqa: E402

from tests.ray.conftest import FT_STEPS
from tests.ray.helpers import events, get_run, metrics, ray_job, status_of, submit, tiny_spec, wait_for, \
    wait_for_step

pytestmark = pytest.mark.ray


def worker_pids(url: str, run_id: str) -> dict[int, int]:
    """rank -> pid from the run's latest placement event."""
    ev = [e for e in events(url, run_id) if e["kind"] == "placement"]
    assert ev, "no placement event"
    return {int(r): int(p) for r, p in re.findall(r'"(\d+)": "[0-9a-f]+ pid (\d+)"', ev[-1]["reason"])}


def driver_pids(run_id: str) -> list[int]:
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "service.runs.driver" in cmd and f"--run-id {run_id}" in cmd:
            out.append(p.info["pid"])
    return out


def gone(pids, timeout_s: float = 30) -> list[int]:
    deadline = time.monotonic() + timeout_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
        time.sleep(0.5)
    return alive


def test_dp2_run_succeeds_with_every_step_and_ray_job(live_service, reference_dp2_run):
    url = live_service.url
    done, rows = reference_dp2_run
    run_id = done["id"]
    assert [r["step"] for r in rows] == list(range(1, FT_STEPS + 1))
    assert all(r["attempt"] == 1 for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert all(r["tokens_per_s"] and r["tokens_per_s"] > 0 and r["step_time_s"] > 0 for r in rows)
    s = done["summary"]
    assert s["steps_done"] == FT_STEPS and s["final_loss"] == pytest.approx(rows[-1]["loss"])
    assert s["wall_time_s"] > 0 and s["mean_tokens_per_s"] > 0 and s["mean_mfu"] > 0
    assert set(s["peak_memory_bytes_per_rank"]) == {"0", "1"}
    assert done["attempts"] == 1
    cost = done["cost"]  # its 2 workers x its attempt's wall time; no price is known for a CPU cluster
    assert cost["devices"] == 2 and cost["attempts_wall_s"] > 0
    assert cost["device_hours"] == pytest.approx(2 * cost["attempts_wall_s"] / 3600)
    assert cost["price_source"] == "none" and cost["usd"] is None
    assert done["rank_nodes"] and set(done["rank_nodes"]) == {"0", "1"}
    assert done["ray_job_id"].startswith(f"meshrun-{run_id}-")
    assert done["dashboard_url"] and done["ray_job_id"] in done["dashboard_url"]
    transitions = [(e["from_status"], e["to_status"]) for e in events(url, run_id) if e["kind"] == "state"]
    assert transitions == [(None, "QUEUED"), ("QUEUED", "STARTING"), ("STARTING", "RUNNING"),
                           ("RUNNING", "SUCCEEDED")]
    # checkpoints: persisted by Ray Train, recorded with step/path/size; the last `keep` exist on disk
    cks = httpx.get(f"{url}/v1/runs/{run_id}/checkpoints", timeout=30).json()["items"]
    assert [c["step"] for c in cks] == [25, 30]  # keep: 2; the pruned ones are not listed
    assert all(c["size_bytes"] for c in cks), cks
    # the Ray Job is in Ray's own job list with the run's metadata
    job = ray_job(live_service, done["ray_job_id"], until={"SUCCEEDED", "FAILED", "STOPPED"})
    assert job.metadata["run_id"] == run_id and job.metadata["name"] == "e2e-dp2-reference"
    assert job.metadata["project"] == done["project"]
    assert status_of(job) == "SUCCEEDED"
    logs = httpx.get(f"{url}/v1/runs/{run_id}/logs", timeout=30).json()["logs"]
    assert run_id in logs


def test_failing_run_is_failed_with_the_worker_error(live_service):
    url = live_service.url
    spec = tiny_spec("e2e-fails", dp=2, steps=5, data={"source": "text", "path": "/nonexistent/meshrun-corpus.txt"})
    run = submit(url, spec)
    done = wait_for(url, run["id"], {"FAILED"}, timeout_s=240)
    assert "FileNotFoundError" in done["status_reason"] and "/nonexistent/meshrun-corpus.txt" in done["status_reason"]
    final = [e for e in events(url, run["id"]) if e["kind"] == "state"][-1]
    assert final["to_status"] == "FAILED" and "/nonexistent/meshrun-corpus.txt" in final["reason"]
    assert len(final["reason"]) <= 4000
    job = ray_job(live_service, done["ray_job_id"], until={"SUCCEEDED", "FAILED", "STOPPED"})
    assert status_of(job) in ("FAILED", "SUCCEEDED")  # the driver records the failure and exits non-zero


def test_cancel_stops_the_job_and_its_workers(live_service):
    url = live_service.url
    run = submit(url, tiny_spec("e2e-cancel", dp=2, steps=5000))
    wait_for_step(url, run["id"], 2, timeout_s=240)
    pids = worker_pids(url, run["id"])
    drivers = driver_pids(run["id"])
    assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids.values())
    r = httpx.post(f"{url}/v1/runs/{run['id']}/cancel", timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "CANCELLED"
    assert gone(list(pids.values()) + drivers) == []
    done = get_run(url, run["id"])
    assert done["status"] == "CANCELLED"  # the driver did not overwrite it
    job = ray_job(live_service, done["ray_job_id"], until={"STOPPED", "FAILED", "SUCCEEDED"})
    assert status_of(job) in ("STOPPED", "FAILED")
    assert httpx.post(f"{url}/v1/runs/{run['id']}/cancel", timeout=30).status_code == 409
    kept = metrics(url, run["id"])
    assert kept and kept[0]["step"] == 1


def test_cluster_endpoint_reports_nodes_and_resources(live_service, ray_cluster):
    body = httpx.get(f"{live_service.url}/v1/cluster", timeout=30).json()
    assert body["cpus_total"] >= 4 and 0 <= body["cpus_free"] <= body["cpus_total"]
    # Ray's dashboard through the service (it adds the cluster's token): the link works for a meshrun-only user
    # on an origin of its own (service.app.ray_origin): /ray/ on the service's port redirects there
    ray_url = live_service.ray_url
    assert ray_url != live_service.url and body["dashboard_url"] == f"{ray_url}/ray/"
    page = httpx.get(body["dashboard_url"], timeout=30)
    assert page.status_code == 200 and "Ray Dashboard" in page.text
    moved = httpx.get(f"{live_service.url}/ray/api/jobs/?limit=5", timeout=30)
    assert moved.status_code == 307 and moved.headers["location"] == f"{ray_url}/ray/api/jobs/?limit=5"
    jobs = httpx.get(f"{ray_url}/ray/api/jobs/", timeout=30)
    assert jobs.status_code == 200 and isinstance(jobs.json(), list)
    assert httpx.post(f"{ray_url}/ray/api/jobs/", json={}, timeout=30).status_code == 405  # read-only
    # the dashboard's port serves nothing else, and a page there cannot act on the API
    assert httpx.get(f"{ray_url}/v1/runs", timeout=30).status_code == 404
    refused = httpx.post(f"{live_service.url}/v1/runs", json=tiny_spec("from-ray-page"), timeout=30,
                         headers={"Origin": ray_url})
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "cross_origin"
    assert any(n["alive"] and n["cpus"] > 0 for n in body["nodes"])


def test_run_that_can_never_fit_is_refused(live_service):
    r = httpx.post(f"{live_service.url}/v1/runs", json=tiny_spec("e2e-too-big", dp=64, steps=2), timeout=60)
    assert r.status_code == 422, r.text
    assert "needs 64 worker slots of 1 CPU" in r.json()["error"]["message"]


def test_3d_run_succeeds_with_clean_logs(live_service, ray_cluster):
    """dp2 x tp2 x pp2: eight workers at half a CPU each; its logs hold no error (tests/ray/test_clean_logs.py)."""
    from tests.ray.test_clean_logs import assert_clean_logs

    url = live_service.url
    spec = tiny_spec("e2e-3d", dp=2, tp=2, pp=2, steps=6, resources={"device": "cpu", "cpus_per_worker": 0.5})
    run = submit(url, spec)
    done = wait_for(url, run["id"], {"SUCCEEDED"}, timeout_s=400)
    rows = metrics(url, run["id"])
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert set(done["rank_nodes"]) == {str(r) for r in range(8)}
    assert done["plan"]["dp"] == done["plan"]["tp"] == done["plan"]["pp"] == 2
    assert_clean_logs(live_service, ray_cluster, run["id"], done["ray_job_id"])

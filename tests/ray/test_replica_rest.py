"""fault_tolerance.mode replica through the service: a replica SIGKILLed mid-run, the other keeps stepping, the run
SUCCEEDS with every step once, and the rows show the replica count dropping to 1 and back to 2."""

from __future__ import annotations

import httpx

from tests.ray.helpers import events, metrics, submit, tiny_spec, wait_for


def test_replica_run_keeps_training_through_a_killed_replica(live_service) -> None:
    url = live_service.url
    spec = tiny_spec(
        "e2e-replica-kill",
        dp=2,
        steps=16,
        fault_tolerance={"mode": "replica"},
        checkpoint={"every_steps": 4, "keep": 1},
        # the survivor's steps are slowed so that its replacement (a new process importing torch and torchft, 5-10 s
        # on a loaded 2-core machine) rejoins before the last step
        faults={"kill_rank": {"rank": 1, "at_step": 4}, "slow_rank": {"rank": 0, "delay_s": 0.8}},
        resources={"device": "cpu", "cpus_per_worker": 0.5, "max_failures": 2},
    )
    run = submit(url, spec)
    done = wait_for(url, run["id"], {"SUCCEEDED", "FAILED"}, timeout_s=400)
    assert done["status"] == "SUCCEEDED", done.get("status_reason")
    assert done["attempts"] == 1  # the worker group was never restarted
    rows = metrics(url, run["id"])
    assert [r["step"] for r in rows] == list(range(1, 17))  # every step once
    replicas = [r["replicas"] for r in rows]
    assert replicas[:3] == [2, 2, 2] and 1 in replicas and replicas[-1] == 2, replicas
    solo = [r for r in rows if r["replicas"] == 1]
    assert all(r["replica_mask"] == 1 for r in solo)  # replica 0 went on alone
    assert rows[-1]["loss"] < rows[0]["loss"]
    evs = events(url, run["id"])
    kinds = [e["kind"] for e in evs]
    assert kinds.count("replica_lost") == 1 and kinds.count("replica_rejoined") == 1, kinds
    lost = next(e["reason"] for e in evs if e["kind"] == "replica_lost")
    assert lost.startswith("replica 1 lost at step 4") and "1 of 2 replicas go on" in lost
    cks = httpx.get(f"{url}/v1/runs/{run['id']}/checkpoints", timeout=30).json()["items"]
    assert max(c["step"] for c in cks) == 16  # the replicas' checkpoints are the run's, like any run's
    resp = httpx.get(f"{url}/v1/runs/{run['id']}/goodput", timeout=30)
    assert resp.status_code == 200, resp.text
    g = resp.json()
    assert g["lost_s"]["failure_detection"] > 0  # the live replica's failed try and the new quorum
    (r0, r1) = sorted(g["replicas"], key=lambda r: r["replica"])
    assert r0["losses"] == 0 and r1["losses"] == 1
    assert r1["absent_s"] > 0 and r0["absent_s"] == 0 and r0["steps"] == 16 > r1["steps"]

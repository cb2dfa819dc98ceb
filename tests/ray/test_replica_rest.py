"""fault_tolerance.mode replica through the service: a replica SIGKILLed mid-run, the other keeps stepping, the run
SUCCEEDS with every step once, and the rows show the replica count dropping to 1 and back to 2; a replica run
preempted by a higher-priority run stops both replicas at one checkpointed step and resumes from the next; a DiLoCo
replica run and an HSDP one (replicas of FSDP shard groups) through a lost replica."""

from __future__ import annotations

import os

import httpx

from tests.ray.helpers import events, metrics, submit, tiny_spec, wait_for, wait_for_step


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


def test_a_replica_run_yields_to_a_higher_priority_run_and_resumes_where_it_stopped(live_service, monkeypatch) -> None:
    """The service's preemption reaches the replicas (issue 33): both stop after the same step, which is
    checkpointed, the run goes PREEMPTED then QUEUED, and its second attempt trains on from the next step: every step
    once, none recomputed."""
    url = live_service.url
    monkeypatch.setattr(live_service.settings, "preemption", "any")
    cpus = int(os.environ.get("MESHRUN_TEST_RAY_CPUS", "6"))  # the session cluster's CPUs: the low run takes all
    steps = 60
    low = submit(
        url,
        tiny_spec(
            "e2e-replica-preempted",
            dp=2,
            steps=steps,
            fault_tolerance={"mode": "replica"},
            checkpoint={"every_steps": 40, "keep": 2},
            faults={"slow_rank": {"rank": 0, "delay_s": 0.2}},  # >= 12 s of steps: it cannot end first
            resources={"device": "cpu", "cpus_per_worker": cpus // 2},
        ),
    )
    wait_for_step(url, low["id"], 3, timeout_s=300)
    high = submit(
        url, tiny_spec("e2e-replica-high", steps=4, resources={"device": "cpu", "cpus_per_worker": 2, "priority": 10})
    )
    wait_for(url, high["id"], {"SUCCEEDED"}, timeout_s=400)
    done = wait_for(url, low["id"], {"SUCCEEDED", "FAILED"}, timeout_s=400)
    assert done["status"] == "SUCCEEDED", done.get("status_reason")

    ev = events(url, low["id"])
    states = [(e["from_status"], e["to_status"]) for e in ev if e["kind"] == "state"]
    assert ("RUNNING", "PREEMPTED") in states and ("PREEMPTED", "QUEUED") in states, states
    preempted = next(e["reason"] for e in ev if e["to_status"] == "PREEMPTED")
    assert f"preempted by run {high['id']} (priority 10 > 0)" in preempted and "checkpoint saved" in preempted
    assert done["attempts"] == 2
    rows = metrics(url, low["id"])
    assert [r["step"] for r in rows] == list(range(1, steps + 1))  # every step once
    assert all(r["replicas"] == 2 for r in rows)  # both replicas stopped together, both came back
    first, second = ({r["step"] for r in metrics(url, low["id"], attempt=a)} for a in (1, 2))
    stopped_at = max(first)
    assert stopped_at < steps and min(second) == stopped_at + 1  # the emergency checkpoint: nothing recomputed
    recorded = [e["reason"] for e in ev if e["kind"] == "checkpoint"]
    assert any(r.startswith(f"checkpoint of step {stopped_at} at ") for r in recorded), (stopped_at, recorded)


def test_a_diloco_replica_run_keeps_training_through_a_killed_replica(live_service) -> None:
    """``layout.sync: diloco`` in replica mode through the service: the round a replica dies in is trained again by
    the survivor, the run SUCCEEDS in one attempt with every step once, and the round ends carry the divergence."""
    url = live_service.url
    spec = tiny_spec(
        "e2e-replica-diloco",
        dp=2,
        steps=12,
        layout={"sync": "diloco", "sync_every_steps": 4},
        fault_tolerance={"mode": "replica"},
        faults={"kill_rank": {"rank": 1, "at_step": 6}, "slow_rank": {"rank": 0, "delay_s": 0.5}},
        resources={"device": "cpu", "cpus_per_worker": 0.5, "max_failures": 2},
    )
    run = submit(url, spec)
    done = wait_for(url, run["id"], {"SUCCEEDED", "FAILED"}, timeout_s=400)
    assert done["status"] == "SUCCEEDED", done.get("status_reason")
    assert done["attempts"] == 1
    rows = metrics(url, run["id"])
    assert [r["step"] for r in rows] == list(range(1, 13))
    replicas = [r["replicas"] for r in rows]
    assert replicas[:4] == [2] * 4 and len(set(replicas[4:8])) == 1, replicas  # round 2 trained again, as one round
    assert rows[4]["recovery_s"] > 0
    assert [r["step"] for r in rows if r.get("replica_divergence") is not None] == [4, 8, 12]
    assert [e["kind"] for e in events(url, run["id"])].count("replica_lost") == 1


def test_an_hsdp_replica_run_loses_a_worker_and_replaces_its_shard_group(live_service) -> None:
    """HSDP's replicate dimension in replica mode through the service: dp=4 in FSDP shard groups of 2 is two replicas
    of two workers. A SIGKILLed worker loses its replica (both its workers, restarted together), the other replica
    trains on alone, the run SUCCEEDS in one attempt with every step once, and goodput counts two replicas."""
    url = live_service.url
    spec = tiny_spec(
        "e2e-replica-hsdp",
        dp=4,
        steps=12,
        layout={"zero_stage": 3, "shard_group_size": 2},
        fault_tolerance={"mode": "replica"},
        faults={"kill_rank": {"rank": 3, "at_step": 4}, "slow_rank": {"rank": 0, "delay_s": 0.8}},
        resources={"device": "cpu", "cpus_per_worker": 0.5, "max_failures": 2},
    )
    run = submit(url, spec)
    assert (run["plan"]["dp_replicate"], run["plan"]["dp_shard"]) == (2, 2)
    done = wait_for(url, run["id"], {"SUCCEEDED", "FAILED"}, timeout_s=400)
    assert done["status"] == "SUCCEEDED", done.get("status_reason")
    assert done["attempts"] == 1
    rows = metrics(url, run["id"])
    assert [r["step"] for r in rows] == list(range(1, 13))  # every step once
    replicas = [r["replicas"] for r in rows]
    assert replicas[:3] == [2, 2, 2] and 1 in replicas, replicas
    assert all(r["replica_mask"] == 1 for r in rows if r["replicas"] == 1)  # replica 0 went on alone
    evs = events(url, run["id"])
    placements = [e["reason"] for e in evs if e["kind"] == "placement"]
    assert len(placements) == 2, placements  # the attempt's four ranks, then the replacement's two
    assert all(f'"{k}":' in placements[0] for k in "0123") and '"2":' in placements[1] and '"3":' in placements[1]
    lost = next(e["reason"] for e in evs if e["kind"] == "replica_lost")
    assert lost.startswith("replica 1 lost at step 4") and "1 of 2 replicas go on" in lost
    g = httpx.get(f"{url}/v1/runs/{run['id']}/goodput", timeout=30).json()
    assert sorted(r["replica"] for r in g["replicas"]) == [0, 1]  # replicas, not workers
    assert next(r for r in g["replicas"] if r["replica"] == 1)["losses"] == 1

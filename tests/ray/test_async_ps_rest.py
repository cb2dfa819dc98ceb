"""async_ps runs through the service: a killed worker or a killed parameter server, the run goes on and SUCCEEDS."""

from __future__ import annotations

import re

from tests.ray.helpers import events, metrics, submit, tiny_spec, wait_for

STEPS = 12


def test_async_ps_run_survives_a_killed_worker(live_service) -> None:
    url = live_service.url
    # the rank that dies is the paced one (1.5 s more per step, the math unchanged), and its peer is not: so the
    # survivor always runs ahead, up to max_staleness updates past the last one the lost worker pushed, and the
    # supervisor's remove_worker applies those without it however late it notices the death. (Pacing the survivor
    # instead made the outcome a race: on a loaded machine the death was seen before the survivor had pushed past
    # the dead worker's last step, so every update had both workers and the replacement rejoined at once.)
    spec = tiny_spec(
        "e2e-async-ps-kill",
        dp=2,
        steps=STEPS,
        layout={"sync": "async_ps", "max_staleness": 2},
        faults={"kill_rank": {"rank": 1, "at_step": 5}, "slow_rank": {"rank": 1, "delay_s": 1.5}},
        resources={"device": "cpu", "cpus_per_worker": 0.5, "max_failures": 1},
    )
    run = submit(url, spec)
    done = wait_for(url, run["id"], {"SUCCEEDED"}, timeout_s=400)
    assert done["status"] == "SUCCEEDED"
    rows = metrics(url, run["id"])
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # every update applied, in order
    assert all(r["staleness_max"] <= 2 for r in rows)
    workers = [r["workers_in_update"] for r in rows]
    assert 1 in workers, workers  # some updates went on without the lost worker
    assert 2 in workers[workers.index(1) :], workers  # and its replacement rejoined after them
    kinds = [e["kind"] for e in events(url, run["id"])]
    assert "worker_lost" in kinds


def test_async_ps_run_restores_a_killed_parameter_server(live_service) -> None:
    """``faults.kill_ps``: server 1's process dies once it has applied update 5; every server restarts from the latest
    complete checkpoint (every 2 updates), the workers re-pull, and the run SUCCEEDS with every step."""
    url = live_service.url
    spec = tiny_spec(
        "e2e-async-ps-kill-server",
        dp=2,
        steps=8,
        layout={"sync": "async_ps", "max_staleness": 1, "ps_shards": 2},
        optimizer={"grad_clip": None},
        checkpoint={"every_steps": 2, "keep": 1},
        faults={"kill_ps": {"shard": 1, "at_step": 5}},
        resources={"device": "cpu", "cpus_per_worker": 0.5},
    )
    run = submit(url, spec)
    done = wait_for(url, run["id"], {"SUCCEEDED"}, timeout_s=400)
    assert done["status"] == "SUCCEEDED"
    restored = [e["reason"] for e in events(url, run["id"]) if e["kind"] == "ps_restored"]
    assert len(restored) == 1, restored
    m = re.search(r"parameter server 1 lost; all 2 server\(s\) restored from the checkpoint of step (\d+)", restored[0])
    assert m is not None, restored[0]
    assert int(m.group(1)) in (2, 4, 6)
    rows = metrics(url, run["id"])
    assert [r["step"] for r in rows] == list(range(1, 9))  # the steps after the checkpoint were trained again
    losses = [r["loss"] for r in rows]
    assert losses[-1] < losses[int(m.group(1))] < losses[0]  # and the loss kept falling after the restore

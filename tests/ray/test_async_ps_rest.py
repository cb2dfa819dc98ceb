"""An async_ps run through the service: one worker is killed mid-run, the run goes on and SUCCEEDS."""

from __future__ import annotations

from tests.ray.helpers import events, metrics, submit, tiny_spec, wait_for


def test_async_ps_run_survives_a_killed_worker(live_service) -> None:
    url = live_service.url
    spec = tiny_spec(
        "e2e-async-ps-kill",
        dp=2,
        steps=8,
        layout={"sync": "async_ps", "max_staleness": 2},
        faults={"kill_rank": {"rank": 1, "at_step": 3}},
        resources={"device": "cpu", "cpus_per_worker": 0.5, "max_failures": 1},
    )
    run = submit(url, spec)
    done = wait_for(url, run["id"], {"SUCCEEDED"}, timeout_s=400)
    assert done["status"] == "SUCCEEDED"
    rows = metrics(url, run["id"])
    assert [r["step"] for r in rows] == list(range(1, 9))  # every update applied, in order
    assert all(r["staleness_max"] <= 2 for r in rows)
    assert min(r["workers_in_update"] for r in rows) == 1  # some updates went on without the lost worker
    assert rows[-1]["workers_in_update"] == 2  # its replacement rejoined
    kinds = [e["kind"] for e in events(url, run["id"])]
    assert "worker_lost" in kinds

"""The SDK against the Ray-backed live service (tests/conftest.py ``live_service``): real training runs."""

from __future__ import annotations

import uuid

import pytest

from api import client as sdk

pytestmark = pytest.mark.ray

TINY = {"model": {"name": "gpt", "preset": "tiny"}, "layout": {"dp": 2},
        "batch": {"global_batch_size": 8, "micro_batch_size": 2}, "train": {"steps": 6},
        "checkpoint": {"every_steps": 3, "keep": 2}}


@pytest.fixture()
def rclient(ray_service_url):
    with sdk.Client(ray_service_url, timeout=30) as c:
        yield c


def test_full_lifecycle_on_ray(rclient):
    from rich.console import Console

    console = Console(record=True, width=160, force_terminal=False)
    run = rclient.runs.create({**TINY, "name": f"sdk-life-{uuid.uuid4().hex[:8]}"})
    run.wait(progress=console, timeout=600, poll_interval_s=0.5)
    assert run.status == sdk.RunStatus.SUCCEEDED, run.status_reason
    assert "6/6" in console.export_text()
    rows = run.metrics()
    assert [r.step for r in rows] == list(range(1, 7))
    assert all(r.loss is not None and r.tokens_per_s and r.tokens_per_s > 0 for r in rows)
    assert run.summary is not None and run.summary.steps_done == 6 and run.summary.final_loss is not None
    assert [e.to_status for e in run.events() if e.kind == "state"][-1] == "SUCCEEDED"
    assert {c.step for c in run.checkpoints()} >= {6}
    assert isinstance(run.logs(), str)



def test_cancel_then_resume_on_another_layout(rclient):
    import time

    run = rclient.runs.create({**TINY, "name": f"sdk-resume-{uuid.uuid4().hex[:8]}", "train": {"steps": 40},
                               "checkpoint": {"every_steps": 2, "keep": 2}})
    deadline = time.monotonic() + 600
    while not run.checkpoints() and not run.refresh().done and time.monotonic() < deadline:
        time.sleep(0.5)
    assert run.checkpoints(), f"no checkpoint written: {run.refresh().status} {run.status_reason}"
    run.cancel()
    assert run.wait(timeout=180).status == sdk.RunStatus.CANCELLED
    with pytest.raises(sdk.ConflictError):
        run.cancel()
    last_ckpt = max(c.step for c in run.checkpoints())
    # resume from the latest checkpoint on another layout (resharded), for fewer total steps
    resumed = rclient.runs.resume(run.id, layout="dp=1,tp=2", steps=last_ckpt + 3)
    final = resumed.wait(timeout=600, poll_interval_s=0.5)
    assert final.status == sdk.RunStatus.SUCCEEDED, final.status_reason
    assert final.spec.layout.tp == 2 and final.attempts >= 2
    rows = final.metrics()
    end = last_ckpt + 3
    assert [r.step for r in rows][:end] == list(range(1, end + 1))
    assert {r.attempt for r in rows if last_ckpt < r.step <= end} == {final.attempts}  # replayed by the resume
    assert [r.step for r in final.metrics(attempt=final.attempts)] == list(range(last_ckpt + 1, end + 1))


def test_cluster_reports_cpus_and_dashboard(rclient):
    cl = rclient.cluster.get()
    # the session's cluster may list nodes that other tests added and removed: dead nodes are reported
    # (alive=False) but never counted
    alive = [n for n in cl.nodes if n.alive]
    assert alive and cl.cpus_total == pytest.approx(sum(n.cpus for n in alive)) and cl.cpus_total > 0
    assert 0 <= cl.cpus_free <= cl.cpus_total
    assert cl.dashboard_url and cl.dashboard_url.startswith("http://")

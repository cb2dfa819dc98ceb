"""GET /v1/runs/{id}/goodput over HTTP: read from the stored events, attempts and metric rows of every attempt."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import update

from service import store
from service.store.db import session_scope
from service.store.models import Run, RunAttempt, RunEvent

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _at(s: float) -> datetime:
    return T0 + timedelta(seconds=s)


def test_goodput_of_a_run_restarted_after_a_failure(client) -> None:
    with session_scope(client.app.state.session_factory) as s:
        run, _ = store.create_run(s, spec={"name": "g"}, plan=None, name="g")
        rid = run.id
        store.transition(s, run_id=rid, to="STARTING", reason="admitted")
        store.transition(s, run_id=rid, to="RUNNING", reason="driver")
        store.start_attempt(s, run_id=rid, cause="start")
        store.add_event(s, run_id=rid, kind="worker_error", reason="attempt 1 failed: boom")
        store.start_attempt(s, run_id=rid, cause="restart")
        # steps 1..4 of attempt 1 (1 s each, from t=20), steps 3..6 of attempt 2 (from t=40)
        rows1 = [{"step": k, "step_time_s": 1.0, "time": _at(20 + k).timestamp()} for k in range(1, 5)]
        # attempt 2 saves a checkpoint after step 4 that holds its loop for 2 s: steps 5 and 6 come 2 s later
        rows2 = [{"step": k, "step_time_s": 1.0, "time": _at(40 + k - 2 + (2 if k > 4 else 0)).timestamp()}
                 for k in range(3, 7)]  # fmt: skip
        store.add_metrics(s, run_id=rid, attempt=1, rows=rows1)
        store.add_metrics(s, run_id=rid, attempt=2, rows=rows2)
        store.add_checkpoint(s, run_id=rid, attempt=2, step=4, path="/ck/4")
        store.end_run(s, run_id=rid, to="SUCCEEDED", reason="done")
        s.execute(update(Run).where(Run.id == rid).values(created_at=_at(0), finished_at=_at(50)))
        times = {"QUEUED": 0, "STARTING": 10, "RUNNING": 11, "SUCCEEDED": 50}
        for status, t in times.items():
            s.execute(update(RunEvent).where(RunEvent.run_id == rid, RunEvent.to_status == status).values(time=_at(t)))
        s.execute(update(RunEvent).where(RunEvent.run_id == rid, RunEvent.kind == "worker_error").values(time=_at(27)))
        for n, t in ((1, 12), (2, 30)):
            s.execute(
                update(RunAttempt).where(RunAttempt.run_id == rid, RunAttempt.attempt == n).values(started_at=_at(t))
            )

    g = client.get(f"/v1/runs/{rid}/goodput").json()
    assert g["status"] == "SUCCEEDED" and g["attempts"] == 2
    assert g["wall_s"] == pytest.approx(50)
    assert g["recomputed_steps"] == 2  # steps 3 and 4 ran twice
    assert g["productive_s"] == pytest.approx(6)  # steps 1..6 once
    lost = g["lost_s"]
    assert lost["queue"] == pytest.approx(10)
    assert lost["startup"] == pytest.approx(20 - 10)  # STARTING -> start of step 1
    assert lost["failure_detection"] == pytest.approx(27 - 24)  # end of step 4 -> the worker error
    assert lost["restart"] == pytest.approx(40 - 27)  # the error -> start of the first step of attempt 2
    assert lost["recomputed_steps"] == pytest.approx(2)
    assert lost["checkpoint_stall"] == pytest.approx(2)  # end of step 4 -> start of step 5 of the same attempt
    assert g["goodput"] == pytest.approx(6 / 50)
    assert g["productive_s"] + sum(lost.values()) == pytest.approx(g["wall_s"])
    one, two = g["attempts_detail"]
    assert one["attempt"] == 1 and one["productive_s"] == pytest.approx(2)  # steps 3 and 4 were redone
    assert one["lost_s"]["startup"] == pytest.approx(10) and one["lost_s"]["recomputed_steps"] == pytest.approx(2)
    assert two["attempt"] == 2 and two["productive_s"] == pytest.approx(4)
    assert {k: v for k, v in two["lost_s"].items() if v} == pytest.approx(
        {"failure_detection": 3, "restart": 13, "checkpoint_stall": 2})
    assert client.get("/v1/runs/run-000000000000/goodput").status_code == 404
    page = client.get(f"/runs/{rid}")
    assert page.status_code == 200
    card = page.text.split('id="goodput"', 1)[1].split("</div>", 1)[0]
    assert "12.0%" in card and "restart" in card  # 12% of 50 s; the largest causes
    lost_cells = [row.split('class="small attempt-lost">', 1)[1].split("</td>", 1)[0]
                  for row in page.text.split('<tr class="attempt-row">')[1:]]  # fmt: skip
    assert len(lost_cells) == 2 and "startup" in lost_cells[0] and "checkpoint stall" in lost_cells[1], lost_cells


def test_goodput_of_a_replica_mode_run(client) -> None:
    """fault_tolerance replica: one attempt; replica 1 lost after step 2 and back at step 5. The live replica's wait
    for a quorum without it is failure detection, its wait while the replacement healed is restart, and each
    replica's steps and time out come from the rows' replica masks (JSON in ``extra``, on SQLite and PostgreSQL)."""
    spec = {"name": "r", "layout": {"dp": 2}, "fault_tolerance": {"mode": "replica"}}
    with session_scope(client.app.state.session_factory) as s:
        run, _ = store.create_run(s, spec=spec, plan=None, name="r")
        rid = run.id
        store.transition(s, run_id=rid, to="STARTING", reason="admitted")
        store.transition(s, run_id=rid, to="RUNNING", reason="driver")
        store.start_attempt(s, run_id=rid, cause="start")
        store.add_event(s, run_id=rid, kind="replica_lost", reason="replica 1 lost at step 3 (ActorDiedError); ...")
        masks = {1: 3, 2: 3, 3: 1, 4: 1, 5: 3, 6: 3}
        rows = [{"step": k, "step_time_s": 1.0, "replicas": bin(m).count("1"), "replica_mask": m,
                 "time": _at(10 + k).timestamp()} for k, m in masks.items()]  # fmt: skip
        rows[2]["recovery_s"], rows[4]["rejoin_s"] = 1.5, 0.25
        store.add_metrics(s, run_id=rid, attempt=1, rows=rows)
        store.end_run(s, run_id=rid, to="SUCCEEDED", reason="done")
    g = client.get(f"/v1/runs/{rid}/goodput").json()
    assert g["attempts"] == 1
    assert g["lost_s"]["failure_detection"] == pytest.approx(1.5) and g["lost_s"]["restart"] == pytest.approx(0.25)
    r0, r1 = g["replicas"]
    assert r0 == {"replica": 0, "steps": 6, "productive_s": 6.0, "absent_s": 0.0, "losses": 0}
    assert r1 == {"replica": 1, "steps": 4, "productive_s": 4.0, "absent_s": 2.0, "losses": 1}
    page = client.get(f"/runs/{rid}")
    table = page.text.split('id="replicas"', 1)[1].split("</table>", 1)[0]
    assert table.count('<tr class="replica-row">') == 2


def test_goodput_of_a_group_mode_run_has_no_replica_split(client) -> None:
    with session_scope(client.app.state.session_factory) as s:
        run, _ = store.create_run(s, spec={"name": "g"}, plan=None, name="g")
        rid = run.id
    g = client.get(f"/v1/runs/{rid}/goodput").json()
    assert g["replicas"] is None

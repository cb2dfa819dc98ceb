"""The sweep and trial state machines (``service.sweeps.state``): legal moves only, every transition stored with its
reason and actor, and served by ``GET /v1/sweeps/{id}/events`` (SQLite, no Ray)."""

from __future__ import annotations

import pytest

from service import store
from service.store.db import session_scope
from service.store.models import Trial
from service.sweeps import TrialStatus, finish_sweep, get_sweep, transition_sweep, transition_trial
from service.sweeps.state import SWEEP_ALLOWED, TRIAL_ALLOWED, SweepStatus
from service.sweeps.trials import TrialRun, close_trial, conclude_trial, prepare_trial_run, wait_for_admission
from service.runs.lifecycle import Outcome
from api.sdk import Client
from api.spec import RunStatus
from tests.sweeps.test_api import body


def _events(api, sweep_id: str) -> list[dict]:
    r = api.get(f"/v1/sweeps/{sweep_id}/events")
    assert r.status_code == 200, r.text
    assert r.json()["sweep_id"] == sweep_id
    return r.json()["items"]


def test_terminal_states_never_change():
    for status in SweepStatus.TERMINAL:
        assert SWEEP_ALLOWED[status] == frozenset()
    for status in TrialStatus.TERMINAL:
        assert TRIAL_ALLOWED[status] == frozenset()
    assert TrialStatus.EARLY_STOPPED not in TRIAL_ALLOWED[TrialStatus.PENDING]  # only a running trial stops early


def test_creation_stores_the_sweep_and_every_trial_with_its_reason(api):
    sw = api.post("/v1/sweeps", json=body()).json()
    ev = _events(api, sw["id"])
    created = ev[0]
    assert created["trial_id"] is None and created["to_status"] == "QUEUED" and created["from_status"] is None
    assert created["actor"] == "local" and "10 trials, 8 to run, 2 skipped" in created["reason"]
    per_trial = {e["trial_id"]: e for e in ev[1:]}
    assert set(per_trial) == {t["id"] for t in sw["trials"]}
    for t in sw["trials"]:
        assert per_trial[t["id"]]["to_status"] == t["status"] and per_trial[t["id"]]["reason"] == t["reason"]
    assert api.get("/v1/sweeps/sweep-doesnotexist/events").status_code == 404


def test_illegal_moves_are_refused_and_nothing_is_recorded(api):
    sw = api.post("/v1/sweeps", json=body()).json()
    factory = api.app.state.session_factory
    n = len(_events(api, sw["id"]))
    with session_scope(factory) as s:
        sweep = get_sweep(s, sweep_id=sw["id"])
        with pytest.raises(store.Conflict, match="is QUEUED; it cannot become SUCCEEDED"):
            transition_sweep(s, sweep=sweep, to="SUCCEEDED", reason="too early")
        t = s.query(Trial).filter(Trial.sweep_id == sw["id"], Trial.status == "PENDING").first()
        with pytest.raises(store.Conflict, match="is PENDING; it cannot become EARLY_STOPPED"):
            transition_trial(s, trial=t, to="EARLY_STOPPED", reason="never ran")
        skipped = s.query(Trial).filter(Trial.sweep_id == sw["id"], Trial.status == "SKIPPED").first()
        with pytest.raises(store.Conflict):
            transition_trial(s, trial=skipped, to="RUNNING", reason=None)
    assert len(_events(api, sw["id"])) == n


def test_a_trials_life_as_a_run_is_recorded_step_by_step(api):
    """What the sweep driver does for one trial: prepare (run STARTING, trial RUNNING), the run ends, the trial
    concludes; another trial is closed by Tune before it started; the sweep finishes."""
    sw = api.post("/v1/sweeps", json=body()).json()
    factory = api.app.state.session_factory
    with session_scope(factory) as s:
        transition_sweep(s, sweep=get_sweep(s, sweep_id=sw["id"]), to="RUNNING", reason="driver started",
                         actor="sweep-driver")
    pending = [t["id"] for t in sw["trials"] if t["status"] == "PENDING"]
    tr = prepare_trial_run(factory, sw["id"], pending[0], job_id="meshrun-x-1", tune_trial_id="tune-0")
    assert isinstance(tr, TrialRun) and tr.spec.train.steps == 6 and tr.spec.name.endswith(f"-t{pending[0]}")
    assert prepare_trial_run(factory, sw["id"], pending[0], job_id="j", tune_trial_id="t") is None  # not PENDING
    run = api.get(f"/v1/runs/{tr.run_id}").json()
    # the trial's run waits in the scheduler's queue like any run; the scheduler admits it (STARTING)
    assert run["status"] == "QUEUED" and run["sweep_id"] == sw["id"] and run["ray_job_id"] == "meshrun-x-1"
    assert run["status_reason"].endswith("waiting for admission")
    assert wait_for_admission(factory, tr.run_id, timeout_s=0) == RunStatus.QUEUED
    with session_scope(factory) as s:
        store.transition(s, run_id=tr.run_id, to=RunStatus.STARTING, reason="admitted", actor="scheduler")
    assert wait_for_admission(factory, tr.run_id, timeout_s=0) == RunStatus.STARTING
    with session_scope(factory) as s:
        store.transition(s, run_id=tr.run_id, to=RunStatus.RUNNING, reason="trial driver started")
        store.end_run(s, run_id=tr.run_id, to=RunStatus.CANCELLED, reason="early-stopped: slow")
    conclude_trial(factory, tr, Outcome(RunStatus.CANCELLED, "early-stopped: slow"), external=None)
    close_trial(factory, sw["id"], pending[1], early_stop_reason=None, error="the trial actor died")
    close_trial(factory, sw["id"], pending[0], early_stop_reason=None, error="late")  # already concluded: no-op

    done = finish_sweep(factory, sw["id"])
    assert done.status == "FAILED"  # nothing measured
    ev = _events(api, sw["id"])
    moves = [(e["trial_id"], e["from_status"], e["to_status"]) for e in ev if e["kind"] == "state"]
    assert (None, "QUEUED", "RUNNING") in moves and (None, "RUNNING", "FAILED") == moves[-1]
    assert (pending[0], "PENDING", "RUNNING") in moves and (pending[0], "RUNNING", "EARLY_STOPPED") in moves
    assert (pending[1], "PENDING", "FAILED") in moves
    # every other pending trial was closed when the sweep finished, with the reason
    for tid in pending[2:]:
        last = [e for e in ev if e["trial_id"] == tid][-1]
        assert last["to_status"] == "FAILED" and last["reason"].startswith("not run: ")
    closed = next(e for e in ev if e["trial_id"] == pending[1] and e["to_status"] == "FAILED")
    assert closed["reason"] == "trial failed: the trial actor died" and closed["actor"] == "sweep-driver"


def test_cancel_records_the_sweep_and_its_trials(api, fake_runtime):
    sw = api.post("/v1/sweeps", json=body()).json()
    assert api.post(f"/v1/sweeps/{sw['id']}/cancel").json()["status"] == "CANCELLED"
    ev = _events(api, sw["id"])
    assert any(e["kind"] == "ray" and sw["ray_job_id"] in e["reason"] for e in ev)  # the submission
    cancelled = [e for e in ev if e["to_status"] == "CANCELLED"]
    assert cancelled[0]["trial_id"] is None and cancelled[0]["reason"] == "cancelled by local"
    assert len(cancelled) == 1 + sum(t["status"] == "PENDING" for t in sw["trials"])
    assert all(e["actor"] == "local" for e in cancelled)
    # the SDK reads the same events
    sdk_events = Client("http://testserver", http_client=api).sweeps.events(sw["id"])
    assert [(e.trial_id, e.to_status, e.reason) for e in sdk_events] == [
        (e["trial_id"], e["to_status"], e["reason"]) for e in ev
    ]


def test_a_running_trial_shows_its_phase_from_its_runs_status_and_steps(api):
    """queued -> starting (re-meshing in a warm group) -> warm-up k/w -> measuring k/n (budget: 6 steps, 2 of
    warm-up), then no phase once ended;
    served by GET /v1/sweeps/{id}, the CLI's table and the console's sweep page."""
    from api.cli.sweeps import _sweep_table
    from api.spec import SweepPublic

    sw = api.post("/v1/sweeps", json=body()).json()
    factory = api.app.state.session_factory
    with session_scope(factory) as s:
        t = s.query(Trial).filter(Trial.sweep_id == sw["id"], Trial.status == "PENDING").first()
        run, _ = store.create_run(s, spec={"name": "trial"}, plan=None, name="trial")
        t.run_id, trial_id, run_id = run.id, t.id, run.id
        transition_trial(s, trial=t, to="RUNNING", reason="started")

    def phase() -> str | None:
        got = api.get(f"/v1/sweeps/{sw['id']}").json()
        return next(x["phase"] for x in got["trials"] if x["id"] == trial_id)

    assert phase() == "queued"
    with session_scope(factory) as s:
        store.transition(s, run_id=run_id, to="STARTING", reason="admitted")
    assert phase() == "starting"
    with session_scope(factory) as s:  # a warm group's trial: its latest phase says it re-meshes the group
        store.add_phase(s, run_id=run_id, phase="re-meshing warm worker group #1 (2 workers, 3 trial(s) before)")
    assert phase() == "re-meshing"
    with session_scope(factory) as s:
        store.transition(s, run_id=run_id, to="RUNNING", reason="driver")
        store.start_attempt(s, run_id=run_id, cause="start")
        store.add_metrics(s, run_id=run_id, attempt=1, rows=[{"step": 1, "loss": 5.0}])
    assert phase() == "warm-up 1/2"
    with session_scope(factory) as s:
        store.add_metrics(s, run_id=run_id, attempt=1, rows=[{"step": k, "loss": 5.0} for k in (2, 3, 4)])
    assert phase() == "measuring 2/4"
    shown = SweepPublic.model_validate(api.get(f"/v1/sweeps/{sw['id']}").json())
    from rich.console import Console

    console = Console(record=True, width=250)
    console.print(_sweep_table(shown))
    assert "RUNNING (measuring 2/4)" in console.export_text()
    assert "measuring 2/4" in api.get(f"/sweeps/{sw['id']}").text
    with session_scope(factory) as s:
        t = s.get(Trial, trial_id)
        transition_trial(s, trial=t, to="SUCCEEDED", reason="done")
    assert phase() is None


class _Jobs:
    """A Ray Jobs client that records submissions (the logic around it is under test, not Ray)."""

    def __init__(self):
        self.submitted: list[str] = []

    def submit(self, *, submission_id, **kw):
        if submission_id in self.submitted:
            raise RuntimeError(f"Job with submission_id {submission_id} already exists")
        self.submitted.append(submission_id)

    def state(self, job_id):
        from service.cluster.jobs import JobState

        return JobState("PENDING" if job_id in self.submitted else "MISSING")

    def reset(self):
        pass


def test_a_new_sweep_is_submitted_once_when_the_route_and_the_tick_race(api, monkeypatch):
    """The tick lists the QUEUED sweeps, the route submits the new one meanwhile, then the tick reaches it: it must see
    the job the route submitted (a second job ran the same trials twice, and half of them failed)."""
    from service.sweeps import execution

    sw = api.post("/v1/sweeps", json=body()).json()
    factory = api.app.state.session_factory
    jobs = _Jobs()

    class Host:
        settings = api.app.state.settings
        gcs_address = "127.0.0.1:1"
        dashboard_url = None

        def __init__(self):
            self.factory, self.jobs = factory, jobs

        def planning_cluster(self):
            return None

    host = Host()
    monkeypatch.setattr(execution, "_runtime_env", lambda *a, **k: {})
    real_sweeps_in = execution.sweeps_in

    def listed_then_route_submits(s, **kw):
        listed = real_sweeps_in(s, **kw)  # the tick's list: read before the route's submission
        assert execution.start_sweep(host, sw["id"])  # the route's
        return listed

    monkeypatch.setattr(execution, "sweeps_in", listed_then_route_submits)
    assert execution.start_queued_sweeps(host) == []
    assert jobs.submitted == [f"meshrun-{sw['id']}-1"]
    with session_scope(factory) as s:
        assert get_sweep(s, sweep_id=sw["id"]).ray_job_id == f"meshrun-{sw['id']}-1"
    jobs.submitted.clear()  # that job ended before its driver started (MISSING): the next tick submits the next one
    monkeypatch.setattr(execution, "sweeps_in", real_sweeps_in)
    assert execution.start_queued_sweeps(host) == [sw["id"]]
    assert jobs.submitted == [f"meshrun-{sw['id']}-2"]


def test_a_superseded_sweep_driver_runs_nothing(api, monkeypatch):
    """Of two Ray Jobs of one sweep, the one the sweep names runs it; the earlier one exits before touching it."""
    from service.sweeps import driver

    sw = api.post("/v1/sweeps", json=body()).json()
    factory = api.app.state.session_factory
    with session_scope(factory) as s:
        get_sweep(s, sweep_id=sw["id"]).ray_job_id = f"meshrun-{sw['id']}-2"
    monkeypatch.setattr(driver, "_job_id", lambda: f"meshrun-{sw['id']}-1")
    assert driver.run_sweep(api.app.state.settings, sw["id"]) == "superseded"
    with session_scope(factory) as s:
        sweep = get_sweep(s, sweep_id=sw["id"])
        assert (sweep.status, sweep.ray_job_id) == ("QUEUED", f"meshrun-{sw['id']}-2")

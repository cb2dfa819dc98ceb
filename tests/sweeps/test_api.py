"""/v1/sweeps through HTTP (SQLite, no Ray): create, list, get, cancel, idempotency, errors; the sweep's Ray Job
submission and finishing (best trial, calibration) with a fake runtime."""

from __future__ import annotations

from api.spec import SweepPublic
from service import store
from service.store.calibrations import cluster_key, latest_factors
from service.store.db import session_scope
from service.store.models import Trial
from service.sweeps import finish_sweep, get_sweep, transition_sweep
from tests.sweeps.conftest import cpu_cluster, tiny_base

LAYOUTS = [{"dp": 2}, {"tp": 2}, {"pp": 2}, {"dp": 2, "tp": 2}, {"tp": 3}]


def body(**over):
    b = {"name": "api-sweep", "base": tiny_base(), "search": {"layouts": LAYOUTS, "micro_batch_sizes": [1, 2]},
         "budget": {"max_trials": 8, "steps_per_trial": 6, "warmup_steps": 2, "max_concurrent_trials": 1}}
    b.update(over)
    return b


def test_create_without_runtime_stores_queued_trials(api):
    r = api.post("/v1/sweeps", json=body())
    assert r.status_code == 201, r.text
    sw = SweepPublic.model_validate(r.json())
    assert sw.status == "QUEUED" and sw.objective == "tokens_per_s" and sw.ray_job_id is None
    assert len(sw.trials) == 10
    skipped = [t for t in sw.trials if t.status == "SKIPPED"]
    assert len(skipped) == 2 and all("layout.tp" in t.reason for t in skipped)
    assert all(t.status == "PENDING" and t.run_id is None for t in sw.trials if t.layout.tp != 3)
    assert sw.spec.base.name == "sw"

    got = api.get(f"/v1/sweeps/{sw.id}")
    assert got.status_code == 200 and got.json()["id"] == sw.id
    page = api.get("/v1/sweeps", params={"status": "QUEUED"}).json()
    assert page["total"] == 1 and page["items"][0]["id"] == sw.id
    assert api.get("/v1/sweeps", params={"status": "RUNNING"}).json()["total"] == 0
    assert api.get("/v1/sweeps", params={"status": "BOGUS"}).status_code == 422


def test_errors_name_the_field(api):
    r = api.post("/v1/sweeps", json=body(search={"layouts": "auto"}))
    assert r.status_code == 422 and r.json()["error"]["param"] == "search.layouts"
    r = api.post("/v1/sweeps", json=body(search={"layouts": [{"tp": 3}]}))
    assert r.status_code == 422 and "tp=3" in r.json()["error"]["message"]
    r = api.post("/v1/sweeps", json=body(budget={"steps_per_trial": 4, "warmup_steps": 4}))
    assert r.status_code == 422 and r.json()["error"]["param"] == "budget.warmup_steps"
    r = api.post("/v1/sweeps", json=body(objective="loss"))
    assert r.status_code == 422
    r = api.post("/v1/sweeps", json=body(name="bad name!"))
    assert r.status_code == 422 and r.json()["error"]["param"] == "name"
    r = api.post("/v1/sweeps", json=body(bogus=1))
    assert r.status_code == 422
    assert api.get("/v1/sweeps/sweep-doesnotexist").status_code == 404
    assert api.post("/v1/sweeps/sweep-doesnotexist/cancel").status_code == 404


def test_yaml_body_and_idempotency(api):
    import yaml

    text = yaml.safe_dump(body())
    r1 = api.post("/v1/sweeps", content=text, headers={"Content-Type": "application/yaml", "Idempotency-Key": "k1"})
    r2 = api.post("/v1/sweeps", content=text, headers={"Content-Type": "application/yaml", "Idempotency-Key": "k1"})
    assert r1.status_code == 201 and r2.status_code == 200 and r1.json()["id"] == r2.json()["id"]
    assert r2.headers["Idempotent-Replayed"] == "true"
    r3 = api.post("/v1/sweeps", json=body(name="other"), headers={"Idempotency-Key": "k1"})
    assert r3.status_code == 409


def test_cancel_queued_then_conflict(api):
    sid = api.post("/v1/sweeps", json=body()).json()["id"]
    r = api.post(f"/v1/sweeps/{sid}/cancel")
    assert r.status_code == 200 and r.json()["status"] == "CANCELLED"
    assert all(t["status"] in ("CANCELLED", "SKIPPED") for t in r.json()["trials"])
    assert api.post(f"/v1/sweeps/{sid}/cancel").status_code == 409


def test_with_runtime_predicts_submits_one_job_and_reconciles(api, fake_runtime):
    r = api.post("/v1/sweeps", json=body())
    assert r.status_code == 201, r.text
    sw = r.json()
    assert sw["ray_job_id"] == f"meshrun-{sw['id']}-1"
    [job] = fake_runtime.jobs.submitted
    assert job["entrypoint"].endswith(f"-m service.sweeps.driver --sweep-id {sw['id']}")
    assert job["metadata"]["sweep_id"] == sw["id"] and job["metadata"]["meshrun"] == "sweep"
    env = job["runtime_env"]["env_vars"]
    assert "MESHRUN_DATABASE_URL" not in env and "MESHRUN_PLACEMENT" not in env
    with open(env["MESHRUN_DATABASE_URL_FILE"]) as f:
        assert f.read().startswith("sqlite")
    runnable = [t for t in sw["trials"] if t["status"] == "PENDING"]
    assert runnable and all(t["predicted_tokens_per_s"] > 0 for t in runnable)
    assert sw["calibration"]["status"] == "pending" and sw["calibration"]["cluster"]["device"] == "cpu"

    # the job dies without the driver finishing: GET reconciles the sweep to FAILED
    fake_runtime.jobs.states[sw["ray_job_id"]] = "FAILED"
    got = api.get(f"/v1/sweeps/{sw['id']}").json()
    assert got["status"] == "FAILED" and "sweep driver lost" in got["status_reason"]
    assert all(t["status"] in ("FAILED", "SKIPPED") for t in got["trials"])


def test_cancel_running_stops_the_job_and_cancels_trial_runs(api, fake_runtime):
    sw = api.post("/v1/sweeps", json=body()).json()
    factory = api.app.state.session_factory
    with session_scope(factory) as s:  # a trial started by the driver: a run in STARTING with the sweep's job
        t = s.query(Trial).filter(Trial.sweep_id == sw["id"], Trial.status == "PENDING").first()
        run, _ = store.create_run(s, spec=tiny_base(), plan=None, sweep_id=sw["id"])
        store.transition(s, run_id=run.id, to="STARTING", reason="trial", ray_job_id=sw["ray_job_id"])
        t.run_id, t.status = run.id, "RUNNING"
        get_sweep(s, sweep_id=sw["id"]).status = "RUNNING"
        run_id, trial_id = run.id, t.id
    r = api.post(f"/v1/sweeps/{sw['id']}/cancel")
    assert r.status_code == 200 and r.json()["status"] == "CANCELLED"
    assert fake_runtime.jobs.stopped == [sw["ray_job_id"]]
    trial = next(t for t in r.json()["trials"] if t["id"] == trial_id)
    assert trial["status"] == "CANCELLED" and trial["run_id"] == run_id
    assert api.get(f"/v1/runs/{run_id}").json()["status"] == "CANCELLED"
    # the driver ending afterwards does not overwrite it
    assert finish_sweep(factory, sw["id"]).status == "CANCELLED"


def test_finish_picks_the_best_measured_trial_and_calibrates(api, fake_runtime):
    sw = api.post("/v1/sweeps", json=body()).json()
    factory = api.app.state.session_factory
    measured = {}
    with session_scope(factory) as s:
        # what the sweep's driver does: RUNNING, then the trials' results
        transition_sweep(s, sweep=get_sweep(s, sweep_id=sw["id"]), to="RUNNING", reason="driver started")
        trials = s.query(Trial).filter(Trial.sweep_id == sw["id"], Trial.status == "PENDING").order_by(Trial.id).all()
        for i, t in enumerate(trials):
            # "measurements": the prediction scaled by a layout-dependent factor
            t.status = ["SUCCEEDED", "EARLY_STOPPED", "FAILED"][i % 3]
            t.measured_tokens_per_s = t.predicted_tokens_per_s * (0.3 + 0.05 * i) if t.status != "FAILED" else None
            measured[t.id] = t.measured_tokens_per_s
    done = finish_sweep(factory, sw["id"])
    assert done.status == "SUCCEEDED"
    got = api.get(f"/v1/sweeps/{sw['id']}").json()
    best = max((tid for tid, v in measured.items() if v is not None), key=lambda tid: measured[tid])
    assert got["best_trial"]["id"] == best
    cal = got["calibration"]
    assert cal["status"] == "fitted" and cal["trials_used"] == sum(v is not None for v in measured.values())
    assert cal["error_after"] < cal["error_before"]
    assert "rank_correlation" in cal and cal["factors"] != cal["factors_before"]
    with session_scope(factory) as s:
        f = latest_factors(s, cluster_key(cpu_cluster()))
    assert f is not None and f.to_dict() == cal["factors"]
    # a second sweep on the same cluster is predicted with the calibrated factors
    sw2 = api.post("/v1/sweeps", json=body(name="again")).json()
    assert sw2["calibration"]["calibrated_before"] is True
    assert sw2["calibration"]["factors_before"] == cal["factors"]


def test_finish_without_measurements_fails(api, fake_runtime):
    sw = api.post("/v1/sweeps", json=body()).json()
    factory = api.app.state.session_factory
    with session_scope(factory) as s:
        for t in s.query(Trial).filter(Trial.sweep_id == sw["id"], Trial.status == "PENDING"):
            t.status, t.reason = "FAILED", "boom"
    done = finish_sweep(factory, sw["id"])
    assert done.status == "FAILED" and "no trial was measured" in done.status_reason


def test_cancel_trial_run_cancels_that_trial_only(api, fake_runtime):
    from service.sweeps import cancel_trial_run

    sw = api.post("/v1/sweeps", json=body()).json()
    factory = api.app.state.session_factory
    with session_scope(factory) as s:
        t = s.query(Trial).filter(Trial.sweep_id == sw["id"], Trial.status == "PENDING").first()
        run, _ = store.create_run(s, spec=tiny_base(), plan=None, sweep_id=sw["id"])
        store.transition(s, run_id=run.id, to="STARTING", reason="trial", ray_job_id=sw["ray_job_id"])
        t.run_id, t.status = run.id, "RUNNING"
        run_id, trial_id = run.id, t.id
    with session_scope(factory) as s:
        out = cancel_trial_run(s, run=store.get_run(s, run_id=run_id), actor="alice")
        assert out.status == "CANCELLED"
    got = api.get(f"/v1/sweeps/{sw['id']}").json()
    assert got["status"] == "QUEUED" and fake_runtime.jobs.stopped == []  # the sweep goes on
    trial = next(t for t in got["trials"] if t["id"] == trial_id)
    assert trial["status"] == "CANCELLED" and "alice" in trial["reason"]

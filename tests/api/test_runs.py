"""/v1/runs through HTTP on SQLite and PostgreSQL: create/read, list, 404, 422 per rule, cancel, idempotency."""

from __future__ import annotations

import pytest
import yaml

from api.spec import ClusterSpec, RunSpec
from service import store

SPEC = {
    "name": "gpt-3d-demo",
    "model": {"name": "gpt", "preset": "tiny"},
    "data": {"source": "synthetic"},
    "layout": {"dp": 2, "tp": 2, "pp": 2, "zero_stage": 0, "shard_group_size": None, "sequence_parallel": False,
               "pp_schedule": "1f1b", "pp_virtual_stages": 1},
    "batch": {"global_batch_size": 16, "micro_batch_size": 2},
    "precision": "fp32",
    "activation_checkpointing": "none",
    "optimizer": {"name": "adamw", "lr": 3.0e-4, "weight_decay": 0.1, "warmup_steps": 10, "schedule": "cosine",
                  "grad_clip": 1.0},
    "train": {"steps": 50, "seed": 0},
    "checkpoint": {"every_steps": 0, "keep": 2},
    "resources": {"device": "auto", "cpus_per_worker": 1, "max_failures": 0},
    "labels": {"team": "ml", "note": "ünïcødé ✓"},
}


def _error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "param"}, body
    assert body["error"]["message"]
    return body["error"]


def _submit(client, spec=None, **kw):
    r = client.post("/v1/runs", json=spec if spec is not None else SPEC, **kw)
    assert r.status_code == 201, r.text
    return r.json()


# ------------------------------------------------------------------------------------------ create / read
def test_create_then_read_back_identical_spec(client):
    run = _submit(client)
    assert run["status"] == "QUEUED" and run["project"] == "default" and run["name"] == "gpt-3d-demo"
    got = client.get(f"/v1/runs/{run['id']}").json()
    expected = RunSpec.model_validate(SPEC).model_dump(mode="json", by_alias=True)  # the wire names ("async")
    assert got["spec"] == expected == run["spec"]
    for k, v in SPEC["layout"].items():
        assert got["spec"]["layout"][k] == v
    assert got["spec"]["labels"]["note"] == "ünïcødé ✓"
    plan = got["plan"]
    assert plan["world_size"] == 8 and (plan["dp"], plan["tp"], plan["pp"]) == (2, 2, 2)
    assert plan["microbatches_per_step"] == 4 and plan["grad_accum_steps"] == 1
    assert got["created_at"].endswith(("Z", "+00:00"))  # timezone-aware on every database


def test_create_from_yaml_body(client):
    r = client.post("/v1/runs", content=yaml.safe_dump(SPEC).encode(), headers={"Content-Type": "application/yaml"})
    assert r.status_code == 201, r.text
    assert r.json()["spec"] == RunSpec.model_validate(SPEC).model_dump(mode="json", by_alias=True)


def test_defaults_only_spec_is_accepted(client):
    run = _submit(client, {})
    assert run["spec"]["layout"]["dp"] == 1 and run["plan"]["world_size"] == 1


def test_priority_comes_from_resources(client):
    run = _submit(client, {**SPEC, "resources": {"priority": 7}})
    assert run["priority"] == 7


def test_events_record_submission_and_cancel(client):
    run = _submit(client)
    assert client.post(f"/v1/runs/{run['id']}/cancel").status_code == 200
    events = client.get(f"/v1/runs/{run['id']}/events").json()["items"]
    states = [(e["from_status"], e["to_status"]) for e in events if e["kind"] == "state"]
    assert states == [(None, "QUEUED"), ("QUEUED", "CANCELLED")]
    audits = [e for e in events if e["kind"] == "audit"]
    assert [a["actor"] for a in audits] == ["local", "local"]
    assert "submitted" in audits[0]["reason"] and "cancel" in audits[1]["reason"]


# --------------------------------------------------------------------------------------------------- list
def test_list_filters_and_pagination(client):
    ids = [_submit(client, {**SPEC, "name": f"run-{i % 2}"})["id"] for i in range(5)]
    client.post(f"/v1/runs/{ids[0]}/cancel")

    page = client.get("/v1/runs", params={"limit": 2, "offset": 0}).json()
    assert page["total"] == 5 and len(page["items"]) == 2 and page["limit"] == 2
    all_ids = []
    for off in range(0, 6, 2):
        all_ids += [r["id"] for r in client.get("/v1/runs", params={"limit": 2, "offset": off}).json()["items"]]
    assert sorted(all_ids) == sorted(ids)  # pages cover every run exactly once
    assert all_ids == list(reversed(ids))  # newest first

    named = client.get("/v1/runs", params={"name": "run-1"}).json()
    assert named["total"] == 2 and {r["name"] for r in named["items"]} == {"run-1"}
    cancelled = client.get("/v1/runs", params={"status": "CANCELLED"}).json()
    assert [r["id"] for r in cancelled["items"]] == [ids[0]]
    both = client.get("/v1/runs", params=[("status", "CANCELLED"), ("status", "QUEUED")]).json()
    assert both["total"] == 5
    assert client.get("/v1/runs", params={"sweep_id": "sweep-none"}).json()["total"] == 0


@pytest.mark.parametrize("params,param", [({"limit": 0}, "limit"), ({"limit": 100000}, "limit"),
                                          ({"offset": -1}, "offset"), ({"status": "DONE"}, "status"),
                                          ({"limit": "many"}, "limit")])
def test_list_bounds(client, params, param):
    err = _error(client.get("/v1/runs", params=params), 422)
    assert err["param"].startswith(param)


# ---------------------------------------------------------------------------------------------------- 404
@pytest.mark.parametrize("method,path", [("get", ""), ("get", "/metrics"), ("get", "/events"),
                                         ("get", "/checkpoints"), ("get", "/logs"), ("post", "/cancel")])
def test_unknown_run_is_404(client, method, path):
    r = getattr(client, method)(f"/v1/runs/run-doesnotexist{path}")
    err = _error(r, 404)
    assert err["code"] == "not_found" and "run-doesnotexist" in err["message"]


def test_unknown_route_and_method_use_the_error_body(client):
    assert _error(client.get("/v1/nothing-here"), 404)["code"] == "not_found"
    assert _error(client.delete("/v1/runs"), 405)["code"] == "method_not_allowed"


# ---------------------------------------------------------------------------------------------------- 422
def _with(**parts):
    spec = yaml.safe_load(yaml.safe_dump(SPEC))
    for dotted, value in parts.items():
        *path, last = dotted.split("__")
        node = spec
        for p in path:
            node = node.setdefault(p, {})
        node[last] = value
    return spec


INVALID = [
    ("dp < 1", _with(layout__dp=0), "layout.dp", "greater than or equal to 1"),
    ("tp < 1", _with(layout__tp=0), "layout.tp", "greater than or equal to 1"),
    ("pp < 1", _with(layout__pp=-1), "layout.pp", "greater than or equal to 1"),
    ("tp does not divide heads", _with(layout__tp=3, layout__pp=1), "layout.tp", "does not divide"),
    ("pp > layers", _with(layout__pp=64, batch__global_batch_size=256), "layout.pp", "exceeds"),
    ("global batch not multiple of micro x dp", _with(batch__global_batch_size=15), "batch.global_batch_size",
     "multiple"),
    ("pp micro-batches below pp", _with(layout__dp=1, layout__pp=2, layout__tp=1, batch__global_batch_size=2,
                                        batch__micro_batch_size=2), "batch.micro_batch_size", "micro-batches"),
    ("elastic layout that can never run", _with(elastic__layouts=[{"dp": 1}, {"tp": 3}]), "elastic.layouts[1]",
     "dp=1 tp=3 pp=1: layout.tp: tp=3 does not divide"),
    ("unknown preset", _with(model__preset="gigantic"), "model.preset", "unknown preset"),
    ("unknown model", _with(model__name="resnet"), "model.name", "unknown model"),
    ("absurd d_model", _with(model__d_model=10**9), "model.d_model", "less than or equal"),
    ("absurd steps", _with(train__steps=10**12), "train.steps", "less than or equal"),
    ("absurd world size", _with(layout__dp=4096, layout__tp=8, layout__pp=8, batch__global_batch_size=2**20,
                                batch__micro_batch_size=1), "layout", "world size"),
    ("unknown field", _with(layout__tensor_parallel=2), "layout.tensor_parallel", "unknown field"),
    ("unknown top-level field", _with(epochs=3), "epochs", "unknown field"),
    ("wrong type", _with(layout__dp="two"), "layout.dp", "integer"),
    ("bad enum", _with(precision="fp8"), "precision", "fp32"),
    ("bad name", _with(name="../etc"), "name", "letters"),
]


@pytest.mark.parametrize("case,spec,param,words", INVALID, ids=[c[0] for c in INVALID])
def test_invalid_spec_names_the_field(client, case, spec, param, words):
    err = _error(client.post("/v1/runs", json=spec), 422)
    assert err["param"] == param, err
    assert words in err["message"], err
    assert client.get("/v1/runs").json()["total"] == 0  # nothing stored


def test_pp_micro_batch_warning_is_kept_in_the_plan(client):
    run = _submit(client, _with(layout__dp=1, layout__tp=1, layout__pp=2, batch__global_batch_size=8,
                                batch__micro_batch_size=2))
    assert any("bubble" in w for w in run["plan"]["warnings"])


@pytest.mark.parametrize("body,ctype,status", [(b"{not json", "application/json", 400),
                                               (b"", "application/json", 400),
                                               (b"[1, 2]", "application/json", 422),
                                               (b"name: [unclosed", "application/yaml", 400),
                                               (b"<xml/>", "application/xml", 415)])
def test_malformed_bodies(client, body, ctype, status):
    _error(client.post("/v1/runs", content=body, headers={"Content-Type": ctype}), status)


# ------------------------------------------------------------------------------------------------- cancel
def test_cancel_queued_run_then_409(client):
    run = _submit(client)
    r = client.post(f"/v1/runs/{run['id']}/cancel")
    assert r.status_code == 200 and r.json()["status"] == "CANCELLED"
    assert r.json()["finished_at"] is not None
    assert client.get(f"/v1/runs/{run['id']}").json()["status"] == "CANCELLED"
    err = _error(client.post(f"/v1/runs/{run['id']}/cancel"), 409)
    assert "CANCELLED" in err["message"]


def test_cancel_running_run_without_runtime_is_503(client):
    run = _submit(client)
    with client.app.state.session_factory.begin() as s:
        store.transition(s, run_id=run["id"], to="STARTING")
    assert _error(client.post(f"/v1/runs/{run['id']}/cancel"), 503)["code"] == "runtime_unavailable"


def test_resume_and_logs_without_runtime(client):
    run = _submit(client)
    assert _error(client.post(f"/v1/runs/{run['id']}/resume", json={}), 409)["param"] == "status"
    client.post(f"/v1/runs/{run['id']}/cancel")
    # no checkpoint: refused with what to do, unless the caller asks for a fresh start explicitly
    err = _error(client.post(f"/v1/runs/{run['id']}/resume", json={"steps": 10}), 409)
    assert err["param"] == "fresh" and "no checkpoint" in err["message"] and "--fresh" in err["message"]
    assert _error(client.post(f"/v1/runs/{run['id']}/resume", json={"steps": 10, "fresh": True}), 503)["code"] == \
        "runtime_unavailable"
    assert _error(client.post(f"/v1/runs/{run['id']}/resume", json={"layout": {"tp": 3}}), 422)["param"] == \
        "layout.tp"
    assert _error(client.get(f"/v1/runs/{run['id']}/logs"), 503)["code"] == "runtime_unavailable"


# -------------------------------------------------------------------------------------------- idempotency
def test_idempotency_key_gives_one_run(client):
    h = {"Idempotency-Key": "submit-42"}
    first = client.post("/v1/runs", json=SPEC, headers=h)
    again = client.post("/v1/runs", json=SPEC, headers=h)
    assert first.status_code == 201 and again.status_code == 200
    assert again.headers["Idempotent-Replayed"] == "true"
    assert first.json()["id"] == again.json()["id"]
    assert client.get("/v1/runs").json()["total"] == 1
    err = _error(client.post("/v1/runs", json={**SPEC, "name": "other"}, headers=h), 409)
    assert err["param"] == "Idempotency-Key"
    assert client.post("/v1/runs", json=SPEC, headers={"Idempotency-Key": "submit-43"}).status_code == 201
    assert client.get("/v1/runs").json()["total"] == 2


# ------------------------------------------------------------------------------------------------ metrics
def test_metrics_since_step_and_attempts(client):
    run = _submit(client)
    with client.app.state.session_factory.begin() as s:
        store.add_metrics(s, run_id=run["id"], attempt=1, rows=[{"step": i, "loss": 10.0 - i} for i in (1, 2, 3)])
        store.add_metrics(s, run_id=run["id"], attempt=2, rows=[{"step": 3, "loss": 0.5}, {"step": 4, "loss": 0.4}])
    items = client.get(f"/v1/runs/{run['id']}/metrics").json()["items"]
    assert [(m["step"], m["attempt"]) for m in items] == [(1, 1), (2, 1), (3, 2), (4, 2)]
    assert [m["step"] for m in client.get(f"/v1/runs/{run['id']}/metrics?since_step=2").json()["items"]] == [3, 4]
    a1 = client.get(f"/v1/runs/{run['id']}/metrics", params={"attempt": 1}).json()["items"]
    assert [m["loss"] for m in a1] == [9.0, 8.0, 7.0]
    _error(client.get(f"/v1/runs/{run['id']}/metrics?since_step=-1"), 422)


def test_checkpoints_listed(client, tmp_path):
    """Only checkpoints that exist are listed: one pruned by ``checkpoint.keep`` (its directory gone) is left out;
    a remote URL is listed (not probed)."""
    run = _submit(client)
    (tmp_path / "ck10").mkdir()
    with client.app.state.session_factory.begin() as s:
        store.add_checkpoint(s, run_id=run["id"], attempt=1, step=5, path=str(tmp_path / "ck5"), size_bytes=1)
        store.add_checkpoint(s, run_id=run["id"], attempt=1, step=10, path=str(tmp_path / "ck10"), size_bytes=123)
        store.add_checkpoint(s, run_id=run["id"], attempt=1, step=15, path="s3://bucket/ck15", size_bytes=2)
    cks = client.get(f"/v1/runs/{run['id']}/checkpoints").json()["items"]
    assert [(c["step"], c["path"], c["size_bytes"]) for c in cks] == [(10, str(tmp_path / "ck10"), 123),
                                                                      (15, "s3://bucket/ck15", 2)]


# -------------------------------------------------------------------------------------------- fake runtime
class FakeRuntime:
    def __init__(self, cluster: ClusterSpec | None = None, never: str | None = None):
        self.cluster, self.never, self.cancelled, self.wakes = cluster, never, [], 0

    def wake(self):
        self.wakes += 1

    def planning_cluster(self):
        return self.cluster

    def never_fits(self, plan):
        return self.never

    def cancel_run(self, run_id, *, actor=None):
        self.cancelled.append((run_id, actor))

    def stop(self):
        pass


def test_planner_prediction_attached_and_memory_refusal(client):
    client.app.state.runtime = runtime = FakeRuntime(ClusterSpec(device="H100", gpus_per_node=8, nodes=1))
    run = _submit(client)
    assert run["plan"]["predicted"]["feasible"] is True
    assert runtime.wakes == 1  # a new run wakes the scheduler instead of waiting for its next tick
    assert run["plan"]["predicted"]["memory_bytes"]["total"] > 0

    client.app.state.runtime = FakeRuntime(ClusterSpec(device="H100", gpus_per_node=8, nodes=1,
                                                       memory_bytes=2**20))
    err = _error(client.post("/v1/runs", json=SPEC), 422)
    assert err["code"] == "insufficient_memory" and err["param"] == "layout"
    assert "GiB" in err["message"] and "skip_memory_check" in err["message"]
    assert _submit(client, {**SPEC, "skip_memory_check": True})["plan"]["predicted"]["feasible"] is False


def test_memory_refusal_names_the_best_feasible_alternative(client):
    # 7B in bf16 under plain DDP needs ~16 bytes/param = ~112 GB per rank: no H100 holds it, but ZeRO-3
    # over 8 ranks (~14 GB of model states) does, and the 422 must say so
    client.app.state.runtime = FakeRuntime(ClusterSpec(device="H100", gpus_per_node=8, nodes=1))
    big = {**SPEC, "name": "big", "model": {"name": "gpt", "preset": "7b"}, "precision": "bf16",
           "layout": {"dp": 8}, "batch": {"global_batch_size": 8, "micro_batch_size": 1}}
    err = _error(client.post("/v1/runs", json=big), 422)
    assert err["code"] == "insufficient_memory" and err["param"] == "layout"
    assert "best feasible alternative" in err["message"] and "zero" in err["message"].split("alternative")[1]
    assert client.get("/v1/runs", params={"name": "big"}).json()["total"] == 0


def test_never_fits_is_refused(client):
    client.app.state.runtime = FakeRuntime(None, never="needs 8 CPUs per node but the largest node has 2")
    err = _error(client.post("/v1/runs", json=SPEC), 422)
    assert err == {"code": "insufficient_capacity", "param": "layout",
                   "message": "needs 8 CPUs per node but the largest node has 2"}


def test_cancel_running_run_goes_through_the_runtime(client):
    rt = FakeRuntime()
    client.app.state.runtime = rt
    run = _submit(client)
    with client.app.state.session_factory.begin() as s:
        store.transition(s, run_id=run["id"], to="STARTING")
    r = client.post(f"/v1/runs/{run['id']}/cancel")
    assert r.status_code == 200, r.text
    assert rt.cancelled == [(run["id"], "local")]


# ------------------------------------------------------------------------------------------------ openapi
def test_openapi_documents_error_bodies(client):
    spec = client.get("/openapi.json").json()
    post = spec["paths"]["/v1/runs"]["post"]
    assert set(post["requestBody"]["content"]) == {"application/json", "application/yaml"}
    for code in ("200", "201", "400", "401", "413", "422", "429"):
        assert code in post["responses"], code
    assert post["responses"]["422"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorBody")
    get = spec["paths"]["/v1/runs/{run_id}"]["get"]
    assert get["responses"]["404"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorBody")
    assert "HTTPValidationError" not in str(spec)
    assert client.get("/docs").status_code == 200


def test_healthz(client):
    assert client.get("/healthz").json() == {"status": "ok", "db": "ok", "ray": "absent", "storage": "ok", "auth": False,
                                             "version": client.get("/healthz").json()["version"]}


def test_startup_log_says_where_the_db_is_and_whether_auth_is_on(make_client, caplog, db_url):
    import logging
    with caplog.at_level(logging.INFO, logger="service.app.server"):
        make_client()
        make_client(auth="on")
    lines = [r.getMessage() for r in caplog.records if r.name == "service.app.server"]
    assert any("auth OFF: embedded single-user default on loopback" in m for m in lines), lines
    assert any("auth ON" in m for m in lines), lines
    assert all(db_url.split("://")[0] in m for m in lines)

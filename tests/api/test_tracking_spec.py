"""The run spec's ``tracking`` section over HTTP: a tracker whose client the service cannot import is refused with
a 422 naming the field and the extra; a local MLflow store needs a token that may run code; GET /v1/runs/{id} says
where the run's trackers log, the service-wide defaults (MESHRUN_TRACKING) merged in."""

from __future__ import annotations

import json

from api.spec import tracking as spec_tracking
from service.security import tokens as auth

BASE = {"name": "tracked", "batch": {"global_batch_size": 8, "micro_batch_size": 2}}


def test_a_tracker_whose_client_is_missing_is_refused_naming_the_extra(client, monkeypatch):
    # a module that does not exist here stands for the uninstalled client (find_spec finds nothing)
    monkeypatch.setitem(spec_tracking.TRACKER_MODULES, "wandb", "wandb_client_not_installed_here")
    r = client.post("/v1/runs", json=BASE | {"tracking": {"wandb": {"project": "p", "mode": "offline"}}})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["param"] == "tracking.wandb" and "pip install meshrun[tracking]" in err["message"]
    assert client.post("/v1/runs/validate", json=BASE | {"tracking": {"wandb": {"mode": "offline"}}}).status_code == 422
    # disabled asks for nothing; the installed trackers pass
    assert client.post("/v1/runs", json=BASE | {"tracking": {"wandb": {"mode": "disabled"}}}).status_code == 201
    assert client.post("/v1/runs", json=BASE | {"tracking": {"tensorboard": True}}).status_code == 201


def test_tracking_fields_are_checked_and_name_themselves(client):
    for bad, param in (
        ({"mlflow": {"tracking_uri": "gopher://x"}}, "tracking.mlflow.tracking_uri"),
        ({"mlflow": {"tracking_uri": "http://[::1"}}, "tracking.mlflow.tracking_uri"),
        ({"mlflow": {"experiment": "a"}}, "tracking.mlflow.tracking_uri"),  # no server and no service default
        ({"wandb": {"mode": "sometimes"}}, "tracking.wandb.mode"),
        ({"wandb": {"project": "<script>"}}, "tracking.wandb.project"),
        ({"comet": {}}, "tracking.comet"),
    ):
        r = client.post("/v1/runs", json=BASE | {"tracking": bad})
        assert r.status_code == 422, (bad, r.text)
        assert r.json()["error"]["param"] == param, (bad, r.json())


def test_a_local_mlflow_store_needs_a_token_that_may_run_code(make_client, tmp_path):
    c = make_client(auth="on")
    with c.app.state.session_factory.begin() as s:
        plain = {"Authorization": f"Bearer {auth.create_token(s, 'p', 'user')}"}
        coder = {"Authorization": f"Bearer {auth.create_token(s, 'p', 'coder', can_run_code=True)}"}
    local = BASE | {"tracking": {"mlflow": {"tracking_uri": f"sqlite:///{tmp_path}/x.db"}}}
    r = c.post("/v1/runs", json=local, headers=plain)
    assert r.status_code == 422 and r.json()["error"]["param"] == "tracking.mlflow.tracking_uri", r.text
    assert c.post("/v1/runs", json=local, headers=coder).status_code == 201
    remote = BASE | {"tracking": {"mlflow": {"tracking_uri": "http://mlflow.internal:5000"}}}
    assert c.post("/v1/runs", json=remote, headers=plain).status_code == 201


def test_the_run_says_where_its_trackers_log_with_the_service_defaults_merged(make_client, monkeypatch, tmp_path):
    monkeypatch.setenv("MESHRUN_TRACKING", json.dumps({"mlflow": {"tracking_uri": "http://mlflow.internal:5000"}}))
    c = make_client()
    run = c.post("/v1/runs", json=BASE | {"tracking": {"tensorboard": True, "mlflow": {"experiment": "team"}}}).json()
    got = c.get(f"/v1/runs/{run['id']}").json()["tracking"]
    assert got["tensorboard"] == str(tmp_path / "tracking" / run["id"] / "tensorboard")
    assert got["mlflow"] == "http://mlflow.internal:5000 experiment team"
    plain = c.post("/v1/runs", json=BASE).json()  # the default alone
    assert c.get(f"/v1/runs/{plain['id']}").json()["tracking"] == {"mlflow": "http://mlflow.internal:5000 experiment "
                                                                              "meshrun"}
    off = c.post("/v1/runs", json=BASE | {"tracking": {"defaults": False}}).json()
    assert c.get(f"/v1/runs/{off['id']}").json()["tracking"] is None

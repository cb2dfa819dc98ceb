"""Layouts a user model cannot support, and user code paths, are refused at submission through REST (no Ray)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from service.app.server import create_app
from service.settings import Settings

MODEL = {"name": "custom", "preset": None, "entrypoint": "byo_user_pkg.models:build", "seq_len": 16}


@pytest.fixture
def client(tmp_path):
    app = create_app(Settings(start_scheduler=False, data_dir=tmp_path, database_url=f"sqlite:///{tmp_path}/m.db",
                              rate_limit_per_minute=0))
    with TestClient(app) as c:
        yield c


def _spec(**over):
    spec = {"name": "byo", "model": dict(MODEL), "layout": {}, "batch": {"global_batch_size": 8, "micro_batch_size": 2},
            "train": {"steps": 2}, "resources": {"device": "cpu"}}
    spec.update(over)
    return spec


def test_tp_without_a_plan_is_a_clear_422(client) -> None:
    r = client.post("/v1/runs", json=_spec(layout={"tp": 2}))
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["param"] == "model.tp_plan" and "needs a tensor-parallel plan" in err["message"]
    assert client.get("/v1/runs").json()["total"] == 0  # nothing stored


def test_pp_without_split_points_is_a_clear_422(client) -> None:
    r = client.post("/v1/runs", json=_spec(layout={"pp": 2}, batch={"global_batch_size": 8, "micro_batch_size": 1}))
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] == "model.pp_split_points"
    assert "needs split points" in r.json()["error"]["message"]


def test_unknown_tp_style_and_bad_code_dir_are_422(client, tmp_path) -> None:
    r = client.post("/v1/runs", json=_spec(model={**MODEL, "tp_plan": {"blocks.*.up": "diagonal"}}, layout={"tp": 2}))
    assert r.status_code == 422 and "model.tp_plan" in r.json()["error"]["param"]
    r = client.post("/v1/runs", json=_spec(code={"working_dir": "/x\u0000y"}))
    assert r.status_code == 422 and "NUL" in r.json()["error"]["message"]
    r = client.post("/v1/runs", json=_spec(code={"working_dir": str(tmp_path / "missing")}))
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] == "code.working_dir" and "not a directory" in r.json()["error"]["message"]


def test_a_declared_plan_is_accepted_and_stored(client, user_code_dir) -> None:
    plan = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}
    r = client.post("/v1/runs", json=_spec(model={**MODEL, "tp_plan": plan}, layout={"tp": 2},
                                           code={"working_dir": str(user_code_dir)}))
    assert r.status_code in (200, 201, 202), r.text
    run = r.json()
    assert run["spec"]["model"]["tp_plan"] == plan and run["spec"]["code"]["working_dir"] == str(user_code_dir)
    assert run["plan"]["tp"] == 2


def test_code_dir_needs_a_code_token_and_an_allowed_root(tmp_path, user_code_dir) -> None:
    from service.security import tokens as auth

    app = create_app(Settings(start_scheduler=False, data_dir=tmp_path, database_url=f"sqlite:///{tmp_path}/m.db",
                              rate_limit_per_minute=0, auth="on"))
    with TestClient(app) as c:
        def tok(name: str, **kw) -> dict[str, str]:
            with c.app.state.session_factory.begin() as s:
                return {"Authorization": f"Bearer {auth.create_token(s, 'p', name, **kw)}"}

        plain, coder = tok("plain"), tok("coder", can_run_code=True)
        builtin_with_code = {"name": "x", "code": {"working_dir": "code"}}
        r = c.post("/v1/runs", json=builtin_with_code, headers=plain)
        assert r.status_code == 403 and r.json()["error"]["param"] == "code.working_dir"
        r = c.post("/v1/runs", json=_spec(code={"working_dir": str(user_code_dir)}), headers=coder)
        assert r.status_code == 422 and "outside the allowed storage roots" in r.json()["error"]["message"]
        (tmp_path / "code").mkdir()
        r = c.post("/v1/runs", json=_spec(code={"working_dir": "code"}), headers=coder)  # under data_dir
        assert r.status_code == 201, r.text

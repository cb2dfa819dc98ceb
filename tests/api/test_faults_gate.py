"""The ``faults`` section of a spec (chaos testing) is refused unless the token is an admin's or the service
allows faults for everyone (``MESHRUN_ALLOW_FAULTS``); the refusal names the field and the fix."""

from __future__ import annotations

from service.security import tokens as auth

FAULTY = {"name": "chaos", "layout": {"dp": 2}, "batch": {"global_batch_size": 8, "micro_batch_size": 2},
          "faults": {"slow_rank": {"rank": 1, "delay_s": 0.1}}}
SWEEP = {"name": "chaos-sweep", "base": FAULTY, "search": {"layouts": [{"dp": 2}]}}


def _token(client, project: str, name: str, **kw) -> dict[str, str]:
    with client.app.state.session_factory.begin() as s:
        secret = auth.create_token(s, project, name, **kw)
    return {"Authorization": f"Bearer {secret}"}


def test_faults_need_an_admin_token(make_client):
    c = make_client(auth="on")
    user, admin = _token(c, "p", "user"), _token(c, "p", "root", admin=True)
    r = c.post("/v1/runs", json=FAULTY, headers=user)
    assert r.status_code == 403, r.text
    err = r.json()["error"]
    assert err["param"] == "faults" and "MESHRUN_ALLOW_FAULTS=true" in err["message"] and "admin" in err["message"]
    r = c.post("/v1/sweeps", json=SWEEP, headers=user)
    assert r.status_code == 403 and r.json()["error"]["param"] == "faults", r.text
    assert c.post("/v1/runs", json={k: v for k, v in FAULTY.items() if k != "faults"}, headers=user).status_code == 201
    assert c.post("/v1/runs", json=FAULTY, headers=admin).status_code == 201


def test_allow_faults_setting_lets_every_token_inject_them(make_client, monkeypatch):
    monkeypatch.setenv("MESHRUN_ALLOW_FAULTS", "true")
    c = make_client(auth="on")
    assert c.app.state.settings.allow_faults
    assert c.post("/v1/runs", json=FAULTY, headers=_token(c, "p", "user")).status_code == 201


def test_local_user_with_auth_off_is_admin(client):
    assert client.post("/v1/runs", json=FAULTY).status_code == 201

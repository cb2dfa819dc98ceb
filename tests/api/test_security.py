"""Authentication, project isolation, user-code permission, path rules, size and rate limits, hostile input."""

from __future__ import annotations

import hashlib
import json

import pytest
from sqlalchemy import select, text

from service.security import tokens as auth
from service.store.models import ApiToken

SPEC = {"name": "sec", "layout": {"dp": 2}, "batch": {"global_batch_size": 8, "micro_batch_size": 2}}


def _error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "param"}, body
    return body["error"]


def _token(client, project: str, name: str, **kw) -> dict[str, str]:
    with client.app.state.session_factory.begin() as s:
        secret = auth.create_token(s, project, name, **kw)
    return {"Authorization": f"Bearer {secret}"}


@pytest.fixture
def secured(make_client):
    return make_client(auth="on")


# ------------------------------------------------------------------------------------------------- auth
@pytest.mark.parametrize("method,path", [("get", "/v1/runs"), ("post", "/v1/runs"), ("get", "/v1/runs/run-x"),
                                         ("get", "/v1/runs/run-x/metrics"), ("post", "/v1/runs/run-x/cancel"),
                                         ("post", "/v1/runs/run-x/resume"), ("get", "/v1/runs/run-x/logs")])
def test_no_token_is_401(secured, method, path):
    r = getattr(secured, method)(path)
    err = _error(r, 401)
    assert err["code"] == "unauthenticated" and "Bearer" in err["message"]
    assert r.headers["WWW-Authenticate"] == "Bearer"


def test_public_endpoints_and_bad_tokens(secured):
    assert secured.get("/healthz").status_code == 200
    assert secured.get("/openapi.json").status_code == 200
    assert secured.get("/docs").status_code == 200
    for bad in ("Bearer nonsense", "Bearer msr_" + "x" * 43, "Basic dXNlcjpwdw==", "Bearer "):
        _error(secured.get("/v1/runs", headers={"Authorization": bad}), 401)
    h = _token(secured, "a", "alice")
    assert secured.get("/v1/runs", headers=h).status_code == 200
    with secured.app.state.session_factory.begin() as s:
        assert auth.revoke_token(s, name="alice", project="a") == 1
    _error(secured.get("/v1/runs", headers=h), 401)


def test_openapi_declares_bearer_when_auth_is_on(secured, client):
    assert "BearerToken" in secured.get("/openapi.json").json()["components"]["securitySchemes"]
    assert "securitySchemes" not in client.get("/openapi.json").json().get("components", {})


def test_tokens_are_stored_hashed(secured):
    h = _token(secured, "a", "alice", admin=True)
    secret = h["Authorization"].split()[1]
    with secured.app.state.session_factory() as s:
        rows = s.execute(text("SELECT * FROM api_tokens")).mappings().all()
        assert len(rows) == 1
        assert all(secret not in str(v) for v in rows[0].values())
        assert rows[0]["token_hash"] == hashlib.sha256(secret.encode()).hexdigest()
        assert secret.startswith(rows[0]["prefix"]) and len(rows[0]["prefix"]) < 16
        assert s.scalar(select(ApiToken)).admin is True


# ---------------------------------------------------------------------------------------------- projects
def test_projects_are_isolated_and_admin_sees_all(secured):
    a, b = _token(secured, "proj-a", "alice"), _token(secured, "proj-b", "bob")
    admin = _token(secured, "ops", "root", admin=True)
    run_a = secured.post("/v1/runs", json=SPEC, headers=a).json()
    run_b = secured.post("/v1/runs", json=SPEC, headers=b).json()
    assert (run_a["project"], run_b["project"]) == ("proj-a", "proj-b")
    rid = run_a["id"]

    assert [r["id"] for r in secured.get("/v1/runs", headers=b).json()["items"]] == [run_b["id"]]
    for method, path in [("get", ""), ("get", "/metrics"), ("get", "/events"), ("get", "/checkpoints"),
                         ("get", "/logs"), ("post", "/cancel")]:
        _error(getattr(secured, method)(f"/v1/runs/{rid}{path}", headers=b), 404)
    _error(secured.post(f"/v1/runs/{rid}/resume", json={}, headers=b), 404)
    assert secured.get(f"/v1/runs/{rid}", headers=a).json()["status"] == "QUEUED"  # B changed nothing

    listed = secured.get("/v1/runs", headers=admin).json()
    assert {r["id"] for r in listed["items"]} == {rid, run_b["id"]}
    only_b = secured.get("/v1/runs", params={"project": "proj-b"}, headers=admin).json()
    assert [r["id"] for r in only_b["items"]] == [run_b["id"]]
    assert secured.get(f"/v1/runs/{rid}", headers=admin).status_code == 200
    assert secured.post(f"/v1/runs/{rid}/cancel", headers=admin).json()["status"] == "CANCELLED"
    _error(secured.post(f"/v1/runs/{rid}/resume", json={}, headers=b), 404)
    events = secured.get(f"/v1/runs/{rid}/events", headers=a).json()["items"]
    audit = [(e["actor"], e["reason"]) for e in events if e["kind"] == "audit"]
    assert audit[0][0] == "alice" and "submitted by alice" in audit[0][1]
    assert audit[1][0] == "root" and "cancel requested by root" in audit[1][1]


def test_idempotency_keys_are_per_project(secured):
    a, b = _token(secured, "proj-a", "alice"), _token(secured, "proj-b", "bob")
    key = {"Idempotency-Key": "same"}
    ra = secured.post("/v1/runs", json=SPEC, headers={**a, **key})
    rb = secured.post("/v1/runs", json=SPEC, headers={**b, **key})
    assert ra.status_code == rb.status_code == 201 and ra.json()["id"] != rb.json()["id"]


# -------------------------------------------------------------------------------------------- user code
CUSTOM = {"name": "byom", "model": {"name": "custom", "entrypoint": "mypkg.models:build"}}


def test_user_code_needs_permission(secured):
    plain, coder = _token(secured, "p", "plain"), _token(secured, "p", "coder", can_run_code=True)
    err = _error(secured.post("/v1/runs", json=CUSTOM, headers=plain), 403)
    assert err["param"] == "model.entrypoint" and "--can-run-code" in err["message"]
    data_code = {"name": "d", "data": {"source": "custom", "entrypoint": "mypkg.data:load"}}
    assert _error(secured.post("/v1/runs", json=data_code, headers=plain), 403)["param"] == "data.entrypoint"
    assert secured.post("/v1/runs", json=CUSTOM, headers=coder).status_code == 201
    assert secured.post("/v1/runs", json=data_code, headers=coder).status_code == 201


def test_local_user_may_run_code_with_auth_off(client):
    assert client.post("/v1/runs", json=CUSTOM).status_code == 201


@pytest.mark.parametrize("entrypoint", ["os.system('rm -rf /'):x", "__import__('os'):f", "a.b", "a:b c", "a;b:c"])
def test_entrypoint_must_be_dotted_identifiers(client, entrypoint):
    err = _error(client.post("/v1/runs", json={"model": {"name": "custom", "entrypoint": entrypoint}}), 422)
    assert err["param"] == "model.entrypoint"


# ------------------------------------------------------------------------------------------------ paths
@pytest.mark.parametrize("field,value", [("data.path", "../../etc/passwd"), ("data.path", "corpus/../../x"),
                                         ("checkpoint.storage", "s3://bucket/../other"),
                                         ("checkpoint.storage", "ftp://host/x"),
                                         ("checkpoint.storage", "file:///tmp/../etc"),
                                         ("data.path", "a\x00b"), ("data.path", "line\nbreak")])
def test_bad_paths_are_refused(client, field, value):
    section, key = field.split(".")
    spec = {"data": {"source": "text"}, section: {key: value}} if section == "data" else {section: {key: value}}
    err = _error(client.post("/v1/runs", json=spec), 422)
    assert err["param"] == field


def test_absolute_paths_must_be_under_allowed_roots_with_auth_on(secured, tmp_path):
    h = _token(secured, "p", "u")
    out = {"checkpoint": {"storage": "/etc/cron.d"}}
    assert _error(secured.post("/v1/runs", json=out, headers=h), 422)["param"] == "checkpoint.storage"
    inside = {"checkpoint": {"storage": str(tmp_path / "ck" / "mine")}}
    assert secured.post("/v1/runs", json=inside, headers=h).status_code == 201
    for ok in ("relative/dir", "s3://bucket/ckpts", "gs://b/x"):
        assert secured.post("/v1/runs", json={"checkpoint": {"storage": ok}}, headers=h).status_code == 201


# ----------------------------------------------------------------------------------------- size and rate
def test_body_size_limit_is_413(make_client):
    c = make_client(max_request_bytes=2048)
    big = {"labels": {f"k{i}": "v" * 50 for i in range(100)}}
    err = _error(c.post("/v1/runs", json=big), 413)
    assert err["code"] == "request_too_large" and "2048" in err["message"]

    def chunks():  # no Content-Length: the limit applies while streaming
        yield json.dumps(big).encode()

    _error(c.post("/v1/runs", content=chunks(), headers={"Content-Type": "application/json"}), 413)
    assert c.get("/v1/runs").json()["total"] == 0


def test_rate_limit_per_token_is_429_with_retry_after(make_client):
    c = make_client(auth="on", rate_limit_per_minute=3)
    a, b = _token(c, "p", "a"), _token(c, "p", "b")
    assert [c.get("/v1/runs", headers=a).status_code for _ in range(3)] == [200] * 3
    r = c.get("/v1/runs", headers=a)
    err = _error(r, 429)
    assert err["code"] == "rate_limited" and int(r.headers["Retry-After"]) >= 1
    assert c.get("/v1/runs", headers=b).status_code == 200  # per token
    assert c.get("/healthz").status_code == 200  # health is never limited


# ------------------------------------------------------------------------------------------ hostile input
HOSTILE = [
    (b'{"layout": {"dp": 1' + b"0" * 5000 + b"}}", "application/json"),  # beyond Python's int digit limit
    (b'{"layout": {"dp": 100000000000000000000000000000000000000}}', "application/json"),
    (b'{"optimizer": {"grad_clip": 1e400}}', "application/json"),  # parses to inf
    (b'{"optimizer": {"lr": NaN}}', "application/json"),
    (b'{"model": {"args": {"x": Infinity}}}', "application/json"),
    (b"[" * 50000 + b"]" * 50000, "application/json"),
    (b'{"labels": {"a": "\\ud800"}}', "application/json"),  # lone surrogate
    (b'{"labels": {"a": "nul\\u0000"}}', "application/json"),
    (b'{"name": "\\u202e\\u0000"}', "application/json"),
    (b"\xff\xfe\x00garbage", "application/json"),
    (b'{"layout": "dp=2"}', "application/json"),
    (b'{"layout": {"dp": true}}', "application/json"),
    (b'{"labels": {"a": 1}}', "application/json"),
    (b'"just a string"', "application/json"),
    (b"null", "application/json"),
    (b"model: {args: {when: 2024-01-01}}", "application/yaml"),  # YAML date: not JSON data
    (b"a: &a [1,1,1,1,1,1,1,1,1]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n"
     b"d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]\ne: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]\nf: [*e,*e,*e,*e,*e,*e,*e,*e,*e]\n",
     "application/yaml"),  # billion laughs
    (b"!!python/object/apply:os.system ['echo pwned']", "application/yaml"),
    (b"{1: 2}", "application/yaml"),
    (b"- just\n- a list\n", "text/yaml"),
]


@pytest.mark.parametrize("body,ctype", HOSTILE, ids=[f"h{i}" for i in range(len(HOSTILE))])
def test_hostile_bodies_are_4xx_with_the_error_body(make_client, body, ctype):
    c = make_client(raise_server_exceptions=False)
    r = c.post("/v1/runs", content=body, headers={"Content-Type": ctype})
    assert 400 <= r.status_code < 500, r.text
    _error(r, r.status_code)
    assert c.get("/v1/runs").json()["total"] == 0


@pytest.mark.parametrize("path", ["/v1/runs/run%00x", "/v1/runs/" + "a" * 5000, "/v1/runs/%F0%9F%92%A5",
                                  "/v1/runs?name=%00", "/v1/runs?sweep_id=%00", "/v1/runs?limit=1e99",
                                  "/v1/runs?offset=99999999999999999999999", "/v1/runs/run-1/metrics?since_step=1e400"])
def test_hostile_urls_are_4xx(make_client, path):
    c = make_client(raise_server_exceptions=False)
    r = c.get(path)
    assert 400 <= r.status_code < 500, r.text
    _error(r, r.status_code)


def test_unicode_labels_round_trip(client):
    labels = {"emoji": "🚀", "rtl": "שלום", "cjk": "训练", "combining": "e\u0301"}
    run = client.post("/v1/runs", json={"labels": labels}).json()
    assert client.get(f"/v1/runs/{run['id']}").json()["spec"]["labels"] == labels


def test_nothing_in_a_spec_reaches_a_shell_or_eval(client, monkeypatch):
    import builtins
    import os
    import subprocess
    payloads = ("$(rm -rf /)", "__import__('os').system('id')", "`id`", "corpus;rm -rf ~")
    calls = []

    def spy(real):
        def wrapped(*a, **k):
            if any(p in repr(a) + repr(k) for p in payloads):
                calls.append(a)
            return real(*a, **k)
        return wrapped

    for mod, name in ((os, "system"), (os, "popen"), (subprocess, "Popen"), (builtins, "eval"), (builtins, "exec")):
        monkeypatch.setattr(mod, name, spy(getattr(mod, name)))
    spec = {"name": "x", "labels": {"cmd": payloads[0], "py": payloads[1]},
            "model": {"args": {"a": payloads[2]}}, "data": {"source": "text", "path": payloads[3]}}
    run = client.post("/v1/runs", json=spec).json()
    assert client.get(f"/v1/runs/{run['id']}").json()["spec"]["labels"]["py"] == payloads[1]
    assert calls == []


def test_failed_authentication_is_rate_limited_per_address(make_client):
    c = make_client(auth="on", rate_limit_per_minute=3)
    good = _token(c, "p", "good")
    bad = {"Authorization": "Bearer msr_" + "y" * 43}
    assert [c.get("/v1/runs", headers=bad).status_code for _ in range(3)] == [401] * 3
    r = c.get("/v1/runs", headers=bad)
    assert _error(r, 429)["code"] == "rate_limited" and int(r.headers["Retry-After"]) >= 1
    assert c.get("/v1/runs", headers=good).status_code == 200  # valid tokens are limited per token only


def test_rate_limiter_refills():
    from service.app.ratelimit import RateLimiter
    now = [0.0]
    rl = RateLimiter(60, clock=lambda: now[0])
    assert all(rl.hit("k") is None for _ in range(60))
    wait = rl.hit("k")
    assert wait is not None and 0 < wait <= 1.0
    now[0] += 1.0
    assert rl.peek("k") is None and rl.hit("k") is None
    assert rl.hit("other") is None
    assert RateLimiter(0).hit("k") is None  # 0 disables


def test_rate_limiter_memory_is_bounded_by_lru_eviction():
    from service.app.ratelimit import MAX_BUCKETS, RateLimiter
    now = [0.0]
    rl = RateLimiter(2, clock=lambda: now[0], max_buckets=3)
    for i in range(1000):  # a client cycling keys, every request allowed
        assert rl.hit(f"cycle-{i}") is None
        assert len(rl._buckets) <= 3
    for key in ("a", "b", "c"):
        rl.hit(key)
    rl.hit("a"), rl.hit("a")  # "a" is exhausted and now the most recently used
    rl.hit("d")  # evicts the least recently used: "b"
    assert list(rl._buckets) == ["c", "a", "d"]
    assert rl.hit("a") is not None  # a recently used bucket keeps its state (no reset by eviction)
    assert RateLimiter(10).max_buckets == MAX_BUCKETS


# ---------------------------------------------------------------------------------------------- /metrics
METRICS_TOKEN = "scrape-" + "s" * 32


def test_metrics_needs_an_admin_or_scrape_token_when_auth_is_on(make_client):
    secured = make_client(auth="on", metrics_token=METRICS_TOKEN)
    project_h = _token(secured, "a", "alice")
    secured.post("/v1/runs", json={**SPEC, "name": "secret-run-name"}, headers=project_h)

    err = _error(secured.get("/metrics"), 401)
    assert err["code"] == "unauthenticated"
    for bad in ("Bearer nonsense", "Bearer " + METRICS_TOKEN + "x", "Basic " + METRICS_TOKEN):
        _error(secured.get("/metrics", headers={"Authorization": bad}), 401)
    r = secured.get("/metrics", headers=project_h)  # a project token must not see other projects' runs
    assert r.status_code in (401, 403) and "secret-run-name" not in r.text and "meshrun_" not in r.text
    _error(r, r.status_code)

    admin = secured.get("/metrics", headers=_token(secured, "ops", "root", admin=True))
    scrape = secured.get("/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
    for r in (admin, scrape):
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/plain") and "meshrun_" in r.text


def test_metrics_stay_open_with_auth_off(client):
    assert client.app.state.settings.auth_enabled is False
    assert client.get("/metrics").status_code == 200


# ---------------------------------------------------------------------------------------------- settings
def test_settings_refuse_in_memory_sqlite_and_normalise_postgres_urls(tmp_path):
    from pydantic import ValidationError

    from service.settings import Settings

    for url in ("sqlite:///:memory:", "sqlite://", "sqlite+pysqlite:///:memory:"):
        with pytest.raises(ValidationError, match="MESHRUN_DATABASE_URL.*in-memory.*sqlite:////"):
            Settings(data_dir=tmp_path, database_url=url)
    for url in ("postgres://u:p@db:5432/meshrun", "postgresql://u:p@db:5432/meshrun"):
        assert Settings(data_dir=tmp_path, database_url=url).database_url == \
            "postgresql+psycopg://u:p@db:5432/meshrun"
    assert Settings(data_dir=tmp_path).database_url == f"sqlite:///{tmp_path / 'meshrun.db'}"


@pytest.mark.parametrize("host,loopback", [("127.0.0.1", True), ("localhost", True), ("::1", True),
                                           ("0.0.0.0", False), ("10.0.0.5", False)])
def test_loopback_decides_default_auth(tmp_path, host, loopback):
    from service.settings import Settings

    s = Settings(data_dir=tmp_path, host=host)
    assert s.listens_on_loopback is loopback and s.auth_enabled is (not loopback)


def test_database_url_is_redacted_in_logs():
    from service.store.db import redact_url

    assert redact_url("postgresql+psycopg://meshrun:hunter2@db/meshrun") == "postgresql+psycopg://meshrun:***@db/meshrun"
    assert "hunter2" not in redact_url("postgres://meshrun:hunter2@db/x")

"""The path policy through REST: every known bypass of a token that may not run code is a 422 naming the field;
allowed paths are stored normalised (what the workers open is what was checked)."""

from __future__ import annotations

import os

import pytest

from service.security import tokens as auth
from service.security.paths import decide_path
from service.settings import Settings


def _token(client, name: str, **kw) -> dict[str, str]:
    with client.app.state.session_factory.begin() as s:
        secret = auth.create_token(s, "p", name, **kw)
    return {"Authorization": f"Bearer {secret}"}


def _spec(field: str, value: str) -> dict:
    section, key = field.split(".")
    if section == "data":
        return {"data": {"source": "text", key: value}}
    return {section: {key: value}}


@pytest.fixture
def secured(make_client, tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("hello")
    os.symlink("/etc", tmp_path / "etc-link")
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "auth_token").write_text("secret")
    return make_client(auth="on")


BYPASSES = [
    "~root/.bashrc", "~/x", "~", "~nosuchuser/x", "/etc/passwd", "/", "//etc/passwd",
    "file:/etc/passwd", "file:///etc/passwd", "file://localhost/etc/passwd", "FILE://LOCALHOST/etc/passwd",
    "file://otherhost/etc/passwd", "file:relative", "local:///etc/passwd",
    "simplecache::file:///etc/passwd", "simplecache::/etc/passwd", "filecache::s3://bucket/x",
    "file::file:///etc/passwd", "zip://x::file:///etc/passwd",
    "%2e%2e/%2e%2e/etc/passwd", "%2E%2E/x", "%252e%252e/%252e%252e/etc", "file:///%2e%2e/etc/passwd",
    "file:%2fetc%2fpasswd", "corpus/..", "s3://bucket/%2e%2e/other", "a%00b", "a%0ab",
    "etc-link/passwd", "meshrun.db", "meshrun.db-wal", "ray/auth_token", "tmp/x", ".hidden/x",
    "corpus/.git", "%ZZ%ff%fe", "ftp://host/x", "http://169.254.169.254/latest",
]


def test_bypasses_are_422_naming_the_field(secured):
    h = _token(secured, "plain")
    wrong = []
    for field in ("data.path", "checkpoint.storage"):
        for value in BYPASSES:
            r = secured.post("/v1/runs", json=_spec(field, value), headers=h)
            if r.status_code != 422 or r.json()["error"]["param"] != field:
                wrong.append((field, value, r.status_code, r.text))
    assert wrong == []
    assert secured.get("/v1/runs", headers=h).json()["total"] == 0


def test_allowed_paths_are_stored_normalised(secured, tmp_path):
    h = _token(secured, "plain")
    root = os.path.realpath(tmp_path)
    cases = {
        ("data.path", "corpus/a.txt"): f"{root}/corpus/a.txt",
        ("data.path", f"file://{tmp_path}/corpus"): f"{root}/corpus",
        ("data.path", f"file://localhost{tmp_path}/corpus"): f"{root}/corpus",
        ("checkpoint.storage", "ck/mine"): f"{root}/ck/mine",
        # the token's project ("p") checkpoints under its own root (tests/api/test_project_paths.py)
        ("checkpoint.storage", f"{tmp_path}/checkpoints/projects/p/x"): f"{root}/checkpoints/projects/p/x",
        ("checkpoint.storage", "s3://bucket/ckpts"): "s3://bucket/ckpts",
    }
    for (field, value), stored in cases.items():
        r = secured.post("/v1/runs", json=_spec(field, value), headers=h)
        assert r.status_code == 201, (value, r.text)
        section, key = field.split(".")
        assert r.json()["spec"][section][key] == stored


def test_a_token_that_may_run_code_is_not_held_to_the_roots(secured):
    coder = _token(secured, "coder", can_run_code=True)
    r = secured.post("/v1/runs", json=_spec("data.path", "/etc/hostname"), headers=coder)
    assert r.status_code == 201 and r.json()["spec"]["data"]["path"] == "/etc/hostname"
    for value in ("%2e%2e/x", "simplecache::file:///etc/passwd", "a\nb"):  # traversal/protocols: for everyone
        r = secured.post("/v1/runs", json=_spec("data.path", value), headers=coder)
        assert r.status_code == 422 and r.json()["error"]["param"] == "data.path", r.text


@pytest.mark.parametrize("working_dir", ["~/.ssh", "/etc", "etc-link", "~root", "ray"])
def test_code_dir_stays_under_the_roots_even_for_code_tokens(secured, working_dir):
    coder, plain = _token(secured, "coder", can_run_code=True), _token(secured, "plain")
    spec = {"model": {"name": "custom", "entrypoint": "pkg.m:build"}, "code": {"working_dir": working_dir}}
    r = secured.post("/v1/runs", json=spec, headers=coder)
    assert r.status_code == 422 and r.json()["error"]["param"] == "code.working_dir", r.text
    assert secured.post("/v1/runs", json=spec, headers=plain).status_code == 403


@pytest.mark.parametrize("entrypoint", ["pkg.m:build\n", "pkg.m:build\r\n", "\npkg.m:build", "pkg.m:build "])
def test_entrypoint_with_a_trailing_newline_is_refused(secured, entrypoint):
    coder = _token(secured, "coder", can_run_code=True)
    r = secured.post("/v1/runs", json={"model": {"name": "custom", "entrypoint": entrypoint}}, headers=coder)
    assert r.status_code == 422 and r.json()["error"]["param"] == "model.entrypoint", r.text


def test_allowed_roots_and_protocols_are_settings(tmp_path):
    extra = tmp_path / "shared"
    s = Settings(data_dir=tmp_path / "d", allowed_path_roots=[extra], allowed_url_schemes=["s3", "simplecache"])
    assert decide_path(f"{extra}/x", param="data.path", settings=s, restricted=True) == f"{extra}/x"
    assert decide_path("simplecache::s3://b/k", param="data.path", settings=s, restricted=True)
    for refused in ("gs://b/k", f"file://{extra}/x"):  # protocols outside the setting
        with pytest.raises(Exception, match="not allowed"):
            decide_path(refused, param="data.path", settings=s, restricted=True)


def test_unwritable_checkpoint_storage_is_reported_at_start_and_refused_at_submission(make_client, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with caplog.at_level("WARNING", logger="service.app.server"):
        c = make_client(checkpoint_root=blocker / "checkpoints")
    assert any("checkpoint storage" in r.getMessage() for r in caplog.records)
    health = c.get("/healthz")
    assert health.status_code == 503 and health.json()["storage"] == "error"
    assert "not a directory" in health.json()["reason"]
    r = c.post("/v1/runs", json={"name": "x"})  # the default storage
    assert r.status_code == 422 and r.json()["error"]["param"] == "checkpoint.storage", r.text
    r = c.post("/v1/runs", json={"checkpoint": {"storage": str(blocker / "mine")}})
    assert r.status_code == 422 and r.json()["error"]["code"] == "storage_unwritable"
    ok = c.post("/v1/runs", json={"checkpoint": {"storage": str(tmp_path / "ck")}})
    assert ok.status_code == 201, ok.text

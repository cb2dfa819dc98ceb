"""Secrets and checkpoints out of a spec's reach (issue 34): ``<data_dir>/secrets``, the credentials directory, the
database file and other projects' checkpoint roots are refused for every caller that may not see them, with a
message that names the rule and not the file's size or content; each project checkpoints under its own root."""

from __future__ import annotations

import os

import pytest

from service.security import tokens as auth
from service.security.paths import project_checkpoint_root
from service.settings import Settings
from tests.api.test_security import SPEC, _error

SECRET = "postgresql+psycopg://meshrun:hunter2-very-secret@db/meshrun"


def _token(client, project: str, name: str, **kw) -> dict[str, str]:
    with client.app.state.session_factory.begin() as s:
        return {"Authorization": f"Bearer {auth.create_token(s, project, name, **kw)}"}


def _data(path: str) -> dict:
    return {**SPEC, "data": {"source": "text", "path": path}}


def _storage(path: str) -> dict:
    return {**SPEC, "checkpoint": {"storage": path}}


@pytest.fixture
def service(make_client, tmp_path):
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "database_url").write_text(SECRET)
    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets" / "database_url").write_text(SECRET)
    c = make_client(auth="on", credentials_dir=creds, allowed_path_roots=[creds])
    settings = c.app.state.settings
    for project in ("alpha", "beta"):
        ckpt = os.path.join(project_checkpoint_root(settings, project), "run-1", "checkpoint_000001")
        os.makedirs(ckpt)
        with open(os.path.join(ckpt, "model.pt"), "w") as f:
            f.write(f"weights of {project}")
    os.makedirs(os.path.join(str(settings.checkpoint_root), "meshrun-run-old-1"))  # a shared run dir of before
    return c


def _refused(r, param: str) -> str:
    err = _error(r, 422)
    assert err["param"] == param and err["code"] == "invalid_path", err
    assert SECRET not in r.text and "hunter2" not in r.text and "weights of" not in r.text
    assert str(len(SECRET)) not in err["message"] and "bytes" not in err["message"]
    return err["message"]


def test_service_secrets_are_refused_to_every_caller(service, tmp_path, make_client):
    plain = _token(service, "alpha", "ann")
    coder = _token(service, "alpha", "cody", can_run_code=True)
    admin = _token(service, "ops", "root", admin=True)
    paths = [str(tmp_path / "secrets" / "database_url"), "secrets/database_url", "secrets",
             f"file://{tmp_path}/secrets/database_url", str(tmp_path / "creds" / "database_url"),
             str(tmp_path / "creds"), str(tmp_path / "meshrun.db"), "meshrun.db", "ray/session_latest"]
    for headers in (plain, coder, admin):
        for p in paths:
            msg = _refused(service.post("/v1/runs", json=_data(p), headers=headers), "data.path")
            assert "credentials, database or Ray directory" in msg or "belongs to the service" in msg, (p, msg)
        _refused(service.post("/v1/runs", json=_storage(str(tmp_path / "secrets" / "x")), headers=headers),
                 "checkpoint.storage")
    # also with auth off, for the local user (a spec from anywhere never reads them)
    local = make_client()
    _refused(local.post("/v1/runs", json=_data(str(tmp_path / "secrets" / "database_url"))), "data.path")
    assert service.get("/v1/runs", headers=admin).json()["total"] == 0


def test_other_projects_checkpoints_are_refused(service):
    settings = service.app.state.settings
    alpha, beta = _token(service, "alpha", "ann"), _token(service, "beta", "bob", can_run_code=True)
    admin = _token(service, "ops", "root", admin=True)
    beta_ckpt = os.path.join(project_checkpoint_root(settings, "beta"), "run-1", "checkpoint_000001")
    alpha_ckpt = os.path.join(project_checkpoint_root(settings, "alpha"), "run-1", "checkpoint_000001")
    shared = os.path.join(str(settings.checkpoint_root), "meshrun-run-old-1")
    for p in (beta_ckpt, os.path.join(beta_ckpt, "model.pt"), "checkpoints/projects/beta", shared,
              str(settings.checkpoint_root), os.path.join(str(settings.checkpoint_root), "projects")):
        msg = _refused(service.post("/v1/runs", json=_data(p), headers=alpha), "data.path")
        assert "outside your project's own directory" in msg or "allowed storage roots" in msg, (p, msg)
        _refused(service.post("/v1/runs", json=_storage(p), headers=alpha), "checkpoint.storage")
    # a token that may run code is walled the same way in its spec's paths
    _refused(service.post("/v1/runs", json=_data(alpha_ckpt), headers=beta), "data.path")
    # one's own project's checkpoints, and everything for an admin, are fine
    assert service.post("/v1/runs", json=_data(alpha_ckpt), headers=alpha).status_code == 201
    own = os.path.join(project_checkpoint_root(settings, "alpha"), "mine")
    assert service.post("/v1/runs", json=_storage(own), headers=alpha).status_code == 201
    assert service.post("/v1/runs", json=_data(beta_ckpt), headers=admin).status_code == 201
    # a resume of a run with another project's checkpoint storage is refused the same way
    assert service.get("/v1/runs", headers=alpha).json()["total"] == 2


def test_each_project_has_its_own_checkpoint_root(tmp_path):
    s = Settings(data_dir=tmp_path)
    a, b = project_checkpoint_root(s, "alpha"), project_checkpoint_root(s, "beta")
    assert a != b and os.path.dirname(a) == os.path.dirname(b) == str(s.checkpoint_root / "projects")
    for weird in ("../beta", "a/b", ".", "..", "x" * 300, "ümlaut"):
        root = project_checkpoint_root(s, weird)
        assert os.path.dirname(root) == str(s.checkpoint_root / "projects") and ".." not in root.split("/")[-1:]
        assert root not in (a, b)

"""spec.code.working_dir reaches the run's Ray Job runtime env (scheduler hook) and the standalone launcher."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from service.cluster.env import code_runtime_env, job_runtime_env
from service.security.policy import resolve_code_dir
from tests.byo.conftest import PKG, ROOT


def _code_env(spec: dict, settings) -> dict:
    """The runtime env the scheduler gives a run with this spec (its code directory resolved as it does)."""
    code = (spec.get("code") or {}).get("working_dir")
    return job_runtime_env(settings, job_id="meshrun-run-x-1", gcs_address="127.0.0.1:6389",
                           code_dir=resolve_code_dir(code, settings) if code else None)


def test_the_code_dir_becomes_the_jobs_working_dir(tmp_path, user_code_dir, monkeypatch) -> None:
    from service.settings import Settings

    monkeypatch.delenv("MESHRUN_RAY_WORKING_DIR", raising=False)
    settings = Settings(data_dir=tmp_path)
    renv = _code_env({"name": "byo", "code": {"working_dir": str(user_code_dir)}}, settings)
    assert renv["working_dir"] == str(user_code_dir.resolve()) and "**/__pycache__" in renv["excludes"]
    # relative paths are under the service's data_dir
    (tmp_path / "code" / PKG).mkdir(parents=True)
    (tmp_path / "code" / PKG / "__init__.py").write_text("")
    assert _code_env({"name": "byo", "code": {"working_dir": "code"}}, settings)["working_dir"] == \
        str((tmp_path / "code").resolve())
    # no code: no working dir; a code dir that is gone: the job starts without it
    assert "working_dir" not in _code_env({"name": "plain"}, settings)
    assert "working_dir" not in _code_env({"name": "gone", "code": {"working_dir": str(tmp_path / "nowhere")}},
                                          settings)


def test_with_meshrun_as_working_dir_user_packages_ship_as_py_modules(user_code_dir) -> None:
    renv = code_runtime_env({"working_dir": "/srv/meshrun"}, user_code_dir)
    assert renv["working_dir"] == "/srv/meshrun" and renv["py_modules"] == [str(user_code_dir.resolve() / PKG)]


def test_standalone_launcher_takes_the_code_dir(user_code_dir, tmp_path) -> None:
    spec = {"name": "byo-local", "code": {"working_dir": str(user_code_dir)},
            "model": {"name": "custom", "preset": None, "entrypoint": f"{PKG}.models:build",
                      "args": {"d": 16, "n_layers": 1, "n_heads": 2, "seq_len": 16}, "seq_len": 16},
            "data": {"source": "custom", "entrypoint": f"{PKG}.data:build", "args": {"n": 64}},
            "batch": {"global_batch_size": 4, "micro_batch_size": 2}, "train": {"steps": 2},
            "resources": {"device": "cpu"}}
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    out = subprocess.run([sys.executable, "-m", "workers", "--spec", str(path), "--log-level", "WARNING"],
                         capture_output=True, text=True, cwd=ROOT, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1])["steps_done"] == 2
    spec["code"] = {"working_dir": str(tmp_path / "nowhere")}
    path.write_text(json.dumps(spec))
    out = subprocess.run([sys.executable, "-m", "workers", "--spec", str(path)], capture_output=True, text=True,
                         cwd=ROOT, timeout=180)
    assert out.returncode == 2 and "code.working_dir" in out.stderr

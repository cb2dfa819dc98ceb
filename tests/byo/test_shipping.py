"""spec.code.working_dir reaches the run's Ray Job runtime env (scheduler hook) and the standalone launcher."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from service.inspect import add_user_code, code_runtime_env
from tests.byo.conftest import PKG, ROOT


@pytest.fixture
def factory(tmp_path):
    from service.db import make_engine, make_sessionmaker
    from service.models import Base

    engine = make_engine(f"sqlite:///{tmp_path / 'm.db'}")
    Base.metadata.create_all(engine)
    yield make_sessionmaker(engine)
    engine.dispose()


def _run_with(factory, spec: dict) -> str:
    from service import store
    from service.db import session_scope

    with session_scope(factory) as s:
        run, _ = store.create_run(s, spec=spec, plan={}, name="byo")
        return run.id


def test_the_code_dir_becomes_the_jobs_working_dir(factory, tmp_path, user_code_dir) -> None:
    from service.settings import Settings

    settings = Settings(data_dir=tmp_path)
    rid = _run_with(factory, {"name": "byo", "code": {"working_dir": str(user_code_dir)}})
    renv = add_user_code({"env_vars": {"A": "1"}}, run_id=rid, session_factory=factory, settings=settings)
    assert renv["working_dir"] == str(user_code_dir.resolve()) and "**/__pycache__" in renv["excludes"]
    # relative paths are under the service's data_dir
    (tmp_path / "code" / PKG).mkdir(parents=True)
    (tmp_path / "code" / PKG / "__init__.py").write_text("")
    rid = _run_with(factory, {"name": "byo", "code": {"working_dir": "code"}})
    assert add_user_code({}, run_id=rid, session_factory=factory, settings=settings)["working_dir"] == \
        str((tmp_path / "code").resolve())
    # no code, or not a run (a sweep's id): unchanged
    rid = _run_with(factory, {"name": "plain"})
    assert add_user_code({}, run_id=rid, session_factory=factory, settings=settings) == {}
    assert add_user_code({}, run_id="sweep-123", session_factory=factory, settings=settings) == {}


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

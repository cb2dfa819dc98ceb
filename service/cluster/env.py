"""The environment of every Ray Job meshrun submits (run drivers and sweep drivers): one place decides it.

``job_runtime_env`` returns the Ray ``runtime_env``: the settings a driver needs (never the database URL: drivers
get the path of a 0600 credential file holding it, ``credential_file``, so no job's details show a password), the
GCS address of meshrun's own cluster (never "auto", which can pick another cluster on a shared host; also as
``RAY_ADDRESS``, which every Ray call in the job's processes falls back to), ``PYTHONPATH`` with meshrun's
packages, the pass-through debugging variables, meshrun's code when the cluster does not have it installed
(``MESHRUN_RAY_WORKING_DIR``), and the user's code directory (``spec.code.working_dir``) when the run names one:
as the job's ``working_dir``, or as ``py_modules`` (one per top-level package) when meshrun itself is shipped as
the working dir. Every Ray Train worker inherits the job's runtime env.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from service.meta import PROJECT_ROOT
from service.settings import Settings

log = logging.getLogger(__name__)

PASS_THROUGH_ENV = (
    "MESHRUN_TORCH_TIMEOUT_S",
    "MESHRUN_PG_TIMEOUT_S",
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S",
)
HEALTH_CHECK_INTERVAL_S = "0.5"
CODE_EXCLUDES = [".git", "**/__pycache__", "*.pyc", ".venv", "venv", "*.ckpt", "*.pt", "*.safetensors"]
MESHRUN_EXCLUDES = [".git", "**/__pycache__", "*.db", "tests", "bench"]


def python_command() -> str:
    """The interpreter of every meshrun Ray Job's entrypoint: the service's own (``sys.executable``), so a
    service run from a venv that is not activated starts drivers with meshrun's dependencies, not whatever
    ``python`` PATH finds."""
    return shlex.quote(sys.executable)


def _packages(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir() and (p / "__init__.py").exists())


def code_runtime_env(renv: dict[str, Any], code_dir: Path) -> dict[str, Any]:
    """Add the user's ``code_dir`` to a Ray runtime env (in place; returned)."""
    code_dir = code_dir.resolve()
    if "working_dir" not in renv:
        renv["working_dir"] = str(code_dir)
        renv["excludes"] = sorted(set(renv.get("excludes", [])) | set(CODE_EXCLUDES))
        return renv
    pkgs = _packages(code_dir)
    loose = [p.name for p in code_dir.glob("*.py")]
    if loose:
        log.warning(
            "code.working_dir %s: modules %s are not packages and cannot ship as py_modules while meshrun "
            "is the job's working_dir; put them in a package",
            code_dir,
            loose[:5],
        )
    renv["py_modules"] = [*renv.get("py_modules", []), *(str(p) for p in pkgs)]
    return renv


SECRET_ENV = ("MESHRUN_DATABASE_URL", "MESHRUN_METRICS_TOKEN")


def credential_file(settings: Settings) -> Path:
    """``<credentials_dir>/database_url`` (default ``<data_dir>/secrets``; directory 0700, file 0600, written
    atomically when it differs): the one place a Ray Job driver reads the database URL from
    (``MESHRUN_DATABASE_URL_FILE``)."""
    folder = Path(settings.credentials_dir or Path(settings.data_dir) / "secrets")
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)
    path = folder / "database_url"
    url = str(settings.database_url)
    try:
        if path.read_text() == url and (path.stat().st_mode & 0o077) == 0:
            return path
    except OSError:
        pass
    tmp = folder / f".database_url.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(url)
    os.replace(tmp, path)
    return path


WARM_POOL_ENV = "MESHRUN_WARM_POOL"


def warm_pool_name(settings: Settings) -> str | None:
    """The name of this service's warm pool actor (``service.cluster.warm_host``), one per service (its database
    and data directory), so services sharing a Ray cluster never take each other's workers; None: no pool."""
    if not settings.warm_workers:
        return None
    key = hashlib.sha256(f"{settings.database_url}|{Path(settings.data_dir).resolve()}".encode()).hexdigest()[:12]
    return f"meshrun-warm-pool-{key}"


def job_runtime_env(
    settings: Settings,
    *,
    job_id: str,
    gcs_address: str | None,
    dashboard_url: str | None = None,
    extra_env: Mapping[str, str] | None = None,
    code_dir: Path | None = None,
) -> dict[str, Any]:
    """The ``runtime_env`` of a meshrun Ray Job (see the module docstring)."""
    env: dict[str, str] = {
        "MESHRUN_DATABASE_URL_FILE": str(credential_file(settings)),
        "MESHRUN_DATA_DIR": str(settings.data_dir),
        "MESHRUN_CHECKPOINT_ROOT": str(settings.checkpoint_root),
        "MESHRUN_LOG_LEVEL": settings.log_level,
        "MESHRUN_RAY_JOB_ID": job_id,
        # the driver connects to this GCS address; a ray:// client address cannot be used from inside the cluster
        "MESHRUN_RAY_GCS_ADDRESS": "" if (gcs_address or "").startswith("ray://") else (gcs_address or ""),
        "PYTHONPATH": os.pathsep.join(p for p in (str(PROJECT_ROOT), os.environ.get("PYTHONPATH")) if p),
    }
    if env["MESHRUN_RAY_GCS_ADDRESS"]:
        # Every Ray call in the job's processes (the driver, Tune trials, Train's controller and its placement
        # group cleaner, the workers) resolves a default address through RAY_ADDRESS; unset, Ray scans the
        # host and fails with "Found multiple active Ray instances" when another cluster runs there.
        env["RAY_ADDRESS"] = env["MESHRUN_RAY_GCS_ADDRESS"]
    if dashboard_url:
        env["MESHRUN_DASHBOARD_URL"] = dashboard_url
    # Ray Train's controller notices a dead or failed worker only when it polls (Ray's default: every 2 s), and a
    # checkpoint is registered at a poll too; 0.5 s cuts the controller's share of failure detection from up to 2 s
    # to up to 0.5 s (bench/bench_goodput.py: 2.4 -> 1.4 s per kill, the rest being the error's own way there) at
    # the cost of two small RPCs per worker a second. RAY_TRAIN_HEALTH_CHECK_INTERVAL_S overrides it.
    env["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = HEALTH_CHECK_INTERVAL_S
    # A job's output is a log file, never a terminal: no ANSI colour around Ray's "(RayTrainWorker pid=...)" prefixes
    env["RAY_COLOR_PREFIX"] = "0"
    env.update({k: os.environ[k] for k in PASS_THROUGH_ENV if os.environ.get(k)})
    pool = warm_pool_name(settings)
    if pool:  # run drivers start their workers in it when they can (service.runs.warm_start)
        env[WARM_POOL_ENV] = pool
    env.update(extra_env or {})
    for k in SECRET_ENV:
        env.pop(k, None)
    renv: dict[str, Any] = {"env_vars": env}
    wd = os.environ.get("MESHRUN_RAY_WORKING_DIR")
    if wd:  # a remote cluster without meshrun installed: ship meshrun's code
        renv["working_dir"] = wd
        renv["excludes"] = list(MESHRUN_EXCLUDES)
    if code_dir is not None:
        if code_dir.is_dir():
            code_runtime_env(renv, code_dir)
        else:
            log.warning("job %s: code.working_dir %s is gone; the job starts without it", job_id, code_dir)
    return renv

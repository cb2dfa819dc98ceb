"""User code on the service side: shipping it to the workers and inspecting user models for the planner.

The service never imports or runs user code in its own process (issue 9: only tokens allowed to run code may
submit it; the API process must not exec it). So:

- Shipping: ``spec.code.working_dir`` (absolute, or relative to the service's ``data_dir``) is added to the run's
  Ray Job runtime environment by ``add_user_code`` (called where the scheduler builds the runtime env): as the
  job's ``working_dir``, or as ``py_modules`` (one per top-level package in it) when meshrun itself is shipped as
  the working dir (``MESHRUN_RAY_WORKING_DIR``). Every Ray Train worker inherits the job's runtime env.
- Inspection happens in the run DRIVER (the Ray Job, already running with that runtime env), before the
  TorchTrainer starts: ``inspect_in_driver`` runs ``workers.user_code.inspect_model`` in an isolated process — a
  Ray task (``num_cpus=0``, the job's runtime env, a timeout) or, without Ray, a subprocess ``python -m
  workers.user_code inspect`` with a timeout. The model is built on the meta device (no weights). The result
  (n_params, blocks, largest block, d_model guess) updates the stored plan (``plan.model.n_params``,
  ``n_layers``, ``d_model``) and the planner's memory prediction, is recorded as a run event, and a model that
  cannot run the layout (TP plan pattern matching no module, bad split points, import errors) or is predicted
  not to fit fails the run there with the reason, before any worker starts.
  Why not at submission: the API process would have to upload the code to the cluster and wait for a Ray
  worker (seconds to minutes on a busy cluster) inside the request, or run user code on the API host.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from api.schemas import ClusterSpec, Plan, RunSpec

log = logging.getLogger(__name__)

INSPECT_TIMEOUT_S = float(os.environ.get("MESHRUN_INSPECT_TIMEOUT_S", "180"))
PROJECT_ROOT = Path(__file__).resolve().parents[1]
CODE_EXCLUDES = [".git", "**/__pycache__", "*.pyc", ".venv", "venv", "*.ckpt", "*.pt", "*.safetensors"]


class InspectionFailed(Exception):
    def __init__(self, message: str, param: str = "model.entrypoint"):
        super().__init__(message)
        self.message, self.param = message, param


# ------------------------------------------------------------------------------------------------ shipping
def resolve_code_dir(working_dir: str, settings: Any) -> Path:
    """Absolute as given; relative to the service's data_dir."""
    p = Path(working_dir).expanduser()
    return p if p.is_absolute() else Path(settings.data_dir) / p


def check_code_dir(spec: RunSpec, settings: Any) -> str | None:
    """Why ``spec.code.working_dir`` cannot be shipped from this service host (None = fine)."""
    if spec.code is None or spec.code.working_dir is None:
        return None
    p = resolve_code_dir(spec.code.working_dir, settings)
    if not p.is_dir():
        return (f"code.working_dir '{spec.code.working_dir}' is not a directory on the service host (looked at {p}); "
                "give the directory that holds your package (relative paths are under the service's data_dir)")
    return None


def _packages(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir() and (p / "__init__.py").exists())


def code_runtime_env(renv: dict[str, Any], code_dir: Path) -> dict[str, Any]:
    """Add ``code_dir`` to a Ray runtime env (in place; returned)."""
    code_dir = code_dir.resolve()
    if "working_dir" not in renv:
        renv["working_dir"] = str(code_dir)
        renv["excludes"] = sorted(set(renv.get("excludes", [])) | set(CODE_EXCLUDES))
        return renv
    pkgs = _packages(code_dir)
    loose = [p.name for p in code_dir.glob("*.py")]
    if loose:
        log.warning("code.working_dir %s: modules %s are not packages and cannot ship as py_modules while meshrun "
                    "is the job's working_dir; put them in a package", code_dir, loose[:5])
    renv["py_modules"] = [*renv.get("py_modules", []), *(str(p) for p in pkgs)]
    return renv


def add_user_code(renv: dict[str, Any], *, run_id: str, session_factory: Any, settings: Any) -> dict[str, Any]:
    """The scheduler's hook: ship the run's ``spec.code.working_dir`` with its Ray Job (no-op without one)."""
    from service import store
    from service.db import session_scope

    with session_scope(session_factory) as s:
        try:
            spec_json = store.get_run(s, run_id=run_id).spec
        except store.NotFound:
            return renv  # not a run (e.g. a sweep driver)
    code = (spec_json or {}).get("code") or {}
    if not code.get("working_dir"):
        return renv
    p = resolve_code_dir(code["working_dir"], settings)
    if not p.is_dir():
        log.warning("run %s: code.working_dir %s is gone; the job starts without it", run_id, p)
        return renv
    return code_runtime_env(renv, p)


# ---------------------------------------------------------------------------------------------- inspection
def _inspect_task(spec_json: dict[str, Any]) -> dict[str, Any]:
    """Runs in a Ray worker (the job's runtime env): the inspection, errors as data."""
    from workers.user_code import UserCodeError, inspect_model

    try:
        return {"ok": True, **inspect_model(spec_json)}
    except UserCodeError as e:
        return {"ok": False, "param": e.param, "error": e.message}
    except Exception as e:  # noqa: BLE001 - user code may raise anything
        return {"ok": False, "param": "model.entrypoint", "error": f"{type(e).__name__}: {e}"}


def inspect_with_ray(spec: RunSpec, *, timeout_s: float = INSPECT_TIMEOUT_S) -> dict[str, Any]:
    import ray

    task = ray.remote(num_cpus=0, max_retries=0)(_inspect_task)
    ref = task.remote(spec.model_dump(mode="json"))
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        ray.cancel(ref, force=True)
        raise InspectionFailed(f"inspecting the user model took longer than {timeout_s:.0f} s (building it on the "
                               "meta device should take seconds); check model.entrypoint") from None


def inspect_with_subprocess(spec: RunSpec, *, code_dir: str | None = None,
                            timeout_s: float = INSPECT_TIMEOUT_S) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "workers.user_code", "inspect", "--spec", "-"]
    if code_dir:
        cmd += ["--code-dir", code_dir]
    try:
        proc = subprocess.run(cmd, input=json.dumps(spec.model_dump(mode="json")), capture_output=True, text=True,
                              timeout=timeout_s, env=env, cwd=str(PROJECT_ROOT))
    except subprocess.TimeoutExpired:
        raise InspectionFailed(f"inspecting the user model took longer than {timeout_s:.0f} s; check "
                               "model.entrypoint") from None
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        raise InspectionFailed(f"the inspection process failed (exit {proc.returncode}): {proc.stderr[-1500:]}")
    return json.loads(lines[-1])


def apply_inspection(plan: Plan, info: dict[str, Any]) -> Plan:
    """The plan with the user model's measured size: n_params, n_layers (blocks), d_model (guess). Sequence
    length and vocabulary stay the spec's (the data pipeline uses them)."""
    upd: dict[str, Any] = {"n_params": int(info["n_params"])}
    if info.get("n_blocks"):
        upd["n_layers"] = int(info["n_blocks"])
    if info.get("d_model"):
        upd["d_model"] = int(info["d_model"])
        upd["d_ff"] = 4 * int(info["d_model"])
    return plan.model_copy(update={"model": plan.model.model_copy(update=upd)})


def describe(info: dict[str, Any]) -> str:
    return (f"user model {info.get('class')} from {info.get('entrypoint')}: {info['n_params']:,} parameters, "
            f"{info.get('n_blocks', 0)} blocks of {'/'.join(info.get('block_classes') or []) or '?'} (largest "
            f"{info.get('block_params', 0):,} parameters), d_model ~ {info.get('d_model')}")


def planning_cluster_from_ray() -> ClusterSpec | None:
    """The connected Ray cluster as the planner sees it (as ``service.runtime.Runtime.planning_cluster``)."""
    import ray

    alive = [n for n in ray.nodes() if n.get("Alive")]
    if not alive:
        return None
    res = [{k: float(v) for k, v in (n.get("Resources") or {}).items()} for n in alive]
    gpu = [r for r in res if r.get("GPU", 0) > 0]
    if gpu:
        acc = next((k.split("accelerator_type:", 1)[1] for r in gpu for k in r if k.startswith("accelerator_type:")),
                   None)
        return ClusterSpec(device=acc or "H100", gpus_per_node=max(1, int(max(r["GPU"] for r in gpu))),
                           nodes=len(gpu))
    from service.runtime import cpu_peak_flops_per_s

    mem = min(r.get("memory", 0) / max(1.0, r.get("CPU", 1)) for r in res)
    return ClusterSpec(device="cpu", gpus_per_node=max(1, int(max(r.get("CPU", 1) for r in res))), nodes=len(res),
                       memory_bytes=int(mem) if mem > 0 else None, peak_flops_per_s=cpu_peak_flops_per_s())


def inspect_in_driver(spec: RunSpec, plan: Plan, *, use_ray: bool = True,
                      timeout_s: float = INSPECT_TIMEOUT_S) -> tuple[Plan, dict[str, Any]]:
    """Inspect the run's user model and return (updated plan, inspection). Raises InspectionFailed with the
    reason when the model cannot be built, does not fit the layout, or (unless skip_memory_check) is predicted
    not to fit in memory."""
    if use_ray:
        info = inspect_with_ray(spec, timeout_s=timeout_s)
    else:
        info = inspect_with_subprocess(spec, code_dir=spec.code.working_dir if spec.code else None,
                                       timeout_s=timeout_s)
    if not info.get("ok"):
        raise InspectionFailed(f"user model: {info.get('error')}", info.get("param") or "model.entrypoint")
    if info.get("errors"):
        raise InspectionFailed("user model does not support this layout: " + "; ".join(info["errors"]),
                               "model.tp_plan" if "tp_plan" in info["errors"][0] else "model")
    new = apply_inspection(plan, info)
    if plan.predicted is not None:
        try:
            from service.planner import predict_run

            cluster = planning_cluster_from_ray() if use_ray else None
            if cluster is not None:
                cand = predict_run(spec, new, cluster)
                new = new.model_copy(update={"predicted": cand})
                if not cand.feasible and not spec.skip_memory_check:
                    gib = cand.memory_bytes.total / 1024**3
                    raise InspectionFailed(f"{describe(info)}: predicted not to fit in device memory ({gib:.2f} GiB "
                                           f"per rank; {cand.reason}); use more data-parallel sharding "
                                           "(zero_stage 3), tensor/pipeline parallel, activation checkpointing, or "
                                           "set skip_memory_check: true", "layout")
        except InspectionFailed:
            raise
        except Exception:  # noqa: BLE001 - a prediction problem must not fail a run that may well fit
            log.exception("re-predicting memory for the inspected user model failed")
    return new, info

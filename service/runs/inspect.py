"""User code on the service side: shipping it to the workers and inspecting user models for the planner.

The service never imports or runs user code in its own process (issue 9: only tokens allowed to run code may
submit it; the API process must not exec it). So:

- Shipping: ``spec.code.working_dir`` (absolute, or relative to the service's ``data_dir``) is added to the run's
  Ray Job runtime environment by ``service.cluster.env.job_runtime_env`` (``code_dir=``, which the scheduler and
  the sweeps resolve with ``service.security.policy.resolve_code_dir``): as the job's ``working_dir``, or as
  ``py_modules`` (one per top-level package in it) when meshrun itself is shipped as the working dir
  (``MESHRUN_RAY_WORKING_DIR``). Every Ray Train worker inherits the job's runtime env.
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
from typing import Any

from api.spec import ClusterSpec, Plan, RunSpec
from service.cluster.capacity import planning_cluster
from service.meta import PROJECT_ROOT

log = logging.getLogger(__name__)

INSPECT_TIMEOUT_S = float(os.environ.get("MESHRUN_INSPECT_TIMEOUT_S", "180"))
CODE_EXCLUDES = [".git", "**/__pycache__", "*.pyc", ".venv", "venv", "*.ckpt", "*.pt", "*.safetensors"]


class InspectionFailed(Exception):
    def __init__(self, message: str, param: str = "model.entrypoint"):
        super().__init__(message)
        self.message, self.param = message, param


def _inspect_task(spec_json: dict[str, Any]) -> dict[str, Any]:
    """Runs in a Ray worker (the job's runtime env): the inspection, errors as data."""
    from workers.user_code import UserCodeError, inspect_model

    try:
        return {"ok": True, **inspect_model(spec_json)}
    except UserCodeError as e:
        return {"ok": False, "param": e.param, "error": e.message}
    except Exception as e:
        return {"ok": False, "param": "model.entrypoint", "error": f"{type(e).__name__}: {e}"}


def inspect_with_ray(spec: RunSpec, *, timeout_s: float = INSPECT_TIMEOUT_S) -> dict[str, Any]:
    import ray

    task = ray.remote(num_cpus=0, max_retries=0)(_inspect_task)
    ref = task.remote(spec.model_dump(mode="json"))
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        ray.cancel(ref, force=True)
        raise InspectionFailed(
            f"inspecting the user model took longer than {timeout_s:.0f} s (building it on the "
            "meta device should take seconds); check model.entrypoint"
        ) from None


def inspect_with_subprocess(
    spec: RunSpec, *, code_dir: str | None = None, timeout_s: float = INSPECT_TIMEOUT_S
) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "workers.user_code", "inspect", "--spec", "-"]
    if code_dir:
        cmd += ["--code-dir", code_dir]
    try:
        proc = subprocess.run(
            cmd,
            input=json.dumps(spec.model_dump(mode="json")),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
            cwd=str(PROJECT_ROOT),
        )
    except subprocess.TimeoutExpired:
        raise InspectionFailed(
            f"inspecting the user model took longer than {timeout_s:.0f} s; check model.entrypoint"
        ) from None
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
    return (
        f"user model {info.get('class')} from {info.get('entrypoint')}: {info['n_params']:,} parameters, "
        f"{info.get('n_blocks', 0)} blocks of {'/'.join(info.get('block_classes') or []) or '?'} (largest "
        f"{info.get('block_params', 0):,} parameters), d_model ~ {info.get('d_model')}"
    )


def planning_cluster_from_ray() -> ClusterSpec | None:
    """The connected Ray cluster as the planner sees it (the same rule as the service's runtime)."""
    import ray

    return planning_cluster(
        [{k: float(v) for k, v in (n.get("Resources") or {}).items()} for n in ray.nodes() if n.get("Alive")]
    )


def inspect_in_driver(
    spec: RunSpec, plan: Plan, *, use_ray: bool = True, timeout_s: float = INSPECT_TIMEOUT_S
) -> tuple[Plan, dict[str, Any]]:
    """Inspect the run's user model and return (updated plan, inspection). Raises InspectionFailed with the
    reason when the model cannot be built, does not fit the layout, or (unless skip_memory_check) is predicted
    not to fit in memory."""
    if use_ray:
        info = inspect_with_ray(spec, timeout_s=timeout_s)
    else:
        info = inspect_with_subprocess(spec, code_dir=spec.code.working_dir if spec.code else None, timeout_s=timeout_s)
    if not info.get("ok"):
        raise InspectionFailed(f"user model: {info.get('error')}", info.get("param") or "model.entrypoint")
    if info.get("errors"):
        raise InspectionFailed(
            "user model does not support this layout: " + "; ".join(info["errors"]),
            "model.tp_plan" if "tp_plan" in info["errors"][0] else "model",
        )
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
                    raise InspectionFailed(
                        f"{describe(info)}: predicted not to fit in device memory ({gib:.2f} GiB "
                        f"per rank; {cand.reason}); use more data-parallel sharding "
                        "(zero_stage 3), tensor/pipeline parallel, activation checkpointing, or "
                        "set skip_memory_check: true",
                        "layout",
                    )
        except InspectionFailed:
            raise
        except Exception:
            log.exception("re-predicting memory for the inspected user model failed")
    return new, info

"""A run that starts in the service's warm pool (``MESHRUN_WARM_WORKERS``, ``service.cluster.warm_host``) instead of
a new Ray Train worker group: the run driver's side.

``cold_reason`` says why a run cannot (GPU workers, a user's code or runtime env, object-store checkpoints, faults,
elastic layouts, label-pinned workers, ``resources.warm_start: false``) or None. ``fit_warm`` then:

1. finds the pool (``MESHRUN_WARM_POOL`` in the ``meshrun-warm`` namespace; gone: the run starts cold);
2. places the run's workers in a placement group of the scheduler's bundles (its CPUs held while it trains) and
   takes an idle group of warm workers on that node (or starts one), a phase saying which;
3. trains it there (``service.cluster.warm.warm_fit``) through the run's channel, with the run's files: one
   checkpoint directory on the run's storage (``<storage>/<Train run name>-warm``, every rank writes into it: the
   ranks share a node) and the run's ``resume_from``.

Placed over several nodes: nothing trained, the run starts cold. A worker that raises or dies (a kill, the hang
watch) fails this attempt like a Ray Train worker would: the error is the channel's ``worker_error`` and the driver
restarts the run as a Ray Train worker group from its latest checkpoint, one of ``resources.max_failures``.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import ray
from ray.actor import ActorHandle

from api.spec import Plan, RunSpec
from service.cluster.env import WARM_POOL_ENV
from service.cluster.placement import Placement
from service.cluster.warm import WARM_NAMESPACE, NotOneNode, usable, warm_fit
from service.runs.lifecycle import RunLifecycle
from service.runs.naming import TORCH_TIMEOUT_S, RunStart

logger = logging.getLogger(__name__)


def cold_reason(spec: RunSpec, plan: Plan, placement: Placement | None) -> str | None:
    """Why this run starts a new Ray Train worker group even when the service has a warm pool (None: it may not)."""
    if not os.environ.get(WARM_POOL_ENV):
        return "the service keeps no warm pool (MESHRUN_WARM_WORKERS=0)"
    checks = (
        (not spec.resources.warm_start, "resources.warm_start is false"),
        (not usable(plan), "GPU workers (warm workers are CPU only)"),
        (spec.code is not None or bool(spec.model.entrypoint) or bool(spec.data.entrypoint), "the run's own code"),
        ("://" in (spec.checkpoint.storage or ""), "object-store checkpoints"),
        (spec.faults is not None, "injected faults (their semantics are Ray Train restarts)"),
        (spec.elastic is not None, "an elastic run"),
        (placement is not None and placement.label_selector is not None, "workers pinned to several nodes"),
    )
    return next((why for bad, why in checks if bad), None)


def warm_pool() -> ActorHandle | None:
    name = os.environ.get(WARM_POOL_ENV)
    if not name:
        return None
    try:
        return ray.get_actor(name, namespace=WARM_NAMESPACE)
    except ValueError:  # its job is not running (yet): this run starts cold
        return None


def fit_warm(life: RunLifecycle, pool: ActorHandle, start: RunStart) -> None:
    """Train the run in a warm group of ``pool``; raises ``NotOneNode`` (nothing trained) or a worker's error."""
    tmp = Path(start.settings.data_dir) / "tmp"
    files = {
        "checkpoint_dir": str(Path(start.storage) / f"{start.train_run_name}-warm"),
        "resume_from": start.resume_from,
        "state_root": str(tmp / "meshrun-state" / start.run_id),
        "profile_root": str(tmp / "meshrun-profiles" / start.run_id),
    }
    w = start.plan.world_size

    def on_group(gid: int, jobs: int, new: bool) -> None:
        if new:
            life.phase(f"starting warm worker group #{gid} of the service's pool: {w} workers (no idle one fits)")
        else:
            life.phase(
                f"re-meshing warm worker group #{gid} of the service's pool ({w} workers, {jobs} job(s) before "
                "this run): no worker start"
            )

    fitted = start.fitted
    warm_fit(
        pool=pool,
        run_id=start.run_id,
        run_name=start.run_name,
        spec_json=start.spec.model_dump(mode="json", by_alias=True),
        plan=start.plan,
        channel=start.channel,
        cancel=threading.Event(),
        on_group=on_group,
        timeout_s=float(TORCH_TIMEOUT_S),
        bundle=dict(fitted.resources_per_worker) if fitted is not None else None,
        strategy=fitted.placement_strategy if fitted is not None else None,
        files=files,
        one_node=True,
        attempt=start.attempt,
    )


def record_failure(channel: ActorHandle, error: BaseException) -> None:
    """The warm attempt's failure as the channel's worker error (the next attempt's cause, the run's reason)."""
    text = f"{type(error).__name__}: {error}"
    try:
        ray.get(channel.worker_error.remote(text[:4000]), timeout=10)
    except Exception:
        logger.exception("recording the warm attempt's failure failed")


def restarts_left(max_failures: int) -> int | None:
    """Ray Train's ``max_failures`` for the cold restart after a failed warm attempt (None: no restart left)."""
    if max_failures < 0:
        return -1
    return max_failures - 1 if max_failures > 0 else None


__all__ = ["NotOneNode", "cold_reason", "fit_warm", "record_failure", "restarts_left", "warm_pool"]

"""A run's Ray Train ``TorchTrainer``: one worker per rank, placed as the scheduler decided, for the run driver and
the sweep's trial driver alike.

``build_trainer`` turns the plan and the placement into the trainer: ``ScalingConfig`` from the placement (per-worker
node pinning) or else from the plan's worker resources, ``FailureConfig(max_failures)``, a unique Train run name per
submission (``train_run_name``), checkpoints kept per the spec, a short ``TorchConfig.timeout_s``, and the
``ChannelCallback`` that forwards checkpoints and worker errors to the run's channel.

The workers run ``workers.ray_worker.train_loop_per_worker``, which calls ``workers.loop.train_job`` with the run
channel's hooks (heartbeats for the hang watch, per-rank breakdowns for the straggler watch, profiles, and
``control()``: stop, preempt, profile). Runs and sweep trials get the same entry and the same hooks; a trial is asked
to stop (a sweep's early stop, a cancel) through its channel like any run. ``stoppable=True`` (sweep trials) only
makes a worker group that cannot start fail the trial at once instead of being retried.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ray.actor import ActorHandle
from ray.train import Checkpoint, CheckpointConfig, RunConfig, ScalingConfig, UserCallback
from ray.train.torch import TorchConfig, TorchTrainer
from ray.train.v2._internal.execution.context import TrainRunContext  # the type UserCallback's hooks name
from ray.train.v2.api.config import FailureConfig  # Train V2 (the default): has controller_failure_limit

from api.spec import Plan
from service.cluster.jobs import format_worker_exceptions
from service.cluster.placement import Placement, slot_description, worker_resources
from service.runs.naming import TORCH_TIMEOUT_S, RunStart, run_storage, train_run_name

__all__ = ["TORCH_TIMEOUT_S", "build_trainer", "placing_phase", "run_storage", "train_run_name"]

RUN_START_RETRIES = 2


def placing_phase(plan: Plan) -> str:
    """The start-up phase while Ray Train places the workers (its placement group, then one actor per rank)."""
    unit = slot_description(worker_resources(plan))
    return f"placing {plan.world_size} workers of {unit} (Ray Train: placement group, worker processes, torch)"


def scaling_config(plan: Plan, placement: Placement | None) -> ScalingConfig:
    """A fitting placement's workers and node pinning, or (None: a sweep trial) the plan's worker resources."""
    if placement is not None:
        return ScalingConfig(**placement.scaling_kwargs())
    res = worker_resources(plan)
    return ScalingConfig(
        num_workers=plan.world_size,
        use_gpu=bool(res.get("GPU")),
        resources_per_worker=res,
        placement_strategy=plan.placement_strategy,
    )


def build_trainer(start: RunStart, *, stoppable: bool = False, max_failures: int | None = None) -> TorchTrainer:
    """The run's Ray Train trainer; ``max_failures`` None: the spec's (a restart after a failed warm attempt passes
    what is left)."""
    from workers.ray_worker import train_loop_per_worker

    scaling = scaling_config(start.plan, start.fitted)
    spec = start.spec
    config = {
        "run_id": start.run_id,
        "run_name": start.run_name,
        "spec": spec.model_dump(mode="json"),
        "plan": start.plan.model_dump(mode="json"),
        "channel": start.channel,
        "resume_from": start.resume_from,
        "local_checkpoint_root": str(Path(start.settings.data_dir) / "tmp"),
    }
    return _Trainer(
        train_loop_per_worker,
        train_loop_config=config,
        scaling_config=scaling,
        torch_config=TorchConfig(backend="nccl" if scaling.use_gpu else "gloo", timeout_s=TORCH_TIMEOUT_S),
        run_config=RunConfig(
            name=start.train_run_name,
            storage_path=start.storage,
            # a worker group that cannot start (RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S, 60 s) is a controller
            # failure, retried forever by default: a sweep trial fails at once with that reason, a run retries twice
            failure_config=FailureConfig(
                max_failures=spec.resources.max_failures if max_failures is None else max_failures,
                controller_failure_limit=0 if stoppable else RUN_START_RETRIES,
            ),
            # never Ray Train's num_to_keep: the driver prunes (checkpoint.keep) once the newer ones are recorded
            # (service.runs.lifecycle.Recorder._prune_checkpoints)
            checkpoint_config=CheckpointConfig(num_to_keep=None),
            # a Train V2 UserCallback; RunConfig's annotation still names the Tune callback base
            callbacks=[ChannelCallback(start.channel)],  # type: ignore[list-item]
        ),
    )


class ChannelCallback(UserCallback):
    """Runs in the Train controller: persisted checkpoints and worker failures -> the run channel."""

    def __init__(self, channel: ActorHandle):
        self.channel = channel

    def after_report(
        self, run_context: TrainRunContext, metrics: list[dict[str, Any]], checkpoint: Checkpoint | None
    ) -> None:
        if checkpoint is None:
            return
        m = metrics[0] if metrics else {}
        self.channel.checkpoint.remote(
            {"step": m.get("step"), "path": checkpoint.path, "attempt_reported": m.get("attempt")}
        )

    def after_exception(self, run_context: TrainRunContext, worker_exceptions: dict[int, Exception]) -> None:
        try:
            text = format_worker_exceptions(worker_exceptions)
        except Exception as e:
            text = f"worker failure ({e})"
        self.channel.worker_error.remote(text)


class _Trainer(TorchTrainer):
    """TorchTrainer without Ray Train's datasets callback when no Ray Dataset is passed (meshrun's workers read their
    own data): that callback starts a DatasetManager actor, one more process importing Ray Data, at every worker
    group start, each restart after a failure included (on a 2-core machine about 0.5 s of every restart)."""

    def _create_default_callbacks(self) -> list[Any]:
        callbacks: list[Any] = super()._create_default_callbacks()  # type: ignore[misc]
        if self.datasets:
            return callbacks
        try:
            from ray.train.v2._internal.callbacks import DatasetsCallback
        except ImportError:  # pragma: no cover - another Ray: keep its callbacks as they are
            return callbacks
        return [c for c in callbacks if not isinstance(c, DatasetsCallback)]

"""The Ray Train ``train_loop_per_worker``: runs ``workers.loop.train_job`` inside a Ray Train worker.

Per worker group start (an attempt):
1. every rank all-gathers (Ray node id, pid); the TP groups (``tp`` consecutive ranks; rank order pp-outer,
   dp, tp-inner) must each share one node, else the run stops with a clear error;
2. rank 0 registers the attempt with the run's channel actor (rank -> node map, pids) and broadcasts the
   attempt number;
3. resume from ``ray.train.get_checkpoint()`` (a restart after a failure) or else ``config["resume_from"]``
   (a user resume of an earlier run);
4. train: rank 0's per-step rows (``api.spec.metrics.MetricRow`` keys, incl. the per-rank step-time breakdown
   ``breakdown_per_rank``; they arrive once per report of ``workers.reporting``) go fire-and-forget to the
   channel in small batches (every ``FLUSH_INTERVAL_S``; never through ``ray.train.report``, a ~2 s barrier);
   each checkpoint (every rank saves its shard into its own local directory) is reported with
   ``ray.train.report(..., checkpoint=...)``, which merges the ranks' directories in the run's storage.

Diagnostics (``workers.diagnostics``, ``workers.profiling``): every rank writes its "where am I" state to
``<local_checkpoint_root or tmp>/meshrun-state/<run_id>/a<attempt>/rank<r>.json`` on its node (stack dumps on
SIGUSR1 next to it) and sends the same snapshot to the channel's ``rank_state(attempt, snapshot)`` every few
seconds (fire and forget). Rank 0 polls the channel's ``control()`` at each report: ``{"stop": True}`` stops every
rank after the step (a cancel, a sweep's early stop), ``{"preempt": reason}`` checkpoints then stops,
``{"profile_steps": k}`` profiles the next k steps on every rank; trace files are written on each node and sent
to the channel's ``artifact(attempt, rank, name, text)``. Runs and sweep trials alike: one entry
(``workers.loop.train_job``), the same hooks (``channel_hooks``).

Imports ray and torch only (no fastapi, no sqlalchemy).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
import torch.distributed as dist

from api.spec.metrics import PEAK_MEMORY_PER_RANK
from workers import memory_copy
from workers.control import ControlPoll
from workers.hooks import Hooks
from workers.preemption import NOTICE, install_on_actor_main_thread
from workers.ray_metrics import RunMetricsPublisher

logger = logging.getLogger(__name__)

FLUSH_INTERVAL_S = 0.25  # rank 0 batches per-step rows to the run channel at most this often
PUBLISH_INTERVAL_S = 1.0  # Ray metrics gauges (latest value) at most this often


class TPGroupSplitError(RuntimeError):
    """A tensor-parallel group spans nodes."""


def check_tp_groups(rank_nodes: list[str], tp: int) -> str | None:
    """None if every TP group (tp consecutive ranks) is on one node, else a message naming the first split."""
    tp = max(1, tp)
    for start in range(0, len(rank_nodes), tp):
        grp = rank_nodes[start : start + tp]
        if len(set(grp)) > 1:
            return (
                f"tensor-parallel group of ranks {start}..{start + len(grp) - 1} spans nodes "
                f"{sorted(set(grp))}; a TP group must share one node. Ranks per node: "
                f"{_counts(rank_nodes)}. Place whole TP groups per node (each node a multiple of tp={tp} "
                "workers) or lower tp"
            )
    return None


def _counts(rank_nodes: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in rank_nodes:
        out[n[:12]] = out.get(n[:12], 0) + 1
    return out


def _gather_objects(obj: Any) -> list[Any]:
    world = dist.get_world_size()
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _broadcast(obj: Any) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _publisher(run_id: str, run_name: str, rank: int) -> RunMetricsPublisher | None:
    try:
        return RunMetricsPublisher(run_id, run_name, rank)
    except Exception:
        logger.exception("metrics publisher unavailable")
        return None


class RowSink:
    """Rank 0's ``sink``: per-step rows to the run channel, fire and forget, in batches at most every
    ``FLUSH_INTERVAL_S`` (never through ``ray.train.report``, a ~2 s barrier); the latest row to the Ray metrics
    gauges at most every ``PUBLISH_INTERVAL_S``."""

    def __init__(self, channel: Any, attempt: int, publisher: RunMetricsPublisher | None) -> None:
        self.channel, self.attempt, self.publisher = channel, attempt, publisher
        self.buffer: list[dict[str, Any]] = []
        self.flushed_at, self.published_at = time.monotonic(), 0.0
        self.unpublished: dict[str, Any] | None = None

    def __call__(self, row: dict[str, Any]) -> None:
        clean = {k: v for k, v in row.items() if k != PEAK_MEMORY_PER_RANK}
        per_rank = row.get(PEAK_MEMORY_PER_RANK)
        if per_rank is not None:
            clean[PEAK_MEMORY_PER_RANK] = list(per_rank)
        self.buffer.append(clean)
        self.unpublished = row
        now = time.monotonic()
        if now - self.flushed_at >= FLUSH_INTERVAL_S:
            self.channel.metrics.remote(self.attempt, list(self.buffer))
            self.buffer.clear()
            self.flushed_at = now
        if self.publisher is not None and now - self.published_at >= PUBLISH_INTERVAL_S:
            self.publisher.publish(row)
            self.published_at, self.unpublished = now, None

    def flush(self) -> None:
        if self.buffer:
            self.channel.metrics.remote(self.attempt, list(self.buffer))  # fire and forget
            self.buffer.clear()
        self.flushed_at = time.monotonic()
        if self.publisher is not None and self.unpublished is not None:
            self.publisher.publish(self.unpublished)
            self.unpublished = None


def channel_hooks(channel: Any, attempt: int, rank: int, rows: RowSink | None, *, copy_world: int = 0) -> Hooks:
    """This rank's callbacks, all through the run's channel actor (``service.cluster.jobs.RunChannel``; see the
    module docstring): rows (``rows``, rank 0), checkpoints to Ray Train, heartbeats, profiles, and rank 0's
    ``control()`` poll. Runs and sweep trials get the same ones. ``copy_world``: the world size when
    ``checkpoint.memory_copy`` is on (each checkpoint's files also go to the channel, ``workers.memory_copy``)."""

    def on_checkpoint(step: int, path: str | None) -> None:
        import ray.train

        if rows is not None:
            rows.flush()  # the rows up to the checkpoint first
        if not path:
            return
        t0 = time.perf_counter()
        if copy_world:
            memory_copy.keep(channel, step, rank, copy_world, path)  # before Ray Train moves the files
        ray.train.report(
            {"step": int(step), "attempt": attempt},
            checkpoint=ray.train.Checkpoint.from_directory(path),
            checkpoint_dir_name=f"step_{int(step):08d}_a{attempt}",
            delete_local_checkpoint_after_upload=True,
        )
        logger.info("rank %d: checkpoint of step %d reported in %.3f s", rank, step, time.perf_counter() - t0)

    def on_state(snap: dict[str, Any]) -> None:
        channel.rank_state.remote(attempt, snap)  # fire and forget

    def on_profile(first: int, last: int, paths: list[str]) -> None:
        for path in paths:
            name = f"profile/steps_{first:08d}-{last:08d}/{Path(path).name}"
            channel.artifact.remote(attempt, rank, name, Path(path).read_text())

    return Hooks(
        sink=rows,
        on_checkpoint=on_checkpoint,
        control=ControlPoll(channel) if rank == 0 else None,
        on_state=on_state,
        on_profile=on_profile,
    )


def register_attempt(channel: Any, plan: Any) -> int:
    """Every rank all-gathers where it runs; the TP groups must each share a node; rank 0 registers the attempt
    with the channel (a split TP group as its cause) and everybody learns its number. Raises on a split group."""
    import ray.train

    ctx = ray.train.get_context()
    me = {
        "rank": ctx.get_world_rank(),
        "node_id": ray.get_runtime_context().get_node_id(),
        "pid": os.getpid(),
        "local_rank": ctx.get_local_rank(),
        "host": os.uname().nodename,
    }
    ranks = _gather_objects(me)
    problem = check_tp_groups([r["node_id"] for r in ranks], plan.tp)
    attempt = None
    if me["rank"] == 0:
        cause = f"placement check failed: {problem}" if problem else None
        attempt = ray.get(channel.begin_attempt.remote({"ranks": ranks, "cause": cause}), timeout=60)
    attempt = int(_broadcast(attempt))
    if problem:
        raise TPGroupSplitError(problem)
    return attempt


def train_loop_per_worker(config: dict[str, Any]) -> None:
    import ray.train

    from api.spec import Plan, RunSpec
    from workers.loop import WorkerJob, train_job

    rank = ray.train.get_context().get_world_rank()
    channel, run_id = config["channel"], config["run_id"]
    spec = RunSpec.model_validate(config["spec"])
    plan = Plan.model_validate(config["plan"])
    if not dist.is_initialized():
        raise RuntimeError("Ray Train did not initialise torch.distributed (TorchTrainer expected)")
    attempt = register_attempt(channel, plan)
    _install_preemption_handler(rank)

    # where to resume from (Ray Train's latest checkpoint after a failure: its in-memory copy when there is one,
    # else storage; else the user's), where files go
    root = Path(config.get("local_checkpoint_root") or tempfile.gettempdir())
    copy_world = ray.train.get_context().get_world_size() if spec.checkpoint.memory_copy else 0
    ckpt = ray.train.get_checkpoint()
    resume_cm: Any = contextlib.nullcontext(config.get("resume_from"))
    restore_dir = root / "meshrun-restore" / run_id / f"a{attempt}" / f"rank{rank}"
    if ckpt is not None:
        step = memory_copy.step_of(ckpt.path) if copy_world else None
        restored = memory_copy.restore(channel, step, restore_dir) if step is not None else None
        resume_cm = contextlib.nullcontext(str(restored[0])) if restored else ckpt.as_directory()
        if restored and rank == 0:
            channel.event.remote(
                "checkpoint_restored",
                f"attempt {attempt} resumes from the in-memory copy of the checkpoint of step {step} "
                f"({restored[1] / 2**20:.1f} MiB, every rank's files, kept by the run's channel), not from storage",
            )
    ckpt_dir = root / "meshrun-ckpt" / run_id / f"a{attempt}" / f"rank{rank}"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    state_dir = root / "meshrun-state" / run_id / f"a{attempt}"
    profile_dir = root / "meshrun-profiles" / run_id / f"a{attempt}"

    rows = RowSink(channel, attempt, _publisher(run_id, config.get("run_name") or run_id, rank)) if rank == 0 else None
    hooks = channel_hooks(channel, attempt, rank, rows, copy_world=copy_world)
    try:
        with resume_cm as resume_from:
            if resume_from:
                logger.info("rank %d: resuming from %s", rank, resume_from)
            job = WorkerJob(
                spec=spec,
                plan=plan,
                run_id=run_id,
                attempt=attempt,
                checkpoint_dir=str(ckpt_dir),
                resume_from=str(resume_from) if resume_from else None,
                state_dir=str(state_dir),
                profile_dir=str(profile_dir),
            )
            summary = train_job(job, hooks)
    finally:
        NOTICE.finish()  # the loop is over: a SIGTERM now is the worker group's shutdown, not a preemption notice
        if rows is not None:
            rows.flush()  # also the rows before a failure
        shutil.rmtree(ckpt_dir, ignore_errors=True)
        shutil.rmtree(restore_dir, ignore_errors=True)
    with contextlib.suppress(OSError):
        (state_dir / f"rank{rank}.json").unlink()  # kept after a failure, for diagnosis
    if rank == 0:
        summary = {k: v for k, v in (summary or {}).items() if k != "losses"}
        ray.get(channel.done.remote(summary), timeout=60)


def _install_preemption_handler(rank: int) -> None:
    """SIGTERM to this worker = a preemption notice (``workers.preemption``). Python handlers live on the main
    thread; the train function runs on another, so the actor's ``__ray_call__`` (run on its main thread) installs it."""
    NOTICE.reset()
    try:
        actor = ray.get_runtime_context().current_actor
        ok = ray.get(actor.__ray_call__.remote(install_on_actor_main_thread), timeout=30)
    except Exception as e:  # not an actor (a test harness): SIGTERM keeps Ray's meaning
        logger.warning("rank %d: no preemption handler (%s); SIGTERM ends this worker", rank, e)
        return
    if not ok:
        logger.warning("rank %d: the preemption handler could not be installed; SIGTERM ends this worker", rank)

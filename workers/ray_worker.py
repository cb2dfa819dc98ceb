"""The Ray Train ``train_loop_per_worker``: runs ``workers.loop.train`` inside a Ray Train worker.

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
SIGUSR1 next to it) and, when the channel actor offers ``rank_state(attempt, snapshot)``, sends the same
snapshot there every few seconds (fire and forget). Rank 0 polls ``control()`` (if offered; else
``should_stop()``) at each report: ``{"stop": True}`` stops every rank after the step, ``{"profile_steps": k}``
profiles the next k steps on every rank; trace files are written on each node and, when the channel offers
``artifact(attempt, rank, name, text)``, sent there.

Imports ray and torch only (no fastapi, no sqlalchemy).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
import ray.train
import torch.distributed as dist

from api.spec.metrics import PEAK_MEMORY_PER_RANK
from workers.preemption import NOTICE, install_on_actor_main_thread
from workers.ray_metrics import RunMetricsPublisher

logger = logging.getLogger(__name__)

DEFAULT_TRAIN_FN = "workers.loop:train"
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


def _load(path: str) -> Callable[..., Any]:
    mod, _, fn = path.partition(":")
    return getattr(importlib.import_module(mod), fn)


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


def _has_method(actor: Any, name: str) -> bool:
    try:
        getattr(actor, name)
    except AttributeError:
        return False
    return True


def _accepted(fn: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments ``fn`` takes (a configured train function may predate the diagnostics hooks)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def _channel_hooks(channel: Any, attempt: int, rank: int) -> dict[str, Any]:
    """The optional diagnostics callbacks this run's channel actor supports (see the module docstring)."""
    hooks: dict[str, Any] = {}
    if _has_method(channel, "rank_state"):
        hooks["on_state"] = lambda snap: channel.rank_state.remote(attempt, snap)
    if _has_method(channel, "artifact"):

        def on_profile(first: int, last: int, paths: list[str]) -> None:
            for path in paths:
                name = f"profile/steps_{first:08d}-{last:08d}/{Path(path).name}"
                channel.artifact.remote(attempt, rank, name, Path(path).read_text())

        hooks["on_profile"] = on_profile
    if rank == 0 and (_has_method(channel, "control") or _has_method(channel, "should_stop")):
        use_control = _has_method(channel, "control")

        def control() -> dict[str, Any] | None:
            try:
                if use_control:
                    return ray.get(channel.control.remote(), timeout=10)
                return {"stop": bool(ray.get(channel.should_stop.remote(), timeout=10))}
            except Exception as e:  # a slow or lost channel must not stop training
                logger.warning("run channel control poll failed: %s", e)
                return None

        hooks["control"] = control
    return hooks


def train_loop_per_worker(config: dict[str, Any]) -> None:
    from api.spec import Plan, RunSpec
    from workers.loop import WorkerJob

    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    channel = config["channel"]
    run_id = config["run_id"]
    spec = RunSpec.model_validate(config["spec"])
    plan = Plan.model_validate(config["plan"])
    if not dist.is_initialized():
        raise RuntimeError("Ray Train did not initialise torch.distributed (TorchTrainer expected)")

    # 1. where is everybody; TP groups must share a node
    me = {
        "rank": rank,
        "node_id": ray.get_runtime_context().get_node_id(),
        "pid": os.getpid(),
        "local_rank": ctx.get_local_rank(),
        "host": os.uname().nodename,
    }
    ranks = _gather_objects(me)
    rank_nodes = [r["node_id"] for r in ranks]
    problem = check_tp_groups(rank_nodes, plan.tp)

    # 2. the attempt (rank 0 registers it; everybody learns the number)
    attempt = None
    if rank == 0:
        cause = None
        if problem:
            cause = f"placement check failed: {problem}"
        attempt = ray.get(channel.begin_attempt.remote({"ranks": ranks, "cause": cause}), timeout=60)
    attempt = _broadcast(attempt)
    if problem:
        raise TPGroupSplitError(problem)
    _install_preemption_handler(rank)

    # 3. where to resume from
    ckpt = ray.train.get_checkpoint()
    resume_cm = ckpt.as_directory() if ckpt is not None else contextlib.nullcontext(config.get("resume_from"))
    local_root = Path(config.get("local_checkpoint_root") or tempfile.gettempdir()) / "meshrun-ckpt" / run_id
    ckpt_dir = local_root / f"a{attempt}" / f"rank{rank}"
    ckpt_dir.mkdir(parents=True, exist_ok=True)

    pub = _publisher(run_id, config.get("run_name") or run_id, rank) if rank == 0 else None
    buffer: list[dict[str, Any]] = []
    last: dict[str, Any] = {"flush": time.monotonic(), "publish": 0.0, "row": None}

    def flush() -> None:
        if buffer:
            channel.metrics.remote(attempt, list(buffer))  # fire and forget
            buffer.clear()
        last["flush"] = time.monotonic()
        if pub is not None and last["row"] is not None:
            pub.publish(last["row"])
            last["row"] = None

    def sink(row: dict[str, Any]) -> None:
        clean = {k: v for k, v in row.items() if k != PEAK_MEMORY_PER_RANK}
        per_rank = row.get(PEAK_MEMORY_PER_RANK)
        if per_rank is not None:
            clean[PEAK_MEMORY_PER_RANK] = list(per_rank)
        buffer.append(clean)
        last["row"] = row
        now = time.monotonic()
        if now - last["flush"] >= FLUSH_INTERVAL_S:
            channel.metrics.remote(attempt, list(buffer))
            buffer.clear()
            last["flush"] = now
        if pub is not None and now - last["publish"] >= PUBLISH_INTERVAL_S:
            pub.publish(row)
            last["publish"], last["row"] = now, None

    def on_checkpoint(step: int, path: str | None) -> None:
        if rank == 0:
            flush()
        if not path:
            return
        t0 = time.perf_counter()
        ray.train.report(
            {"step": int(step), "attempt": attempt},
            checkpoint=ray.train.Checkpoint.from_directory(path),
            checkpoint_dir_name=f"step_{int(step):08d}_a{attempt}",
            delete_local_checkpoint_after_upload=True,
        )
        logger.info("rank %d: checkpoint of step %d reported in %.3f s", rank, step, time.perf_counter() - t0)

    state_dir = local_root.parent.parent / "meshrun-state" / run_id / f"a{attempt}"
    profile_dir = local_root.parent.parent / "meshrun-profiles" / run_id / f"a{attempt}"
    hooks = _channel_hooks(channel, attempt, rank)

    train_fn = _load(config.get("train_fn") or DEFAULT_TRAIN_FN)
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
            summary = train_fn(job, sink=sink, on_checkpoint=on_checkpoint, **_accepted(train_fn, hooks))
    finally:
        NOTICE.finish()  # the loop is over: a SIGTERM now is the worker group's shutdown, not a preemption notice
        if rank == 0:
            flush()  # also the rows before a failure
        shutil.rmtree(ckpt_dir, ignore_errors=True)
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

"""The training loop: one function that the Ray Train wrapper and the standalone launcher both call.

Read top to bottom like torchtitan's ``train.py``: ``train_job`` sets up (``workers.engine``: mesh, model,
parallelize, optimizers, checkpoint, data, reporting), runs ``train_steps`` (each ``measured_step`` around
``train_step``, then the periodic work: ``report``, ``checkpoint``, the stop votes) and returns ``summarize``.

A step: ``data`` (fetch the batch, move it to the device) -> ``compute`` (forward/backward of every micro-batch,
or the pipeline schedule) -> ``optimizer`` (gradient-norm clipping, optimizer and LR-scheduler step). Nothing
else happens per step: no device synchronisation, no collective for metrics, no allocator calls, no log line.
The loss and gradient norm stay on the device until the next report.

What each rank emits (see the modules for the formats):

- rows: global rank 0 calls ``sink(row)`` once per step, in batches, after each report (``workers.reporting``:
  the ranks combine their measurements in one ``all_gather`` every ~``spec.metrics.report_every_s`` seconds).
  Keys: ``api.spec.metrics.MetricRow`` (``step, loss, tokens_per_s, step_time_s, mfu, peak_memory_bytes,
  peak_memory_bytes_per_rank, grad_norm, lr, time`` and, on measured steps, ``comm_fraction, breakdown,
  breakdown_per_rank``: the per-rank step-time breakdown of ``workers.timeline``, so the service can compare
  per-rank compute time to find stragglers);
- "where am I": ``workers.diagnostics.RankState``, published every few seconds to ``<state_dir>/rank<r>.json``
  and/or ``on_state(snapshot)``; a stack dump on SIGUSR1;
- profiles: ``workers.profiling`` writes Chrome traces (and the pipeline timeline) per rank into
  ``profile_dir`` for ``spec.profile`` or a ``control()`` request, then calls ``on_profile``;
- checkpoints: ``on_checkpoint(step, path)`` after every rank saved (rows up to that step are reported first).

``control()`` (polled on every rank at reports) may return ``{"stop": True}``, ``{"preempt": reason}`` or
``{"profile_steps": k}``; a ``stop()`` callback works too. Both take effect at the next report, on every rank together.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from workers.checkpoint import checkpoint_state, prune_checkpoints, write_checkpoint
from workers.engine import Engine, WorkerJob, build_engine, setup_mesh, start_instruments
from workers.hooks import Hooks
from workers.metrics import CROSS_GROUP
from workers.preemption import NOTICE, PREEMPT_VOTE, STOP_VOTE
from workers.step import forward_backward, loss_fn, optimizer_step

__all__ = ["Hooks", "WorkerJob", "init_distributed", "loss_fn", "train", "train_job"]

log = logging.getLogger(__name__)

PG_TIMEOUT_S = float(os.environ.get("MESHRUN_PG_TIMEOUT_S", "600"))


def init_distributed(*, timeout_s: float = PG_TIMEOUT_S) -> bool:
    """Initialise the default process group unless someone (Ray Train, a test) already did.
    Returns True when this call created it (and so should destroy it). A lone process needs no launcher."""
    if dist.is_initialized():
        return False
    if "RANK" not in os.environ:
        # a lone process: an in-memory store, no port to pick (a free port found first can be taken before use)
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        dist.init_process_group(
            backend=None, store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=timeout_s)
        )
        return True
    dist.init_process_group(backend=None, timeout=timedelta(seconds=timeout_s))
    return True


# --------------------------------------------------------------------------------------------- entry
def train(
    job: WorkerJob,
    *,
    sink: Callable[[dict], None] | None = None,
    on_checkpoint: Callable[[int, str], None] | None = None,
    stop: Callable[[], bool] | None = None,
    control: Callable[[], dict[str, Any] | None] | None = None,
    on_state: Callable[[dict[str, Any]], None] | None = None,
    on_profile: Callable[[int, int, list[str]], None] | None = None,
) -> dict:
    """Train ``job`` on this rank; returns a summary dict (complete on global rank 0)."""
    hooks = Hooks(
        sink=sink, on_checkpoint=on_checkpoint, stop=stop, control=control, on_state=on_state, on_profile=on_profile
    )
    created_pg = init_distributed()
    try:
        return train_job(job, hooks)
    finally:
        if created_pg and dist.is_initialized():
            # torch's DeviceMesh keeps a root mesh and its sub-meshes in a reference cycle that holds the process
            # group: collected first, the group's gloo threads are joined by destroy_process_group. Left to the
            # interpreter's exit, they were still running there, and the standalone launcher once died of SIGABRT
            # after its summary ("terminate called without an active exception")
            gc.collect()
            dist.destroy_process_group()


def train_job(job: WorkerJob, hooks: Hooks) -> dict:
    """Setup, the steps with their periodic work, the summary (torchtitan's ``train.py`` in one screen). The
    typed entry of a process whose process group is up (the Ray worker: runs and sweep trials alike)."""
    dims, device = setup_mesh(job)
    with start_instruments(job, dims, device, hooks) as inst:
        engine = build_engine(job, dims, device, inst, hooks)
        with closing(engine.profiler):
            timing = train_steps(engine, hooks)
    return summarize(engine, timing)


@dataclass(frozen=True)
class LoopTiming:
    started: float  # wall clock before the first step
    loop_time_s: float  # first step to the final report, this rank
    loop_cpu_time_s: float  # CPU time of this process (all its threads) over the same span


def train_steps(e: Engine, hooks: Hooks) -> LoopTiming:
    """Every step from ``e.start_step + 1``, each followed by the periodic work: the report (metrics, breakdown,
    stop and profile votes), the checkpoint; stops early when the ranks agreed to."""
    t_start = time.time()
    for m in e.model_parts:
        m.train()
    CROSS_GROUP.reload()
    CROSS_GROUP.take()
    e.reporter.start()
    last_end = e.reporter.prev_end
    loop_t0, loop_cpu0 = time.perf_counter(), time.process_time()
    for step in range(e.start_step + 1, e.spec.train.steps + 1):
        ckpt_due = checkpoint_due(e, step)
        last_end = measured_step(e, step, last_end, ckpt_due)
        if e.reporter.due(step, force=ckpt_due):
            report(e, step, hooks)
        last_end = checkpoint(e, step, last_end, ckpt_due, hooks)
        if e.saver is not None:
            e.saver.poll(listed(e, hooks))  # a background save complete on every rank: listed now
        if e.reporter.stop_agreed:
            why = f"preemption notice on ranks {e.reporter.preempted_ranks}" if e.reporter.preempted_ranks else "stop"
            log.info("%s: stopping after step %d", why, step)
            break
    if e.saver is not None:
        e.saver.wait(listed(e, hooks))
    with e.inst.tracker.paused():
        e.reporter.report()
    timing = LoopTiming(t_start, time.perf_counter() - loop_t0, time.process_time() - loop_cpu0)
    e.inst.state.set_phase("done")
    return timing


# ---------------------------------------------------------------------------------------------- step
def measured_step(e: Engine, step: int, last_end: Any, ckpt_due: bool) -> Any:
    """One step between the step clock's marks, its measurements handed to the reporter and the profiler; returns
    the step's end mark."""
    inst = e.inst
    inst.faults.before_step(step)
    e.profiler.before_step(step)
    inst.tracker.begin_step(step, last_end, record=e.reporter.measure(step) or e.profiler.active(step))
    loss, grad_norm, lr, extra = train_step(e, step, sync_replicas=ckpt_due)
    end, unix = inst.tracker.clock.mark(), time.time()  # the row's wall-clock time is the step's end, not the report's
    rec = inst.tracker.end_step(end)
    extra["cross_group_bytes"] = CROSS_GROUP.take()
    e.reporter.add(
        step, end, unix, loss=loss if e.loss_owner else 0.0, grad_norm=grad_norm, lr=lr, rec=rec, extra=extra
    )
    inst.state.step_done(step)
    e.profiler.after_step(step, rec)
    return end


def train_step(e: Engine, step: int, *, sync_replicas: bool) -> tuple[Any, torch.Tensor, float, dict[str, Any]]:
    """data -> compute -> optimizer; returns (loss, gradient norm, lr, the replica averager's row keys).
    ``sync_replicas``: local SGD / DiLoCo replicas average now (before a checkpoint)."""
    tracker, device = e.inst.tracker, e.device
    tracker.begin_phase("data")
    if e.runner is not None:
        x, y = e.batches.batch(step - 1)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    else:
        micro_batches = [
            (a.to(device, non_blocking=True), b.to(device, non_blocking=True))
            for a, b in e.batches.micro_batches(step - 1)
        ]
    tracker.end_phase()

    tracker.begin_phase("compute")
    e.inst.faults.in_compute(step)
    loss: Any = 0.0
    if e.runner is not None:
        pp_loss = e.runner.step(x if e.runner.has_first_stage else None, y if e.runner.has_last_stage else None)
        if pp_loss is not None:
            loss = pp_loss.detach().float()
    else:
        loss = forward_backward(e.parts[0], micro_batches, device, e.scaler, tracker)
    tracker.end_phase()

    tracker.begin_phase("optimizer")
    grad_norm, lr = optimizer_step(
        e.optimizers,
        e.schedulers,
        e.all_params,
        scaler=e.scaler,
        grad_clip=e.spec.optimizer.grad_clip,
        pp_group=e.pp_group,
    )
    extra = e.averager.maybe_sync(step, force=sync_replicas) if e.averager is not None else {}
    tracker.end_phase()
    return loss, grad_norm, lr, extra


# ------------------------------------------------------------------------------------- periodic work
def report(e: Engine, step: int, hooks: Hooks) -> None:
    """The ranks' one collective: rows to the sink, and agreement on stopping (asked, a notice, a preemption)
    and on profiling the next steps."""
    e.inst.state.set_phase("report")
    want_stop, profile_vote, asked = poll(hooks)
    e.preempt_cause = e.preempt_cause or asked
    stop_vote = max(STOP_VOTE if want_stop else 0, NOTICE.vote(), PREEMPT_VOTE if asked else 0)
    with e.inst.tracker.paused():
        e.reporter.report(stop_vote=stop_vote, profile_vote=profile_vote)
    if e.reporter.profile_request:
        e.profiler.schedule(step + 1, e.reporter.profile_request)


def poll(hooks: Hooks) -> tuple[bool, int, str | None]:
    """(stop, profile steps, preemption reason) asked of this rank."""
    want_stop = bool(hooks.stop()) if hooks.stop is not None else False
    profile_steps, preempt = 0, None
    if hooks.control is not None:
        c = hooks.control() or {}
        want_stop = want_stop or bool(c.get("stop"))
        profile_steps = int(c.get("profile_steps") or 0)
        preempt = str(c["preempt"]) if c.get("preempt") else None
    return want_stop, profile_steps, preempt


def checkpoint_due(e: Engine, step: int) -> bool:
    every = e.spec.checkpoint.every_steps
    return bool(e.job.checkpoint_dir and every and step % every == 0)


def checkpoint(e: Engine, step: int, last_end: Any, due: bool, hooks: Hooks) -> Any:
    """The periodic checkpoint, or the emergency one of a preemption notice the ranks agreed on; returns the step
    clock's mark the next step starts from (a periodic save is no step's time: goodput counts it as overhead)."""
    emergency = bool(e.reporter.preempted_ranks) and not due and bool(e.job.checkpoint_dir)
    if not (due or emergency):
        return last_end
    e.inst.state.set_phase("checkpoint")
    if emergency and e.averager is not None:  # every rank is here (the vote was all-gathered): average the replicas
        e.averager.maybe_sync(step, force=True)
    with e.inst.tracker.paused():
        if e.saver is not None and not emergency:  # checkpoint.async: copied now, listed once written everywhere
            path = f"{e.job.checkpoint_dir}/step_{step:08d}"
            e.saver.save(path, state(e, step), step=step, plan=e.plan, spec=e.spec, on_done=listed(e, hooks))
        else:
            if e.saver is not None:
                e.saver.wait(listed(e, hooks))  # the save in flight first
            save(e, step)
            listed(e, hooks)(step, f"{e.job.checkpoint_dir}/step_{step:08d}")
    return last_end if emergency else e.reporter.restart_period(last_end)


def state(e: Engine, step: int) -> dict[str, Any]:
    job = e.job
    extra = {"data": e.batches.state_dict(step), "run_id": job.run_id, "attempt": job.attempt}
    return checkpoint_state(
        model_parts=e.model_parts, optimizers=e.optimizers, schedulers=e.schedulers, step=step, extra=extra
    )


def save(e: Engine, step: int) -> str:
    """Every rank saves its shard of ``step`` under ``checkpoint_dir``."""
    path = f"{e.job.checkpoint_dir}/step_{step:08d}"
    write_checkpoint(path, state(e, step), step=step, plan=e.plan, spec=e.spec)
    dist.barrier()
    return path


def listed(e: Engine, hooks: Hooks) -> Callable[[int, str], None]:
    """What follows a checkpoint complete on every rank: rank 0 prunes the old ones, it is reported."""

    def done(step: int, path: str) -> None:
        e.last_checkpoint = path
        if dist.get_rank() == 0 and e.job.checkpoint_dir and e.job.prune:
            prune_checkpoints(e.job.checkpoint_dir, e.spec.checkpoint.keep)
        log.info("checkpoint of step %d at %s", step, path)
        if hooks.on_checkpoint is not None:
            hooks.on_checkpoint(step, path)

    return done


# ------------------------------------------------------------------------------------------- summary
def summarize(e: Engine, timing: LoopTiming) -> dict:
    summary = e.reporter.summary()
    r = e.reporter
    return {
        "run_id": e.job.run_id,
        "attempt": e.job.attempt,
        **summary,
        "steps_done": summary["steps_done"] if summary["steps_done"] is not None else e.start_step,
        "resumed_from_step": e.start_step,
        "wall_time_s": time.time() - timing.started,
        "loop_time_s": timing.loop_time_s,
        "loop_cpu_time_s": timing.loop_cpu_time_s,
        "stopped": r.stop_agreed,
        "preempted": bool(r.preempted_ranks),
        "preempted_ranks": list(r.preempted_ranks),
        "preempted_at_step": summary["steps_done"] if r.preempted_ranks else None,
        "preempt_cause": e.preempt_cause,
        "last_checkpoint": e.last_checkpoint,
        "profiles": e.profiler.written,
        # checkpoint.async: the loop's cost of each save (the copy) and the writer's time (overlapped)
        "checkpoint_copy_s": list(e.saver.copy_s) if e.saver is not None else None,
        "checkpoint_write_s": list(e.saver.write_s) if e.saver is not None else None,
    }

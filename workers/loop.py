"""The training loop: one function that the Ray Train wrapper and the standalone launcher both call.

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

``control()`` (polled on every rank at reports) may return ``{"stop": True}`` or ``{"profile_steps": k}``; the
older ``stop()`` callback still works. Both take effect at the next report, on every rank together.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from api.spec import Plan, RunSpec
from api.spec.validation import SpecError, check_spec
from workers.checkpoint import load_checkpoint, prune_checkpoints, save_checkpoint, usable_checkpoint
from workers.comm_hooks import Tracker, measure_p2p_link
from workers.data import build_batches
from workers.diagnostics import FaultInjector, Heartbeat, RankState, install_stack_dump
from workers.metrics import CROSS_GROUP, device_peak_flops
from workers.models import build_model
from workers.optim import build_optimizer, build_scheduler
from workers.parallel_dims import ParallelDims
from workers.parallelize import clip_grad_norm_, grad_sync, parallelize_model
from workers.periodic import PeriodicAverager
from workers.pipeline import build_pipeline
from workers.preemption import NOTICE, PREEMPT_VOTE, STOP_VOTE
from workers.profiling import Profiler
from workers.reporting import Reporter
from workers.timeline import make_clock

log = logging.getLogger(__name__)

PG_TIMEOUT_S = float(os.environ.get("MESHRUN_PG_TIMEOUT_S", "600"))


@dataclass
class WorkerJob:
    """What a worker needs."""

    spec: RunSpec
    plan: Plan
    run_id: str = "local"
    attempt: int = 1
    checkpoint_dir: str | None = None  # periodic checkpoints go to f"{checkpoint_dir}/step_{step:08d}"
    resume_from: str | None = None  # a checkpoint dir to load before training
    state_dir: str | None = None  # "where am I" files rank<r>.json and stack dumps rank<r>.stacks.txt
    profile_dir: str | None = None  # profiles go to f"{profile_dir}/steps_<first>-<last>/"


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


def resolve_device(plan: Plan) -> torch.device:
    if plan.device == "cuda" or (plan.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("the plan asks for cuda but this worker sees no GPU; use resources.device cpu/auto")
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank() % max(1, torch.cuda.device_count())))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy; logits (B, T, V) (a vocab-sharded DTensor under loss_parallel)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def _check(spec: RunSpec, plan: Plan, world_size: int) -> None:
    chk = check_spec(spec)
    if not chk.ok:
        raise SpecError(chk.errors)
    if plan.world_size != world_size:
        raise RuntimeError(
            f"the plan needs world size {plan.world_size} (dp {plan.dp} x tp {plan.tp} x pp "
            f"{plan.pp}) but {world_size} processes were started; launch {plan.world_size}"
        )


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
    spec, plan = job.spec, job.plan
    created_pg = init_distributed()
    try:
        return _train(
            job,
            spec,
            plan,
            sink=sink,
            on_checkpoint=on_checkpoint,
            stop=stop,
            control=control,
            on_state=on_state,
            on_profile=on_profile,
        )
    finally:
        if created_pg and dist.is_initialized():
            dist.destroy_process_group()


def _train(
    job: WorkerJob,
    spec: RunSpec,
    plan: Plan,
    *,
    sink: Callable[[dict], None] | None,
    on_checkpoint: Callable[[int, str], None] | None,
    stop: Callable[[], bool] | None,
    control: Callable[[], dict[str, Any] | None] | None,
    on_state: Callable[[dict[str, Any]], None] | None,
    on_profile: Callable[[int, int, list[str]], None] | None,
) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    _check(spec, plan, world)
    device = resolve_device(plan)
    if spec.train.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
        torch.use_deterministic_algorithms(True, warn_only=True)
    torch.manual_seed(spec.train.seed)
    dims = ParallelDims.from_plan(plan, world_size=world, device_type=device.type)
    _ = dims.mesh
    log.info("rank %d/%d: %s, run %s attempt %d", rank, world, dims.describe(), job.run_id, job.attempt)

    state = RankState(rank=rank, world_size=world, run_id=job.run_id, attempt=job.attempt)
    heartbeat = Heartbeat(state, state_dir=job.state_dir, on_state=on_state).start()
    if job.state_dir:
        install_stack_dump(job.state_dir, rank)
    tracker = Tracker(clock=make_clock(device.type), state=state, dims=dims).install(pipeline=plan.pp > 1)
    faults = FaultInjector(spec.faults, rank=rank, attempt=job.attempt, state=state)
    profiler: Profiler | None = None
    try:
        model = build_model(plan.model, device="meta")
        fpt = getattr(model, "flops_per_token", None)
        flops_per_token = float(fpt()) if callable(fpt) else 6.0 * sum(p.numel() for p in model.parameters())
        pfn = partial(parallelize_model, dims=dims, plan=plan, spec=spec, device=device)
        runner = None
        if dims.pp_enabled:
            runner = build_pipeline(
                model, dims=dims, plan=plan, spec=spec, device=device, parallelize_fn=pfn, loss_fn=loss_fn
            )
            model_parts = list(runner.model_parts)
            for stage in runner.stages:
                tracker.wrap_stage(stage)
            if spec.metrics.breakdown_every_steps or spec.profile is not None:
                with tracker.paused():
                    tracker.link = measure_p2p_link(dims.pp_mesh.get_group(), device)
        else:
            model_parts = [pfn(model)]
        del model

        averager = (
            PeriodicAverager(model_parts, dims=dims, spec=spec) if spec.layout.sync in ("local_sgd", "diloco") else None
        )
        dp_group = dims.mesh["dp_replicate"].get_group() if plan.zero_stage == 1 else None
        # one optimizer + LR scheduler per model part (pipeline parts), so checkpoints name state by part
        optimizers = [build_optimizer([m], spec, plan, dp_group=dp_group) for m in model_parts]
        schedulers = [build_scheduler(o, spec) for o in optimizers]
        scaler: Any = None
        if spec.precision == "fp16" and runner is not None:
            log.warning(
                "fp16 with pipeline parallel runs without loss scaling (the schedule owns backward); prefer bf16"
            )
        elif spec.precision == "fp16":
            if any(getattr(m, "meshrun_dp", None) == "fsdp" for m in model_parts):
                from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

                scaler = ShardedGradScaler(device.type)
            else:
                scaler = torch.amp.GradScaler(device.type)

        start_step, ck_state = 0, dict[str, Any]()
        resume = usable_checkpoint(job.resume_from) if job.resume_from else None
        if job.resume_from and resume is None:
            raise FileNotFoundError(
                f"no usable checkpoint at or beside {job.resume_from} (each failed verification; see the log)"
            )
        if resume is not None:
            with tracker.paused():
                ck_state = load_checkpoint(
                    resume, model_parts=model_parts, optimizers=optimizers, schedulers=schedulers
                )
            start_step = int(ck_state["step"])
            log.info("resumed from %s at step %d", resume, start_step)

        batches = build_batches(
            spec.data,
            seq_len=plan.model.seq_len,
            vocab_size=plan.model.vocab_size,
            seed=spec.train.seed,
            global_batch_size=plan.global_batch_size,
            micro_batch_size=plan.micro_batch_size,
            dp_rank=dims.dp_rank,
            dp_size=dims.dp_size,
        )
        batches.step = start_step
        if job.resume_from and isinstance(ck_state.get("extra"), dict) and ck_state["extra"].get("data"):
            batches.load_state_dict({**ck_state["extra"]["data"], "step": start_step})  # the exact data position
        pp_group = dims.pp_mesh.get_group() if dims.pp_enabled else None
        is_last_stage = runner.has_last_stage if runner is not None else True
        loss_owner = is_last_stage and dims.tp_rank == 0
        all_params = [p for m in model_parts for p in m.parameters()]
        reporter = Reporter(
            spec=spec,
            plan=plan,
            tracker=tracker,
            device=device,
            dp_size=dims.dp_size,
            flops_per_token=flops_per_token,
            peak_flops=device_peak_flops(device, spec.precision),
            sink=sink if rank == 0 else None,
            first_step=start_step + 1,
            last_step=spec.train.steps,
        )
        profiler = Profiler(
            out_dir=job.profile_dir, rank=rank, tracker=tracker, pipeline=runner is not None, on_profile=on_profile
        )
        if spec.profile is not None:
            profiler.schedule(spec.profile.start_step, spec.profile.steps)

        last_ckpt, t_start = None, time.time()
        preempt_cause: str | None = None  # the service's reason to preempt (rank 0 polls it)
        for m in model_parts:
            m.train()
        CROSS_GROUP.reload()
        CROSS_GROUP.take()
        reporter.start()
        last_end = reporter.prev_end
        loop_t0, loop_cpu0 = time.perf_counter(), time.process_time()
        for step in range(start_step + 1, spec.train.steps + 1):
            faults.before_step(step)
            profiler.before_step(step)
            tracker.begin_step(step, last_end, record=reporter.measure(step) or profiler.active(step))

            tracker.begin_phase("data")
            if runner is not None:
                x, y = batches.batch(step - 1)
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                micro_batches = []
            else:
                micro_batches = [
                    (a.to(device, non_blocking=True), b.to(device, non_blocking=True))
                    for a, b in batches.micro_batches(step - 1)
                ]
            tracker.end_phase()

            tracker.begin_phase("compute")
            faults.in_compute(step)
            loss: Any = 0.0
            if runner is not None:
                pp_loss = runner.step(x if runner.has_first_stage else None, y if runner.has_last_stage else None)
                if pp_loss is not None:
                    loss = pp_loss.detach().float()
            else:
                loss = _forward_backward(model_parts[0], micro_batches, device, scaler, tracker)
            tracker.end_phase()

            tracker.begin_phase("optimizer")
            if scaler is not None:
                for o in optimizers:
                    scaler.unscale_(o)
            grad_norm = clip_grad_norm_(all_params, spec.optimizer.grad_clip, pp_group=pp_group)
            lr = optimizers[0].param_groups[0]["lr"]
            for o in optimizers:
                if scaler is not None:
                    scaler.step(o)
                else:
                    o.step()
            if scaler is not None:
                scaler.update()
            for o, sch in zip(optimizers, schedulers):
                sch.step()
                o.zero_grad(set_to_none=True)
            every = spec.checkpoint.every_steps
            ckpt_due = bool(job.checkpoint_dir and every and step % every == 0)
            sync_keys = averager.maybe_sync(step, force=ckpt_due) if averager is not None else {}
            tracker.end_phase()

            last_end = tracker.clock.mark()
            rec = tracker.end_step(last_end)
            sync_keys["cross_group_bytes"] = CROSS_GROUP.take()
            reporter.add(
                step, last_end, loss=loss if loss_owner else 0.0, grad_norm=grad_norm, lr=lr, rec=rec, extra=sync_keys
            )
            state.step_done(step)
            profiler.after_step(step, rec)

            if reporter.due(step, force=ckpt_due):
                state.set_phase("report")
                want_stop, profile_vote, asked = _poll(stop, control)
                preempt_cause = preempt_cause or asked
                stop_vote = max(STOP_VOTE if want_stop else 0, NOTICE.vote(), PREEMPT_VOTE if asked else 0)
                with tracker.paused():
                    reporter.report(stop_vote=stop_vote, profile_vote=profile_vote)
                if reporter.profile_request:
                    profiler.schedule(step + 1, reporter.profile_request)
            if ckpt_due:
                state.set_phase("checkpoint")
                with tracker.paused():
                    last_ckpt = _save(job, step, model_parts, optimizers, schedulers, batches, plan, spec)
                if on_checkpoint is not None and last_ckpt is not None:
                    on_checkpoint(step, last_ckpt)
                last_end = reporter.restart_period(last_end)  # the save is no step's time (goodput: overhead)
            if reporter.preempted_ranks and not ckpt_due and job.checkpoint_dir:
                state.set_phase("checkpoint")  # the emergency checkpoint of a preemption notice
                if averager is not None:  # every rank is here (the vote was all-gathered): average the replicas
                    averager.maybe_sync(step, force=True)
                with tracker.paused():
                    last_ckpt = _save(job, step, model_parts, optimizers, schedulers, batches, plan, spec)
                if on_checkpoint is not None and last_ckpt is not None:
                    on_checkpoint(step, last_ckpt)
            if reporter.stop_agreed:
                why = f"preemption notice on ranks {reporter.preempted_ranks}" if reporter.preempted_ranks else "stop"
                log.info("%s: stopping after step %d", why, step)
                break
        with tracker.paused():
            reporter.report()
        loop_time_s, loop_cpu_s = time.perf_counter() - loop_t0, time.process_time() - loop_cpu0
        state.set_phase("done")
    except BaseException:
        state.set_phase("failed")
        raise
    finally:
        if profiler is not None:
            profiler.close()
        tracker.uninstall()
        heartbeat.stop()

    summary = reporter.summary()
    return {
        "run_id": job.run_id,
        "attempt": job.attempt,
        **summary,
        "steps_done": summary["steps_done"] if summary["steps_done"] is not None else start_step,
        "resumed_from_step": start_step,
        "wall_time_s": time.time() - t_start,
        "loop_time_s": loop_time_s,  # first step to the final report, this rank
        "loop_cpu_time_s": loop_cpu_s,  # CPU time of this process (all its threads) over the same span
        "stopped": reporter.stop_agreed,
        "preempted": bool(reporter.preempted_ranks),
        "preempted_ranks": list(reporter.preempted_ranks),
        "preempted_at_step": summary["steps_done"] if reporter.preempted_ranks else None,
        "preempt_cause": preempt_cause,
        "last_checkpoint": last_ckpt,
        "profiles": profiler.written if profiler is not None else [],
    }


def _poll(
    stop: Callable[[], bool] | None, control: Callable[[], dict[str, Any] | None] | None
) -> tuple[bool, int, str | None]:
    """(stop, profile steps, preemption reason) asked of this rank."""
    want_stop = bool(stop()) if stop is not None else False
    profile_steps, preempt = 0, None
    if control is not None:
        c = control() or {}
        want_stop = want_stop or bool(c.get("stop"))
        profile_steps = int(c.get("profile_steps") or 0)
        preempt = str(c["preempt"]) if c.get("preempt") else None
    return want_stop, profile_steps, preempt


def _forward_backward(
    model: torch.nn.Module,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
    scaler: Any,
    tracker: Tracker,
) -> torch.Tensor:
    """Gradient accumulation over the rank's micro-batches; returns the rank's mean loss (detached, on device)."""
    m = len(micro_batches)
    autocast_dtype = getattr(model, "meshrun_autocast", None)
    lp = getattr(model, "meshrun_loss_parallel", False)
    total = torch.zeros((), device=device)
    for i, (x, y) in enumerate(micro_batches):
        with grad_sync(model, i == m - 1):
            lp_ctx: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
            if lp:
                from torch.distributed.tensor.parallel import loss_parallel

                lp_ctx = loss_parallel()
            with lp_ctx:
                with (
                    torch.autocast(device.type, dtype=autocast_dtype)
                    if autocast_dtype is not None
                    else contextlib.nullcontext()
                ):
                    logits = model(x)
                loss = loss_fn(logits, y) / m
                loss_plain = loss.detach()
                full = getattr(loss_plain, "full_tensor", None)
                if callable(full):
                    loss_plain = full()
                (scaler.scale(loss) if scaler is not None else loss).backward()
            tracker.after_backward()
        total += loss_plain.float()
    return total


def _save(job: WorkerJob, step: int, model_parts, optimizers, schedulers, batches, plan, spec) -> str | None:
    path = f"{job.checkpoint_dir}/step_{step:08d}"
    save_checkpoint(
        path,
        model_parts=model_parts,
        optimizers=optimizers,
        schedulers=schedulers,
        step=step,
        plan=plan,
        spec=spec,
        extra={"data": batches.state_dict(step), "run_id": job.run_id, "attempt": job.attempt},
    )
    dist.barrier()
    if dist.get_rank() == 0 and job.checkpoint_dir:
        prune_checkpoints(job.checkpoint_dir, spec.checkpoint.keep)
    log.info("checkpoint of step %d at %s", step, path)
    return path

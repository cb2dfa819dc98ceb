"""The engine's setup, in torchtitan's order: mesh -> model -> parallelize (or pipeline) -> optimizer ->
checkpoint -> data -> reporting. ``workers.loop`` runs the steps on the ``Engine`` this builds.

Each function here is one setup stage (``setup_mesh``, ``start_instruments``, ``build_model_parts``,
``build_optimizers``, ``build_grad_scaler``, ``load_resume``, ``build_data``); ``build_engine`` calls them in order
and returns the ``Engine`` (everything a step and the periodic work need). A new parallel dimension or precision
is an ``apply_*`` function and one line in ``workers.parallelize.parallelize_model``'s order, not a change here.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from api.spec import Plan, RunSpec
from api.spec.validation import SpecError, check_spec
from workers.checkpoint import load_checkpoint, usable_checkpoint
from workers.checkpoint_async import AsyncCheckpointer
from workers.comm_hooks import Tracker, measure_p2p_link
from workers.data import build_batches
from workers.diagnostics import FaultInjector, Heartbeat, RankState, install_stack_dump
from workers.hooks import Hooks
from workers.metrics import device_peak_flops
from workers.models import build_model
from workers.optim import build_optimizer, build_scheduler
from workers.parallel_dims import ParallelDims
from workers.parallelize import Parallelized, parallelize_model
from workers.periodic import PeriodicAverager
from workers.pipeline import PipelineRunner, build_pipeline
from workers.profiling import Profiler
from workers.reporting import Reporter
from workers.step import loss_fn
from workers.timeline import make_clock

log = logging.getLogger(__name__)


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
    # rank 0 keeps checkpoint.keep in checkpoint_dir; False: whoever lists them prunes (a warm run's driver, whose
    # checkpoint_dir is the run's storage, prunes only what it recorded, as for Ray Train's uploaded copies)
    prune: bool = True


@dataclass
class Instruments:
    """What watches this rank while it trains: its state (heartbeats), the step clock and comm tracker, faults."""

    state: RankState
    tracker: Tracker
    faults: FaultInjector


@dataclass
class Engine:
    """Everything the steps and the periodic work use; built once by ``build_engine``."""

    job: WorkerJob
    dims: ParallelDims
    device: torch.device
    inst: Instruments
    parts: list[Parallelized]  # one per model part (one unless pipelined)
    runner: PipelineRunner | None
    optimizers: list[torch.optim.Optimizer]
    schedulers: list[Any]
    scaler: Any  # a GradScaler for fp16, else None
    averager: PeriodicAverager | None  # local SGD / DiLoCo
    batches: Any
    reporter: Reporter
    profiler: Profiler
    start_step: int = 0
    last_checkpoint: str | None = None
    preempt_cause: str | None = None  # the service's reason to preempt (rank 0 polls it)
    all_params: list[torch.nn.Parameter] = field(default_factory=list)  # every part's, for the gradient norm
    pp_group: Any = None  # the pipeline's process group (the gradient norm sums over it)
    loss_owner: bool = True  # this rank's loss is the reported one: it holds the last stage, TP rank 0
    saver: AsyncCheckpointer | None = None  # checkpoint.async: the background writer

    @property
    def spec(self) -> RunSpec:
        return self.job.spec

    @property
    def plan(self) -> Plan:
        return self.job.plan

    @property
    def model_parts(self) -> list[torch.nn.Module]:
        return [p.model for p in self.parts]


def resolve_device(plan: Plan) -> torch.device:
    if plan.device == "cuda" or (plan.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("the plan asks for cuda but this worker sees no GPU; use resources.device cpu/auto")
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank() % max(1, torch.cuda.device_count())))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def setup_mesh(job: WorkerJob) -> tuple[ParallelDims, torch.device]:
    """Check the spec and the world size against the plan, pick the device, seed, build the device mesh."""
    spec, plan = job.spec, job.plan
    rank, world = dist.get_rank(), dist.get_world_size()
    chk = check_spec(spec)
    if not chk.ok:
        raise SpecError(chk.errors)
    if plan.world_size != world:
        raise RuntimeError(
            f"the plan needs world size {plan.world_size} (dp {plan.dp} x tp {plan.tp} x pp "
            f"{plan.pp}) but {world} processes were started; launch {plan.world_size}"
        )
    device = resolve_device(plan)
    if spec.train.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
        torch.use_deterministic_algorithms(True, warn_only=True)
    torch.manual_seed(spec.train.seed)
    dims = ParallelDims.from_plan(plan, world_size=world, device_type=device.type)
    _ = dims.mesh
    log.info("rank %d/%d: %s, run %s attempt %d", rank, world, dims.describe(), job.run_id, job.attempt)
    return dims, device


@contextmanager
def start_instruments(job: WorkerJob, dims: ParallelDims, device: torch.device, hooks: Hooks) -> Iterator[Instruments]:
    """Heartbeats ("where am I"), stack dumps on SIGUSR1, the step clock and comm tracker, injected faults; the
    rank's phase is "failed" when the block raises. Everything is uninstalled at the end."""
    rank, world = dist.get_rank(), dist.get_world_size()
    state = RankState(rank=rank, world_size=world, run_id=job.run_id, attempt=job.attempt)
    heartbeat = Heartbeat(state, state_dir=job.state_dir, on_state=hooks.on_state).start()
    if job.state_dir:
        install_stack_dump(job.state_dir, rank)
    tracker = Tracker(clock=make_clock(device.type), state=state, dims=dims).install(pipeline=job.plan.pp > 1)
    faults = FaultInjector(job.spec.faults, rank=rank, attempt=job.attempt, state=state)
    try:
        yield Instruments(state=state, tracker=tracker, faults=faults)
    except BaseException:
        state.set_phase("failed")
        raise
    finally:
        tracker.uninstall()
        heartbeat.stop()


def build_model_parts(
    job: WorkerJob, dims: ParallelDims, device: torch.device, tracker: Tracker
) -> tuple[list[Parallelized], PipelineRunner | None, float]:
    """Build the model on meta, parallelize it (``parallelize_model``) or split it into this rank's pipeline
    stages; returns the parts, the pipeline runner (None without pp) and the model's FLOPs per token."""
    spec, plan = job.spec, job.plan
    model = build_model(plan.model, device="meta")
    fpt = getattr(model, "flops_per_token", None)
    flops_per_token = float(fpt()) if callable(fpt) else 6.0 * sum(p.numel() for p in model.parameters())
    pfn = partial(parallelize_model, dims=dims, plan=plan, spec=spec, device=device)
    if not dims.pp_enabled:
        return [pfn(model)], None, flops_per_token
    runner = build_pipeline(model, dims=dims, plan=plan, spec=spec, device=device, parallelize_fn=pfn, loss_fn=loss_fn)
    for stage in runner.stages:
        tracker.wrap_stage(stage)
    if spec.metrics.breakdown_every_steps or spec.profile is not None:
        with tracker.paused():
            tracker.link = measure_p2p_link(dims.pp_mesh.get_group(), device)
    return list(runner.parts), runner, flops_per_token


def build_optimizers(
    spec: RunSpec, plan: Plan, dims: ParallelDims, parts: list[Parallelized]
) -> tuple[list[torch.optim.Optimizer], list[Any]]:
    """One optimizer + LR scheduler per model part (pipeline parts), so checkpoints name state by part."""
    dp_group = dims.mesh["dp_replicate"].get_group() if plan.zero_stage == 1 else None
    optimizers = [build_optimizer([p.model], spec, plan, dp_group=dp_group) for p in parts]
    return optimizers, [build_scheduler(o, spec) for o in optimizers]


def build_grad_scaler(spec: RunSpec, device: torch.device, parts: list[Parallelized], pipelined: bool) -> Any:
    """Loss scaling for fp16 (None otherwise): sharded for FSDP parts; none under a pipeline schedule."""
    if spec.precision != "fp16":
        return None
    if pipelined:
        log.warning("fp16 with pipeline parallel runs without loss scaling (the schedule owns backward); prefer bf16")
        return None
    if any(p.dp == "fsdp" for p in parts):
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device.type)
    return torch.amp.GradScaler(device.type)


def load_resume(
    job: WorkerJob, parts: list[Parallelized], optimizers: list[Any], schedulers: list[Any], tracker: Tracker
) -> tuple[int, dict[str, Any]]:
    """Load ``job.resume_from`` (or the newest usable checkpoint beside it); returns (its step, its state)."""
    if not job.resume_from:
        return 0, {}
    resume = usable_checkpoint(job.resume_from)
    if resume is None:
        raise FileNotFoundError(
            f"no usable checkpoint at or beside {job.resume_from} (each failed verification; see the log)"
        )
    with tracker.paused():
        ck_state = load_checkpoint(
            resume, model_parts=[p.model for p in parts], optimizers=optimizers, schedulers=schedulers
        )
    start_step = int(ck_state["step"])
    log.info("resumed from %s at step %d", resume, start_step)
    return start_step, ck_state


def build_data(job: WorkerJob, dims: ParallelDims, start_step: int, ck_state: dict[str, Any]) -> Any:
    """This data-parallel rank's batches, positioned after ``start_step`` (exactly, from a checkpoint's state)."""
    spec, plan = job.spec, job.plan
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
    extra = ck_state.get("extra")
    if isinstance(extra, dict) and extra.get("data"):
        batches.load_state_dict({**extra["data"], "step": start_step})  # the exact data position
    return batches


def build_engine(job: WorkerJob, dims: ParallelDims, device: torch.device, inst: Instruments, hooks: Hooks) -> Engine:
    """Model, parallelize, optimizers, checkpoint, data, reporter and profiler, in that order."""
    spec, plan, rank = job.spec, job.plan, dist.get_rank()
    parts, runner, flops_per_token = build_model_parts(job, dims, device, inst.tracker)
    periodic = spec.layout.sync in ("local_sgd", "diloco")
    averager = PeriodicAverager([p.model for p in parts], dims=dims, spec=spec) if periodic else None
    optimizers, schedulers = build_optimizers(spec, plan, dims, parts)
    scaler = build_grad_scaler(spec, device, parts, pipelined=runner is not None)
    start_step, ck_state = load_resume(job, parts, optimizers, schedulers, inst.tracker)
    batches = build_data(job, dims, start_step, ck_state)
    reporter = Reporter(
        spec=spec,
        plan=plan,
        tracker=inst.tracker,
        device=device,
        dp_size=dims.dp_size,
        flops_per_token=flops_per_token,
        peak_flops=device_peak_flops(device, spec.precision),
        sink=hooks.sink if rank == 0 else None,
        first_step=start_step + 1,
        last_step=spec.train.steps,
    )
    profiler = Profiler(
        out_dir=job.profile_dir,
        rank=rank,
        tracker=inst.tracker,
        pipeline=runner is not None,
        on_profile=hooks.on_profile,
    )
    if spec.profile is not None:
        profiler.schedule(spec.profile.start_step, spec.profile.steps)
    return Engine(
        job=job,
        dims=dims,
        device=device,
        inst=inst,
        parts=parts,
        runner=runner,
        optimizers=optimizers,
        schedulers=schedulers,
        scaler=scaler,
        averager=averager,
        batches=batches,
        reporter=reporter,
        profiler=profiler,
        start_step=start_step,
        all_params=[p for part in parts for p in part.model.parameters()],
        pp_group=dims.pp_mesh.get_group() if dims.pp_enabled else None,
        loss_owner=(runner.has_last_stage if runner is not None else True) and dims.tp_rank == 0,
        saver=AsyncCheckpointer.create(device) if spec.checkpoint.async_save and job.checkpoint_dir else None,
    )

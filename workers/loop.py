"""The training loop: one function that the Ray Train wrapper and the standalone launcher both call.

Per step (1-based ``step``) global rank 0 calls ``sink(row)`` with one aggregated row:
step, loss (mean over the global batch, from the last pipeline stage), tokens_per_s (global), step_time_s,
mfu, peak_memory_bytes (max over ranks), peak_memory_bytes_per_rank, comm_fraction (see workers.metrics),
grad_norm, lr, time (unix seconds).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from api.schemas import Plan, RunSpec
from api.validation import SpecError, check_spec
from workers.data import build_batches
from workers.metrics import CommTimer, device_peak_flops, peak_memory_bytes, reset_peak_memory
from workers.models import build_model
from workers.optim import build_optimizer, build_scheduler
from workers.parallel_dims import ParallelDims
from workers.parallelize import clip_grad_norm_, grad_sync, parallelize_model

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(*, timeout_s: float = PG_TIMEOUT_S) -> bool:
    """Initialise the default process group unless someone (Ray Train, a test) already did.
    Returns True when this call created it (and so should destroy it). A lone process needs no launcher."""
    if dist.is_initialized():
        return False
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
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
        raise RuntimeError(f"the plan needs world size {plan.world_size} (dp {plan.dp} x tp {plan.tp} x pp "
                           f"{plan.pp}) but {world_size} processes were started; launch {plan.world_size}")


def train(job: WorkerJob, *, sink: Callable[[dict], None] | None = None,
          on_checkpoint: Callable[[int, str], None] | None = None,
          stop: Callable[[], bool] | None = None) -> dict:
    """Train ``job`` on this rank; returns a summary dict (complete on global rank 0)."""
    spec, plan = job.spec, job.plan
    created_pg = init_distributed()
    try:
        return _train(job, spec, plan, sink=sink, on_checkpoint=on_checkpoint, stop=stop)
    finally:
        if created_pg and dist.is_initialized():
            dist.destroy_process_group()


def _train(job: WorkerJob, spec: RunSpec, plan: Plan, *, sink, on_checkpoint, stop) -> dict:
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

    comm = CommTimer().install()
    try:
        model = build_model(plan.model, device="meta")
        flops_per_token = model.flops_per_token() if hasattr(model, "flops_per_token") else \
            6.0 * sum(p.numel() for p in model.parameters())
        pfn = partial(parallelize_model, dims=dims, plan=plan, spec=spec, device=device, comm_timer=comm)
        runner = None
        if dims.pp_enabled:
            try:
                from workers.pipeline import build_pipeline
            except ImportError as e:
                raise NotImplementedError("pipeline parallel (pp > 1) needs workers.pipeline.build_pipeline, "
                                          "which this build lacks; use pp=1") from e
            runner = build_pipeline(model, dims=dims, plan=plan, spec=spec, device=device, parallelize_fn=pfn,
                                    loss_fn=loss_fn)
            model_parts = list(runner.model_parts)
        else:
            model_parts = [pfn(model)]
        del model

        dp_group = dims.mesh["dp_replicate"].get_group() if plan.zero_stage == 1 else None
        # one optimizer + LR scheduler per model part (pipeline parts), so checkpoints name state by part
        optimizers = [build_optimizer([m], spec, plan, dp_group=dp_group) for m in model_parts]
        schedulers = [build_scheduler(o, spec) for o in optimizers]
        scaler = None
        if spec.precision == "fp16" and runner is not None:
            log.warning("fp16 with pipeline parallel runs without loss scaling (the schedule owns backward); "
                        "prefer bf16")
        elif spec.precision == "fp16":
            if any(getattr(m, "meshrun_dp", None) == "fsdp" for m in model_parts):
                from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
                scaler = ShardedGradScaler(device.type)
            else:
                scaler = torch.amp.GradScaler(device.type)

        start_step = 0
        if job.resume_from:
            from workers.checkpoint import load_checkpoint
            state = load_checkpoint(job.resume_from, model_parts=model_parts, optimizers=optimizers,
                                    schedulers=schedulers)
            start_step = int(state["step"])
            log.info("resumed from %s at step %d", job.resume_from, start_step)

        batches = build_batches(spec.data, seq_len=plan.model.seq_len, vocab_size=plan.model.vocab_size,
                                seed=spec.train.seed, global_batch_size=plan.global_batch_size,
                                micro_batch_size=plan.micro_batch_size, dp_rank=dims.dp_rank, dp_size=dims.dp_size)
        batches.step = start_step
        peak_flops = device_peak_flops(device, spec.precision)
        pp_group = dims.pp_mesh.get_group() if dims.pp_enabled else None
        is_last_stage = runner.has_last_stage if runner is not None else True
        loss_owner = is_last_stage and dims.tp_rank == 0
        all_params = [p for m in model_parts for p in m.parameters()]

        history: list[dict] = []
        peaks = [0] * world
        last_ckpt, stopped, t_start = None, False, time.time()
        for m in model_parts:
            m.train()
        for step in range(start_step + 1, spec.train.steps + 1):
            reset_peak_memory(device)
            comm.reset()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()

            if runner is not None:
                x, y = batches.batch(step - 1)
                x, y = x.to(device), y.to(device)
                out = runner.step(x if runner.has_first_stage else None, y if runner.has_last_stage else None)
                loss_val = out.detach().float() if out is not None else torch.zeros((), device=device)
            else:
                loss_val = _forward_backward(model_parts[0], batches.micro_batches(step - 1), device, scaler)

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
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            step_time = time.perf_counter() - t0

            # one gather: [loss share, peak bytes, comm seconds, stop vote]
            comm.enabled = False
            want_stop = bool(stop()) if stop is not None else False
            mine = torch.tensor([float(loss_val) if loss_owner else 0.0, float(peak_memory_bytes(device)),
                                 comm.total_s(), 1.0 if want_stop else 0.0], dtype=torch.float64)
            gathered = _all_gather(mine, device, world)
            comm.enabled = True
            peaks = [max(a, int(b)) for a, b in zip(peaks, gathered[:, 1].tolist())]
            stopped = bool(gathered[:, 3].max() > 0)
            if rank == 0:
                loss = float(gathered[:, 0].sum()) / dims.dp_size
                row = {
                    "step": step, "loss": loss, "tokens_per_s": plan.tokens_per_step / step_time,
                    "step_time_s": step_time,
                    "mfu": flops_per_token * plan.tokens_per_step / (step_time * world * peak_flops),
                    "peak_memory_bytes": int(gathered[:, 1].max()),
                    "peak_memory_bytes_per_rank": [int(v) for v in gathered[:, 1].tolist()],
                    "comm_fraction": min(1.0, float(gathered[:, 2].max()) / step_time),
                    "grad_norm": float(grad_norm), "lr": lr, "time": time.time(),
                }
                history.append(row)
                if not math.isfinite(loss):
                    log.warning("step %d: loss is %s", step, loss)
                log.info("step %d loss %.4f %.0f tok/s mfu %.3f", step, loss, row["tokens_per_s"], row["mfu"])
                if sink is not None:
                    sink(row)

            every = spec.checkpoint.every_steps
            if job.checkpoint_dir and every and step % every == 0:
                last_ckpt = _save(job, step, model_parts, optimizers, schedulers, batches, plan, spec)
                if on_checkpoint is not None:
                    on_checkpoint(step, last_ckpt)
            if stopped:
                log.info("stop requested: stopping after step %d", step)
                break
    finally:
        comm.uninstall()

    timed = history[1:] or history
    return {
        "run_id": job.run_id, "attempt": job.attempt, "steps_done": history[-1]["step"] if history else start_step,
        "resumed_from_step": start_step, "final_loss": history[-1]["loss"] if history else None,
        "mean_tokens_per_s": sum(r["tokens_per_s"] for r in timed) / len(timed) if timed else None,
        "mean_mfu": sum(r["mfu"] for r in timed) / len(timed) if timed else None,
        "peak_memory_bytes_per_rank": {str(r): v for r, v in enumerate(peaks)},
        "wall_time_s": time.time() - t_start, "stopped": stopped, "last_checkpoint": last_ckpt,
        "losses": [r["loss"] for r in history],
    }


def _forward_backward(model, micro_batches, device, scaler) -> torch.Tensor:
    """Gradient accumulation over the rank's micro-batches; returns the rank's mean loss (detached)."""
    m = len(micro_batches)
    autocast_dtype = getattr(model, "meshrun_autocast", None)
    lp = getattr(model, "meshrun_loss_parallel", False)
    total = torch.zeros((), device=device)
    for i, (x, y) in enumerate(micro_batches):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with grad_sync(model, i == m - 1):
            lp_ctx = contextlib.nullcontext()
            if lp:
                from torch.distributed.tensor.parallel import loss_parallel
                lp_ctx = loss_parallel()
            with lp_ctx:
                with (torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None
                      else contextlib.nullcontext()):
                    logits = model(x)
                loss = loss_fn(logits, y) / m
                if hasattr(loss, "full_tensor"):
                    loss_plain = loss.detach().full_tensor()
                else:
                    loss_plain = loss.detach()
                (scaler.scale(loss) if scaler is not None else loss).backward()
        total += loss_plain.float()
    return total


def _all_gather(t: torch.Tensor, device: torch.device, world: int) -> torch.Tensor:
    t = t.to(device)
    out = [torch.zeros_like(t) for _ in range(world)]
    dist.all_gather(out, t)
    return torch.stack(out).cpu()


def _save(job: WorkerJob, step: int, model_parts, optimizers, schedulers, batches, plan, spec) -> str | None:
    path = f"{job.checkpoint_dir}/step_{step:08d}"
    try:
        from workers.checkpoint import prune_checkpoints, save_checkpoint
    except ImportError:
        log.warning("workers.checkpoint is not available: skipping the checkpoint of step %d", step)
        return None
    save_checkpoint(path, model_parts=model_parts, optimizers=optimizers, schedulers=schedulers, step=step,
                    plan=plan, spec=spec, extra={"data": batches.state_dict() | {"step": step},
                                                 "run_id": job.run_id, "attempt": job.attempt})
    dist.barrier()
    if dist.get_rank() == 0:
        prune_checkpoints(job.checkpoint_dir, spec.checkpoint.keep)
    log.info("checkpoint of step %d at %s", step, path)
    return path

"""Multi-process harness shared by the pipeline and checkpoint tests (no tests here).

- ``run_world(fn, world, *args)``: start ``world`` gloo/CPU processes (``tests.spawn.spawn_ranks``, one
  thread each) on a free port; every rank calls ``fn(*args)``; returns rank 0's (JSON-able) result.
- ``loop_runs(runs)``: the whole engine, ``workers.loop.train``, for a list of (spec, job kwargs) in one
  world; returns per run the losses of the steps it ran (rows from the sink) and the summary.
- ``train_local``: a few-line engine from the same pieces (models, parallelize, pipeline, checkpoint) that
  also runs WITHOUT a process group and can save to a per-rank directory (what the loop does not do).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.spawn import spawn_ranks

TINY = {"name": "gpt", "preset": "tiny", "seq_len": 32}  # 2 layers, d_model 64, 4 heads, vocab 256


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable[..., Any], world: int, port: int, out: str, args: tuple) -> None:
    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        result = fn(*args)
        if rank == 0:
            Path(out).write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_world(fn: Callable[..., Any], world: int, *args: Any) -> Any:
    """Run ``fn(*args)`` on ``world`` processes; returns what rank 0 returned."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "result.json")
        spawn_ranks(_entry, (fn, world, free_port(), out, args), world)
        return json.loads(Path(out).read_text())


def make_spec(
    layout: dict | None = None,
    *,
    model: dict | None = None,
    gbs: int = 8,
    mbs: int = 2,
    steps: int = 4,
    every: int = 0,
    lr: float = 1e-2,
    grad_clip: float | None = 1.0,
) -> dict:
    return {
        "name": "pp-ckpt-test",
        "model": dict(model or TINY),
        "layout": dict(layout or {}),
        "batch": {"global_batch_size": gbs, "micro_batch_size": mbs},
        "optimizer": {"lr": lr, "warmup_steps": 2, "schedule": "cosine", "grad_clip": grad_clip},
        "train": {"steps": steps, "seed": 7},
        "checkpoint": {"every_steps": every, "keep": 5},
        "resources": {"device": "cpu"},
    }


def loop_runs(runs: list[tuple[dict, dict]]) -> list[dict]:
    """``workers.loop.train`` for each (spec, WorkerJob kwargs), in order, in this world."""
    from api.spec import RunSpec
    from api.spec.validation import build_plan
    from workers.loop import WorkerJob, train

    out = []
    for spec_d, job_kw in runs:
        spec = RunSpec.model_validate(spec_d)
        plan = build_plan(spec, device="cpu")
        rows: list[dict] = []
        summary = train(WorkerJob(spec=spec, plan=plan, **job_kw), sink=rows.append)
        out.append(
            {
                "losses": [r["loss"] for r in rows],
                "steps": [r["step"] for r in rows],
                "grad_norms": [r["grad_norm"] for r in rows],
                "summary": summary,
            }
        )
    return out


def loop_world(world: int, runs: list[tuple[dict, dict]]) -> list[dict]:
    return run_world(loop_runs, world, runs)


# ------------------------------------------------------------------------------------------ local engine
def _batch(step: int, *, batch: int, seq_len: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Learnable arithmetic sequences ``start + k t (mod vocab)``; the same global batch on every rank."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    stride = torch.randint(1, 4, (batch, 1), generator=g)
    toks = (start + stride * torch.arange(seq_len + 1)) % vocab
    return toks[:, :-1].contiguous(), toks[:, 1:].contiguous()


def train_local(
    spec_dict: dict, save_at: int | None = None, ckpt: str | None = None, resume: str | None = None
) -> dict:
    """Train to ``spec.train.steps`` (from ``resume`` if given), saving after step ``save_at`` to ``ckpt``
    (``{rank}`` in it is replaced: per-rank directories). No grad clipping. Works without a process group.
    Returns {"losses", "start", "extra", "rng_after_save", "rng_after_load"}."""
    from api.spec import RunSpec
    from api.spec.validation import build_plan
    from workers.checkpoint import load_checkpoint, save_checkpoint
    from workers.loop import loss_fn
    from workers.models import build_model, materialize
    from workers.optim import build_optimizer, build_scheduler
    from workers.pipeline import build_pipeline

    spec = RunSpec.model_validate(spec_dict)
    plan = build_plan(spec, device="cpu")
    on = dist.is_initialized()
    rank = dist.get_rank() if on else 0
    model = build_model(plan.model, device="meta")
    runner, dims = None, None
    if on:
        from functools import partial

        from workers.parallel_dims import ParallelDims
        from workers.parallelize import parallelize_model

        dims = ParallelDims.from_plan(plan, world_size=dist.get_world_size(), device_type="cpu")
        pfn = partial(parallelize_model, dims=dims, plan=plan, spec=spec, device="cpu")
        if plan.pp > 1:
            runner = build_pipeline(
                model, dims=dims, plan=plan, spec=spec, device="cpu", parallelize_fn=pfn, loss_fn=loss_fn
            )
            parts = list(runner.model_parts)
        else:
            parts = [pfn(model).model]
    else:
        parts = [materialize(model, device="cpu", seed=spec.train.seed)]
    dp_group = dims.mesh["dp_replicate"].get_group() if (dims is not None and plan.zero_stage == 1) else None
    opts = [build_optimizer([p], spec, plan, dp_group=dp_group) for p in parts]
    scheds = [build_scheduler(o, spec) for o in opts]

    res: dict[str, Any] = {"start": 0, "extra": None, "losses": []}
    if resume:
        info = load_checkpoint(resume, model_parts=parts, optimizers=opts, schedulers=scheds)
        res.update(start=info["step"], extra=info["extra"], plan=info["plan"])
        res["rng_after_load"] = torch.rand(3).tolist()
        if on:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, info["extra"])
            res["extras"] = gathered
    dp_rank, dp = (dims.dp_rank, dims.dp_size) if dims is not None else (0, 1)
    local_b = plan.global_batch_size // dp
    for step in range(res["start"] + 1, spec.train.steps + 1):
        x, y = _batch(
            step,
            batch=plan.global_batch_size,
            seq_len=plan.model.seq_len,
            vocab=plan.model.vocab_size,
            seed=spec.train.seed,
        )
        x, y = x[dp_rank * local_b : (dp_rank + 1) * local_b], y[dp_rank * local_b : (dp_rank + 1) * local_b]
        if runner is not None:
            loss = runner.step(x, y)
            loss = torch.zeros(()) if loss is None else loss
        else:
            loss = loss_fn(parts[0](x), y)
            loss.backward()
            loss = loss.detach()
        for o, s in zip(opts, scheds):
            o.step()
            s.step()
            o.zero_grad(set_to_none=True)
        if on:  # mean over the ranks holding the last stage (dp x tp of them; tp copies are equal)
            loss = loss.clone().float()
            dist.all_reduce(loss)
            loss = loss / (dp * plan.tp)
        res["losses"].append(float(loss))
        if save_at is not None and step == save_at:
            save_checkpoint(
                ckpt.format(rank=rank),
                model_parts=parts,
                optimizers=opts,
                schedulers=scheds,
                step=step,
                plan=plan,
                spec=spec,
                extra={"rank": rank, "next_step": step + 1},
            )
            res["rng_after_save"] = torch.rand(3).tolist()
    return res

"""meshrun's training loop vs a minimal hand-written torch loop doing the same work, interleaved A/B.

    python bench/bench_loop.py [--repeats 5] [--steps 20] [--layouts single,ddp,fsdp,tp,pp] [--model small]

For each layout (1 process; DDP dp2; FSDP2 dp2 zero 3; TP tp2; PP pp2 1F1B), in one spawned gloo world (CPU, one
thread per process), three arms run one after another, ``--repeats`` times, in a rotating order:

- ``plain``: a minimal torch loop: the same model and weights, data (``workers.data``), micro-batching (no_sync /
  set_requires_gradient_sync), loss, global-norm gradient clipping, AdamW with the same parameter groups, LR
  scheduler; DDP / fully_shard / parallelize_module / PipelineStage + Schedule1F1B from torch directly;
- ``meshrun``: ``workers.loop.train`` with the spec's defaults (breakdown measured on every step, reports about
  once a second);
- ``meshrun-nobd``: the same with ``metrics.breakdown_every_steps: 0`` (the breakdown's overhead = meshrun /
  meshrun-nobd).

Each arm is timed from outside on rank 0, from the end of step 1 (warm-up: lazy init) to the end of the loop:
tokens/s = tokens of steps 2..N / wall time, CPU time per step = process CPU time (all threads) / (N - 1).
The table shows the median and [min-max] over the repeats and the ratio of medians to ``plain`` (target >= 0.97
for meshrun). Takes ~3-5 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAYOUTS: dict[str, tuple[int, dict[str, Any]]] = {  # name -> (world size, layout)
    "single": (1, {}),
    "ddp": (2, {"dp": 2, "zero_stage": 0}),
    "fsdp": (2, {"dp": 2, "zero_stage": 3}),
    "tp": (2, {"tp": 2}),
    "pp": (2, {"pp": 2, "pp_schedule": "1f1b"}),
}
ARMS = ("plain", "meshrun", "meshrun-nobd")


def _spec(model: str, layout: dict[str, Any], steps: int, breakdown: bool) -> dict[str, Any]:
    return {
        "name": "bench",
        "model": {"name": "gpt", "preset": model},
        "layout": layout,
        "batch": {"global_batch_size": 16, "micro_batch_size": 4},
        "optimizer": {"warmup_steps": 0, "schedule": "constant", "grad_clip": 1.0},
        "train": {"steps": steps, "seed": 0},
        "metrics": {} if breakdown else {"breakdown_every_steps": 0},
    }


# ------------------------------------------------------------------------------------------- plain loop
def _clip(params: list[torch.Tensor], max_norm: float, pp_group: Any) -> torch.Tensor:
    """Global-norm clipping over plain and DTensor grads (one norm per mesh; summed over pipeline stages)."""
    from torch.distributed.tensor import DTensor

    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p.grad)
    sq = torch.zeros(())
    for grads in by_mesh.values():
        n = torch.nn.utils.get_total_norm(grads)
        sq = sq + (n.full_tensor() if isinstance(n, DTensor) else n) ** 2
    if pp_group is not None:
        dist.all_reduce(sq, group=pp_group)
    total = sq.sqrt()
    for grads in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(grads, max_norm, total)
    return total


def plain_loop(spec: Any, plan: Any, marks: dict[str, float]) -> float:
    """The hand-written baseline. Fills marks (after step 1, end); returns the last loss."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from workers.data import build_batches
    from workers.models import build_model, materialize
    from workers.optim import lr_factor, param_groups

    lay, world = spec.layout, dist.get_world_size()
    model = materialize(build_model(plan.model), device="cpu", seed=spec.train.seed)
    dp = lay.dp
    ctx: Any = contextlib.nullcontext
    stage = schedule = pp_group = None
    if lay.tp > 1:
        from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

        mesh = init_device_mesh("cpu", (lay.tp,), mesh_dim_names=("tp",))
        parallelize_module(model, mesh, model.tp_plan(sequence_parallel=False, loss_parallel=True))
        ctx = loss_parallel
    elif lay.pp > 1:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        from workers.pipeline import split_model_part, stage_module_names

        rank = dist.get_rank()
        model = split_model_part(model, stage_module_names(model, lay.pp)[rank])
        pp_group = dist.group.WORLD
        stage = PipelineStage(model, rank, lay.pp, torch.device("cpu"), group=pp_group)
        m = plan.microbatches_per_step

        def pp_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(out.flatten(0, 1), y.flatten()) / m

        schedule = Schedule1F1B(stage, n_microbatches=m, loss_fn=pp_loss, scale_grads=False)
    elif lay.zero_stage >= 2:
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif dp > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
    o = spec.optimizer
    opt = torch.optim.AdamW(param_groups([model], o.weight_decay), lr=o.lr, betas=tuple(o.betas), eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: lr_factor(s, warmup_steps=0, total_steps=spec.train.steps, schedule="constant", min_lr_ratio=0.1),
    )
    data = build_batches(
        spec.data,
        seq_len=plan.model.seq_len,
        vocab_size=plan.model.vocab_size,
        seed=0,
        global_batch_size=plan.global_batch_size,
        micro_batch_size=plan.micro_batch_size,
        dp_rank=dist.get_rank() if dp > 1 else 0,
        dp_size=dp,
    )
    params = list(model.parameters())
    last = torch.zeros(())
    for step in range(spec.train.steps):
        if schedule is not None:
            x, y = data.batch(step)
            losses: list[torch.Tensor] = []
            if dist.get_rank() == 0:
                schedule.step(x)
            else:
                schedule.step(target=y, losses=losses)
                last = torch.stack(losses).sum().detach()
        else:
            mbs = data.micro_batches(step)
            total = torch.zeros(())
            for i, (x, y) in enumerate(mbs):
                is_last = i == len(mbs) - 1
                sync: Any = contextlib.nullcontext()
                if hasattr(model, "no_sync") and not is_last:
                    sync = model.no_sync()
                elif hasattr(model, "set_requires_gradient_sync"):
                    model.set_requires_gradient_sync(is_last)
                with sync, ctx():
                    loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()) / len(mbs)
                    loss.backward()
                total += loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach()
            last = total
        _clip(params, o.grad_clip or 1e9, pp_group)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step == 0:
            marks["t1"], marks["c1"] = time.perf_counter(), time.process_time()
    marks["t2"], marks["c2"] = time.perf_counter(), time.process_time()
    return float(last)


def meshrun_loop(spec: Any, plan: Any, marks: dict[str, float]) -> float:
    from workers.loop import WorkerJob, train

    def sink(row: dict[str, Any]) -> None:
        if "t1" not in marks:  # the first report comes right after step 1
            marks["t1"], marks["c1"] = time.perf_counter(), time.process_time()

    summary = train(WorkerJob(spec=spec, plan=plan), sink=sink)
    marks["t2"], marks["c2"] = time.perf_counter(), time.process_time()
    return float(summary["final_loss"] or 0.0)


# -------------------------------------------------------------------------------------------- driver
def _worker(rank: int, world: int, port: int, model: str, layout: str, steps: int, repeats: int, out: str) -> None:
    import logging
    from datetime import timedelta

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    from api.spec import RunSpec
    from api.spec.validation import build_plan

    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    results: dict[str, list[dict[str, float]]] = {a: [] for a in ARMS}
    for rep in range(repeats):
        order = ARMS[rep % len(ARMS) :] + ARMS[: rep % len(ARMS)]  # rotate: no arm always goes first
        for arm in order:
            spec = RunSpec.model_validate(_spec(model, LAYOUTS[layout][1], steps, breakdown=arm != "meshrun-nobd"))
            plan = build_plan(spec, device="cpu")
            marks: dict[str, float] = {}
            dist.barrier()
            (plain_loop if arm == "plain" else meshrun_loop)(spec, plan, marks)
            dist.barrier()
            if rank == 0:
                n = steps - 1
                results[arm].append(
                    {
                        "tokens_per_s": plan.tokens_per_step * n / (marks["t2"] - marks["t1"]),
                        "cpu_ms_per_step": 1e3 * (marks["c2"] - marks["c1"]) / n,
                    }
                )
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def _fmt(xs: list[float], digits: int = 0) -> str:
    return f"{statistics.median(xs):.{digits}f} [{min(xs):.{digits}f}-{max(xs):.{digits}f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--model", default="tiny", help="gpt preset: tiny | small")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"some of {list(LAYOUTS)}")
    ap.add_argument("--json", default=None, help="also write the raw figures here")
    a = ap.parse_args()
    from tests.workers.dist_utils import free_port

    t0, raw = time.time(), {}
    print(f"model gpt/{a.model}, {a.steps} steps per run (step 1 excluded), {a.repeats} repeats, arms interleaved")
    print(
        f"{'layout':<7} {'arm':<13} {'tokens/s median [min-max]':>28} {'CPU ms/step median [min-max]':>30} "
        f"{'tok/s ratio':>11} {'CPU ratio':>9}"
    )
    for layout in a.layouts.split(","):
        world = LAYOUTS[layout][0]
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "r.json")
            args = (world, free_port(), a.model, layout, a.steps, a.repeats, out)
            mp.spawn(_worker, args=args, nprocs=world, join=True)
            res = json.loads(Path(out).read_text())
        raw[layout] = res
        base_tps = statistics.median(r["tokens_per_s"] for r in res["plain"])
        base_cpu = statistics.median(r["cpu_ms_per_step"] for r in res["plain"])
        for arm in ARMS:
            tps = [r["tokens_per_s"] for r in res[arm]]
            cpu = [r["cpu_ms_per_step"] for r in res[arm]]
            print(
                f"{layout:<7} {arm:<13} {_fmt(tps):>28} {_fmt(cpu, 2):>30} "
                f"{statistics.median(tps) / base_tps:>11.3f} {statistics.median(cpu) / base_cpu:>9.3f}"
            )
        bd = statistics.median(r["tokens_per_s"] for r in res["meshrun"]) / statistics.median(
            r["tokens_per_s"] for r in res["meshrun-nobd"]
        )
        print(f"{layout:<7} breakdown on/off tokens/s = {bd:.3f} (target >= 0.97)")
    print(
        f"(gloo, 1 thread per process, {time.time() - t0:.0f} s; load average {os.getloadavg()[0]:.1f} on "
        f"{os.cpu_count()} CPUs; target: meshrun / plain tokens/s >= 0.97)"
    )
    if a.json:
        Path(a.json).write_text(json.dumps(raw, indent=1))


if __name__ == "__main__":
    main()

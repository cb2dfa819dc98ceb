"""Throughput of the meshrun training loop vs a plain hand-written torch loop, side by side.

    python bench/bench_loop.py [--steps 8] [--warmup 2] [--models tiny,small] [--layouts dp2,dp2_zero3,tp2]

For each model and layout, in ONE spawned 2-process gloo world (CPU): the plain loop (DDP / FSDP2 / TP via
parallelize_module with the same model, same data, same micro-batching; no metrics, no cross-mesh clipping)
and ``workers.loop.train`` run alternately (twice each); tokens/s = tokens per step / the median step time
over the steps after ``--warmup``; comm_frac is meshrun's median comm_fraction.
ratio = meshrun / plain (1.0 = no overhead). Takes ~1-3 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAYOUTS = {
    "dp2": dict(dp=2, zero_stage=0),
    "dp2_zero1": dict(dp=2, zero_stage=1),
    "dp2_zero3": dict(dp=2, zero_stage=3),
    "tp2": dict(tp=2),
    "tp2_sp": dict(tp=2, sequence_parallel=True),
}
MODELS = {"tiny": dict(global_batch_size=16, micro_batch_size=4), "small": dict(global_batch_size=16, micro_batch_size=4)}


def _spec(model: str, layout: str, steps: int) -> dict:
    return {"name": "bench", "model": {"name": "gpt", "preset": model}, "layout": LAYOUTS[layout],
            "batch": MODELS[model], "optimizer": {"warmup_steps": 0, "schedule": "constant"},
            "train": {"steps": steps, "seed": 0}}


def plain_loop(spec, plan, steps: int, warmup: int) -> list[float]:
    """The hand-written baseline: build, wrap with the stock torch API, accumulate, AdamW. Returns step times."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from workers.data import build_batches
    from workers.models import build_model, materialize

    lay = spec.layout
    world = dist.get_world_size()
    model = materialize(build_model(plan.model), device="cpu", seed=spec.train.seed)
    dp_rank, dp_size = (dist.get_rank(), world) if lay.dp > 1 else (0, 1)
    zero1 = False
    if lay.tp > 1:
        from torch.distributed.tensor.parallel import loss_parallel, parallelize_module
        mesh = init_device_mesh("cpu", (lay.tp,), mesh_dim_names=("tp",))
        parallelize_module(model, mesh, model.tp_plan(sequence_parallel=lay.sequence_parallel, loss_parallel=True))
        ctx = loss_parallel
    elif lay.zero_stage >= 2:
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        ctx = None
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model)
        zero1 = lay.zero_stage == 1
        ctx = None
    if zero1:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=3e-4)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    data = build_batches(spec.data, seq_len=plan.model.seq_len, vocab_size=plan.model.vocab_size, seed=0,
                         global_batch_size=plan.global_batch_size, micro_batch_size=plan.micro_batch_size,
                         dp_rank=dp_rank, dp_size=dp_size)
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        mbs = data.micro_batches(step)
        for i, (x, y) in enumerate(mbs):
            last = i == len(mbs) - 1
            if hasattr(model, "no_sync") and not last:
                sync = model.no_sync()
            else:
                if hasattr(model, "set_requires_gradient_sync"):
                    model.set_requires_gradient_sync(last)
                from contextlib import nullcontext
                sync = nullcontext()
            with sync, (ctx() if ctx else __import__("contextlib").nullcontext()):
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / len(mbs)
                loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    dist.barrier()
    return times[warmup:]


def meshrun_loop(spec, plan, steps: int, warmup: int) -> tuple[list[float], list[float]]:
    from workers.loop import WorkerJob, train
    rows: list[dict] = []
    train(WorkerJob(spec=spec, plan=plan), sink=rows.append)
    timed = rows[warmup:]
    return [r["step_time_s"] for r in timed], [r["comm_fraction"] for r in timed]


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def _worker(rank: int, world: int, port: int, cases: list, steps: int, warmup: int, out: str) -> None:
    import logging
    from datetime import timedelta
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    from api.schemas import RunSpec
    from api.validation import build_plan
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    results = []
    for model, layout in cases:
        spec = RunSpec.model_validate(_spec(model, layout, steps))
        plan = build_plan(spec, device="cpu")
        plain, mr, comm = [], [], []
        for _ in range(2):  # alternate, and take medians of step times: the shared CPU is noisy
            plain += plain_loop(spec, plan, steps, warmup)
            t, c = meshrun_loop(spec, plan, steps, warmup)
            mr += t
            comm += c
        if rank != 0:  # the sink (and so meshrun's step times) lives on rank 0
            continue
        results.append(dict(model=model, layout=layout, plain=plan.tokens_per_step / _median(plain),
                            meshrun=plan.tokens_per_step / _median(mr), comm=_median(comm) if comm else 0.0))
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--models", default="tiny,small")
    ap.add_argument("--layouts", default="dp2,dp2_zero3,tp2", help=f"some of {list(LAYOUTS)}")
    a = ap.parse_args()
    from tests.workers.dist_utils import free_port
    cases = [(m, l) for m in a.models.split(",") for l in a.layouts.split(",")]
    t0 = time.time()
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        mp.spawn(_worker, args=(2, free_port(), cases, a.steps, a.warmup, out), nprocs=2, join=True)
        results = json.loads(Path(out).read_text())
    print(f"{'model':<6} {'layout':<10} {'plain tok/s':>12} {'meshrun tok/s':>14} {'ratio':>6} {'comm_frac':>9}")
    for r in results:
        print(f"{r['model']:<6} {r['layout']:<10} {r['plain']:>12.0f} {r['meshrun']:>14.0f} "
              f"{r['meshrun'] / r['plain']:>6.2f} {r['comm']:>9.2f}")
    print(f"(2 gloo processes x 1 thread, 2 x {a.steps} steps per loop, first {a.warmup} of each excluded, "
          f"medians; {time.time() - t0:.0f} s; load average {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()

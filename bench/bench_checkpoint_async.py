"""Checkpoint stall: synchronous vs background (``checkpoint.async: true``) saves, side by side in one run.

Spawns one gloo world (``--world`` ranks, FSDP) of meshrun's worker loop and trains the same GPT three ways,
interleaved ``--repeats`` times: without checkpoints, with a synchronous save every ``--every`` steps, and with a
background save every ``--every`` steps. Prints per mode the median step time (rank 0's ``step_time_s``, which
leaves a periodic save out) of the steps without a save in flight and of the 3 steps after a save (a background
save writes then), the loop's total time and the stall per save (its excess over the run without saves), and the
machine's load.

    python bench/bench_checkpoint_async.py                       # d_model 512, 6 layers, 2 ranks, 30 steps
    python bench/bench_checkpoint_async.py --d-model 256 --steps 20 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spec(args: argparse.Namespace, mode: str) -> dict:
    ck = {"every_steps": args.every, "keep": 2, "async": mode == "async"} if mode != "none" else {"every_steps": 0}
    return {
        "name": f"bench-ckpt-{mode}",
        "model": {
            "name": "gpt",
            "preset": None,
            "n_layers": args.layers,
            "d_model": args.d_model,
            "n_heads": 8,
            "vocab_size": 4096,
            "seq_len": 128,
        },  # fmt: skip
        "layout": {"dp": args.world, "zero_stage": 3},
        "batch": {"global_batch_size": 4 * args.world, "micro_batch_size": 4},
        "optimizer": {"lr": 1e-3, "warmup_steps": 0, "schedule": "constant"},
        "train": {"steps": args.steps, "seed": 0},
        "checkpoint": ck,
        "metrics": {"report_every_s": 0, "breakdown_every_steps": 0},
    }


def _worker(rank: int, world: int, port: int, runs: list[tuple[str, dict]], out: str, root: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    import torch.distributed as dist

    from api.spec import RunSpec
    from api.spec.validation import build_plan
    from workers.loop import WorkerJob, train

    dist.init_process_group("gloo")
    results = []
    for i, (mode, spec_d) in enumerate(runs):
        spec = RunSpec.model_validate(spec_d)
        rows: list[dict] = []
        job = WorkerJob(spec=spec, plan=build_plan(spec, device="cpu"), checkpoint_dir=f"{root}/{i}-{mode}")
        summary = train(job, sink=rows.append)
        copy_s, write_s = summary.get("checkpoint_copy_s"), summary.get("checkpoint_write_s")
        results.append({"mode": mode, "rows": rows, "loop_time_s": summary.get("loop_time_s"), "copy_s": copy_s,
                        "write_s": write_s})  # fmt: skip
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    modes = ["none", "sync", "async"]
    runs = [(m, _spec(args, m)) for _ in range(args.repeats) for m in modes]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "out.json")
        load0 = os.getloadavg()
        mp.spawn(_worker, args=(args.world, _free_port(), runs, out, d), nprocs=args.world, join=True)
        results = json.loads(Path(out).read_text())
        load1 = os.getloadavg()
    print(
        f"checkpoint stall: GPT d_model {args.d_model} x {args.layers} layers, dp{args.world} FSDP on "
        f"{os.cpu_count()} CPUs, {args.steps} steps, a save every {args.every}, {args.repeats} repeat(s)"
    )
    print(f"load average before {load0[0]:.2f}, after {load1[0]:.2f}")
    skip = 2  # warm-up steps
    n_saves = args.steps // args.every
    loop_none = statistics.median(r["loop_time_s"] for r in results if r["mode"] == "none")
    for mode in modes:
        mine = [r for r in results if r["mode"] == mode]
        quiet, during = [], []
        for r in mine:
            for row in r["rows"]:
                step, t = row["step"], row["step_time_s"]
                if step <= skip or t is None:
                    continue
                after_save = step > args.every and (step - 1) % args.every < 3  # the 3 steps after a save's step
                (during if after_save else quiet).append(t)
        med = statistics.median(quiet)
        loop = statistics.median(r["loop_time_s"] for r in mine)
        line = f"{mode:>5}: step {med * 1000:7.1f} ms without a save in flight"
        if mode != "none":
            dm = statistics.median(during)
            line += f", {dm * 1000:7.1f} ms in the 3 steps after a save ({(dm / med - 1) * 100:+5.1f} %)"
        line += f"; loop {loop:6.2f} s"
        if mode != "none":
            line += f", stall per save {(loop - loop_none) / n_saves * 1000:7.1f} ms"
        copies = [c for r in mine for c in (r["copy_s"] or [])]
        writes = [w for r in mine for w in (r["write_s"] or [])]
        if copies:
            copy_ms, write_s = statistics.median(copies) * 1000, statistics.median(writes)
            line += f" (copy {copy_ms:.0f} ms, background write {write_s:.2f} s)"
        print(line)


if __name__ == "__main__":
    main()

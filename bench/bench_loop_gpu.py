"""One GPU: meshrun's training loop vs a minimal torch loop doing the same work, interleaved A/B (needs CUDA).

    python bench/bench_loop_gpu.py [--repeats 5] [--steps 30] [--preset 125m] [--seq-len 1024]

Arms (rotating order, ``--repeats`` times): ``plain`` (build, AdamW with the same parameter groups, bf16 autocast,
gradient accumulation, ``clip_grad_norm_``, LR scheduler; one ``synchronize`` at the start and the end),
``meshrun`` (``workers.loop.train``, breakdown on every step: CUDA events, read once per report) and
``meshrun-nobd`` (breakdown off). ``plain`` is timed from step ``--warmup`` to the end (CUDA synchronised); meshrun
by the loop's span on the host clock (``loop_time_s``, ends after the final report, which waits for the last
step's event) minus its first ``--warmup`` step times. Also checks the CUDA paths of the measurements: the step
times (events) add up to the loop's wall time, the breakdown parts add up, peak allocated/reserved memory is
reported, and a profile window writes a trace with CUDA kernels.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _spec(a: argparse.Namespace, *, breakdown: bool, steps: int, profile: bool = False) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": "bench-gpu",
        "model": {"name": "gpt", "preset": a.preset, "seq_len": a.seq_len},
        "batch": {"global_batch_size": a.gbs, "micro_batch_size": a.mbs},
        "precision": "bf16",
        "optimizer": {"warmup_steps": 0, "schedule": "constant", "grad_clip": 1.0},
        "train": {"steps": steps, "seed": 0},
        "resources": {"device": "gpu"},
        "metrics": {} if breakdown else {"breakdown_every_steps": 0},
    }
    if profile:
        spec["profile"] = {"start_step": 3, "steps": 2}
    return spec


def plain(spec: Any, plan: Any, warmup: int) -> tuple[float, float]:
    import torch.nn.functional as F

    from workers.data import build_batches
    from workers.models import build_model, materialize
    from workers.optim import lr_factor, param_groups

    dev = torch.device("cuda")
    model = materialize(build_model(plan.model), device=dev, seed=spec.train.seed)
    o = spec.optimizer
    opt = torch.optim.AdamW(param_groups([model], o.weight_decay), lr=o.lr, betas=tuple(o.betas), eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, warmup_steps=0, total_steps=spec.train.steps, schedule="constant", min_lr_ratio=0)
    )
    data = build_batches(
        spec.data,
        seq_len=plan.model.seq_len,
        vocab_size=plan.model.vocab_size,
        seed=0,
        global_batch_size=plan.global_batch_size,
        micro_batch_size=plan.micro_batch_size,
        dp_rank=0,
        dp_size=1,
    )
    t0 = 0.0
    for step in range(spec.train.steps):
        if step == warmup:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        mbs = data.micro_batches(step)
        for x, y in mbs:
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()) / len(mbs)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip or 1e9)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, float(loss)


def meshrun(spec: Any, plan: Any, **job: Any) -> tuple[float, dict[str, Any], list[dict[str, Any]]]:
    """(wall time of the whole call, summary, rows)."""
    from workers.loop import WorkerJob, train

    rows: list[dict[str, Any]] = []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    summary = train(WorkerJob(spec=spec, plan=plan, **job), sink=rows.append)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, summary, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--preset", default="125m")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--gbs", type=int, default=16)
    ap.add_argument("--mbs", type=int, default=8)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    from api.spec import BREAKDOWN_PARTS, RunSpec
    from api.spec.validation import build_plan

    specs = {
        arm: RunSpec.model_validate(_spec(a, breakdown=arm != "meshrun-nobd", steps=a.steps))
        for arm in ("plain", "meshrun", "meshrun-nobd")
    }
    plan = build_plan(specs["plain"], device="cuda")
    tps: dict[str, list[float]] = {arm: [] for arm in specs}
    n = a.steps - a.warmup
    for rep in range(a.repeats):
        arms = list(specs)
        for arm in arms[rep % 3 :] + arms[: rep % 3]:
            if arm == "plain":
                wall, _ = plain(specs[arm], plan, a.warmup)
            else:
                # the loop's span (host clock, first step to the final report) minus the warm-up steps
                _, summary, rows = meshrun(specs[arm], plan)
                wall = summary["loop_time_s"] - sum(r["step_time_s"] for r in rows[: a.warmup])
            tps[arm].append(plan.tokens_per_step * n / wall)
    print(
        f"one GPU ({torch.cuda.get_device_name()}), gpt/{a.preset} seq {a.seq_len} bf16, {plan.tokens_per_step} "
        f"tokens/step, {a.steps} steps ({a.warmup} warm-up excluded), {a.repeats} interleaved repeats"
    )
    base = statistics.median(tps["plain"])
    for arm, xs in tps.items():
        print(
            f"{arm:<13} tokens/s median {statistics.median(xs):>10.0f} [{min(xs):.0f}-{max(xs):.0f}]  "
            f"ratio {statistics.median(xs) / base:.3f}"
        )

    # the CUDA paths of the measurements
    with tempfile.TemporaryDirectory() as d:
        spec = RunSpec.model_validate(_spec(a, breakdown=True, steps=8, profile=True))
        _, summary, rows = meshrun(spec, build_plan(spec, device="cuda"), profile_dir=d)
        step_sum = sum(r["step_time_s"] for r in rows)
        print(f"step times sum {step_sum:.4f} s vs loop {summary['loop_time_s']:.4f} s")
        for r in rows[1:3]:
            bd = r["breakdown"]
            parts = sum(bd[t] for t in BREAKDOWN_PARTS)
            print(
                f"step {r['step']}: total {bd['total'] * 1e3:.2f} ms, parts {parts * 1e3:.2f} ms, "
                + ", ".join(f"{t} {bd[t] * 1e3:.2f}" for t in ("compute", "optimizer", "data_wait", "other"))
            )
        print(
            "peak allocated",
            rows[-1]["peak_memory_bytes_per_rank"],
            "reserved",
            rows[-1].get("peak_memory_reserved_bytes_per_rank"),
        )
        trace = json.loads(Path(summary["profiles"][0]).read_text())
        cats = sorted({e.get("cat", "") for e in trace["traceEvents"]})
        print("profile", summary["profiles"], "event categories", cats)


if __name__ == "__main__":
    main()

"""meshrun on one GPU: the checks of the GPU issue in one go, inside a wall-clock budget.

    python3 scripts/gpu/check.py --out DIR [--budget-s 600] [--sections env,train,parity,service,compile]

Sections run in order, each in its own subprocess with the time that is left, so one that hangs or runs out of
memory cannot take the others down. Results go to ``DIR/gpu_check.json`` after every section (a run cut short
still leaves what it measured) and a table is printed at the end.

- ``env``: versions, the device, a measured bf16 matmul peak (8192^3, CUDA events, median of 10).
- ``train``: the GPT presets in bf16 through meshrun's loop (``workers.loop.train``, breakdown on): tokens/s, MFU
  against the dense bf16 peak and the measured matmul peak, peak allocated/reserved memory, the measured
  breakdown, and the planner's prediction for the same layout (``service.planner.evaluate``, device H100/H200);
  then the same 1B-class model through a minimal hand-written loop (the ratio meshrun / plain).
- ``parity``: loss parity on the GPU: a single process against DDP dp2 on gloo with CUDA tensors (NCCL refuses
  two ranks on one GPU: "Duplicate GPU detected"), and NCCL with one rank (the NCCL code path end to end).
- ``service``: the meshrun service end to end: ``python -m api.cli serve`` (SQLite, a local Ray head that sees
  the GPU), a run submitted through REST with ``resources.device: gpu``, SUCCEEDED, its metrics in the database.
- ``compile``: the 1B-class model again with ``compile: true`` (torch.compile per block).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

PRESETS = [("125m", 8, 16), ("350m", 8, 16), ("1.3b", 8, 16), ("2.7b", 2, 8)]  # (preset, micro batch, global)
FLAGSHIP = "1.3b"


# ----------------------------------------------------------------------------------------------- sections
def section_env(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    dev = torch.device("cuda")
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a @ b
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(),
        "memory_bytes": torch.cuda.get_device_properties(0).total_memory,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "matmul_bf16_flops_per_s": 2 * 8192**3 / statistics.median(times),
    }


def _spec(preset: str, mb: int, gbs: int, steps: int, **extra: Any) -> dict[str, Any]:
    return {
        "name": f"gpu-{preset}",
        "model": {"name": "gpt", "preset": preset, "seq_len": 2048},
        "batch": {"global_batch_size": gbs, "micro_batch_size": mb},
        "precision": "bf16",
        "optimizer": {"warmup_steps": 0, "schedule": "constant", "grad_clip": 1.0},
        "train": {"steps": steps, "seed": 0},
        "resources": {"device": "gpu"},
        **extra,
    }


def _predict(spec: Any, plan: Any, device_name: str) -> dict[str, Any]:
    from api.spec import ClusterSpec
    from service.planner import evaluate

    dev = "H200" if "H200" in device_name else "H100"
    c = evaluate(
        plan.model,
        ClusterSpec(device=dev, gpus_per_node=1, nodes=1),
        layout=spec.layout,
        micro_batch_size=plan.micro_batch_size,
        global_batch_size=plan.global_batch_size,
        precision="bf16",
        activation_checkpointing=spec.activation_checkpointing,
    )
    return {
        "step_time_s": c.step_time_s.total,
        "memory_bytes": c.memory_bytes.total,
        "breakdown_s": c.step_time_s.model_dump(),
        "tokens_per_s": c.tokens_per_s,
        "mfu": c.mfu,
        "feasible": c.feasible,
    }


def _meshrun_run(preset: str, mb: int, gbs: int, steps: int, warmup: int, **extra: Any) -> dict[str, Any]:
    import torch

    from api.spec import RunSpec, build_plan
    from workers.loop import WorkerJob, train
    from workers.metrics import GPU_PEAK_FLOPS

    spec = RunSpec.model_validate(_spec(preset, mb, gbs, steps, **extra))
    plan = build_plan(spec, device="cuda")
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    summary = train(WorkerJob(spec=spec, plan=plan), sink=rows.append)
    wall = time.perf_counter() - t0
    steady = rows[warmup:] or rows
    step_s = statistics.median(r["step_time_s"] for r in steady)
    name = torch.cuda.get_device_name()
    peak = next((v[0] for k, v in GPU_PEAK_FLOPS.items() if k in name), 989e12)
    bds = [r["breakdown"] for r in steady if r.get("breakdown")]
    breakdown = {k: statistics.median(float(b[k]) for b in bds) for k in bds[0]} if bds else None
    mfu = statistics.median(r["mfu"] for r in steady)
    return {
        "preset": preset,
        "micro_batch_size": mb,
        "global_batch_size": gbs,
        "n_params": plan.model.n_params,
        "tokens_per_step": plan.tokens_per_step,
        "step_time_s": step_s,
        "tokens_per_s": plan.tokens_per_step / step_s,
        "mfu": mfu,
        "mfu_vs_dense_peak_flops": peak,
        "peak_allocated_bytes": max(max(r.get("peak_memory_bytes_per_rank") or [0]) for r in rows),
        "peak_reserved_bytes": max(max(r.get("peak_memory_reserved_bytes_per_rank") or [0]) for r in rows),
        "breakdown_s": breakdown,
        "final_loss": rows[-1]["loss"],
        "wall_s": wall,
        "loop_time_s": summary.get("loop_time_s"),
        "predicted": _predict(spec, plan, name),
    }


def _plain_run(preset: str, mb: int, gbs: int, steps: int, warmup: int) -> dict[str, Any]:
    """The same model, data and optimizer through a minimal hand-written loop (clipping included)."""
    import torch
    import torch.nn.functional as F

    from api.spec import RunSpec, build_plan
    from workers.data import build_batches
    from workers.models import build_model, materialize
    from workers.optim import param_groups

    spec = RunSpec.model_validate(_spec(preset, mb, gbs, steps))
    plan = build_plan(spec, device="cuda")
    dev = torch.device("cuda")
    model = materialize(build_model(plan.model), device=dev, seed=0)
    groups = param_groups([model], spec.optimizer.weight_decay)
    opt = torch.optim.AdamW(groups, lr=spec.optimizer.lr, betas=tuple(spec.optimizer.betas), fused=True)
    data = build_batches(
        spec.data,
        seq_len=plan.model.seq_len,
        vocab_size=plan.model.vocab_size,
        seed=0,
        global_batch_size=gbs,
        micro_batch_size=mb,
        dp_rank=0,
        dp_size=1,
    )
    t0 = 0.0
    loss = torch.zeros(())
    for step in range(steps):
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
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    step_s = (time.perf_counter() - t0) / (steps - warmup)
    return {
        "preset": preset,
        "step_time_s": step_s,
        "tokens_per_s": plan.tokens_per_step / step_s,
        "final_loss": float(loss) * len(mbs),
    }


def section_train(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"meshrun": [], "plain": None}
    for preset, mb, gbs in PRESETS if args.all_presets else [p for p in PRESETS if p[0] == FLAGSHIP]:
        try:
            out["meshrun"].append(_meshrun_run(preset, mb, gbs, args.steps, args.warmup))
        except Exception as e:
            out["meshrun"].append({"preset": preset, "error": f"{type(e).__name__}: {str(e)[:300]}"})
        _flush_cuda()
    p = next(p for p in PRESETS if p[0] == FLAGSHIP)
    out["plain"] = _plain_run(p[0], p[1], p[2], args.steps, args.warmup)
    return out


def section_compile(args: argparse.Namespace) -> dict[str, Any]:
    p = next(p for p in PRESETS if p[0] == FLAGSHIP)
    return _meshrun_run(p[0], p[1], p[2], args.steps + 5, args.warmup + 5, compile=True)


def _flush_cuda() -> None:
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()


def _parity_worker(rank: int, world: int, port: int, backend: str, result: str) -> None:
    import torch
    import torch.distributed as dist

    from api.spec import RunSpec, build_plan
    from workers.loop import WorkerJob, train

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.cuda.set_device(0)
    dist.init_process_group(backend=backend, timeout=__import__("datetime").timedelta(seconds=120))
    try:
        spec = RunSpec.model_validate(
            {
                "name": "parity",
                "model": {"name": "gpt", "preset": "tiny"},
                "layout": {"dp": world},
                "batch": {"global_batch_size": 8, "micro_batch_size": 8 // world},
                "train": {"steps": 8, "seed": 0},
                "resources": {"device": "gpu"},
                "precision": "fp32",
            }
        )
        rows: list[dict[str, Any]] = []
        train(WorkerJob(spec=spec, plan=build_plan(spec, device="cuda")), sink=rows.append)
        if rank == 0:
            Path(result).write_text(json.dumps([r["loss"] for r in sorted(rows, key=lambda r: r["step"])]))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def section_parity(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.multiprocessing as mp

    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as d:
        for name, world, backend in (("single_nccl", 1, "nccl"), ("ddp_dp2_gloo_cuda", 2, "gloo")):
            res = f"{d}/{name}.json"
            mp.spawn(_parity_worker, args=(world, _free_port(), backend, res), nprocs=world, join=True)
            out[name] = json.loads(Path(res).read_text())
    ref = out["single_nccl"]
    dp2 = out["ddp_dp2_gloo_cuda"]
    out["max_abs_loss_diff"] = max(abs(a - b) for a, b in zip(ref, dp2, strict=True))
    out["note"] = (
        "fp32 without TF32; NCCL cannot run two ranks on one GPU (Duplicate GPU detected), so the "
        "two-rank check runs on gloo with CUDA tensors and NCCL runs the one-rank path"
    )
    out["tf32"] = torch.backends.cuda.matmul.allow_tf32
    return out


def section_service(args: argparse.Namespace) -> dict[str, Any]:
    from api.sdk import Client

    port = _free_port()
    with tempfile.TemporaryDirectory() as d:
        env = dict(
            os.environ,
            MESHRUN_DATA_DIR=d,
            MESHRUN_PORT=str(port),
            MESHRUN_RAY_GCS_PORT=str(_free_port()),
            MESHRUN_RAY_DASHBOARD_PORT=str(_free_port()),
            MESHRUN_RAY_METRICS_EXPORT_PORT=str(_free_port()),
        )
        log = open(Path(args.out) / "service.log", "wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "api.cli", "serve"],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        t0 = time.monotonic()
        try:
            client = Client(f"http://127.0.0.1:{port}", timeout=30)
            while True:
                try:
                    if client.health().get("status") in ("ok", "degraded"):
                        break
                except Exception:
                    pass
                if proc.poll() is not None or time.monotonic() - t0 > 180:
                    raise RuntimeError("the service did not come up; see service.log")
                time.sleep(1)
            up_s = time.monotonic() - t0
            run = client.runs.create(
                {
                    "name": "gpu-rest",
                    "model": {"name": "gpt", "preset": "125m", "seq_len": 1024},
                    "batch": {"global_batch_size": 8, "micro_batch_size": 8},
                    "precision": "bf16",
                    "train": {"steps": 20},
                    "resources": {"device": "gpu"},
                }
            )
            run = client.runs.wait(run.id, timeout=300)
            rows = client.runs.metrics(run.id)
            return {
                "status": str(run.status.value if hasattr(run.status, "value") else run.status),
                "reason": run.status_reason,
                "service_up_s": up_s,
                "metric_rows": len(rows),
                "mean_tokens_per_s": run.summary.mean_tokens_per_s if run.summary else None,
                "mean_mfu": run.summary.mean_mfu if run.summary else None,
                "submit_to_end_s": time.monotonic() - t0 - up_s,
            }
        finally:
            import signal

            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=30)
            except Exception:
                os.killpg(proc.pid, signal.SIGKILL)


SECTIONS = {
    "env": section_env,
    "train": section_train,
    "parity": section_parity,
    "service": section_service,
    "compile": section_compile,
}


# ------------------------------------------------------------------------------------------------- driver
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=600)
    ap.add_argument("--sections", default="env,train,parity,service,compile")
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--all-presets", action="store_true", help="every GPT preset, not only the 1B-class one")
    ap.add_argument("--section", help=argparse.SUPPRESS)  # internal: run one section in this process
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.section:
        res = SECTIONS[args.section](args)
        Path(args.out, f"{args.section}.json").write_text(json.dumps(res, indent=1, default=str))
        return 0
    deadline = time.monotonic() + args.budget_s
    results: dict[str, Any] = {}
    for name in args.sections.split(","):
        left = deadline - time.monotonic()
        if left < 15:
            results[name] = {"skipped": f"out of time ({left:.0f} s left)"}
            continue
        t0 = time.monotonic()
        cmd = [
            sys.executable,
            __file__,
            "--section",
            name,
            "--out",
            args.out,
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
        ] + (["--all-presets"] if args.all_presets else [])
        try:
            r = subprocess.run(cmd, timeout=left - 5, capture_output=True, text=True)
            path = Path(args.out, f"{name}.json")
            results[name] = (
                json.loads(path.read_text())
                if r.returncode == 0 and path.exists()
                else {"error": f"exit {r.returncode}: {(r.stderr or '')[-1500:]}"}
            )
        except subprocess.TimeoutExpired:
            results[name] = {"error": f"timed out after {left - 5:.0f} s"}
        results[name]["section_s"] = round(time.monotonic() - t0, 1)
        Path(args.out, "gpu_check.json").write_text(json.dumps(results, indent=1, default=str))
        print(f"== {name} ({results[name]['section_s']} s)", flush=True)
        print(json.dumps(results[name], default=str)[:1500], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

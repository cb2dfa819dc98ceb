"""Run several training layouts inside one spawned gloo world (helpers importable by spawned children)."""

from __future__ import annotations

import json
import os
import socket
import tempfile
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.spawn import spawn_ranks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, specs: list[dict], out_path: str, kwargs: dict) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    from datetime import timedelta

    from api.spec import RunSpec
    from api.spec.validation import build_plan
    from workers.loop import WorkerJob, train

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    results: list[Any] = []
    try:
        for spec_d in specs:
            spec_d = dict(spec_d)
            env = spec_d.pop("_env", {})  # per-spec environment (e.g. MESHRUN_META_INIT_BYTES)
            job = {**kwargs, **spec_d.pop("_job", {})}  # per-spec WorkerJob fields (checkpoint_dir, resume_from)
            old = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            spec = RunSpec.model_validate(spec_d)
            plan = build_plan(spec, device="cpu")
            rows: list[dict] = []
            summary = train(WorkerJob(spec=spec, plan=plan, **job), sink=rows.append)
            results.append({"losses": summary["losses"], "rows": rows, "summary": summary})
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    except Exception:
        results.append({"error": traceback.format_exc()})
        raise
    else:
        # every rank done before any tears its gloo pairs down: a peer closing first can make the other's gloo
        # thread call std::terminate at exit ("terminate called without an active exception", SIGABRT)
        dist.barrier()
    finally:
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(results, f)
        dist.destroy_process_group()


def run_world(world: int, specs: list[dict], **job_kwargs) -> list[dict]:
    """Train every spec in order inside one ``world``-process gloo group; rank 0's results per spec."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "out.json")
        try:
            spawn_ranks(_worker, (world, free_port(), specs, out, job_kwargs), world)
        except mp.ProcessExitedException as e:
            # a rank killed by a signal after every rank passed the final barrier and rank 0 wrote every spec's
            # results (gloo's teardown, seen now and then as SIGABRT next to a Ray session): the training is whole
            done = _read(out)
            if done is None or len(done) != len(specs) or any("error" in r for r in done):
                raise
            print(f"run_world: {e} after every spec finished; using rank 0's results")
            return done
        done = _read(out)
        assert done is not None, "rank 0 wrote no results"
        return done


def _read(path: str) -> list[dict] | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def tiny_spec(
    *, steps: int = 4, dp: int = 1, tp: int = 1, pp: int = 1, zero: int = 0, gbs: int = 8, mbs: int = 2, **extra: Any
) -> dict:
    layout = {"dp": dp, "tp": tp, "pp": pp, "zero_stage": zero}
    layout.update(extra.pop("layout", {}))
    spec = {
        "name": "parity",
        "model": {"name": "gpt", "preset": "tiny", "seq_len": 32},
        "layout": layout,
        "batch": {"global_batch_size": gbs, "micro_batch_size": mbs},
        "optimizer": {"lr": 3e-3, "warmup_steps": 0, "schedule": "constant", "grad_clip": 1.0},
        "train": {"steps": steps, "seed": 1234},
    }
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(spec.get(k), dict):
            spec[k] = {**spec[k], **v}
        else:
            spec[k] = v
    return spec

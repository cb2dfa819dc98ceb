"""Ray Job entrypoint of the GPU probe: a GPU task, a 1-worker Ray Train run on NCCL, and 2 Train workers sharing
the one GPU (0.5 GPU each) on gloo with CUDA tensors. Prints one line ``JOBRESULT {json}``."""

from __future__ import annotations

import json
import os
import time
import traceback

import ray
import torch


@ray.remote(num_gpus=1)
def gpu_task() -> dict:
    return {
        "gpu_ids": ray.get_gpu_ids(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "cuda_available": torch.cuda.is_available(),
        "name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "sum": float((torch.ones(1024, device="cuda") * 2).sum().item()),
    }


def train_loop(config: dict) -> None:
    import ray.train
    import ray.train.torch
    import torch.distributed as dist

    dev = ray.train.torch.get_device()
    t = torch.ones(4, device=dev) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    rec = {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "backend": dist.get_backend(),
        "device": str(dev),
        "tensor_device": str(t.device),
        "sum": float(t[0].item()),
        "gpu_ids": ray.get_gpu_ids(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    with open(f"{config['out']}.rank{dist.get_rank()}.json", "w") as f:
        json.dump(rec, f)
    ray.train.report({"sum": rec["sum"]})


def fit(name: str, num_workers: int, backend: str, resources: dict | None) -> dict:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    out = f"/tmp/probe-{name}"
    t0 = time.time()
    try:
        TorchTrainer(
            train_loop,
            train_loop_config={"out": out},
            scaling_config=ScalingConfig(
                num_workers=num_workers, use_gpu=True, resources_per_worker=resources
            ),
            torch_config=TorchConfig(backend=backend, timeout_s=120),
            run_config=RunConfig(
                name=f"{name}-{time.time_ns()}", storage_path="/tmp/ray-probe-storage"
            ),
        ).fit()
        ranks = []
        for r in range(num_workers):
            with open(f"{out}.rank{r}.json") as f:
                ranks.append(json.load(f))
        return {"ok": True, "fit_s": round(time.time() - t0, 1), "ranks": ranks}
    except Exception as e:  # noqa: BLE001 - the probe records every outcome
        traceback.print_exc()
        return {
            "ok": False,
            "fit_s": round(time.time() - t0, 1),
            "error": f"{type(e).__name__}: {e}"[:1500],
        }


def main() -> None:
    ray.init()
    res: dict = {"cluster_resources": ray.cluster_resources()}
    t0 = time.time()
    try:
        res["gpu_task"] = ray.get(gpu_task.remote(), timeout=120)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        res["gpu_task"] = {"error": f"{type(e).__name__}: {e}"[:1500]}
    res["gpu_task_s"] = round(time.time() - t0, 1)
    res["train_1gpu_nccl"] = fit("nccl1", 1, "nccl", None)
    res["train_2x_half_gpu_gloo"] = fit("gloo2", 2, "gloo", {"GPU": 0.5})
    print("JOBRESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()

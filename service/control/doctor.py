"""``meshrun doctor``: checks of the install and the machine, each with what to fix.

``run_checks(settings)`` returns one ``Check`` per item: the torch build (and CUDA / NCCL when present, gloo for CPU
workers), Ray (version, the dashboard / Jobs API that ``ray[default]`` brings), the database (reachable, migrated),
the ports the service and its local Ray head need, and the CPU slots (do the examples fit). Nothing is started;
each check is bounded (no check waits long on the network).
"""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
from dataclasses import dataclass
from typing import Literal

from service.cluster.head import local_cpu_slots
from service.settings import Settings

Level = Literal["ok", "warn", "fail"]
LARGEST_EXAMPLE_WORKERS = 8  # examples/gpt-3d-demo.yaml: dp2 x tp2 x pp2
PROBE_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class Check:
    name: str
    level: Level
    detail: str
    fix: str = ""


def _torch() -> list[Check]:
    try:
        import torch
        import torch.distributed as dist
    except Exception as e:
        return [Check("torch", "fail", f"cannot import torch: {e}", "pip install torch (CPU or CUDA build)")]
    cuda = torch.version.cuda
    out = [Check("torch", "ok", f"torch {torch.__version__} ({'CUDA ' + cuda if cuda else 'CPU-only'} build)")]
    if not dist.is_available() or not dist.is_gloo_available():
        out.append(Check("gloo", "fail", "torch.distributed without gloo", "install a torch build with distributed"))
    else:
        out.append(Check("gloo", "ok", "gloo backend available (CPU workers)"))
    if cuda:
        if torch.cuda.is_available():
            names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
            out.append(Check("cuda", "ok", f"{torch.cuda.device_count()} GPU(s): {', '.join(names)}"))
            try:
                nccl = ".".join(map(str, torch.cuda.nccl.version()))
                out.append(Check("nccl", "ok", f"NCCL {nccl}"))
            except Exception as e:
                out.append(Check("nccl", "warn", f"NCCL unavailable: {e}", "GPU runs need NCCL; CPU runs use gloo"))
        else:
            out.append(
                Check(
                    "cuda",
                    "warn",
                    "CUDA build but no GPU visible",
                    "check the NVIDIA driver / CUDA_VISIBLE_DEVICES; runs with resources.device: cpu still work",
                )
            )
    return out


def _ray() -> list[Check]:
    try:
        import ray
    except Exception as e:
        return [Check("ray", "fail", f"cannot import ray: {e}", 'pip install "ray[default,train,tune]"')]
    out = [Check("ray", "ok", f"ray {ray.__version__} at {os.path.dirname(ray.__file__)}")]
    if importlib.util.find_spec("aiohttp") is None or importlib.util.find_spec("ray.dashboard") is None:
        out.append(
            Check(
                "ray dashboard",
                "fail",
                "the Ray dashboard / Jobs API is not installed (meshrun submits every run as a Ray Job)",
                'pip install "ray[default]"',
            )
        )
    else:
        out.append(Check("ray dashboard", "ok", "dashboard and Jobs API installed (ray[default])"))
    return out


def _database(settings: Settings) -> Check:
    from sqlalchemy import text

    from service.store.db import make_engine

    url = str(settings.database_url)
    shown = url.split("@")[-1] if "@" in url else url
    try:
        engine = make_engine(url)
        try:
            with engine.connect() as conn:
                conn.execute(text("SELECT 1"))
        finally:
            engine.dispose()
    except Exception as e:
        return Check(
            "database",
            "fail",
            f"{shown} not reachable: {type(e).__name__}: {str(e).splitlines()[0][:200]}",
            "check MESHRUN_DATABASE_URL (the service creates and migrates a SQLite file by itself)",
        )
    return Check("database", "ok", f"{shown} reachable (migrated on the service's start)")


def _listening(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(PROBE_TIMEOUT_S)
        return s.connect_ex((host if host not in ("0.0.0.0", "") else "127.0.0.1", port)) == 0


def _ports(settings: Settings) -> list[Check]:
    wanted = [("service", settings.port, "MESHRUN_PORT")]
    if not settings.ray_address:
        wanted += [
            ("Ray GCS", settings.ray_gcs_port, "MESHRUN_RAY_GCS_PORT"),
            ("Ray dashboard", settings.ray_dashboard_port, "MESHRUN_RAY_DASHBOARD_PORT"),
        ]
    out = []
    for what, port, var in wanted:
        if _listening(settings.host, port):
            out.append(
                Check(
                    f"port {port}",
                    "warn",
                    f"{what} port {port} is in use (a meshrun already serving, or another program)",
                    f"stop that program or set {var} to a free port"
                    + (" (the local Ray head picks a free one by itself)" if var != "MESHRUN_PORT" else ""),
                )
            )
        else:
            out.append(Check(f"port {port}", "ok", f"{what} port {port} is free"))
    if settings.ray_address:
        host, _, port_s = settings.ray_address.split("://", 1)[-1].rpartition(":")
        try:
            up = _listening(host or "127.0.0.1", int(port_s))
        except ValueError:
            up = False
        out.append(
            Check("ray cluster", "ok", f"GCS {settings.ray_address} answers")
            if up
            else Check(
                "ray cluster",
                "fail",
                f"GCS {settings.ray_address} does not answer",
                "start the cluster, or unset MESHRUN_RAY_ADDRESS to let meshrun start its own head",
            )
        )
    return out


def _cpu_slots(settings: Settings) -> Check:
    if settings.ray_address:
        return Check("cpu slots", "ok", "an existing Ray cluster: its nodes' CPUs are the slots (meshrun cluster)")
    slots, note = local_cpu_slots(settings.ray_num_cpus)
    if slots - 1 < LARGEST_EXAMPLE_WORKERS:  # one slot stays free for a sweep's trial driver
        return Check(
            "cpu slots",
            "warn",
            f"{note}: the 8-worker examples (gpt-3d-demo.yaml) will be refused",
            f"set MESHRUN_RAY_NUM_CPUS={LARGEST_EXAMPLE_WORKERS + 1} or more (logical slots; workers share cores)",
        )
    return Check("cpu slots", "ok", f"{note}: every example fits")


def run_checks(settings: Settings) -> list[Check]:
    checks = [Check("python", "ok", f"{sys.executable} (Python {sys.version.split()[0]})")]
    checks += _torch()
    checks += _ray()
    checks.append(_database(settings))
    checks += _ports(settings)
    checks.append(_cpu_slots(settings))
    return checks

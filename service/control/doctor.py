"""``meshrun doctor``: checks of the install and the machine, each with what to fix.

``run_checks(settings)`` returns one ``Check`` per item: the torch build (and CUDA / NCCL when present, gloo for CPU
workers), Ray (version, the dashboard / Jobs API that ``ray[default]`` brings), the database (reachable, migrated),
the ports the service and its local Ray head need, and the CPU slots (do the examples fit). The data directory's
own running ``meshrun serve`` (``service.control.service_record``) is reported as such, with its URL and Ray head,
and the ports it holds are not "in use by another program". Nothing is started; each check is bounded (no check
waits long on the network).
"""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
from dataclasses import dataclass
from typing import Literal

from service.cluster.head import local_cpu_slots
from service.control.service_record import find_running, meshrun_at
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


def _url(host: str, port: int) -> str:
    return f"http://{host if host not in ('0.0.0.0', '') else '127.0.0.1'}:{port}"


def _running_service(settings: Settings) -> tuple[Check | None, set[int]]:
    """This data directory's own ``meshrun serve`` (``<data_dir>/service.json``), when it answers: a check that
    reports it (URL, Ray head) and the ports it holds (not "another program")."""
    svc = find_running(settings.data_dir)
    if svc is None:
        return None, set()
    rec = svc.record
    if rec.ray_owned:
        ray = f"its own Ray head at {rec.ray_address} (dashboard {rec.ray_dashboard_url})"
    elif rec.ray_address:
        ray = f"the Ray cluster at {rec.ray_address}"
    else:
        ray = "no Ray runtime (--no-scheduler: runs stay QUEUED)"
    where = f"meshrun {rec.version} (pid {rec.pid}) serves this data directory at {rec.url}/ with {ray}"
    if svc.healthy:
        return Check("service", "ok", f"{where}: healthy"), svc.ports
    reason = svc.health.get("reason") or "degraded"
    return Check("service", "warn", f"{where}: {reason}", "see that service's log; /healthz says what is wrong"), (
        svc.ports
    )


def _ports(settings: Settings) -> list[Check]:
    service, ours = _running_service(settings)
    wanted = [("service", settings.port, "MESHRUN_PORT")]
    if not settings.ray_address:
        wanted += [
            ("Ray GCS", settings.ray_gcs_port, "MESHRUN_RAY_GCS_PORT"),
            ("Ray dashboard", settings.ray_dashboard_port, "MESHRUN_RAY_DASHBOARD_PORT"),
        ]
    out = [service] if service is not None else []
    for what, port, var in wanted:
        if port in ours:
            out.append(Check(f"port {port}", "ok", f"{what} port {port} is held by this data directory's service"))
        elif _listening(settings.host, port) and var == "MESHRUN_PORT" and meshrun_at(_url(settings.host, port)):
            out.append(
                Check(
                    f"port {port}",
                    "warn",
                    f"a meshrun service of another data directory answers on port {port}",
                    f"use it (--url {_url(settings.host, port)}), or set MESHRUN_PORT to a free port for this one",
                )
            )
        elif _listening(settings.host, port):
            out.append(
                Check(
                    f"port {port}",
                    "warn",
                    f"{what} port {port} is in use by another program (no meshrun service of this data directory)",
                    f"stop that program or set {var} to a free port"
                    + (
                        " (meshrun serve refuses to start while it is taken: it never moves to another port)"
                        if var != "MESHRUN_PORT"
                        else ""
                    ),
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

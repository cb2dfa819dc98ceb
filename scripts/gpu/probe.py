"""Probe of the lent GPU machine, run with the bundle active (bundle_setup.sh); see scripts/gpu/NOTES.md.

    python3 probe.py OUTDIR                 # every section, each in its own process with a time limit
    python3 probe.py OUTDIR --section NAME  # one section (prints ``RESULT {json}`` last)

Sections: env, imports, service, ray, perf, nccl, gloo, compile. Writes OUTDIR/summary.json and
OUTDIR/sections.log (each section's output), and prints a compact summary last.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import statistics
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
SECTIONS = {  # name: time limit in seconds
    "env": 45,
    "imports": 60,
    "service": 40,
    "ray": 130,
    "perf": 40,
    "nccl": 70,
    "gloo": 45,
    "compile": 80,
}
BUDGET_S = 250.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sh(cmd: str, timeout: float = 30) -> str:
    try:
        p = subprocess.run(
            cmd,
            shell=True,
            check=False,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        return (p.stdout + p.stderr).strip()
    except subprocess.TimeoutExpired:
        return f"timeout after {timeout}s"


# ------------------------------------------------------------------------------------------------ sections
def s_env(out: Path) -> dict:
    import importlib.metadata as md

    import torch

    p = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info()
    names = [
        "ray",
        "torch",
        "triton",
        "numpy",
        "pandas",
        "pyarrow",
        "protobuf",
        "grpcio",
        "aiohttp",
        "click",
        "packaging",
        "typing_extensions",
        "requests",
        "filelock",
        "anyio",
        "fastapi",
        "starlette",
        "uvicorn",
        "pydantic",
        "pydantic_core",
        "pydantic-settings",
        "sqlalchemy",
        "alembic",
        "httpx",
        "typer",
        "rich",
        "pyyaml",
        "prometheus_client",
        "msgpack",
        "fsspec",
        "jsonschema",
        "setuptools",
    ]
    vers: dict[str, str | None] = {}
    for n in names:
        try:
            vers[n] = md.version(n)
        except md.PackageNotFoundError:
            vers[n] = None
    pipcheck = sh(f"{sys.executable} -m pip check", 120)
    (out / "pipcheck.txt").write_text(pipcheck + "\n")
    meminfo = dict(
        ln.split(":", 1) for ln in Path("/proc/meminfo").read_text().splitlines()[:3]
    )
    return {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "gpu": p.name,
        "capability": f"{p.major}.{p.minor}",
        "sm_count": p.multi_processor_count,
        "l2_bytes": getattr(p, "L2_cache_size", None),
        "gpu_total_bytes": total,
        "gpu_free_bytes": free,
        "device_count": torch.cuda.device_count(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)),
        "meminfo": {k: v.strip() for k, v in meminfo.items()},
        "nvidia_smi": sh(
            "nvidia-smi --query-gpu=name,memory.total,driver_version,power.limit,clocks.max.sm,"
            "clocks.sm,compute_mode,persistence_mode --format=csv,noheader"
        ),
        "kernel": os.uname().release,
        "disk_tmp": sh("df -h /tmp | tail -1"),
        "xz": sh("command -v xz"),
        "torchrun": sh("command -v torchrun"),
        "versions": vers,
        "pip_check_lines": len([ln for ln in pipcheck.splitlines() if ln.strip()]),
    }


def s_imports(out: Path) -> dict:
    import importlib

    mods = [
        "torch",
        "ray",
        "ray.train",
        "ray.train.torch",
        "ray.tune",
        "ray.job_submission",
        "ray.dashboard",
        "fastapi",
        "uvicorn",
        "sqlalchemy",
        "alembic",
        "pydantic",
        "pydantic_settings",
        "httpx",
        "typer",
        "rich",
        "yaml",
        "prometheus_client",
        "api.cli",
        "api.server",
        "service.runtime",
        "service.ray_backend",
        "service.ray_cluster",
        "workers.loop",
        "workers.ray_worker",
    ]
    res: dict = {}
    for m in mods:
        t0 = time.time()
        try:
            mod = importlib.import_module(m)
            res[m] = {
                "ok": True,
                "s": round(time.time() - t0, 2),
                "version": getattr(mod, "__version__", None),
                "from": str(Path(mod.__file__).parent) if mod.__file__ else None,
            }
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            res[m] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
    return res


def s_service(out: Path) -> dict:
    import tempfile

    from api.server import create_app
    from service.settings import Settings
    from starlette.testclient import TestClient

    d = Path(tempfile.mkdtemp(prefix="probe-svc-"))
    app = create_app(
        Settings.model_validate(
            {"data_dir": d, "start_scheduler": False, "auth": "off"}
        )
    )
    with TestClient(app) as c:
        h = c.get("/healthz")
        o = c.get("/openapi.json")
        runs = c.get("/v1/runs")
    return {
        "healthz": [h.status_code, h.text[:200]],
        "openapi": o.status_code,
        "runs_list": runs.status_code,
        "db_files": sorted(p.name for p in d.iterdir()),
    }


RAY_PGID_FILE = Path("/tmp/probe-ray-head.pgid")


def stop_head(pgid: int) -> None:
    """Stop exactly the head this probe started (its process group), never a machine-wide ``ray stop``."""
    import signal

    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        t0 = time.time()
        while time.time() - t0 < wait_s:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                RAY_PGID_FILE.unlink(missing_ok=True)
                return
            time.sleep(0.2)
    RAY_PGID_FILE.unlink(missing_ok=True)


def s_ray(out: Path) -> dict:
    """A local head as meshrun's service starts it (``ray start --head --block`` in its own process group,
    token auth), the dashboard's Jobs API, one job (probe_job.py) that uses the GPU, then the head stopped."""
    import secrets
    import urllib.request

    gcs, dash = free_port(), free_port()
    tok = Path("/tmp/probe-ray-token")
    tok.write_text(secrets.token_hex(32))
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(tok))
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block"]
    cmd += [f"--port={gcs}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}"]
    cmd += ["--num-gpus=1", "--include-dashboard=true", "--disable-usage-stats"]
    res: dict = {"gcs_port": gcs, "dashboard_port": dash, "auth": "token"}
    t0 = time.time()
    head_log = open("/tmp/probe-ray-head.log", "w")  # noqa: SIM115 - lives as long as the head
    head = subprocess.Popen(
        cmd, stdout=head_log, stderr=subprocess.STDOUT, start_new_session=True
    )
    RAY_PGID_FILE.write_text(str(head.pid))
    try:
        from ray._private.authentication.http_token_authentication import (
            get_auth_headers_if_auth_enabled,
        )

        headers = dict(get_auth_headers_if_auth_enabled({}))
        url = f"http://127.0.0.1:{dash}"
        while time.time() - t0 < 60 and head.poll() is None:
            try:
                req = urllib.request.Request(f"{url}/api/version", headers=headers)
                with urllib.request.urlopen(req, timeout=5) as r:
                    res["dashboard_version"] = json.loads(r.read())
                    break
            except Exception as e:  # noqa: BLE001
                res["dashboard_error"] = f"{type(e).__name__}: {e}"[:300]
                time.sleep(0.5)
        res["dashboard_up_s"] = round(time.time() - t0, 1)
        if "dashboard_version" not in res:
            res["head_rc"] = head.poll()
            print(Path("/tmp/probe-ray-head.log").read_text()[-4000:])
            return res
        try:
            urllib.request.urlopen(f"{url}/api/version", timeout=5)
            res["dashboard_without_token"] = "200"
        except Exception as e:  # noqa: BLE001
            res["dashboard_without_token"] = f"{type(e).__name__}: {e}"[:200]
        from ray.job_submission import JobStatus, JobSubmissionClient

        client = JobSubmissionClient(url)
        t1 = time.time()
        sid = client.submit_job(entrypoint=f"{sys.executable} {HERE / 'probe_job.py'}")
        status = None
        while time.time() - t1 < 90:
            status = client.get_job_status(sid)
            if status in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
                break
            time.sleep(1)
        res["job_status"], res["job_s"] = str(status), round(time.time() - t1, 1)
        logs = client.get_job_logs(sid)
        (out / "ray_job.log").write_text(logs)
        for ln in logs.splitlines():
            if ln.startswith("JOBRESULT "):
                res["job"] = json.loads(ln[len("JOBRESULT ") :])
        if "job" not in res:
            print(logs[-4000:])
            client.stop_job(sid)
    finally:
        t2 = time.time()
        stop_head(head.pid)
        res["stop_s"] = round(time.time() - t2, 1)
    return res


def s_perf(out: Path) -> dict:
    import torch

    def med_ms(fn, n: int = 10, warm: int = 3) -> float:
        for _ in range(warm):
            fn()
        ts = []
        for _ in range(n):
            a, b = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b))
        return statistics.median(ts)

    def matmul(n: int) -> tuple[float, float]:
        x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        y = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        z = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
        ms = med_ms(lambda: torch.matmul(x, y, out=z))
        ref = x[:256].double() @ y.double()
        return ms, float((z[:256].double() - ref).norm() / ref.norm())

    n = 8192
    ms, rel = matmul(n)
    numel = 2**30 // 2  # 1 GiB of bf16... as float16 elements
    src = torch.randn(numel, device="cuda", dtype=torch.float16)
    dst = torch.empty_like(src)
    cms = med_ms(lambda: dst.copy_(src), n=20)
    ok = bool(torch.equal(dst, src))
    return {
        "matmul_bf16_8192_ms": round(ms, 3),
        "matmul_bf16_tflops": round(2 * n**3 / ms / 1e9, 1),
        "matmul_rel_err_vs_fp64": rel,
        "copy_bytes": 2 * src.numel() * 2,
        "copy_ms": round(cms, 3),
        "copy_tb_per_s_read_plus_write": round(2 * src.numel() * 2 / cms / 1e9, 2),
        "copy_ok": ok,
    }


def _dist_worker(rank: int, world: int, port: int, backend: str, q) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        torch.cuda.set_device(0)
        dist.init_process_group(
            backend, rank=rank, world_size=world, timeout=timedelta(seconds=45)
        )
        t = torch.ones(1024, device="cuda") * (rank + 1)
        dist.all_reduce(t)
        torch.cuda.synchronize()
        rec = {"rank": rank, "ok": True, "sum": float(t[0].item())}
        if (
            backend == "gloo" and world > 1
        ):  # 64 MiB fp32 all_reduce of a CUDA tensor through gloo
            big = torch.randn(16 * 2**20, device="cuda")
            ts = []
            for _ in range(5):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                dist.all_reduce(big)
                torch.cuda.synchronize()
                ts.append(time.perf_counter() - t0)
            rec["allreduce_64MiB_s"] = round(statistics.median(ts), 4)
        q.put(rec)
    except Exception as e:  # noqa: BLE001
        q.put({"rank": rank, "ok": False, "error": f"{type(e).__name__}: {e}"[:1500]})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _spawn(world: int, backend: str, wait_s: float) -> list:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    ps = [
        ctx.Process(target=_dist_worker, args=(r, world, port, backend, q))
        for r in range(world)
    ]
    for p in ps:
        p.start()
    recs: list[dict] = []
    t0 = time.time()
    while len(recs) < world and time.time() - t0 < wait_s:
        try:
            recs.append(q.get(timeout=1))
        except queue.Empty:
            continue
    for p in ps:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            recs.append({"note": f"a process still ran after {wait_s}s and was killed"})
    return recs + [
        {"exitcodes": [p.exitcode for p in ps], "s": round(time.time() - t0, 1)}
    ]


def s_nccl(out: Path) -> dict:
    os.environ.setdefault("NCCL_DEBUG", "WARN")
    return {
        "nccl_1rank": _spawn(1, "nccl", 25),
        "nccl_2ranks_same_gpu": _spawn(2, "nccl", 35),
    }


def s_gloo(out: Path) -> dict:
    return {"gloo_2ranks_cuda_tensors": _spawn(2, "gloo", 35)}


def s_compile(out: Path) -> dict:
    import torch
    import torch.nn.functional as F
    from torch import nn

    torch.manual_seed(0)
    model = (
        nn.Sequential(
            *[
                nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024))
                for _ in range(2)
            ]
        )
        .cuda()
        .to(torch.bfloat16)
    )
    x = torch.randn(32, 512, 1024, device="cuda", dtype=torch.bfloat16)
    cm = torch.compile(model)

    def step(m) -> float:
        loss = m(x).float().pow(2).mean()
        loss.backward()
        return loss

    t0 = time.time()
    lc = step(cm)
    torch.cuda.synchronize()
    res: dict = {"compile_first_step_s": round(time.time() - t0, 1)}
    model.zero_grad()
    le = step(model)
    res["loss_compiled_vs_eager"] = [float(lc), float(le)]
    for name, m in (("eager", model), ("compiled", cm)):
        for _ in range(3):
            step(m)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            step(m)
        torch.cuda.synchronize()
        res[f"{name}_step_ms"] = round((time.perf_counter() - t0) * 100, 2)
    q = torch.randn(4, 16, 2048, 64, device="cuda", dtype=torch.bfloat16)
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
        res["sdpa_flash"] = "ok"
    except Exception as e:  # noqa: BLE001
        res["sdpa_flash"] = f"{type(e).__name__}: {e}"[:300]
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        opt.step()
        res["adamw_fused_bf16"] = "ok"
    except Exception as e:  # noqa: BLE001
        res["adamw_fused_bf16"] = f"{type(e).__name__}: {e}"[:300]
    return res


# ----------------------------------------------------------------------------------------------------- main
def run_section(name: str, out: Path) -> None:
    fn = globals()[f"s_{name}"]
    try:
        res = fn(out)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        res = {"error": f"{type(e).__name__}: {e}"[:1500]}
    print("RESULT " + json.dumps(res, default=str), flush=True)


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    if "--section" in sys.argv:
        run_section(sys.argv[sys.argv.index("--section") + 1], out)
        return
    only = os.environ.get("PROBE_SECTIONS", ",".join(SECTIONS)).split(",")
    summary: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    start = time.time()
    with open(out / "sections.log", "w") as log:
        for name in only:
            left = BUDGET_S - (time.time() - start)
            limit = min(SECTIONS[name], left)
            if limit < 10:
                summary[name] = {"skipped": "probe time budget spent"}
                continue
            t0 = time.time()
            try:
                p = subprocess.run(
                    [sys.executable, __file__, str(out), "--section", name],
                    check=False,
                    capture_output=True,
                    text=True,
                    timeout=limit,
                )
                text = p.stdout + p.stderr
                last = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
                res = (
                    json.loads(last[-1][7:])
                    if last
                    else {
                        "error": f"no result, rc={p.returncode}",
                        "tail": text[-1500:],
                    }
                )
            except subprocess.TimeoutExpired as e:
                text = "".join(
                    x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
                    for x in (e.stdout, e.stderr)
                )
                res = {"error": f"timed out after {limit:.0f}s", "tail": text[-1500:]}
            if name == "ray" and RAY_PGID_FILE.exists():  # the section timed out
                stop_head(int(RAY_PGID_FILE.read_text()))
            res["_s"] = round(time.time() - t0, 1)
            summary[name] = res
            log.write(f"===== {name} ({res['_s']} s)\n{text}\n")
            log.flush()
            print(f"== {name}: {res['_s']} s", flush=True)
    summary["total_s"] = round(time.time() - start, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print(json.dumps(summary, separators=(",", ":"), default=str))


if __name__ == "__main__":
    main()

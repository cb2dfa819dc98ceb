"""The compose topology for real on this machine: PostgreSQL + an external two-node Ray cluster + the service.

- a database of its own on the PostgreSQL at 127.0.0.1:5432 (created here, dropped afterwards);
- a Ray head started with ``ray start --head`` on a non-default GCS port, plus a second node joining it
  (``ray start --address``), 2 CPUs each; both started here and stopped here through their process groups
  (never a machine-wide ``ray stop``);
- the service as a subprocess (``meshrun serve``) pointed at both through ``MESHRUN_DATABASE_URL`` and
  ``MESHRUN_RAY_ADDRESS``.

A tiny GPT run with dp=4 and 1 CPU per worker must span both nodes and succeed; its per-step metrics are in
PostgreSQL; the service's ``/metrics`` carries the run (by status and its training series); the Ray nodes'
metrics export ports carry the workers' ``ray_meshrun_train_*`` gauges tagged with the run id.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from service.cluster.head import ray_cli
from service.cluster.ownership import STOP_GRACE_S
from tests.service.pg import postgres_database
from workers import ray_metrics

pytestmark = [pytest.mark.ray, pytest.mark.postgres, pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
NODE_CPUS = 2
RAY_START_TIMEOUT_S = 120
SERVICE_START_TIMEOUT_S = 120
RUN_TIMEOUT_S = 480  # a loaded 2-core machine took 245 s for this run
METRICS_EXPORT_GRACE_S = 30


# ------------------------------------------------------------------------------------------------ helpers
def _free_port(preferred: int | None = None) -> int:
    if preferred:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", preferred))
                return preferred
            except OSError:
                pass
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_group(proc: subprocess.Popen, *, timeout_s: float = STOP_GRACE_S) -> None:
    """SIGTERM the process group this test started (start_new_session=True), then SIGKILL what is left (a Ray node's
    workers wait about 30 s for their raylet after a SIGTERM: the service's grace, ``STOP_GRACE_S``)."""
    pgid = proc.pid
    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            proc.poll()
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


def _kill_leftovers(marker: str) -> list[int]:
    """Kill (by pid) processes whose command line holds this test's unique temp dir: Ray workers this test's
    raylets spawned that left the process group. Returns the pids killed."""
    killed = []
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit() or int(pid_dir.name) == os.getpid():
            continue
        try:
            cmdline = (pid_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            try:
                os.kill(int(pid_dir.name), signal.SIGKILL)
                killed.append(int(pid_dir.name))
            except ProcessLookupError:
                pass
    return killed


def _http(method: str, url: str, body: dict | None = None, *, timeout_s: float = 60.0) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _wait_http_ok(url: str, *, timeout_s: float, proc: subprocess.Popen, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if proc.poll() is not None and proc.returncode != 0:
            raise AssertionError(f"{what} exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            status, text = _http("GET", url, timeout_s=10)
            if status == 200:
                return
            last = f"HTTP {status}: {text[:300]}"
        except OSError as e:
            last = str(e)
        time.sleep(1.0)
    raise AssertionError(f"{what} not ready at {url} after {timeout_s}s ({last}):\n{log.read_text()[-4000:]}")


def _prom_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    from prometheus_client.parser import text_string_to_metric_families

    return [(s.name, dict(s.labels), s.value) for fam in text_string_to_metric_families(text) for s in fam.samples]


@dataclass
class Cluster:
    tmp: Path
    gcs_port: int
    dashboard_port: int
    metrics_ports: list[int]
    procs: list[subprocess.Popen] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"


def _ray_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "RAY_AUTH_MODE": "disabled",  # explicit: a token in ~/.ray would otherwise turn token auth on
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_metrics_report_interval_ms": "2000",  # workers' gauges reach the export port within seconds
        "PYTHONPATH": str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""),
    })
    return env


def _ray_start(cluster: Cluster, args: list[str], *, name: str, worker_ports: tuple[int, int]) -> None:
    log = cluster.tmp / f"{name}.log"
    cmd = [*ray_cli(), "start", *args, "--block", "--disable-usage-stats",
           f"--num-cpus={NODE_CPUS}", f"--temp-dir={cluster.tmp / 'ray'}",
           f"--dashboard-agent-listen-port={_free_port()}", f"--dashboard-agent-grpc-port={_free_port()}",
           f"--runtime-env-agent-port={_free_port()}",
           f"--min-worker-port={worker_ports[0]}", f"--max-worker-port={worker_ports[1]}"]
    with open(log, "ab") as fh:
        proc = subprocess.Popen(cmd, env=_ray_env(), stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=cluster.tmp)
    cluster.procs.append(proc)
    cluster.logs.append(log)


def _alive_nodes(cluster: Cluster) -> list[dict]:
    status, text = _http("GET", f"{cluster.dashboard_url}/nodes?view=summary", timeout_s=5)
    if status != 200:
        return []
    summary = json.loads(text)["data"]["summary"]
    return [n for n in summary if n.get("raylet", {}).get("state") == "ALIVE"]


# ----------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def pg_url() -> Iterator[str]:
    with postgres_database("meshrun_test_deploy") as url:
        yield url


@pytest.fixture(scope="module")
def external_cluster() -> Iterator[Cluster]:
    # short path: Ray's unix sockets live under the temp dir (108-byte limit)
    tmp = Path(f"/tmp/mrdeploy_{secrets.token_hex(3)}")
    tmp.mkdir()
    gcs_port = _free_port(6395)
    cluster = Cluster(tmp=tmp, gcs_port=gcs_port, dashboard_port=_free_port(), metrics_ports=[_free_port(), _free_port()])
    base = 30000 + secrets.randbelow(200) * 100
    try:
        _ray_start(cluster, ["--head", f"--port={gcs_port}",
                             "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                             f"--dashboard-port={cluster.dashboard_port}",
                             f"--metrics-export-port={cluster.metrics_ports[0]}",
                             f"--ray-client-server-port={_free_port()}"],
                   name="head", worker_ports=(base, base + 49))
        _wait_http_ok(f"{cluster.dashboard_url}/api/jobs/", timeout_s=RAY_START_TIMEOUT_S, proc=cluster.procs[0],
                      what="Ray head", log=cluster.logs[0])
        _ray_start(cluster, [f"--address={cluster.address}", f"--metrics-export-port={cluster.metrics_ports[1]}"],
                   name="node2", worker_ports=(base + 50, base + 99))
        t0 = time.monotonic()
        deadline = t0 + RAY_START_TIMEOUT_S
        retried = False
        while len(_alive_nodes(cluster)) < 2:
            if cluster.procs[-1].poll() is not None and not retried:
                # `ray start --address` gives up when the head's GCS answers late ("Failed to get node info: RPC
                # error: Deadline Exceeded", seen on a loaded 2-core machine): a second try, as an operator would
                retried = True
                _ray_start(cluster, [f"--address={cluster.address}",
                                     f"--metrics-export-port={cluster.metrics_ports[1]}"],
                           name="node2-retry", worker_ports=(base + 50, base + 99))
            assert cluster.procs[-1].poll() is None, cluster.logs[-1].read_text()[-4000:]
            assert time.monotonic() < deadline, "the second Ray node did not join the head"
            time.sleep(1.0)
        print(f"Ray cluster of 2 nodes up at {cluster.address} (second node joined in {time.monotonic() - t0:.1f}s)")
        yield cluster
    finally:
        for proc in reversed(cluster.procs):
            _kill_group(proc)
        _kill_leftovers(str(tmp))
        shutil.rmtree(tmp, ignore_errors=True)


@dataclass
class Service:
    url: str
    proc: subprocess.Popen
    log: Path


@pytest.fixture(scope="module")
def service(pg_url, external_cluster) -> Iterator[Service]:
    port = _free_port()
    data_dir = external_cluster.tmp / "meshrun"
    env = _ray_env()
    env.update({
        "MESHRUN_DATABASE_URL": pg_url,
        "MESHRUN_RAY_ADDRESS": external_cluster.address,
        "MESHRUN_RAY_DASHBOARD_URL": external_cluster.dashboard_url,
        "MESHRUN_HOST": "127.0.0.1",
        "MESHRUN_PORT": str(port),
        "MESHRUN_PUBLIC_URL": f"http://127.0.0.1:{port}",
        "MESHRUN_DATA_DIR": str(data_dir),
        "MESHRUN_CHECKPOINT_ROOT": str(data_dir / "checkpoints"),
        "MESHRUN_LOG_JSON": "true",
        "MESHRUN_RATE_LIMIT_PER_MINUTE": "0",
        "MESHRUN_SCHEDULER_INTERVAL_S": "0.5",
    })
    log = external_cluster.tmp / "service.log"
    with open(log, "ab") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "api.cli", "serve"], env=env, cwd=ROOT, stdout=fh,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    svc = Service(url=f"http://127.0.0.1:{port}", proc=proc, log=log)
    try:
        _wait_http_ok(f"{svc.url}/healthz", timeout_s=SERVICE_START_TIMEOUT_S, proc=proc, what="meshrun service",
                      log=log)
        yield svc
    finally:
        _kill_group(proc)


class RayMetricsPoller(threading.Thread):
    """Scrapes every Ray node's metrics export port until stopped, keeping the run's ray_meshrun_train_* samples
    (gauges of exited workers may disappear after the run ends, so they are collected while it runs)."""

    def __init__(self, ports: list[int], run_id_box: list[str]) -> None:
        super().__init__(daemon=True)
        self.ports = ports
        self.run_id_box = run_id_box
        self.seen: dict[int, dict[str, dict[str, float]]] = {p: {} for p in ports}  # port -> name -> rank -> v
        self.stop_event = threading.Event()
        self.errors: list[str] = []

    def run(self) -> None:
        while not self.stop_event.is_set():
            run_id = self.run_id_box[0] if self.run_id_box else None
            for port in self.ports:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                        text = r.read().decode()
                except OSError as e:
                    self.errors.append(f"{port}: {e}")
                    continue
                if run_id is None:
                    continue
                for name, labels, value in _prom_samples(text):
                    if name.startswith("ray_meshrun_train_") and labels.get("run_id") == run_id:
                        self.seen[port].setdefault(name, {})[labels.get("rank", "?")] = value
            self.stop_event.wait(2.0)


# ----------------------------------------------------------------------------------------------------- test
PUBLISH_SCRIPT = """
import time, ray
from workers.ray_metrics import RunMetricsPublisher
ray.init()

@ray.remote(num_cpus=1)
def publish(run_id):
    pub = RunMetricsPublisher(run_id, "probe", 0)
    for step in range(1, 6):
        pub.publish({"step": step, "loss": 10.0 / step, "tokens_per_s": 100.0 * step, "mfu": 0.01,
                     "peak_memory_bytes_per_rank": [1000, 2000]})
        time.sleep(1.0)
    time.sleep(6.0)  # stay alive while the metrics agent exports
    return pub.published, pub.enabled

print("PUBLISHED", ray.get(publish.remote("%s")))
"""


def test_ray_metrics_publisher_reaches_the_nodes_metrics_port(external_cluster):
    """workers/ray_metrics.py inside a real Ray worker: ray_meshrun_train_* on the node's export port."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    probe_id = f"run-probe{secrets.token_hex(3)}"
    client = JobSubmissionClient(external_cluster.dashboard_url)
    job = client.submit_job(entrypoint=f"python -c '{PUBLISH_SCRIPT % probe_id}'",
                            runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    poller = RayMetricsPoller(external_cluster.metrics_ports, [probe_id])
    poller.start()
    try:
        deadline = time.monotonic() + 120
        while client.get_job_status(job) not in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
            assert time.monotonic() < deadline, client.get_job_logs(job)
            time.sleep(1.0)
    finally:
        poller.stop_event.set()
        poller.join(timeout=10)
    logs = client.get_job_logs(job)
    assert client.get_job_status(job) == JobStatus.SUCCEEDED, logs
    assert "PUBLISHED (5, True)" in logs, logs
    merged: dict[str, dict[str, float]] = {}
    for port in external_cluster.metrics_ports:
        for name, by_rank in poller.seen[port].items():
            merged.setdefault(name, {}).update(by_rank)
    assert ray_metrics.PROMETHEUS_NAMES["loss"] in merged, (sorted(merged), poller.errors[-3:])
    assert merged[ray_metrics.PROMETHEUS_NAMES["peak_memory_bytes"]] == {"0": 1000.0, "1": 2000.0}
    assert 1 <= merged[ray_metrics.PROMETHEUS_NAMES["step"]]["0"] <= 5


def test_run_spans_two_external_ray_nodes_with_postgres_and_metrics(pg_url, external_cluster, service):
    import psycopg

    nodes = _alive_nodes(external_cluster)
    assert len(nodes) == 2
    for node in nodes:  # what the compose health checks probe (dashboard agent of each node, GCS via the head)
        agent = node["raylet"]["dashboardAgentListenPort"]
        assert _http("GET", f"http://127.0.0.1:{agent}/api/local_raylet_healthz")[0] == 200
    assert _http("GET", f"{external_cluster.dashboard_url}/api/gcs_healthz")[0] == 200
    status, body = _http("GET", f"{service.url}/healthz")
    health = json.loads(body)
    assert status == 200 and health["db"] == "ok", body

    spec = {
        "name": "deploy-e2e",
        "model": {"name": "gpt", "preset": "tiny"},
        "layout": {"dp": 4},
        "batch": {"global_batch_size": 8, "micro_batch_size": 2},
        "train": {"steps": 20, "seed": 0},
        "optimizer": {"warmup_steps": 2},
        "resources": {"device": "cpu", "cpus_per_worker": 1},
    }
    run_id_box: list[str] = []
    poller = RayMetricsPoller(external_cluster.metrics_ports, run_id_box)
    poller.start()
    try:
        t_submit = time.monotonic()
        status, body = _http("POST", f"{service.url}/v1/runs", spec)
        assert status in (200, 201), body
        run = json.loads(body)
        run_id_box.append(run["id"])
        print(f"submitted {run['id']} in {time.monotonic() - t_submit:.1f}s")
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while run["status"] not in ("SUCCEEDED", "FAILED", "CANCELLED"):
            assert time.monotonic() < deadline, f"run still {run['status']} after {RUN_TIMEOUT_S}s: {run}\n" \
                                                f"{service.log.read_text()[-4000:]}"
            time.sleep(2.0)
            status, body = _http("GET", f"{service.url}/v1/runs/{run['id']}")
            assert status == 200, body
            run = json.loads(body)
        assert run["status"] == "SUCCEEDED", f"{run}\n{service.log.read_text()[-6000:]}"
        print(f"run {run['id']} SUCCEEDED {time.monotonic() - t_submit:.1f}s after submission "
              f"(started {run.get('started_at')}, finished {run.get('finished_at')}, created {run.get('created_at')})")

        # the Ray metrics agent exports on an interval: give it a little time after the run if needed
        step_name = ray_metrics.PROMETHEUS_NAMES["step"]
        final = float(spec["train"]["steps"])
        deadline = time.monotonic() + METRICS_EXPORT_GRACE_S
        while time.monotonic() < deadline and not any(
                poller.seen[p].get(step_name, {}).get("0") == final for p in external_cluster.metrics_ports):
            time.sleep(1.0)
    finally:
        poller.stop_event.set()
        poller.join(timeout=10)
    run_id = run["id"]

    # placement: 4 ranks over both nodes (2 CPUs each, 1 CPU per worker)
    assert run.get("rank_nodes"), run
    assert len(run["rank_nodes"]) == 4 and len(set(run["rank_nodes"].values())) == 2, run["rank_nodes"]
    assert set(run["rank_nodes"].values()) == {n["raylet"]["nodeId"] for n in nodes}

    # per-step metrics are in PostgreSQL
    with psycopg.connect(pg_url.replace("postgresql+psycopg://", "postgresql://", 1)) as conn:
        rows = conn.execute("SELECT step, loss, tokens_per_s FROM metrics WHERE run_id = %s ORDER BY step",
                            (run_id,)).fetchall()
        db_status = conn.execute("SELECT status FROM runs WHERE id = %s", (run_id,)).fetchone()[0]
    assert db_status == "SUCCEEDED"
    assert len({r[0] for r in rows}) == spec["train"]["steps"], rows
    assert all(r[1] is not None and r[1] > 0 for r in rows)
    assert rows[-1][1] < rows[0][1], "loss should fall over 20 steps of a tiny GPT"

    # the service's /metrics carries the run: by status and its latest training series
    status, text = _http("GET", f"{service.url}/metrics")
    assert status == 200
    samples = _prom_samples(text)
    by_status = {lab["status"]: v for name, lab, v in samples if name == "meshrun_runs"}
    assert by_status.get("SUCCEEDED", 0) >= 1 and by_status.get("QUEUED", 0) == 0
    series = {name: v for name, lab, v in samples if lab.get("run_id") == run_id}
    assert series.get("meshrun_run_step") == max(r[0] for r in rows), series
    assert series.get("meshrun_run_loss") == pytest.approx(rows[-1][1])
    assert series.get("meshrun_run_info") == 1.0
    assert any(name == "meshrun_http_requests_total" and lab.get("route") == "/v1/runs/{run_id}"
               for name, lab, _ in samples)

    # the Ray metrics export port of rank 0's node carried the workers' gauges, tagged with the run id (rank 0
    # publishes the aggregated row; peak memory once per rank)
    seen_anywhere = {name for port in external_cluster.metrics_ports for name in poller.seen[port]}
    assert seen_anywhere, f"no ray_meshrun_train_* series for {run_id} on ports {external_cluster.metrics_ports} " \
                          f"(scrape errors: {poller.errors[-3:]})"
    port_of_node = {n["raylet"]["nodeId"]: n["raylet"]["metricsExportPort"] for n in nodes}
    rank0_port = port_of_node[run["rank_nodes"]["0"]]
    assert rank0_port in external_cluster.metrics_ports
    seen = poller.seen[rank0_port]
    for name in ("loss", "tokens_per_s", "mfu", "step_time_s", "step"):
        assert ray_metrics.PROMETHEUS_NAMES[name] in seen, (name, sorted(seen))
    steps_seen = seen[ray_metrics.PROMETHEUS_NAMES["step"]]
    assert set(steps_seen) == {"0"} and 1 <= steps_seen["0"] <= spec["train"]["steps"], steps_seen
    assert set(seen[ray_metrics.PROMETHEUS_NAMES["peak_memory_bytes"]]) == {"0", "1", "2", "3"}

    # structured logs: the service wrote JSON lines, some of them about this run
    lines = [ln for ln in service.log.read_text().splitlines() if ln.startswith("{")]
    parsed = [json.loads(ln) for ln in lines]
    assert parsed and all({"ts", "level", "logger", "message"} <= set(p) for p in parsed)
    assert any(p.get("run_id") == run_id or run_id in p.get("message", "") for p in parsed)

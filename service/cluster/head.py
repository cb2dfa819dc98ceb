"""The Ray cluster meshrun runs on: a local head that the service starts and owns, or an existing cluster.

- Embedded (``settings.ray_address`` unset): ``ray start --head --block`` in its own process group, on a GCS
  port other than 6379 (Redis), with the dashboard (Jobs API) on ``settings.ray_dashboard_port``. ``stop()``
  terminates exactly that process group (never a machine-wide ``ray stop``).
- Existing (``settings.ray_address`` set, e.g. ``head:6380``): connect to it; the dashboard URL comes from
  ``settings.ray_dashboard_url`` or ``http://<head>:8265``.

Token auth (Ray 2.60 turns it on for new clusters when a token exists): an owned head gets its own token
(``<data_dir>/ray/auth_token``) and ``RAY_AUTH_MODE=token`` in its environment, and this process exports the same
variables so ``JobSubmissionClient`` and the GCS client authenticate. For an existing cluster the caller's
``RAY_AUTH_*`` variables (or ``~/.ray/auth_token``) apply.

One owner per head (``service.cluster.ownership``): the service holds a lock on its data directory's head and
records the head it started (pid, process group, ports, session) in ``<data_dir>/ray/head.json``. On start it adopts
a recorded head that still answers, or stops what is left of it, and starts a new one on the configured ports;
a configured port that another process holds is an error naming the setting. The embedded head listens on loopback
unless ``MESHRUN_RAY_MULTI_NODE`` is on.

Cluster state (nodes, total/free resources per node) is read by a child process (``service.cluster.gcs_view``):
Ray's GCS client, which aborts its process when the GCS is gone for a minute, never runs in the service process.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.cluster import ownership
from service.cluster.capacity import CORES_RESOURCE
from service.cluster.gcs_view import GcsView, gcs_port_answers
from service.cluster.ownership import STOP_GRACE_S, HeadLock, HeadOwnershipError, HeadRecord, kill_process_group
from service.meta import PROJECT_ROOT
from service.settings import Settings

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0
# Logical CPU slots of an owned head when MESHRUN_RAY_NUM_CPUS is unset: at least this many, so every example (the
# 3-D demo has 8 one-CPU workers) and a sweep trial's driver fit on a 2-core laptop. Ray CPUs are scheduling
# slots, not cores: tiny CPU workers share the cores (oversubscribed; each worker runs torch with 1 thread).
MIN_LOCAL_CPU_SLOTS = 10


def local_cpu_slots(requested: int | None) -> tuple[int, str]:
    """The owned head's CPU slots and the sentence the service logs about them."""
    cores = os.cpu_count() or 1
    if requested is not None:
        return requested, f"{requested} CPU slots on {cores} cores (MESHRUN_RAY_NUM_CPUS)"
    slots = max(cores, MIN_LOCAL_CPU_SLOTS)
    over = f", {slots / cores:.1f}x oversubscribed: small CPU workers share cores" if slots > cores else ""
    return slots, f"{slots} logical CPU slots on {cores} cores{over} (set MESHRUN_RAY_NUM_CPUS to change)"


PROBE_TIMEOUT_S = 1.0


@dataclass
class NodeView:
    """One alive (or dead) Ray node and its resources."""

    node_id: str
    alive: bool
    address: str | None
    total: dict[str, float] = field(default_factory=dict)
    free: dict[str, float] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    is_head: bool = False


def free_port(preferred: int | None = None, *, host: str = "127.0.0.1") -> int:
    """``preferred`` if nothing listens there (and it is not 6379), else a free ephemeral port."""
    if preferred and preferred != 6379 and _port_free(preferred, host=host):
        return preferred
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _port_free(port: int, *, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) != 0


def node_ip_address() -> str:
    """The address Ray binds its node services to on this machine (what the GCS advertises)."""
    from ray.util import get_node_ip_address

    return get_node_ip_address()


def ray_cli() -> list[str]:
    """The ``ray`` command of THIS interpreter's Ray (a venv may have no ``ray`` script beside python)."""
    return [sys.executable, "-m", "ray.scripts.scripts"]


def _set_auth_env(env: dict[str, str] | os._Environ, *, token_path: Path | None) -> None:
    if token_path is None:
        return
    env["RAY_AUTH_MODE"] = "token"
    env["RAY_AUTH_TOKEN_PATH"] = str(token_path)
    env.pop("RAY_AUTH_TOKEN", None)


def _refresh_ray_config() -> None:
    """Ray caches RAY_AUTH_MODE in its config; re-read it after changing the environment."""
    try:
        from ray._raylet import Config  # type: ignore[attr-defined]

        Config.initialize("")
    except Exception:  # pragma: no cover - older/newer ray
        pass
    try:
        from ray._private.authentication.authentication_token_setup import AuthenticationTokenLoader

        AuthenticationTokenLoader.instance().reset_cache()
    except Exception:  # pragma: no cover
        pass


def auth_headers() -> dict[str, str]:
    """HTTP headers for the dashboard when token auth is on (empty otherwise)."""
    try:
        from ray._private.authentication.http_token_authentication import get_auth_headers_if_auth_enabled

        return dict(get_auth_headers_if_auth_enabled({}))
    except Exception:  # pragma: no cover
        return {}


class RayCluster:
    """Start-or-connect, plus a read-only view of nodes and resources."""

    def __init__(
        self,
        *,
        address: str | None = None,
        dashboard_url: str | None = None,
        gcs_port: int = 6389,
        dashboard_port: int = 8265,
        metrics_export_port: int | None = None,
        num_cpus: int | None = None,
        num_gpus: int | None = None,
        data_dir: Path | str | None = None,
        auth: bool = True,
        node_labels: dict[str, str] | None = None,
        multi_node: bool = False,
    ):
        self._requested_address = address
        self._dashboard_url = dashboard_url
        self.gcs_port = gcs_port
        self.dashboard_port = dashboard_port
        self.metrics_export_port = metrics_export_port
        self.num_cpus = num_cpus
        self.num_gpus = num_gpus
        self.data_dir = Path(data_dir) if data_dir else Path.home() / ".meshrun"
        self.auth = auth
        self.node_labels = node_labels or {}
        self.multi_node = multi_node
        self.address: str | None = address
        self.proc: subprocess.Popen | None = None
        self.record: HeadRecord | None = None  # the owned head (started or adopted)
        self.adopted = False
        self.lost_head: HeadRecord | None = None  # a recorded head found dead at start (its runs were lost)
        self.token_path: Path | None = None
        self._gcs: GcsView | None = None
        self._lock = threading.Lock()
        self._head_lock: HeadLock | None = None
        self._log_file: Any = None
        self.temp_dir: Path | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> RayCluster:
        return cls(
            address=settings.ray_address,
            dashboard_url=settings.ray_dashboard_url,
            gcs_port=settings.ray_gcs_port,
            dashboard_port=settings.ray_dashboard_port,
            metrics_export_port=settings.ray_metrics_export_port,
            num_cpus=settings.ray_num_cpus,
            data_dir=settings.data_dir,
            multi_node=settings.ray_multi_node,
        )

    # --------------------------------------------------------------------------------------- lifecycle
    @property
    def owned(self) -> bool:
        return self.record is not None

    @property
    def ray_dir(self) -> Path:
        return self.data_dir / "ray"

    @property
    def dashboard_url(self) -> str | None:
        if self._dashboard_url:
            return self._dashboard_url.rstrip("/")
        if self.owned:
            return f"http://127.0.0.1:{self.dashboard_port}"
        if not self.address:
            return None
        host = self.address.split("://", 1)[-1].rsplit(":", 1)[0] or "127.0.0.1"
        return f"http://{host}:8265"

    def start(self) -> RayCluster:
        """Start the owned head (embedded mode) or check the existing cluster answers."""
        if self._requested_address:
            self.address = self._requested_address
            if self.address.startswith("ray://"):
                logger.warning(
                    "ray:// (Ray Client) addresses are not used for jobs; give the GCS address "
                    "host:port and MESHRUN_RAY_DASHBOARD_URL instead"
                )
            logger.info("using existing Ray cluster at %s (dashboard %s)", self.address, self.dashboard_url)
            return self
        self.ray_dir.mkdir(parents=True, exist_ok=True)
        self._head_lock = self._head_lock or HeadLock(self.ray_dir)
        self._head_lock.acquire()
        try:
            self._setup_auth()
            if self._adopt_or_clear():
                return self
            self._start_with_retry()
        except BaseException:
            self._head_lock.release()
            raise
        return self

    def restart(self) -> None:
        """Start the owned head again after it died (same configured ports); its old processes are stopped."""
        if self.record is None and self.proc is None:
            raise RuntimeError("restart() needs an owned head")
        self._close_gcs()
        if self.record is not None:
            ownership.stop_recorded(self.record)
        if self.proc is not None:
            kill_process_group(self.proc)
            self.proc = None
        ownership.clear_record(self.ray_dir)
        self.record = None
        self.adopted = False
        self._start_with_retry()

    def _start_with_retry(self) -> None:
        for attempt in (1, 2):
            try:
                self._start_head()
                break
            except (RuntimeError, TimeoutError) as e:
                if attempt == 2 or isinstance(e, HeadOwnershipError):
                    raise
                logger.warning("the Ray head failed to start (an overloaded machine?); trying once more", exc_info=True)

    def _adopt_or_clear(self) -> bool:
        """Adopt the head recorded by an earlier run of this service when it still answers (True); otherwise stop
        what is left of it and forget it (``lost_head`` names it when it had died)."""
        rec = ownership.load_record(self.ray_dir)
        if rec is None:
            return False
        alive = ownership.pid_alive(rec.pid) and ownership.is_ray_head(rec.pid)
        if alive:
            self.address, self.gcs_port, self.dashboard_port = rec.address, rec.gcs_port, rec.dashboard_port
            self.temp_dir = Path(rec.temp_dir)
            self.record, self.adopted = rec, True
            try:
                self.wait_ready(timeout_s=30.0)
            except (RuntimeError, TimeoutError) as e:
                logger.warning("the recorded Ray head (pid %s) does not answer (%s); stopping it", rec.pid, e)
                self.record, self.adopted = None, False
            else:
                logger.info(
                    "adopted the Ray head this service started before: pid %s, GCS %s, dashboard %s",
                    rec.pid,
                    rec.address,
                    self.dashboard_url,
                )
                return True
        else:
            self.lost_head = rec
            logger.warning("the Ray head this service started before (pid %s, GCS %s) is gone", rec.pid, rec.address)
        ownership.stop_recorded(rec)
        ownership.clear_record(self.ray_dir)
        return False

    def _setup_auth(self) -> None:
        if self.auth:
            self.token_path = self.ray_dir / "auth_token"
            if not self.token_path.exists():
                self.token_path.write_text(secrets.token_hex(32))
                self.token_path.chmod(0o600)
            _set_auth_env(os.environ, token_path=self.token_path)
        else:
            os.environ["RAY_AUTH_MODE"] = "disabled"
        _refresh_ray_config()

    def _start_head(self) -> None:
        ray_dir = self.ray_dir
        env = dict(os.environ)
        for k in ("MESHRUN_DATABASE_URL", "MESHRUN_METRICS_TOKEN"):  # Ray processes inherit the head's env
            env.pop(k, None)
        env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        # Project root on the path of every Ray process started by this head (drivers and Train workers).
        root = str(PROJECT_ROOT)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        ownership.check_port(self.gcs_port, setting="MESHRUN_RAY_GCS_PORT")
        ownership.check_port(self.dashboard_port, setting="MESHRUN_RAY_DASHBOARD_PORT")
        if self.metrics_export_port is not None:
            ownership.check_port(self.metrics_export_port, setting="MESHRUN_RAY_METRICS_EXPORT_PORT")
        metrics_port = self.metrics_export_port or free_port(None)
        ip = node_ip_address() if self.multi_node else "127.0.0.1"
        cmd = [
            *ray_cli(),
            "start",
            "--head",
            "--block",
            "--disable-usage-stats",
            f"--node-ip-address={ip}",
            f"--port={self.gcs_port}",
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={self.dashboard_port}",
            f"--metrics-export-port={metrics_port}",
            f"--ray-client-server-port={free_port(None)}",
            f"--dashboard-agent-listen-port={free_port(None)}",
            f"--dashboard-agent-grpc-port={free_port(None)}",
            f"--runtime-env-agent-port={free_port(None)}",
            f"--min-worker-port={20000 + (self.gcs_port % 200) * 100}",
            f"--max-worker-port={20000 + (self.gcs_port % 200) * 100 + 99}",
        ]
        # Own temp dir: Ray resolves "auto" addresses (the Job supervisor does, for each driver) through
        # <temp_dir>/ray_current_cluster, which the newest cluster on the machine overwrites when shared.
        self.temp_dir = ray_dir if len(str(ray_dir)) <= 40 else Path(f"/tmp/meshrun-ray-{self.gcs_port}")
        self.temp_dir.mkdir(parents=True, exist_ok=True)
        cmd.append(f"--temp-dir={self.temp_dir}")
        self.num_cpus, slots_note = local_cpu_slots(self.num_cpus)
        cmd.append(f"--num-cpus={self.num_cpus}")
        cores = os.cpu_count() or 1
        if self.num_cpus > cores:  # oversubscribed slots: the planner counts the cores, not the slots
            cmd.append("--resources=" + json.dumps({CORES_RESOURCE: cores}))
        logger.info("Ray head: %s", slots_note)
        if self.num_gpus is not None:
            cmd.append(f"--num-gpus={self.num_gpus}")
        if self.node_labels:
            cmd.append("--labels=" + ",".join(f"{k}={v}" for k, v in self.node_labels.items()))
        log_path = ray_dir / f"head-{self.gcs_port}.log"
        self._log_file = open(log_path, "ab")
        logger.info("starting Ray head: %s", " ".join(cmd))
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=str(ray_dir),
        )
        self.address = f"{ip}:{self.gcs_port}"
        self.record = HeadRecord(
            pid=self.proc.pid,
            pgid=self.proc.pid,
            gcs_port=self.gcs_port,
            dashboard_port=self.dashboard_port,
            metrics_port=metrics_port,
            address=self.address,
            temp_dir=str(self.temp_dir),
            session_dir=None,
            started_at=time.time(),
            service_pid=os.getpid(),
        )
        ownership.save_record(ray_dir, self.record)  # before it is ready: a crash meanwhile still finds it
        try:
            self.wait_ready(timeout_s=START_TIMEOUT_S)
        except BaseException:
            self._stop_head()
            raise
        self.record.session_dir = ownership.session_dir_of(self.temp_dir)
        ownership.save_record(ray_dir, self.record)
        logger.info("Ray head ready at %s, dashboard %s (pgid %s)", self.address, self.dashboard_url, self.proc.pid)

    def wait_ready(self, *, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until the dashboard's Jobs API answers (the head is then fully up)."""
        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(
                    f"ray start exited with {self.proc.returncode}; see {self.data_dir / 'ray'} for its log"
                )
            if self.adopted and self.record is not None and not ownership.pid_alive(self.record.pid):
                raise RuntimeError(f"the Ray head (pid {self.record.pid}) exited")
            try:
                req = urllib.request.Request(f"{self.dashboard_url}/api/jobs/", headers=auth_headers())
                with urllib.request.urlopen(req, timeout=3) as r:
                    ok = r.status == 200
                if ok and any(n.alive for n in self.nodes()):
                    return
            except Exception as e:
                last = e
            time.sleep(0.5)
        raise TimeoutError(f"Ray head at {self.address} not ready after {timeout_s:.0f}s: {last}")

    def stop(self, *, timeout_s: float = STOP_GRACE_S) -> None:
        """Stop the owned head (started or adopted): SIGTERM its leader, SIGKILL what is left of its process group
        and session after ``timeout_s``; forget its record and release the data directory. No-op for an existing
        cluster."""
        self._close_gcs()
        self._stop_head(timeout_s=timeout_s)
        if self._head_lock is not None:
            self._head_lock.release()

    def _stop_head(self, *, timeout_s: float = STOP_GRACE_S) -> None:
        proc, self.proc = self.proc, None
        rec, self.record = self.record, None
        self.adopted = False
        if proc is not None:
            kill_process_group(proc, timeout_s=timeout_s)
        if rec is not None:
            ownership.stop_recorded(rec, timeout_s=timeout_s)
            ownership.clear_record(self.ray_dir)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if proc is not None or rec is not None:
            logger.info("Ray head %s stopped", self.address)

    def _close_gcs(self) -> None:
        gcs, self._gcs = self._gcs, None
        if gcs is not None:
            gcs.close()

    # ------------------------------------------------------------------------------------------ health
    def probe(self, *, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
        """Why the cluster is not usable now, or None when it is: the owned head's process is alive, its GCS
        port accepts connections and its dashboard (the Jobs API) answers. Each check is bounded by ``timeout_s``
        (plain sockets and HTTP, no GCS client: a dead head makes it fail fast, never hang)."""
        if self.proc is not None and self.proc.poll() is not None:
            return f"the Ray head this service started (pid {self.proc.pid}) exited with code {self.proc.returncode}"
        if self.proc is None and self.record is not None and not ownership.pid_alive(self.record.pid):
            return f"the Ray head this service started (pid {self.record.pid}) exited"
        if not self.address:
            return "not connected to a Ray cluster"
        why = gcs_port_answers(self.address, timeout_s=timeout_s)
        if why is not None:
            return why
        if self.dashboard_url:
            try:
                req = urllib.request.Request(f"{self.dashboard_url}/api/version", headers=auth_headers())
                with urllib.request.urlopen(req, timeout=timeout_s) as r:
                    r.read()
            except Exception as e:
                return f"the Ray dashboard at {self.dashboard_url} does not answer: {e}"
        return None

    # ----------------------------------------------------------------------------------------- clients
    def head_dead(self) -> bool:
        """True when this service owns the head and its leader process is gone (restart it)."""
        if self.proc is not None:
            return self.proc.poll() is not None
        return self.record is not None and not ownership.pid_alive(self.record.pid)

    def nodes(self) -> list[NodeView]:
        """Every node the GCS knows, with total and free resources (free only for alive nodes); read by a child
        process (``GcsView``), bounded by a timeout. Raises ``ClusterUnavailable`` when the GCS cannot be read."""
        with self._lock:
            if self._gcs is None or self._gcs.address != self.address:
                if self._gcs is not None:
                    self._gcs.close()
                if not self.address:
                    raise ConnectionError("not connected to a Ray cluster")
                self._gcs = GcsView(self.address)
            gcs = self._gcs
        out = []
        for n in gcs.nodes():
            alive = bool(n["Alive"])
            total = dict(n["Resources"])
            out.append(
                NodeView(
                    node_id=n["NodeID"],
                    alive=alive,
                    address=n.get("NodeManagerAddress"),
                    total=total,
                    free=dict(n["Available"]) if alive else {},
                    labels=dict(n.get("Labels") or {}),
                    is_head="node:__internal_head__" in total,
                )
            )
        return out

    def free(self) -> dict[str, float]:
        tot: dict[str, float] = {}
        for n in self.nodes():
            if n.alive:
                for k, v in n.free.items():
                    tot[k] = tot.get(k, 0.0) + v
        return tot


def http_get_json(url: str, *, timeout_s: float = 5.0) -> Any:
    import json

    req = urllib.request.Request(url, headers=auth_headers())
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read().decode())


__all__ = ["NodeView", "RayCluster", "auth_headers", "free_port", "http_get_json", "kill_process_group"]

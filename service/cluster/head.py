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

Cluster state (nodes, total/free resources per node) is read through a GCS client without ``ray.init()``: the
service process does not become a Ray driver.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.meta import PROJECT_ROOT
from service.settings import Settings

if TYPE_CHECKING:
    from ray._private.state import GlobalState

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
        self.address: str | None = address
        self.proc: subprocess.Popen | None = None
        self.token_path: Path | None = None
        self._gcs_state: GlobalState | None = None
        self._lock = threading.Lock()
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
        )

    # --------------------------------------------------------------------------------------- lifecycle
    @property
    def owned(self) -> bool:
        return self.proc is not None

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
        for attempt in (1, 2):
            try:
                self._start_head()
                break
            except (RuntimeError, TimeoutError):
                if attempt == 2:
                    raise
                logger.warning("the Ray head failed to start (an overloaded machine?); trying once more", exc_info=True)
        return self

    def _start_head(self) -> None:
        ray_dir = self.data_dir / "ray"
        ray_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        if self.auth:
            self.token_path = ray_dir / "auth_token"
            if not self.token_path.exists():
                self.token_path.write_text(secrets.token_hex(32))
                self.token_path.chmod(0o600)
            _set_auth_env(env, token_path=self.token_path)
            _set_auth_env(os.environ, token_path=self.token_path)
            _refresh_ray_config()
        else:
            env["RAY_AUTH_MODE"] = "disabled"
            os.environ["RAY_AUTH_MODE"] = "disabled"
            _refresh_ray_config()
        env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        # Project root on the path of every Ray process started by this head (drivers and Train workers).
        root = str(PROJECT_ROOT)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.gcs_port = free_port(self.gcs_port)
        self.dashboard_port = free_port(self.dashboard_port)
        metrics_port = free_port(self.metrics_export_port)
        cmd = [
            *ray_cli(),
            "start",
            "--head",
            "--block",
            "--disable-usage-stats",
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
        self.address = f"{node_ip_address()}:{self.gcs_port}"
        try:
            self.wait_ready(timeout_s=START_TIMEOUT_S)
        except BaseException:
            self.stop()
            raise
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

    def stop(self, *, timeout_s: float = 15.0) -> None:
        """Stop the owned head: SIGTERM its process group, SIGKILL what is left. No-op when not owned."""
        proc, self.proc = self.proc, None
        self._gcs_state = None
        if proc is None:
            return
        kill_process_group(proc, timeout_s=timeout_s)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        logger.info("Ray head %s stopped", self.address)

    # ------------------------------------------------------------------------------------------ health
    def probe(self, *, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
        """Why the cluster is not usable now, or None when it is: the owned head's process is alive, its GCS
        port accepts connections and its dashboard (the Jobs API) answers. Each check is bounded by ``timeout_s``
        (plain sockets and HTTP, no GCS client: a dead head makes it fail fast, never hang)."""
        if self.proc is not None and self.proc.poll() is not None:
            return f"the Ray head this service started (pid {self.proc.pid}) exited with code {self.proc.returncode}"
        if not self.address:
            return "not connected to a Ray cluster"
        host, _, port = self.address.split("://", 1)[-1].rpartition(":")
        try:
            socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s).close()
        except (OSError, ValueError) as e:
            return f"the Ray GCS at {self.address} does not answer: {e}"
        if self.dashboard_url:
            try:
                req = urllib.request.Request(f"{self.dashboard_url}/api/version", headers=auth_headers())
                with urllib.request.urlopen(req, timeout=timeout_s) as r:
                    r.read()
            except Exception as e:
                return f"the Ray dashboard at {self.dashboard_url} does not answer: {e}"
        return None

    # ----------------------------------------------------------------------------------------- clients
    def _state(self) -> GlobalState:
        with self._lock:
            if self._gcs_state is None:
                from ray._private.state import GlobalState
                from ray._raylet import GcsClientOptions  # type: ignore[attr-defined]  # a Cython class

                gs = GlobalState()
                gs._initialize_global_state(
                    GcsClientOptions.create(
                        self.address, None, allow_cluster_id_nil=True, fetch_cluster_id_if_nil=False
                    )
                )
                self._gcs_state = gs
            return self._gcs_state

    def nodes(self) -> list[NodeView]:
        """Every node the GCS knows, with total and free resources (free only for alive nodes)."""
        st = self._state()
        try:
            table = st.node_table()
            free = st.available_resources_per_node()
        except Exception:
            self._gcs_state = None
            raise
        out = []
        for n in table:
            nid = n.get("NodeID")
            alive = bool(n.get("Alive", n.get("alive", False)))
            total = {k: float(v) for k, v in (n.get("Resources") or {}).items()}
            out.append(
                NodeView(
                    node_id=nid,
                    alive=alive,
                    address=n.get("NodeManagerAddress"),
                    total=total,
                    free={k: float(v) for k, v in free.get(nid, {}).items()} if alive else {},
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


def kill_process_group(proc: subprocess.Popen, *, timeout_s: float = 15.0) -> None:
    """Stop the process tree led by ``proc`` (started with start_new_session): SIGTERM the leader (``ray start
    --block`` then stops its children), wait, then SIGKILL what is left of its process group and of its
    descendants (Ray workers run in process groups of their own)."""
    try:
        import psutil
        import ray  # noqa: F401 - ray vendors psutil (ray/thirdparty_files)

        descendants = psutil.Process(proc.pid).children(recursive=True)
    except Exception:
        descendants = []
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        pgid = proc.pid
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        logger.warning("process %s did not stop within %.0fs; killing its group", proc.pid, timeout_s)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and (_group_alive(pgid) or any(_running(p) for p in descendants)):
        time.sleep(0.2)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for p in descendants:
        if _running(p):
            try:
                p.kill()
            except Exception:
                pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # pragma: no cover
        pass


def _running(p) -> bool:
    try:
        return p.is_running() and p.status() != "zombie"
    except Exception:
        return False


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover
        return True


def http_get_json(url: str, *, timeout_s: float = 5.0) -> Any:
    import json

    req = urllib.request.Request(url, headers=auth_headers())
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read().decode())


__all__ = ["NodeView", "RayCluster", "auth_headers", "free_port", "http_get_json", "kill_process_group"]

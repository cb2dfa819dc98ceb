"""Which ``meshrun serve`` serves a data directory: ``<data_dir>/service.json``, written once the service has
started and removed when it stops.

``meshrun doctor`` and ``meshrun demo`` read it (``find_running``): a port that the data directory's own
service holds is that service, not "another program", and ``demo`` reuses the service instead of starting a
second one. The record is only a hint: ``find_running`` believes it when the recorded process is alive and the
recorded URL answers ``/healthz`` as a meshrun service.
"""

from __future__ import annotations

import json
import logging
import os
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from service.cluster.ownership import pid_alive
from service.meta import VERSION

logger = logging.getLogger(__name__)

RECORD_NAME = "service.json"
PROBE_TIMEOUT_S = 2.0


@dataclass
class ServiceRecord:
    pid: int
    url: str
    host: str
    port: int
    data_dir: str
    ray_address: str | None  # the Ray GCS the service uses (its own head, or an existing cluster)
    ray_dashboard_url: str | None
    ray_owned: bool  # the service started (owns) that head
    ray_gcs_port: int | None  # the owned head's ports (None for an existing cluster)
    ray_dashboard_port: int | None
    version: str
    started_at: float


@dataclass(frozen=True)
class RunningService:
    """A recorded service that answers: ``health`` is its /healthz body (``status`` "ok" or "degraded")."""

    record: ServiceRecord
    health: dict[str, Any]

    @property
    def healthy(self) -> bool:
        return self.health.get("status") == "ok"

    @property
    def ports(self) -> set[int]:
        held = {self.record.port}
        if self.record.ray_owned:
            held |= {p for p in (self.record.ray_gcs_port, self.record.ray_dashboard_port) if p}
        return held


def record_path(data_dir: Path) -> Path:
    return Path(data_dir) / RECORD_NAME


def write(data_dir: Path, *, url: str, host: str, port: int, runtime: Any) -> ServiceRecord:
    """Record this process as the service of ``data_dir`` (``runtime``: its ``Runtime``, or None)."""
    cluster: Any = getattr(runtime, "ray_cluster", None)
    owned = bool(cluster is not None and cluster.owned)
    rec = ServiceRecord(
        pid=os.getpid(),
        url=url,
        host=host,
        port=port,
        data_dir=str(data_dir),
        ray_address=getattr(cluster, "address", None),
        ray_dashboard_url=getattr(cluster, "dashboard_url", None),
        ray_owned=owned,
        ray_gcs_port=cluster.gcs_port if owned else None,
        ray_dashboard_port=cluster.dashboard_port if owned else None,
        version=VERSION,
        started_at=time.time(),
    )
    path = record_path(data_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{RECORD_NAME}.{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(asdict(rec), f)
    os.replace(tmp, path)
    return rec


def clear(data_dir: Path) -> None:
    """Remove the record if it is this process's (a later service on the same data directory keeps its own)."""
    rec = load(data_dir)
    if rec is not None and rec.pid == os.getpid():
        try:
            record_path(data_dir).unlink()
        except FileNotFoundError:
            pass


def load(data_dir: Path) -> ServiceRecord | None:
    try:
        return ServiceRecord(**json.loads(record_path(data_dir).read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as e:
        logger.warning("ignoring unreadable service record %s: %s", record_path(data_dir), e)
        return None


def meshrun_at(url: str) -> bool:
    """Whether a meshrun service answers /healthz at ``url``."""
    return _healthz(url) is not None


def _healthz(url: str) -> dict[str, Any] | None:
    """The /healthz body of a meshrun service at ``url`` (200 or 503), or None when nothing meshrun answers."""
    try:
        with urllib.request.urlopen(f"{url}/healthz", timeout=PROBE_TIMEOUT_S) as r:
            body = json.loads(r.read().decode())
    except urllib.error.HTTPError as e:  # 503: degraded, still a meshrun service
        try:
            body = json.loads(e.read().decode())
        except ValueError:
            return None
    except (OSError, ValueError):
        return None
    if not isinstance(body, dict) or "status" not in body or "version" not in body:
        return None
    return body


def find_running(data_dir: Path) -> RunningService | None:
    """The service recorded for ``data_dir`` when its process lives and its URL answers as meshrun."""
    rec = load(data_dir)
    if rec is None or rec.pid == os.getpid() or not pid_alive(rec.pid):
        return None
    health = _healthz(rec.url)
    return RunningService(rec, health) if health is not None else None

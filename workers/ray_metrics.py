"""Training metrics published through Ray's metrics API, tagged by run, so they reach Prometheus and the Ray
dashboard's Grafana panels.

A Ray Train worker creates one ``RunMetricsPublisher(run_id, run_name, rank)`` and calls ``publish(row)`` with
each per-step metrics row (the same dict that goes to the run database: in ``workers.loop`` global rank 0's
sink gets one aggregated row per step). Each field becomes a ``ray.util.metrics.Gauge`` point tagged
``run_id``/``run_name``/``rank``; Ray's metrics agent on the node exports it on the node's metrics export port
as ``ray_<gauge name>`` (e.g. ``ray_meshrun_train_loss``). A row with ``peak_memory_bytes_per_rank`` (a list
indexed by rank) publishes the peak-memory gauge once per rank, tagged with that rank.

Guarantees:
- importing this module is cheap (no ray, no torch; only the spec): ray is only touched inside ``publish``, and
  only if the process already imported it (under ``torchrun`` without Ray publishing is a silent no-op);
- ``publish`` never raises into the training loop: the first failure is logged once and the publisher turns
  itself off.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
from collections.abc import Mapping
from typing import Any

from api.spec.metrics import GAUGES as METRIC_GAUGES
from api.spec.metrics import METRIC_ROW_FIELDS, PEAK_MEMORY_PER_RANK

logger = logging.getLogger(__name__)

TAG_KEYS: tuple[str, ...] = ("run_id", "run_name", "rank")

# Metrics-row field -> (gauge name as created in Ray, description): every field of the metric row with a gauge
# name (api.spec.metrics, the one definition of a metric row). Prometheus sees "ray_" + the gauge name.
GAUGE_PREFIX = "meshrun_train_"
GAUGES: dict[str, tuple[str, str]] = {
    field: (GAUGE_PREFIX + gauge, METRIC_ROW_FIELDS[field].description) for field, gauge in METRIC_GAUGES.items()
}

# Prometheus-side names (what Grafana queries), for dashboards and tests.
RAY_PROMETHEUS_PREFIX = "ray_"
PROMETHEUS_NAMES: dict[str, str] = {field: RAY_PROMETHEUS_PREFIX + name for field, (name, _) in GAUGES.items()}

_gauges_lock = threading.Lock()
_gauges: dict[str, Any] | None = None  # field -> ray.util.metrics.Gauge, created once per process


def _ray_ready() -> bool:
    """True when this process already runs inside Ray (never imports ray itself)."""
    ray = sys.modules.get("ray")
    if ray is None:
        return False
    is_initialized = getattr(ray, "is_initialized", None)
    return bool(is_initialized and is_initialized())


def _get_gauges() -> dict[str, Any]:
    global _gauges
    with _gauges_lock:
        if _gauges is None:
            from ray.util.metrics import Gauge  # only reached inside a Ray process

            _gauges = {
                field: Gauge(name, description=desc, tag_keys=TAG_KEYS) for field, (name, desc) in GAUGES.items()
            }
        return _gauges


def _as_float(value: Any) -> float | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        out = float(value)  # also accepts 0-d tensors and numpy scalars
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


class RunMetricsPublisher:
    """Publishes one worker's per-step metrics as Ray gauges tagged by run id, run name and rank."""

    def __init__(self, run_id: str, run_name: str, rank: int, *, enabled: bool = True) -> None:
        self.tags = {"run_id": str(run_id), "run_name": str(run_name), "rank": str(rank)}
        self._enabled = enabled
        self._warned = False
        self.published = 0  # rows published (for tests and debugging)

    @property
    def enabled(self) -> bool:
        return self._enabled

    def publish(self, row: Mapping[str, Any]) -> None:
        """Set every known field of ``row`` that has a finite value. Never raises."""
        if not self._enabled:
            return
        try:
            if not _ray_ready():
                self._disable(
                    "ray is not initialised in this process; training metrics go to the database only",
                    level=logging.DEBUG,
                )
                return
            gauges = _get_gauges()
            per_rank = row.get(PEAK_MEMORY_PER_RANK)
            per_rank = per_rank if isinstance(per_rank, (list, tuple)) else None
            for field, gauge in gauges.items():
                if field == "peak_memory_bytes" and per_rank is not None:
                    for rank, v in enumerate(per_rank):
                        value = _as_float(v)
                        if value is not None:
                            gauge.set(value, tags={**self.tags, "rank": str(rank)})
                    continue
                value = _as_float(row.get(field))
                if value is not None:
                    gauge.set(value, tags=self.tags)
            self.published += 1
        except Exception as exc:
            self._disable(
                f"publishing Ray metrics failed ({type(exc).__name__}: {exc}); "
                "further training metrics of this worker are not exported to Prometheus"
            )

    def _disable(self, message: str, *, level: int = logging.WARNING) -> None:
        self._enabled = False
        if not self._warned:
            self._warned = True
            logger.log(level, "run %s rank %s: %s", self.tags["run_id"], self.tags["rank"], message)

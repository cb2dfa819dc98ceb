"""The parts the trackers' hub (``service.runs.tracking``) and its sinks (``service.runs.tracking_sinks``) share:
an item of the queue, the sink interface, where local tracker files live and how a metric row is flattened."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def tracking_dir(data_dir: str | Path, run_id: str) -> Path:
    """Where a run's local tracker files live: ``<data_dir>/tracking/<run id>``."""
    return Path(data_dir) / "tracking" / run_id


def tensorboard_dir(data_dir: str | Path, run_id: str) -> Path:
    """The run's TensorBoard event files (``tensorboard --logdir`` this, or its parent for every run)."""
    return tracking_dir(data_dir, run_id) / "tensorboard"


def flatten(obj: Any, prefix: str = "", sep: str = ".") -> dict[str, Any]:
    """A nested mapping as ``{"a.b.c": value}`` (lists kept as JSON text; None left out)."""
    out: dict[str, Any] = {}
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}{sep}{k}" if prefix else str(k), sep))
    elif obj is not None:
        out[prefix] = json.dumps(obj) if isinstance(obj, list | tuple) else obj
    return out


def numeric_metrics(row: Mapping[str, Any]) -> dict[str, float]:
    """A metric row's scalar measurements, nested ones (the time breakdown) as ``breakdown/compute``; per-rank
    lists, the step and the time are left out."""
    out: dict[str, float] = {}
    for k, v in flatten({k: v for k, v in row.items() if k not in ("step", "time", "attempt")}, sep="/").items():
        if isinstance(v, bool) or not isinstance(v, int | float):
            continue
        if v != v or v in (float("inf"), float("-inf")):
            continue
        out[k] = float(v)
    return out


@dataclass
class Item:
    kind: str  # start | metrics | event | checkpoint | finish
    data: dict[str, Any]


class Sink:
    """One tracker. ``handle`` raises on a failure worth retrying (the tracker unreachable); ``Rejected`` for an
    item the tracker refuses (it is dropped, not retried)."""

    name = "?"

    def handle(self, item: Item) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Release what ``handle`` opened (called once, from the sink's thread)."""


class Rejected(Exception):
    """The tracker refused this item (bad value): drop it and go on."""

"""The one definition of a metric row: its fields, units and meaning.

``MetricRow`` is one training step of one attempt as global rank 0 of the worker group measured it. Everything
else derives from its fields, so a new field is declared here once:

- the workers build the row (``workers.loop``: a dict with these keys, plus ``PEAK_MEMORY_PER_RANK``, which the run
  driver folds into the run's summary and does not store per step) and publish it as Ray gauges
  (``workers.ray_metrics``: one gauge per field with a ``gauge`` name);
- the store keeps one column per field (``service.store.models.Metric``; ``service.store.METRIC_FIELDS`` is
  ``MEASUREMENTS``); unknown keys of a worker row go to the row's ``extra`` JSON;
- the API serves ``MetricRow``/``MetricList``; the SDK's ``metrics_df`` has one column per field;
- the service's Prometheus exporter (``service.app.observability``) exports the latest value of every field with
  a ``gauge`` name as ``meshrun_run_<gauge>``.

Each field's metadata (``json_schema_extra``, also in the OpenAPI schema) carries its ``unit`` and, for the
exported ones, its Prometheus ``gauge`` name (the unit spelled out, Prometheus style: ``_seconds``, ``_bytes``).

Fields whose metadata says ``column: false`` (structured values: per-rank lists, the breakdown) are kept in
the row's ``extra`` JSON rather than in a column of their own.

Workers (``workers.reporting``) send one row per optimizer step; the ranks combine their measurements once per
report interval (``spec.metrics``), so rows arrive in batches of one or more steps.

The measured step-time breakdown (``MeasuredStepTime``) uses the SAME term names as the planner's prediction
(``api.spec.plan.StepTimeBreakdown``: ``total``, ``compute``, ``tp_comm``, ``pp_comm``, ``pp_bubble``,
``dp_comm``) plus the ``*_exposed`` part of each communication term and the terms the planner does not model
(``optimizer``, ``data_wait``, ``other``). Per rank, the terms add up to the rank's step time::

    total = compute + tp_comm_exposed + pp_comm_exposed + pp_bubble + dp_comm_exposed
            + optimizer + data_wait + other
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, get_args

from pydantic import Field

from api.spec._base import _Public

# order of the measured terms (workers send per-rank breakdowns as columns in this order)
BREAKDOWN_TERMS: tuple[str, ...] = (
    "total",
    "compute",
    "tp_comm",
    "tp_comm_exposed",
    "pp_comm",
    "pp_comm_exposed",
    "pp_bubble",
    "dp_comm",
    "dp_comm_exposed",
    "optimizer",
    "data_wait",
    "other",
)
# the terms that add up to ``total``
BREAKDOWN_PARTS: tuple[str, ...] = (
    "compute",
    "tp_comm_exposed",
    "pp_comm_exposed",
    "pp_bubble",
    "dp_comm_exposed",
    "optimizer",
    "data_wait",
    "other",
)


class MeasuredStepTime(_Public):
    """Seconds of one optimizer step on one rank (or the mean over ranks), measured.

    Communication is classified by the process group it runs on (tensor-, pipeline- or data-parallel ranks).
    ``*_comm`` is the time that kind of communication was in flight (issue to completion, intervals merged);
    ``*_comm_exposed`` the part of it this rank's training thread was blocked on (not overlapped with compute).
    """

    total: float = Field(0.0, description="Step time: the full loop period of this rank.")
    compute: float = Field(0.0, description="Forward, backward and recompute, minus the waits below.")
    tp_comm: float = Field(0.0, description="Tensor-parallel collectives in flight (DTensor functional collectives).")
    tp_comm_exposed: float = Field(0.0, description="Part of tp_comm the rank waited for.")
    pp_comm: float = Field(
        0.0, description="Pipeline send/recv transfer time (bytes over the link speed measured at start-up)."
    )
    pp_comm_exposed: float = Field(0.0, description="Part of pp_comm the rank waited for.")
    pp_bubble: float = Field(
        0.0,
        description="Waiting for a pipeline neighbour: recv waits beyond the transfer time, and the stage "
        "imbalance absorbed by the pipeline-group gradient-norm reduction.",
    )
    dp_comm: float = Field(0.0, description="Data-parallel all-reduce / reduce-scatter / all-gather in flight.")
    dp_comm_exposed: float = Field(0.0, description="Part of dp_comm the rank waited for.")
    optimizer: float = Field(0.0, description="Gradient clipping, optimizer and LR-scheduler step, minus waits.")
    data_wait: float = Field(0.0, description="Fetching the batch and moving it to the device.")
    other: float = Field(
        0.0, description="The rest of the loop period: reporting, logging, checkpoints, profiler, injected hangs."
    )


# A worker-row key that is not a column: the peak memory of every rank (a list indexed by rank). The run driver
# keeps the maximum per rank for the run's summary (``RunSummary.peak_memory_bytes_per_rank``).
PEAK_MEMORY_PER_RANK = "peak_memory_bytes_per_rank"
# A worker-row key that is not a column: a text the run driver turns into a run event (``kind: sync_alert``): an
# async_ps worker held back by ``max_staleness``, local SGD / DiLoCo replicas diverging more at every sync.
SYNC_ALERT = "sync_alert"


def _field(description: str, *, unit: str, gauge: str | None = None, column: bool = True) -> Any:
    extra: dict[str, Any] = {"unit": unit}
    if gauge is not None:
        extra["gauge"] = gauge
    if not column:
        extra["column"] = False
    return Field(None, description=description, json_schema_extra=extra)


class MetricRow(_Public):
    """One training step of one attempt (global rank 0's aggregate over the worker group)."""

    step: int = Field(
        description="Training step, 1-based (a resumed run continues the numbering).",
        json_schema_extra={"unit": "step", "gauge": "step"},
    )
    attempt: int = Field(
        1,
        description="Attempt (worker-group start) that measured the step; a restart replays steps in a new attempt.",
        json_schema_extra={"unit": "attempt"},
    )
    loss: float | None = _field("Training loss: mean over the global batch.", unit="1", gauge="loss")
    tokens_per_s: float | None = _field(
        "Throughput of the whole run: tokens of the global batch / step time.",
        unit="tokens/s",
        gauge="tokens_per_second",
    )
    step_time_s: float | None = _field(
        "Full loop period of rank 0 for this step (end of the previous step to the end of this one; on GPUs from "
        "CUDA events): the step times of a run add up to the wall time of its loop.",
        unit="s",
        gauge="step_time_seconds",
    )
    mfu: float | None = _field(
        "Model FLOPs utilisation: model FLOPs per second / peak FLOPs of all workers (0..1).", unit="ratio", gauge="mfu"
    )
    peak_memory_bytes: int | None = _field(
        "Max over ranks of the peak memory since the previous report (GPU: allocated by tensors; CPU: resident "
        "set size of the process, torch runtime included).",
        unit="bytes",
        gauge="peak_memory_bytes",
    )
    comm_fraction: float | None = _field(
        "Share of the step the ranks waited for communication (tp + pp + dp exposed, bubble excluded; mean over "
        "ranks); only on steps with a breakdown (0..1).",
        unit="ratio",
        gauge="comm_fraction",
    )
    grad_norm: float | None = _field("Global gradient norm before clipping.", unit="1", gauge="grad_norm")
    lr: float | None = _field("Learning rate of the step.", unit="1", gauge="learning_rate")
    time: datetime | None = Field(
        None,
        description="When the step ended (the workers send unix seconds; the API answers UTC).",
        json_schema_extra={"unit": "timestamp"},
    )
    cross_group_bytes: int | None = _field(
        "Bytes rank 0 sent over the link between data-parallel groups in this step (payload: DDP gradient "
        "buckets, a local SGD / DiLoCo averaging, parameter-server pushes and pulls; 0 on local steps).",
        unit="bytes",
        column=False,
    )
    replica_divergence: float | None = _field(
        "local_sgd / diloco, on averaging steps: ||replica - mean of replicas|| / ||mean|| before the sync, over "
        "all replicas (a growing value means H is too large or the learning rate too high).",
        unit="ratio",
        column=False,
    )
    staleness_mean: float | None = _field(
        "async_ps: mean over the workers' gradients applied in this update of their staleness (parameter "
        "updates between the pull they were computed on and this update).",
        unit="updates",
        column=False,
    )
    staleness_max: int | None = _field(
        "async_ps: the largest staleness among the gradients of this update (never above layout.max_staleness).",
        unit="updates",
        column=False,
    )
    workers_in_update: int | None = _field(
        "async_ps: workers whose gradients this update averaged (fewer than dp while a lost worker rejoins).",
        unit="workers",
        column=False,
    )
    replicas: int | None = _field(
        "fault_tolerance replica: replicas in this step's quorum (fewer than dp while a lost replica restarts).",
        unit="replicas",
        column=False,
    )
    replica_mask: int | None = _field(
        "fault_tolerance replica: the replicas that trained this step, bit i for replica i.",
        unit="bitmask",
        column=False,
    )
    samples: int | None = _field(
        "fault_tolerance replica: sequences this step trained on (the global batch, or less with batch: shrink).",
        unit="sequences",
        column=False,
    )
    recovery_s: float | None = _field(
        "fault_tolerance replica: on the first step after a replica was lost, the live replicas' failed tries "
        "until the new quorum (failure detection).",
        unit="s",
        column=False,
    )
    rejoin_s: float | None = _field(
        "fault_tolerance replica: on the first step after a replacement joined, the wait while it healed from a "
        "live peer.",
        unit="s",
        column=False,
    )
    peak_memory_bytes_per_rank: list[int] | None = _field(
        "peak_memory_bytes per rank (index = rank).", unit="bytes", column=False
    )
    peak_memory_reserved_bytes_per_rank: list[int] | None = _field(
        "GPU only: peak memory reserved by the caching allocator per rank since the previous report.",
        unit="bytes",
        column=False,
    )
    breakdown: MeasuredStepTime | None = _field(
        "Measured step-time breakdown, mean over ranks (steps selected by metrics.breakdown_every_steps).",
        unit="s",
        column=False,
    )
    breakdown_per_rank: dict[str, list[float]] | None = _field(
        "The breakdown per rank: term -> [seconds of rank 0, rank 1, ...] (terms as in breakdown).",
        unit="s",
        column=False,
    )


class MetricList(_Public):
    run_id: str
    items: list[MetricRow]
    next_cursor: str | None = Field(None, description="Pass as ``cursor`` for the next page; null on the last.")
    downsampled: bool = Field(False, description="True when ``items`` is a downsampled series (``points``).")
    series_rows: int | None = Field(None, description="Rows in the run's whole series (downsampled answers).")


@dataclass(frozen=True)
class MetricField:
    """One field of ``MetricRow``: its name, unit, meaning and (when exported) Prometheus gauge name."""

    name: str
    unit: str
    description: str
    gauge: str | None
    integer: bool  # an int (a count of bytes, a step), not a float
    column: bool  # stored in a column of its own (else in the row's ``extra`` JSON)


def _fields() -> dict[str, MetricField]:
    out = {}
    for name, info in MetricRow.model_fields.items():
        extra = info.json_schema_extra
        assert isinstance(extra, dict), f"MetricRow.{name} needs json_schema_extra with its unit"
        gauge = extra.get("gauge")
        out[name] = MetricField(
            name=name,
            unit=str(extra["unit"]),
            description=info.description or "",
            gauge=str(gauge) if gauge is not None else None,
            integer=int in (info.annotation, *get_args(info.annotation)),
            column=bool(extra.get("column", True)),
        )
    return out


METRIC_ROW_FIELDS: dict[str, MetricField] = _fields()
"""Every field of ``MetricRow`` in declaration order."""

KEY_FIELDS: tuple[str, ...] = ("step", "attempt")
"""A row is identified by (run, attempt, step)."""

MEASUREMENTS: tuple[str, ...] = tuple(
    n for n, f in METRIC_ROW_FIELDS.items() if n not in (*KEY_FIELDS, "time") and f.column
)
"""The measured scalar values of a step (one nullable column each in the store)."""

GAUGES: dict[str, str] = {n: f.gauge for n, f in METRIC_ROW_FIELDS.items() if f.gauge is not None}
"""Field -> Prometheus gauge name (without the ``meshrun_run_`` / ``meshrun_train_`` prefix)."""

UNITS: dict[str, str] = {n: f.unit for n, f in METRIC_ROW_FIELDS.items()}

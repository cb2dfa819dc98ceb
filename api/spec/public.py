"""What the API returns about runs, events, checkpoints, logs and the cluster (response models)."""

from __future__ import annotations

from datetime import datetime
from enum import Enum

from pydantic import Field

from api.spec._base import _Public
from api.spec.plan import Plan, PriceSource
from api.spec.run import RunSpec


class RunStatus(str, Enum):
    QUEUED = "QUEUED"
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    PREEMPTED = "PREEMPTED"  # transient: checkpointed after a preemption notice, on its way back to the queue

    @property
    def terminal(self) -> bool:
        return self in (RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED)


TERMINAL_STATUSES = frozenset({RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED})


class RunSummary(_Public):
    steps_done: int = 0
    final_loss: float | None = None
    mean_tokens_per_s: float | None = None
    mean_mfu: float | None = None
    peak_memory_bytes: int | None = Field(None, description="Max over ranks and steps.")
    peak_memory_bytes_per_rank: dict[str, int] = Field(default_factory=dict)
    wall_time_s: float | None = None


class RunCost(_Public):
    """What a run has cost so far: its devices (the plan's world size) x the wall time of its attempts (each from
    its start to its end, or to now while it runs), and in US dollars where a price is known (``price_source``:
    the spec's ``cluster.price_per_device_hour`` (``request``), else the price resolved when it was submitted
    (``settings`` or ``default``), else ``none`` and ``usd`` null)."""

    devices: int
    attempts_wall_s: float = 0.0
    device_hours: float = 0.0
    price_per_device_hour: float | None = None
    price_source: PriceSource = "none"
    usd: float | None = None


class RunPublic(_Public):
    id: str
    name: str
    project: str
    status: RunStatus
    status_reason: str | None = None
    priority: int = 0
    spec: RunSpec
    plan: Plan | None = None
    attempts: int = 0
    sweep_id: str | None = None
    ray_job_id: str | None = None
    dashboard_url: str | None = None
    rank_nodes: dict[str, str] | None = Field(None, description="world rank -> Ray node id")
    summary: RunSummary | None = None
    cost: RunCost | None = Field(None, description="Device-hours (and US dollars) its attempts took; single reads.")
    tracking: dict[str, str] | None = Field(
        None,
        description="Where the run's experiment trackers log: tensorboard (its event file directory), mlflow (server "
        "and experiment; the MLflow run has the tag meshrun.run_id), wandb (project and run id).",
    )
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None


NEXT_CURSOR_DOC = "Pass as ``cursor`` to get the next page; null on the last page."
TOTAL_DOC = "Matching items, counted up to 1,000 (``total_exact`` false beyond: there are more)."


class RunList(_Public):
    items: list[RunPublic]
    total: int | None = Field(None, description=TOTAL_DOC)
    total_exact: bool = True
    limit: int
    offset: int = 0
    next_cursor: str | None = Field(None, description=NEXT_CURSOR_DOC)


class EventPublic(_Public):
    id: int
    run_id: str
    time: datetime
    kind: str = "state"
    from_status: str | None = None
    to_status: str | None = None
    reason: str | None = None
    actor: str | None = None


class EventList(_Public):
    run_id: str
    items: list[EventPublic]
    next_cursor: str | None = Field(None, description=NEXT_CURSOR_DOC)


class CheckpointPublic(_Public):
    run_id: str
    attempt: int
    step: int
    path: str
    size_bytes: int | None = None
    created_at: datetime


class CheckpointList(_Public):
    run_id: str
    items: list[CheckpointPublic]
    next_cursor: str | None = Field(None, description=NEXT_CURSOR_DOC)


class GoodputAttemptLost(_Public):
    """Seconds lost by or before one attempt, per cause."""

    startup: float = Field(0.0, description="First STARTING to the first step (job, workers, model, data).")
    failure_detection: float = Field(0.0, description="Last finished step of a failed attempt to its error.")
    restart: float = Field(0.0, description="Error or preemption back to the next first step, queue excluded.")
    recomputed_steps: float = Field(0.0, description="Step time of steps done again after a restart.")
    checkpoint_stall: float = Field(
        0.0, description="Periodic saves holding the loop (end of a checkpoint's step to the next step's start)."
    )


class GoodputLost(GoodputAttemptLost):
    """Seconds of the wall time lost, per cause: the attempts' causes and the run's own."""

    queue: float = Field(0.0, description="QUEUED: at submission and after a preemption.")
    other: float = Field(0.0, description="The rest: reports, the driver's start and end.")


class GoodputAttempt(_Public):
    attempt: int
    productive_s: float = Field(0.0, description="Its step time that counts (steps not redone later).")
    lost_s: GoodputAttemptLost = Field(default_factory=GoodputAttemptLost)


class GoodputReplica(_Public):
    """Replica mode (``fault_tolerance.mode: replica``): one data-parallel replica's share."""

    replica: int
    steps: int = Field(0, description="Steps it trained in.")
    productive_s: float = Field(0.0, description="Step time of those steps.")
    absent_s: float = Field(0.0, description="Step time of the steps the run made without it (restart and heal).")
    losses: int = Field(0, description="Times it was lost and replaced.")


class RunGoodput(_Public):
    """Productive step time over the wall time since submission (until the end, or now while it runs)."""

    run_id: str
    status: RunStatus
    wall_s: float
    productive_s: float
    goodput: float | None = Field(None, description="productive_s / wall_s (None before any time passed).")
    lost_s: GoodputLost
    recomputed_steps: int = 0
    attempts: int = 0
    attempts_detail: list[GoodputAttempt] = Field(
        default_factory=list, description="Per attempt (worker-group start): productive time and what it lost."
    )
    replicas: list[GoodputReplica] | None = Field(
        None, description="Replica mode only: per data-parallel replica, what it trained and how long it was out."
    )


class LogsPublic(_Public):
    run_id: str
    logs: str
    offset: int = Field(0, description="Character offset of ``logs`` in the run's whole output.")
    total_chars: int | None = Field(None, description="Length of the run's whole output now.")
    has_more: bool = Field(False, description="More output after this page exists already.")
    next_cursor: str | None = Field(
        None, description="Where the next page starts (also to follow new output); pass as ``cursor``."
    )


class NodePublic(_Public):
    node_id: str
    alive: bool
    address: str | None = None
    cpus: float = 0
    gpus: float = 0
    memory_bytes: int | None = None


class ClusterPublic(_Public):
    address: str | None = None
    dashboard_url: str | None = None
    nodes: list[NodePublic] = Field(default_factory=list)
    cpus_total: float = 0
    cpus_free: float = 0
    gpus_total: float = 0
    gpus_free: float = 0

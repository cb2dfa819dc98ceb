"""Layout sweeps: the request (``SweepCreate``) and what the API returns (sweeps and their trials)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import Field

from api.spec._base import _Public, _Spec
from api.spec.run import Layout, RunSpec


class SweepSearch(_Spec):
    layouts: list[Layout] | Literal["auto"] = "auto"
    micro_batch_sizes: list[int] | None = Field(None, description="Default: the base spec's micro-batch.")
    add_auto: bool = Field(
        False,
        description="Also try the planner's top candidates for the live cluster ('auto') after the listed layouts "
        "(the CLI's --layouts auto sets this when the spec lists layouts; the listed ones are kept).",
    )


class SweepBudget(_Spec):
    max_trials: int = Field(8, ge=1, le=256)
    steps_per_trial: int = Field(10, ge=2, le=100_000)
    warmup_steps: int = Field(2, ge=0, le=100_000, description="Steps excluded from the measurement.")
    max_concurrent_trials: int = Field(1, ge=1, le=64)
    warm_workers: bool = Field(
        True,
        description="Run the trials one after another in warm worker groups (one worker start per sweep and "
        "shape; each trial re-meshes in place and reserves its workers' resources only while it trains). CPU "
        "trials; false: one Ray Train worker group per trial.",
    )


class SweepCreate(_Spec):
    name: str = "sweep"
    base: RunSpec
    search: SweepSearch = Field(default_factory=SweepSearch)
    objective: Literal["tokens_per_s", "mfu", "cost"] = Field(
        "tokens_per_s",
        description="What the sweep maximises: tokens/s (time), MFU, or cost: tokens per device-second, the lowest "
        "cost per token at one price per device-hour (with layouts 'auto', smaller worlds compete too).",
    )
    budget: SweepBudget = Field(default_factory=SweepBudget)
    early_stopping: bool = True


class TrialPublic(_Public):
    id: int
    run_id: str | None = None
    layout: Layout
    micro_batch_size: int
    status: str
    reason: str | None = None
    predicted_tokens_per_s: float | None = None
    measured_tokens_per_s: float | None = None
    measured_mfu: float | None = None
    peak_memory_bytes: int | None = None
    phase: str | None = Field(
        None,
        description="While the trial runs: 'queued', 'starting' (Ray Train places and starts its workers), "
        "'warm-up k/w' (steps excluded from the measurement) or 'measuring k/n'.",
    )


class SweepPublic(_Public):
    id: str
    name: str
    project: str
    status: str
    status_reason: str | None = None
    objective: str
    spec: SweepCreate
    trials: list[TrialPublic] = Field(default_factory=list)
    best_trial: TrialPublic | None = None
    calibration: dict[str, Any] | None = None
    ray_job_id: str | None = None
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None = None


class SweepList(_Public):
    items: list[SweepPublic]
    total: int | None = Field(None, description="Matching sweeps, counted up to 1,000 (``total_exact``).")
    total_exact: bool = True
    limit: int
    offset: int = 0
    next_cursor: str | None = Field(None, description="Pass as ``cursor`` for the next page; null on the last.")


class SweepEventPublic(_Public):
    """A state change of the sweep (``trial_id`` None) or of one of its trials, or another recorded event."""

    id: int
    sweep_id: str
    trial_id: int | None = None
    time: datetime
    kind: str = "state"
    from_status: str | None = None
    to_status: str | None = None
    reason: str | None = None
    actor: str | None = None


class SweepEventList(_Public):
    sweep_id: str
    items: list[SweepEventPublic]

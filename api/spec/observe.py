"""Where the time goes: what the API answers about a run's measured step-time breakdown (``RunBreakdown``), its
profiles and other stored files (``ArtifactPublic``), and a profile request (``ProfileRequest``).

The breakdown compares the planner's prediction (``Plan.predicted.step_time_s``, ``api.spec.plan.StepTimeBreakdown``)
with what the workers measured (``MetricRow.breakdown_per_rank``, ``api.spec.metrics.MeasuredStepTime``), term by
term, under the SAME names. Communication terms compare the EXPOSED time (what the step waited for); the time the
communication was in flight is ``measured_total_s``. The measured terms are averaged over the same steps (the
steady-state steps whose step time lies in the middle half), so they add up to the measured step time, overall and
per rank; ``unaccounted_s`` is what is left (rounding only).
"""

from __future__ import annotations

from datetime import datetime

from pydantic import Field

from api.spec._base import _Public, _Spec

# the terms of a breakdown answer, in display order (they add up to ``total``)
BREAKDOWN_ROWS: tuple[str, ...] = (
    "compute",
    "tp_comm",
    "pp_comm",
    "pp_bubble",
    "dp_comm",
    "optimizer",
    "data_wait",
    "other",
)


class BreakdownTerm(_Public):
    term: str = Field(description="compute, tp_comm, pp_comm, pp_bubble, dp_comm, optimizer, data_wait or other.")
    predicted_s: float | None = Field(None, description="The plan's prediction (null: the planner does not model it).")
    measured_s: float | None = Field(
        None,
        description="Mean over the typical steady-state steps (step time in the middle half) of the mean over ranks "
        "(communication: the exposed part). The terms' measured_s add up to the step's.",
    )
    measured_total_s: float | None = Field(
        None, description="Communication terms: median time in flight (overlapped with compute or not)."
    )
    share: float | None = Field(None, description="measured_s / the measured step time (0..1).")
    per_rank_s: list[float] = Field(
        default_factory=list,
        description="Per rank (index = rank), over that rank's typical steps; a rank's terms add up to its step time.",
    )


class RankBreakdown(_Public):
    rank: int
    node_id: str | None = None
    step_time_s: float | None = Field(None, description="Step time of this rank (over its typical steps).")
    compute_s: float | None = Field(None, description="Compute time of this rank (over its typical steps).")
    compute_vs_peers: float | None = Field(
        None, description="compute_s / the median compute of the other ranks (a straggler is well above 1)."
    )
    peak_memory_bytes: int | None = Field(None, description="Peak memory measured on this rank.")


class RunBreakdown(_Public):
    run_id: str
    status: str
    steps_measured: int = Field(0, description="Steady-state steps measured (the typical half of them is averaged).")
    warmup_steps_excluded: int = Field(0, description="Measured steps left out as warm-up (per attempt).")
    first_step: int | None = None
    last_step: int | None = None
    step_time_s: BreakdownTerm = Field(description="The whole step (term 'total').")
    terms: list[BreakdownTerm] = Field(default_factory=list)
    unaccounted_s: float | None = Field(
        None,
        description="The measured step time minus the sum of the terms' measured_s: what no term names (rounding "
        "only; null when nothing was measured).",
    )
    ranks: list[RankBreakdown] = Field(default_factory=list)
    predicted_memory_bytes: int | None = Field(None, description="The plan's predicted memory of the busiest rank.")
    stragglers: list[str] = Field(default_factory=list, description="The run's straggler events (newest first).")


class ArtifactPublic(_Public):
    run_id: str
    attempt: int
    rank: int | None = None
    name: str = Field(description="e.g. profile/steps_00000005-00000007/rank0.trace.json")
    kind: str = Field("file", description="profile (Chrome-trace JSON), pipeline (timeline), stacks (text), file.")
    size_bytes: int
    created_at: datetime


class ArtifactList(_Public):
    run_id: str
    items: list[ArtifactPublic]


class ProfileRequest(_Spec):
    steps: int = Field(3, ge=1, le=100, description="Profile this many steps on every rank, from the next report on.")


class ProfileAccepted(_Public):
    run_id: str
    steps: int
    message: str

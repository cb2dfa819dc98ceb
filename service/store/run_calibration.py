"""Calibrate the planner term by term from finished runs' measured breakdowns.

A run that measured its step-time breakdown (``service.store.breakdown``) is one ``Observation`` per layout with
``measured_terms_s`` under the planner's term names: compute, tp_comm / pp_comm / dp_comm (the EXPOSED part, as the
planner predicts them), pp_bubble, optimizer and other (+ data wait, which the planner folds into its fixed per-step
cost), and the throughput of the median step. ``calibrate_from_runs`` fits the factors to the latest finished runs of
the service's cluster (``service.store.calibrations.calibrate``: each term pins its own factors: compute efficiency,
TP/PP/DP bandwidth and latency, bubble, optimizer, overhead) and stores them with the names of the factors the fit
moved and when, which ``POST /v1/plans`` reports (``calibration.measured``, ``measured_at``). Runs with injected
faults are left out (a slowed or hung rank is not the cluster's speed).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.orm import Session

from api.spec import ClusterSpec, Plan, RunSpec
from service.store.breakdown import breakdown_rows, steady_steps
from service.store.calibrations import FitResult, Observation, calibrate, cluster_key, latest_calibration
from service.store.models import Calibration, Run

log = logging.getLogger(__name__)

MAX_RUNS = 20
FINISHED = ("SUCCEEDED", "CANCELLED")
_PLANNER_TERMS = {
    "compute": ("compute",),
    "tp_comm": ("tp_comm_exposed",),
    "pp_comm": ("pp_comm_exposed",),
    "pp_bubble": ("pp_bubble",),
    "dp_comm": ("dp_comm_exposed",),
    "optimizer": ("optimizer",),
    "other": ("other", "data_wait"),
}


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def observation_from_run(session: Session, run: Run) -> Observation | None:
    """The run as a calibration observation (None: no measured breakdown, no plan, or injected faults)."""
    if not run.plan:
        return None
    spec = RunSpec.model_validate(run.spec)
    if spec.faults is not None:
        return None
    plan = Plan.model_validate(run.plan)
    steady, _ = steady_steps(breakdown_rows(session, run_id=run.id))
    if not steady:
        return None

    def med(terms: tuple[str, ...]) -> float:
        # per step: the mean over ranks (the planner predicts the busiest rank; on balanced layouts they agree)
        return _median([sum(sum(pr[t]) / len(pr[t]) for t in terms) for _, pr in steady])

    total = med(("total",))
    return Observation(
        model=plan.model,
        layout=spec.layout,
        micro_batch_size=plan.micro_batch_size,
        global_batch_size=plan.global_batch_size,
        measured_tokens_per_s=plan.tokens_per_step / total if total > 0 else None,
        precision=spec.precision,
        activation_checkpointing=spec.activation_checkpointing,
        label=run.id,
        measured_terms_s={name: med(parts) for name, parts in _PLANNER_TERMS.items()},
    )


def finished_runs(session: Session, *, limit: int = MAX_RUNS) -> list[Run]:
    stmt = select(Run).where(Run.status.in_(FINISHED)).order_by(Run.finished_at.desc(), Run.id).limit(limit)
    return list(session.scalars(stmt).all())


def calibrate_from_runs(
    session: Session, *, cluster: ClusterSpec, runs: Sequence[Run] | None = None, only_if_new: bool = False
) -> tuple[FitResult, Calibration] | None:
    """Fit and store the cluster's factors from ``runs`` (default: the latest finished ones). With ``only_if_new``,
    nothing happens unless a run finished after the cluster's latest calibration. None: nothing to fit."""
    runs = finished_runs(session) if runs is None else list(runs)
    if only_if_new:
        latest = latest_calibration(session, cluster_key(cluster))
        if latest is not None and not any(
            r.finished_at is not None and r.finished_at.replace(tzinfo=None) > latest.created_at.replace(tzinfo=None)
            for r in runs
        ):
            return None
    obs = [o for o in (observation_from_run(session, r) for r in runs) if o is not None]
    if not obs:
        return None
    fit, cal = calibrate(session, cluster=cluster, observations=obs)
    if cal is None:
        return None
    log.info(
        "calibrated the planner for %s from %d runs: mean error %.1f%% -> %.1f%% (%s)",
        cluster_key(cluster),
        len(obs),
        100 * (fit.error_before or 0),
        100 * (fit.error_after or 0),
        ", ".join(fit.fitted),
    )
    return fit, cal

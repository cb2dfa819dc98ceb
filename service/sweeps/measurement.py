"""What a trial measured, the best trial of a sweep, and the planner's calibration from a sweep's measurements.

Measured objective = mean over the steps after ``budget.warmup_steps``; best trial = highest measured objective
among SUCCEEDED / EARLY_STOPPED trials. A finished sweep fits the planner's factors to its measured trials
(``service.store.calibrations.fit_factors``) and stores them per cluster, for later plans on that cluster.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from api.spec import ClusterSpec, Layout, SweepCreate
from api.spec.validation import resolve_model
from service import store
from service.planner import Factors
from service.store.calibrations import Observation, fit_factors, guard, store_calibration
from service.store.models import Sweep, Trial
from service.sweeps.state import TrialStatus

log = logging.getLogger(__name__)


def objective_value(objective: str, *, tokens_per_s: float | None, mfu: float | None, devices: int) -> float | None:
    """The value a sweep maximises: ``mfu``; ``cost``: tokens per device-second (the cheapest per token at one price
    per device-hour); else (``tokens_per_s``) tokens/s."""
    if objective == "mfu":
        return mfu
    if objective == "cost":
        return tokens_per_s / max(1, devices) if tokens_per_s is not None else None
    return tokens_per_s


@dataclass
class Measurement:
    steps_done: int = 0
    steps_measured: int = 0
    tokens_per_s: float | None = None
    mfu: float | None = None
    peak_memory_bytes: int | None = None
    devices: int = 1  # the trial's world size (objective ``cost``)

    def objective(self, objective: str) -> float | None:
        return objective_value(objective, tokens_per_s=self.tokens_per_s, mfu=self.mfu, devices=self.devices)


def measure_run(session: Session, *, run_id: str, warmup_steps: int, devices: int = 1) -> Measurement:
    """Means of tokens/s and MFU over the steps after ``warmup_steps``; peak memory over all steps. ``devices``:
    the run's world size."""
    rows = store.list_metrics(session, run_id=run_id)
    if not rows:
        return Measurement(devices=devices)
    steady = [r for r in rows if r.step > warmup_steps]
    tps = [r.tokens_per_s for r in steady if r.tokens_per_s is not None]
    mfu = [r.mfu for r in steady if r.mfu is not None]
    peak = max((r.peak_memory_bytes or 0) for r in rows) or None
    return Measurement(
        steps_done=rows[-1].step,
        steps_measured=len(tps),
        tokens_per_s=sum(tps) / len(tps) if tps else None,
        mfu=sum(mfu) / len(mfu) if mfu else None,
        peak_memory_bytes=peak,
        devices=devices,
    )


def record_measurement(trial: Trial, m: Measurement) -> None:
    trial.measured_tokens_per_s = m.tokens_per_s
    trial.measured_mfu = m.mfu
    trial.peak_memory_bytes = m.peak_memory_bytes


def measure_trial(session: Session, trial: Trial, *, warmup_steps: int) -> Measurement:
    """Measure the trial's run (if it has one) and record it on the trial."""
    devices = Layout.model_validate(trial.layout).world_size
    m = (
        measure_run(session, run_id=trial.run_id, warmup_steps=warmup_steps, devices=devices)
        if trial.run_id
        else Measurement(devices=devices)
    )
    if trial.run_id:
        record_measurement(trial, m)
    return m


def objective_of(trial: Trial, objective: str) -> float | None:
    return objective_value(
        objective,
        tokens_per_s=trial.measured_tokens_per_s,
        mfu=trial.measured_mfu,
        devices=Layout.model_validate(trial.layout).world_size if objective == "cost" else 1,
    )


def best_trial(trials: Sequence[Trial], objective: str) -> Trial | None:
    """Highest measured objective among SUCCEEDED / EARLY_STOPPED trials (ties: the earlier trial)."""
    best, best_v = None, -math.inf
    for t in trials:
        v = objective_of(t, objective)
        if t.status in TrialStatus.MEASURED and v is not None and v > best_v:
            best, best_v = t, v
    return best


# ------------------------------------------------------------------------------------------ calibration
def _observations(sweep: Sweep, trials: Sequence[Trial]) -> tuple[list[Observation], list[str]]:
    create = SweepCreate.model_validate(sweep.spec)
    cfg = resolve_model(create.base.model)
    obs, labels = [], []
    for t in trials:
        if t.status in TrialStatus.MEASURED and t.measured_tokens_per_s:
            obs.append(
                Observation(
                    model=cfg,
                    layout=Layout.model_validate(t.layout),
                    micro_batch_size=t.micro_batch_size,
                    global_batch_size=create.base.batch.global_batch_size,
                    measured_tokens_per_s=float(t.measured_tokens_per_s),
                    precision=create.base.precision,
                    activation_checkpointing=create.base.activation_checkpointing,
                    label=str(t.id),
                )
            )
            labels.append(str(t.id))
    return obs, labels


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def calibrate_sweep(session: Session, sweep: Sweep, trials: Sequence[Trial]) -> dict[str, Any] | None:
    """Fit the planner's factors to the sweep's measured trials, store a ``calibrations`` row for the cluster,
    and return the sweep's ``calibration`` JSON (None without a cluster or measurements)."""
    info = dict(sweep.calibration or {})
    if not info.get("cluster"):
        return (
            {**info, "status": "skipped", "reason": "no cluster was known when the sweep was created"} if info else None
        )
    obs, labels = _observations(sweep, trials)
    if not obs:
        return {**info, "status": "skipped", "reason": "no trial was measured"}
    cluster = ClusterSpec.model_validate(info["cluster"])
    start = Factors.from_dict(info.get("factors_before")) if info.get("factors_before") else None
    fit = fit_factors(obs, cluster, start=start)
    meta = guard(obs, cluster, fit)  # held-out check, rejection, machine load (service.store.calibration_guards)
    cal = store_calibration(
        session,
        cluster_key=info["cluster_key"],
        factors=fit.factors,
        error_before=_finite(fit.error_before),
        error_after=_finite(fit.error_after),
        sweep_id=sweep.id,
        measured=fit.fitted,
        observations=len(obs),
        meta=meta,
    )
    status = "rejected" if meta.get("rejected") else "fitted"
    out = {**info, **fit.to_json(labels), **meta, "status": status, "calibration_id": cal.id}
    log.info(
        "sweep %s calibration for %s: mean relative error %.1f%% -> %.1f%% over %d trials",
        sweep.id,
        info["cluster_key"],
        100 * fit.error_before,
        100 * fit.error_after,
        len(obs),
    )
    return out

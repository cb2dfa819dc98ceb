"""A sweep trial IS a run: the trial's side of the sweep driver (``service.sweeps.driver``).

- ``prepare_trial_run``: when Ray Tune starts a trial, create its run QUEUED (in the scheduler's queue like any run;
  admitted, it moves to STARTING without a Ray Job of its own: its Ray Job is the sweep's) and move the trial
  PENDING -> RUNNING; ``wait_for_admission`` waits for the scheduler's decision;
- ``observe_trial``: while it trains, the run's status and the trial's measurement (recorded on the trial);
- ``conclude_trial``: the trial's status from how its run ended (SUCCEEDED, FAILED, an early stop -> EARLY_STOPPED,
  the run cancelled by someone else -> CANCELLED);
- ``close_trial``: a trial Tune ended without ``run_trial`` finishing it (early stopped, errored, killed);
- ``note_stop_request``: the early-stopping scheduler's reason, written on the trial before its workers are asked to
  stop.

The run's own records (attempts, metrics, checkpoints, its end) go through ``service.runs.lifecycle`` like any run's.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import ray
from sqlalchemy.orm import Session, sessionmaker

from api.spec import ClusterSpec, Plan, RunSpec, RunStatus, SweepCreate
from api.spec.validation import build_plan
from service import store
from service.cluster.jobs import channel_name
from service.planner import Factors, predict_run
from service.runs.lifecycle import Outcome, Recorder, run_summary
from service.store import controller
from service.store.db import session_scope
from service.sweeps.execution import DRIVER_ACTOR, end_trial_run
from service.sweeps.expansion import trial_spec
from service.sweeps.measurement import Measurement, measure_run, measure_trial
from service.sweeps.state import SweepStatus, TrialStatus, get_sweep, get_trial

log = logging.getLogger(__name__)

DRAIN_REST_TIMEOUT_S = 5.0
_TRIAL_STATUS_OF_RUN = {RunStatus.SUCCEEDED: TrialStatus.SUCCEEDED, RunStatus.CANCELLED: TrialStatus.EARLY_STOPPED}


@dataclass(frozen=True)
class TrialRun:
    """What a trial's driver needs to train it."""

    trial_id: int
    run_id: str
    run_name: str
    spec: RunSpec
    plan: Plan
    warmup_steps: int
    objective: str


def _predicted(spec: RunSpec, plan: Plan, calibration: dict | None, trial_id: int) -> Plan:
    info = calibration or {}
    if not info.get("cluster"):
        return plan
    try:
        pred = predict_run(
            spec,
            plan,
            ClusterSpec.model_validate(info["cluster"]),
            factors=Factors.from_dict(info.get("factors_before")),
        )
    except Exception:
        log.exception("predicting trial %s failed", trial_id)
        return plan
    return plan.model_copy(update={"predicted": pred})


def prepare_trial_run(
    factory: sessionmaker[Session],
    sweep_id: str,
    trial_id: int,
    *,
    job_id: str | None,
    tune_trial_id: str,
    dashboard_url: str | None = None,
) -> TrialRun | None:
    """Create the trial's run (STARTING) and mark the trial RUNNING. None if the sweep ended or the trial is not
    PENDING (a cancel came first)."""
    with session_scope(factory) as s:
        sweep = get_sweep(s, sweep_id=sweep_id)
        t = get_trial(s, trial_id=trial_id)
        if sweep.status in SweepStatus.TERMINAL or t is None or t.status != TrialStatus.PENDING:
            return None
        create = SweepCreate.model_validate(sweep.spec)
        spec = trial_spec(
            create,
            t.layout,
            t.micro_batch_size,
            name=f"{sweep.name}-t{t.id}",
            labels={"sweep": sweep_id, "trial": str(t.id)},
        )
        plan = _predicted(spec, build_plan(spec), sweep.calibration, trial_id)
        run, _ = store.create_run(
            s,
            spec=spec.model_dump(mode="json"),
            plan=plan.model_dump(mode="json"),
            project=sweep.project,
            name=spec.name,
            priority=spec.resources.priority,
            created_by=sweep.created_by,
            sweep_id=sweep_id,
        )
        # QUEUED: the scheduler admits it like any run (same queue, same order); ``wait_for_admission`` waits
        run.ray_job_id = job_id
        run.dashboard_url = f"{dashboard_url}/#/jobs/{job_id}" if dashboard_url and job_id else None
        store.set_reason(
            s,
            run_id=run.id,
            reason=f"trial {t.id} of sweep {sweep_id} (Ray Tune trial {tune_trial_id}, Ray Job {job_id}): "
            "waiting for admission",
        )
        t.run_id = run.id
        controller.request_trial(s, trial=t, to=TrialStatus.RUNNING, reason=None, actor=DRIVER_ACTOR).or_raise()
        return TrialRun(
            trial_id=t.id,
            run_id=run.id,
            run_name=run.name,
            spec=spec,
            plan=plan,
            warmup_steps=create.budget.warmup_steps,
            objective=sweep.objective,
        )


def wait_for_admission(
    factory: sessionmaker[Session], run_id: str, *, poll_s: float = 0.1, timeout_s: float | None = None
) -> RunStatus:
    """Until the scheduler admits the trial's run (STARTING) or it ends (a cancel). Returns that status; QUEUED
    after ``timeout_s`` (None: no bound: the queue decides)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        with session_scope(factory) as s:
            status = RunStatus(store.get_run(s, run_id=run_id).status)
        if status != RunStatus.QUEUED or (deadline is not None and time.monotonic() > deadline):
            return status
        time.sleep(poll_s)


def observe_trial(factory: sessionmaker[Session], tr: TrialRun) -> tuple[RunStatus, Measurement]:
    """The trial's run status now and its measurement so far (recorded on the trial while it runs)."""
    with session_scope(factory) as s:
        status = RunStatus(store.get_run(s, run_id=tr.run_id).status)
        t = get_trial(s, trial_id=tr.trial_id)
        if t is not None and t.status == TrialStatus.RUNNING:
            return status, measure_trial(s, t, warmup_steps=tr.warmup_steps)
        return status, measure_run(s, run_id=tr.run_id, warmup_steps=tr.warmup_steps, devices=tr.plan.world_size)


def early_stop_reason(factory: sessionmaker[Session], trial_id: int) -> str:
    """The reason the early-stopping scheduler wrote on the trial (``note_stop_request``)."""
    with session_scope(factory) as s:
        t = get_trial(s, trial_id=trial_id)
        return (t.reason if t is not None else None) or "early-stopped by the sweep's scheduler"


def conclude_trial(
    factory: sessionmaker[Session], tr: TrialRun, outcome: Outcome, *, external: RunStatus | None
) -> Measurement:
    """The trial's final measurement and status, after its run ended with ``outcome`` (or, ``external``, was ended
    by someone else: the trial then follows the run, CANCELLED or FAILED with the run's reason)."""
    with session_scope(factory) as s:
        t = get_trial(s, trial_id=tr.trial_id)
        if t is None:
            return Measurement()
        m = measure_trial(s, t, warmup_steps=tr.warmup_steps)
        if t.status != TrialStatus.RUNNING:
            return m
        if outcome.status is not None:
            to = _TRIAL_STATUS_OF_RUN.get(outcome.status, TrialStatus.FAILED)
            reason = None if outcome.status == RunStatus.SUCCEEDED else outcome.reason
        else:
            run = store.get_run(s, run_id=tr.run_id)
            to = TrialStatus.CANCELLED if external == RunStatus.CANCELLED else TrialStatus.FAILED
            reason = f"run {run.status.lower()}: {run.status_reason}"
        controller.request_trial(s, trial=t, to=to, reason=reason, actor=DRIVER_ACTOR)  # it is RUNNING: allowed
        return m


def note_stop_request(factory: sessionmaker[Session], trial_id: int, reason: str) -> str | None:
    """Write the early-stop reason on a RUNNING trial; returns its run id (None when it has none)."""
    with session_scope(factory) as s:
        t = get_trial(s, trial_id=trial_id)
        if t is None:
            return None
        if t.status == TrialStatus.RUNNING:
            t.reason = reason
        return t.run_id


def _drain_rest(factory: sessionmaker[Session], run_id: str) -> None:
    """Best effort: metrics still buffered in the run's channel actor (gone if its trial actor is gone)."""
    try:
        events: list[dict[str, Any]] = ray.get(
            ray.get_actor(channel_name(run_id)).drain.remote(), timeout=DRAIN_REST_TIMEOUT_S
        )
    except Exception:
        return
    Recorder(factory, run_id).apply([e for e in events if e.get("type") in ("metrics", "worker_error")])


def close_trial(
    factory: sessionmaker[Session], sweep_id: str, trial_id: int, *, early_stop_reason: str | None, error: str | None
) -> None:
    """Record a trial Tune ended, unless ``run_trial`` already did (then nothing changes): EARLY_STOPPED (its run
    CANCELLED) with the scheduler's reason, or FAILED (its run FAILED) with the error."""
    with session_scope(factory) as s:
        t = get_trial(s, trial_id=trial_id)
        if t is None or t.status in TrialStatus.TERMINAL:
            return
        run_id = t.run_id
    if run_id:
        _drain_rest(factory, run_id)
    if early_stop_reason:
        status, run_to, reason = TrialStatus.EARLY_STOPPED, RunStatus.CANCELLED, early_stop_reason
    elif error:
        status, run_to, reason = TrialStatus.FAILED, RunStatus.FAILED, f"trial failed: {error}"
    else:
        status, run_to, reason = TrialStatus.FAILED, RunStatus.FAILED, "the trial ended without a result"
    with session_scope(factory) as s:
        t = get_trial(s, trial_id=trial_id, fresh=True)
        if t is None or t.status in TrialStatus.TERMINAL:
            return
        if t.status == TrialStatus.PENDING:  # never started: it cannot have been measured or stopped early
            status = TrialStatus.FAILED
        warmup = SweepCreate.model_validate(get_sweep(s, sweep_id=sweep_id).spec).budget.warmup_steps
        controller.request_trial(s, trial=t, to=status, reason=reason, actor=DRIVER_ACTOR)  # not terminal: allowed
        if t.run_id:
            measure_trial(s, t, warmup_steps=warmup)
            summary = run_summary(s, run_id=t.run_id, warmup_steps=warmup)
            end_trial_run(s, t.run_id, run_to, reason, DRIVER_ACTOR, summary=summary)
    log.info("trial %s: %s (%s)", trial_id, status, reason)

"""Running sweeps: one Ray Job per sweep, its reconciliation, cancellation and end.

A QUEUED sweep runs as ONE Ray Job (``python -m service.sweeps.driver --sweep-id ID``, submission id
``meshrun-<sweep id>-<n>``) whose driver runs a Ray Tune ``Tuner`` over the trials (``service.sweeps.driver``).
Every executed trial is a row in ``runs`` (``sweep_id`` set, ``ray_job_id`` = the sweep's job) with its own attempts,
events and per-step metrics, written exactly as a normal run's (``service.runs.lifecycle``).

The runtime's tick calls ``reconcile_sweeps`` (a sweep whose job ended without its driver finishing it -> FAILED)
and ``start_queued_sweeps`` (sweeps created while no scheduler ran, or whose submission failed). ``finish_sweep``
ends a sweep: open trials closed, best trial, calibration, SUCCEEDED or FAILED. Every status change goes through
the state machines of ``service.sweeps.state``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from api.spec import RunSpec, RunStatus, SweepCreate, layout_label
from service import store
from service.cluster.env import job_runtime_env, python_command
from service.cluster.jobs import submission_id, submission_number, trim
from service.security.policy import resolve_code_dir
from service.store import controller
from service.store.db import session_scope
from service.store.models import Run, Sweep, Trial
from service.sweeps.host import SweepHost
from service.sweeps.measurement import best_trial, calibrate_sweep, measure_trial, objective_of
from service.sweeps.state import (
    SweepStatus,
    TrialStatus,
    add_sweep_event,
    get_sweep,
    list_trials,
    set_sweep_reason,
    sweeps_in,
    trial_of_run,
)

log = logging.getLogger(__name__)

DRIVER_MODULE = "service.sweeps.driver"
CANCEL_WAIT_S = 20.0
DRIVER_ACTOR = "sweep-driver"


def end_trial_run(session: Session, run_id: str, to: RunStatus, reason: str, actor: str, **fields: Any) -> None:
    """End a trial's run (and its current attempt) unless it has ended already (or the controller refuses: it
    ended meanwhile) or is gone; ``fields`` as in ``controller.request_run``."""
    try:
        if not RunStatus(store.get_run(session, run_id=run_id).status).terminal:
            controller.end_run(session, run_id=run_id, to=to, reason=reason, actor=actor, **fields)
    except store.NotFound:
        pass


# ---------------------------------------------------------------------------------------------- submit
def _runtime_env(host: SweepHost, *, job_id: str, base_spec: RunSpec) -> dict[str, Any]:
    """The sweep job's runtime env: what every meshrun job gets, plus the base spec's user code directory."""
    code = base_spec.code.working_dir if base_spec.code is not None else None
    return job_runtime_env(
        host.settings,
        job_id=job_id,
        gcs_address=host.gcs_address,
        dashboard_url=host.dashboard_url,
        code_dir=resolve_code_dir(code, host.settings) if code else None,
    )


def start_sweep(host: SweepHost, sweep_id: str) -> bool:
    """Submit a QUEUED sweep as its Ray Job. False when the host has no Jobs client yet (it stays QUEUED), its job
    is submitted already and has not ended (the route and the runtime's tick race for a new sweep: one job only), or
    the submission failed (it stays QUEUED with the reason; ``start_queued_sweeps`` retries)."""
    jobs = host.jobs
    if jobs is None:
        return False
    with session_scope(host.factory) as s:
        sweep = get_sweep(s, sweep_id=sweep_id)
        if sweep.status != SweepStatus.QUEUED:
            return False
        prior = sweep.ray_job_id
        n = submission_number(prior) + 1
        name, project, base_spec = sweep.name, sweep.project, RunSpec.model_validate((sweep.spec or {}).get("base"))
    if prior:  # read now, not from a list read earlier: the route and the runtime's tick both submit
        try:
            if not jobs.state(prior).terminal:
                return False  # submitted (its driver has not started yet): a second job would run the same trials
        except Exception:
            return False  # unknown: the next tick asks again
    sid = submission_id(sweep_id, n)
    try:
        jobs.submit(
            entrypoint=f"{python_command()} -m {DRIVER_MODULE} --sweep-id {sweep_id}",
            submission_id=sid,
            metadata={
                "sweep_id": sweep_id,
                "name": name,
                "job_name": f"sweep {name}",  # the name Ray's job list shows
                "project": project,
                "meshrun": "sweep",
            },
            runtime_env=_runtime_env(host, job_id=sid, base_spec=base_spec),
        )
    except Exception as e:
        if "already exists" in str(e):  # submitted concurrently (the route and the runtime's tick)
            return False
        log.exception("submitting sweep %s failed", sweep_id)
        jobs.reset()
        with session_scope(host.factory) as s:
            sweep = get_sweep(s, sweep_id=sweep_id)
            set_sweep_reason(s, sweep=sweep, reason=trim(f"Ray Job submission failed, will retry: {e}", 1000))
            sweep.ray_job_id = sid
        return False
    with session_scope(host.factory) as s:
        sweep = get_sweep(s, sweep_id=sweep_id)
        sweep.ray_job_id = sid
        if sweep.status == SweepStatus.QUEUED:
            set_sweep_reason(s, sweep=sweep, reason=f"submitted as Ray Job {sid}")
        add_sweep_event(s, sweep_id=sweep_id, kind="ray", reason=f"submitted as Ray Job {sid}", actor="scheduler")
    log.info("sweep %s submitted as Ray Job %s", sweep_id, sid)
    return True


def start_queued_sweeps(host: SweepHost) -> list[str]:
    """Submit every QUEUED sweep without a running job (a hook for the runtime's admission tick)."""
    jobs = host.jobs
    if jobs is None:
        return []
    with session_scope(host.factory) as s:
        queued = [sw.id for sw in sweeps_in(s, statuses=[SweepStatus.QUEUED])]
    return [sweep_id for sweep_id in queued if start_sweep(host, sweep_id)]


# ------------------------------------------------------------------------------------------- reconcile
def reconcile_sweep(host: SweepHost, sweep_id: str) -> bool:
    """A QUEUED/RUNNING sweep whose Ray Job ended without the driver finishing it -> FAILED ("sweep driver
    lost"), its unfinished trials FAILED. True when it changed something."""
    jobs = host.jobs
    if jobs is None:
        return False
    with session_scope(host.factory) as s:
        sweep = get_sweep(s, sweep_id=sweep_id)
        if sweep.status in SweepStatus.TERMINAL or not sweep.ray_job_id:
            return False
        job_id = sweep.ray_job_id
    try:
        state = jobs.state(job_id)
    except Exception:
        log.exception("reading the state of sweep job %s failed", job_id)
        return False
    if not state.terminal:
        return False
    with session_scope(host.factory) as s:  # the driver may have finished it meanwhile
        if get_sweep(s, sweep_id=sweep_id).status in SweepStatus.TERMINAL:
            return False
    reason = f"sweep driver lost: Ray Job {job_id} is {state.status}" + (f": {state.message}" if state.message else "")
    finish_sweep(host.factory, sweep_id, failure=trim(reason, 2000), actor="scheduler")
    return True


def reconcile_sweeps(host: SweepHost) -> list[str]:
    """``reconcile_sweep`` for every QUEUED/RUNNING sweep with a job (a hook for the runtime's tick)."""
    with session_scope(host.factory) as s:
        ids = [sw.id for sw in sweeps_in(s, statuses=[SweepStatus.QUEUED, SweepStatus.RUNNING], with_job=True)]
    return [i for i in ids if reconcile_sweep(host, i)]


# -------------------------------------------------------------------------------------------- cancel
def cancel_sweep(session: Session, *, sweep_id: str, scope: str | None, actor: str, runtime: SweepHost | None) -> Sweep:
    """CANCELLED at once (so the driver never overwrites it), unfinished trials and their runs CANCELLED, then
    the sweep's Ray Job stopped (its Tune trials, Train controllers and workers go with it). Terminal -> 409."""
    sweep = get_sweep(session, sweep_id=sweep_id, project=scope)
    if sweep.status in SweepStatus.TERMINAL:
        raise store.Conflict(f"sweep '{sweep_id}' is already {sweep.status}; nothing to cancel", param="status")
    reason = f"cancelled by {actor}"
    controller.request_sweep(session, sweep=sweep, to=SweepStatus.CANCELLED, reason=reason, actor=actor).or_raise()
    for t in list_trials(session, sweep_id=sweep_id):
        if t.status in TrialStatus.TERMINAL:
            continue
        if t.run_id:
            end_trial_run(session, t.run_id, RunStatus.CANCELLED, f"sweep {sweep_id} {reason}", actor)
        controller.request_trial(session, trial=t, to=TrialStatus.CANCELLED, reason=f"sweep {reason}", actor=actor)
    job_id = sweep.ray_job_id
    session.commit()
    jobs = runtime.jobs if runtime is not None else None
    if job_id and jobs is not None:
        try:
            jobs.stop(job_id)
            deadline = time.monotonic() + CANCEL_WAIT_S
            while time.monotonic() < deadline and not jobs.state(job_id).terminal:
                time.sleep(0.5)
        except Exception:
            log.exception("stopping sweep job %s failed", job_id)
    session.expire_all()
    return get_sweep(session, sweep_id=sweep_id)


def cancel_trial_run(session: Session, *, run: Run, actor: str) -> Run:
    """Cancel ONE trial's run without stopping its sweep (the run's Ray Job is the sweep's): CANCELLED here; the
    trial's driver sees it within a second and ends the trial (its Train workers are released), the sweep goes
    on. For ``service.control.submission.cancel_run`` when ``run.sweep_id`` is set."""
    end_trial_run(session, run.id, RunStatus.CANCELLED, f"cancelled by {actor}", actor)
    t = trial_of_run(session, run_id=run.id)
    if t is not None and t.status not in TrialStatus.TERMINAL:
        reason = f"run cancelled by {actor}"
        controller.request_trial(session, trial=t, to=TrialStatus.CANCELLED, reason=reason, actor=actor)
    session.flush()
    return store.get_run(session, run_id=run.id)


# -------------------------------------------------------------------------------------------- finish
def finish_sweep(
    factory: sessionmaker[Session],
    sweep_id: str,
    *,
    failure: str | None = None,
    cancelled: str | None = None,
    actor: str = DRIVER_ACTOR,
) -> Sweep:
    """End a sweep: unfinished trials closed (their runs ended), best trial chosen, calibration fitted, status
    SUCCEEDED (some trial measured) or FAILED. A sweep CANCELLED meanwhile stays CANCELLED. ``failure``: the
    driver failed (reason); ``cancelled``: the driver was stopped (reason)."""
    with session_scope(factory) as s:
        sweep = get_sweep(s, sweep_id=sweep_id, lock=True)
        create = SweepCreate.model_validate(sweep.spec)
        was_cancelled = sweep.status == SweepStatus.CANCELLED or cancelled is not None
        trials = list_trials(s, sweep_id=sweep_id)
        for t in trials:
            if t.status in TrialStatus.TERMINAL:
                continue
            why = (
                (cancelled or sweep.status_reason or "sweep cancelled")
                if was_cancelled
                else (failure or "the sweep ended before this trial finished")
            )
            if t.run_id:
                to = RunStatus.CANCELLED if was_cancelled else RunStatus.FAILED
                end_trial_run(s, t.run_id, to, f"sweep {sweep_id}: {why}", actor)
                measure_trial(s, t, warmup_steps=create.budget.warmup_steps)
            controller.request_trial(
                s,
                trial=t,
                to=TrialStatus.CANCELLED if was_cancelled else TrialStatus.FAILED,
                reason=why if t.run_id else f"not run: {why}",
                actor=actor,
            )
        if sweep.status in SweepStatus.TERMINAL:
            return sweep
        if was_cancelled:
            reason = cancelled or "sweep cancelled"
            return controller.transition_sweep(s, sweep=sweep, to=SweepStatus.CANCELLED, reason=reason, actor=actor)
        return _conclude(s, sweep, trials, failure=failure, actor=actor)


def _conclude(s: Session, sweep: Sweep, trials: list[Trial], *, failure: str | None, actor: str) -> Sweep:
    """SUCCEEDED with the best measured trial (and the planner calibrated from the measurements), or FAILED."""
    best = best_trial(trials, sweep.objective)
    try:
        cal = calibrate_sweep(s, sweep, trials)
    except Exception as e:
        log.exception("calibration of sweep %s failed", sweep.id)
        cal = {**(sweep.calibration or {}), "status": "failed", "reason": f"{type(e).__name__}: {e}"}
    sweep.calibration = cal
    counts: dict[str, int] = {}
    for t in trials:
        counts[t.status] = counts.get(t.status, 0) + 1
    tally = ", ".join(f"{v} {k.lower()}" for k, v in sorted(counts.items()))
    if best is None:
        reason = trim(f"no trial was measured ({tally})" + (f": {failure}" if failure else ""), 2000)
        return controller.transition_sweep(s, sweep=sweep, to=SweepStatus.FAILED, reason=reason, actor=actor)
    reason = trim(
        f"best: trial {best.id} ({layout_label(best.layout)} mb={best.micro_batch_size}) "
        f"{sweep.objective}={objective_of(best, sweep.objective) or 0.0:.4g}; trials: {tally}"
        + (f"; driver: {failure}" if failure else ""),
        2000,
    )
    return controller.transition_sweep(
        s, sweep=sweep, to=SweepStatus.SUCCEEDED, reason=reason, actor=actor, best_trial_id=best.id
    )

"""The sweep driver: the entrypoint of a sweep's Ray Job (``python -m service.sweeps.driver --sweep-id ID``).

It runs a Ray Tune ``Tuner`` over the sweep's PENDING trials (a grid over the trial ids, best predicted first),
the Train V2 pattern (a trial reserves only its driver; Train makes its own placement group):

- each Tune trial runs ``run_trial`` and reserves only its driver (``TRIAL_RESOURCES``, a sliver of a CPU, which
  the sweep's expansion counts: a candidate that cannot be placed beside its sweep's trial drivers is SKIPPED). A
  trial IS a run: ``service.sweeps.trials.prepare_trial_run`` creates its ``runs`` row (``sweep_id`` set), QUEUED
  in the scheduler's queue like any run (``wait_for_admission``); admitted, the run goes through the run lifecycle
  of every run (``service.runs.lifecycle``: RUNNING, its channel drained into attempts, events and per-step
  metrics, its end). With ``budget.warm_workers`` (CPU trials) it trains on a warm worker group of the sweep's pool
  (``service.sweeps.warm``: one worker start per sweep and shape, re-meshed in place per trial; Tune reuses its
  trial actor too); otherwise with a stoppable ``TorchTrainer`` (``service.runs.trainer``) whose workers must start
  within Ray Train's worker-group start timeout (60 s) or the trial fails with that reason (no endless retry);
- concurrency is bounded by ``TuneConfig(max_concurrent_trials=budget.max_concurrent_trials)``;
- ``run_trial`` reports the running mean of the objective over the post-warm-up steps to Tune (every report
  carries the metric ``objective``); ``SlowTrialStopper`` (``service.sweeps.stopping``) stops a trial that, after
  ``grace`` measured steps, reaches less than ``EARLY_STOP_RATIO`` of the best objective another trial measured
  (gracefully: its workers stop after their current step and the run ends CANCELLED with the reason, the trial
  EARLY_STOPPED). A trial whose training fails is recorded FAILED with the workers' error, and the sweep goes on
  (``run_trial`` never raises into Tune, which sidesteps ray#54379); ``TrialRecorder`` (a Tune callback in this
  process) records trials Tune ended without ``run_trial`` finishing them;
- at the end ``service.sweeps.execution.finish_sweep``: best trial, calibration of the planner, sweep
  SUCCEEDED/FAILED. A sweep cancelled meanwhile (the API marks it first, then stops this job) stays CANCELLED.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any, cast

import ray
from ray import tune
from ray._private import ray_constants
from ray.actor import ActorHandle
from ray.tune.experiment import Trial as TuneTrial
from sqlalchemy.orm import Session, sessionmaker

from api.spec import RunStatus, SweepCreate
from service import store
from service.cluster.jobs import open_channel, submission_number
from service.runs.lifecycle import Outcome, RunLifecycle
from service.runs.naming import RunStart
from service.runs.preemption import preemption_reason
from service.runs.tracking import track_run
from service.runs.trainer import build_trainer, placing_phase, train_run_name
from service.settings import Settings
from service.store import controller
from service.store.db import session_scope, shared_sessionmaker
from service.sweeps.execution import DRIVER_ACTOR, finish_sweep
from service.sweeps.expansion import TRIAL_DRIVER_CPU
from service.sweeps.measurement import Measurement
from service.sweeps.state import SweepStatus, TrialStatus, add_sweep_event, get_sweep, list_trials
from service.sweeps.stopping import METRIC, TIME_ATTR, GracefulStop, SlowTrialStopper, early_stop_grace
from service.sweeps.trials import (
    TrialRun,
    close_trial,
    conclude_trial,
    early_stop_reason,
    observe_trial,
    prepare_trial_run,
    wait_for_admission,
)
from service.sweeps.warm import start_pool, sweep_pool, usable, warm_fit

logger = logging.getLogger("meshrun.sweep_driver")

TRIAL_RESOURCES = {"CPU": TRIAL_DRIVER_CPU}
REPORT_INTERVAL_S = 0.5
STOP_WAIT_S = 90.0
DASHBOARD_ENV = "MESHRUN_DASHBOARD_URL"
GCS_ADDRESS_ENV = "MESHRUN_RAY_GCS_ADDRESS"
JOB_ID_ENVS = ("MESHRUN_RAY_JOB_ID", "RAY_JOB_SUBMISSION_ID", "RAY_SUBMISSION_ID")

__all__ = ["SlowTrialStopper", "TrialRecorder", "main", "run_sweep", "run_trial"]


# ------------------------------------------------------------------------------------------ callback
class TrialRecorder(tune.Callback):
    """Runs in this (driver) process: records trials Tune ended without ``run_trial`` finishing them (early
    stopped, errored, killed): trial status and reason, measurements, the run ended."""

    def __init__(self, database_url: str, sweep_id: str, stopper: SlowTrialStopper | None):
        # only plain data: Tune pickles its callbacks with the experiment state
        self.database_url, self.sweep_id, self.stopper = database_url, sweep_id, stopper

    @property
    def factory(self) -> sessionmaker[Session]:
        return shared_sessionmaker(self.database_url)

    def on_trial_complete(self, iteration: int, trials: list[TuneTrial], trial: TuneTrial, **info: Any) -> None:
        self._close(trial, error=None)

    def on_trial_error(self, iteration: int, trials: list[TuneTrial], trial: TuneTrial, **info: Any) -> None:
        err = "the Tune trial failed"
        path = trial.error_file
        try:
            if path and Path(path).exists():
                lines = [ln for ln in Path(path).read_text().splitlines() if ln.strip()]
                err = " ".join(lines[-3:])[-1500:] or err
        except OSError:
            pass
        self._close(trial, error=err)

    def _close(self, trial: TuneTrial, *, error: str | None) -> None:
        try:
            close_trial(
                self.factory,
                self.sweep_id,
                int(trial.config["trial_id"]),
                early_stop_reason=self.stopper.reasons.get(trial.trial_id) if self.stopper else None,
                error=error,
            )
        except Exception:
            logger.exception("recording trial %s failed", trial)


# --------------------------------------------------------------------------------------------- trial
def _report(m: Measurement, objective: str, *, run_id: str | None, final: bool, failed: bool = False) -> None:
    value = m.objective(objective)
    tune.report(
        {
            METRIC: float(value or 0.0),
            TIME_ATTR: m.steps_measured,
            "step": m.steps_done,
            "run_id": run_id,
            "final": final,
            "failed": failed,
        }
    )


def _follow(life: RunLifecycle, tr: TrialRun, channel: ActorHandle, fitter: threading.Thread) -> RunStatus | None:
    """While the trial trains: report new measured steps to Tune; a run ended meanwhile by someone else (its
    cancel, the sweep's) asks the workers to stop. Returns that external status (None: it was not ended)."""
    reported, external, stop_sent_at = 0, None, None
    while fitter.is_alive():
        fitter.join(REPORT_INTERVAL_S)
        run_status, m = observe_trial(life.factory, tr)
        if run_status.terminal and external is None:
            external = run_status
            channel.request_stop.remote()
            stop_sent_at = time.monotonic()
        if stop_sent_at is not None:
            if time.monotonic() - stop_sent_at > STOP_WAIT_S:
                logger.warning(
                    "trial %s: workers did not stop within %.0fs; leaving them to Tune", tr.trial_id, STOP_WAIT_S
                )
                break
            continue
        if m.steps_measured > reported and m.objective(tr.objective) is not None:
            reported = m.steps_measured
            _report(m, tr.objective, run_id=tr.run_id, final=False)
    return external


def run_trial(config: dict[str, Any]) -> None:
    """One Tune trial = one run: a stoppable TorchTrainer trained through the run lifecycle, the objective
    reported to Tune.

    Stops (the scheduler's early stop, a cancelled trial run) go through the run channel: the workers stop after
    their current step and ``fit()`` returns normally, releasing the Train placement group."""
    settings = Settings()
    factory = shared_sessionmaker(settings.database_url)
    tune_trial_id = tune.get_context().get_trial_id()
    tr = prepare_trial_run(
        factory,
        config["sweep_id"],
        int(config["trial_id"]),
        job_id=config.get("job_id"),
        tune_trial_id=tune_trial_id,
        dashboard_url=config.get("dashboard_url"),
    )
    if tr is None:
        tune.report({METRIC: 0.0, TIME_ATTR: 0, "final": True, "failed": True, "not_run": True})
        return
    open_channel(tr.run_id, 1)  # its process starts while the trial waits (``life.channel`` takes this one)
    admitted = wait_for_admission(factory, tr.run_id)  # the scheduler's queue, like every run
    if admitted != RunStatus.STARTING:  # ended while queued (its sweep or the run cancelled)
        m = conclude_trial(factory, tr, Outcome(None, f"ended while queued ({admitted.value})"), external=admitted)
        _report(m, tr.objective, run_id=tr.run_id, final=True, failed=True)
        return
    name = train_run_name(tr.run_id, 1)
    life = RunLifecycle(
        factory,
        tr.run_id,
        actor=DRIVER_ACTOR,
        warmup_steps=tr.warmup_steps,
        train_run_name=name,
        checkpoint_keep=tr.spec.checkpoint.keep,
        data_dir=str(settings.data_dir),  # the hang watch's stack dumps, as for a run
        hang_timeout_s=tr.spec.resources.hang_timeout_s,
    )
    if not life.start(f"trial driver started (Tune trial {tune_trial_id})"):  # cancelled since its admission
        with session_scope(factory) as s:
            now = RunStatus(store.get_run(s, run_id=tr.run_id).status)
        m = conclude_trial(factory, tr, Outcome(None, f"ended before its driver started ({now.value})"), external=now)
        _report(m, tr.objective, run_id=tr.run_id, final=True, failed=True)
        return
    track_run(
        life,
        tr.spec,
        tr.plan,
        defaults=settings.tracking,
        data_dir=settings.data_dir,
        run_name=tr.run_name,
        flush_timeout_s=settings.tracking_flush_timeout_s,
        parent=config["sweep_id"],
    )
    box: dict[str, Any] = {}
    t0 = time.time()
    with life.channel(first_attempt=1) as channel:
        cancel = threading.Event()
        warm = bool(config.get("warm")) and usable(tr.plan)
        if not warm:  # a warm trial says which group it re-meshes (``_warm_fit``)
            life.phase(placing_phase(tr.plan))

        def fit() -> None:
            try:
                if warm:
                    _warm_fit(life, tr, channel, cancel, config["sweep_id"])
                else:
                    start = RunStart(tr.run_id, tr.run_name, tr.spec, tr.plan, None, channel, settings, name)
                    build_trainer(start, stoppable=True).fit()
                box["ok"] = True
            except BaseException as e:
                box["error"] = e

        fitter = threading.Thread(target=fit, daemon=True, name="trial-fit")
        fitter.start()
        external = _follow(life, tr, channel, fitter)
        if fitter.is_alive():  # its workers did not stop when asked: abandon them (a warm group is killed)
            cancel.set()
            fitter.join(10)
    try:
        stop_requested = bool(ray.get(channel.should_stop.remote(), timeout=10))
    except Exception:
        stop_requested = False
    if external is not None:
        outcome = Outcome(None, f"run ended externally ({external.value})")
    elif box.get("ok") and stop_requested:
        outcome = Outcome(RunStatus.CANCELLED, early_stop_reason(factory, tr.trial_id))
    elif box.get("ok") and (notice := preemption_reason(life.recorder.summary, total_steps=tr.spec.train.steps)):
        # a trial cannot checkpoint and come back (its sweep's job moves on): a preempted trial did not finish
        outcome = Outcome(RunStatus.FAILED, f"trial preempted: {notice}")
    elif box.get("ok"):
        outcome = Outcome.succeeded()
    elif "error" in box:
        logger.error("trial %s failed: %s", tr.trial_id, box["error"])
        outcome = life.failed(box["error"])
    else:
        outcome = Outcome(RunStatus.FAILED, "training ended without a result")
    life.finish(outcome, wall_s=time.time() - t0)
    if life.recorder.trackers is not None:  # a Tune trial's process outlives the trial: flush now
        life.recorder.trackers.close(settings.tracking_flush_timeout_s)
    m = conclude_trial(factory, tr, outcome, external=external)
    try:
        ray.kill(channel)  # the Train run has ended; nothing reports to the channel any more
    except Exception:
        pass
    _report(
        m,
        tr.objective,
        run_id=tr.run_id,
        final=True,
        failed=outcome.status not in (RunStatus.SUCCEEDED, RunStatus.CANCELLED),
    )


def _warm_fit(life: RunLifecycle, tr: TrialRun, channel: ActorHandle, cancel: threading.Event, sweep_id: str) -> None:
    """The trial on a warm worker group of the sweep's pool (``service.sweeps.warm``); a new group is a sweep event,
    a reused one a ``re-meshing`` phase of the trial's run."""

    def on_group(gid: int, jobs: int, new: bool) -> None:
        w = tr.plan.world_size
        if new:
            life.phase(f"starting warm worker group #{gid}: {w} workers (torch and the engine imported once)")
            with session_scope(life.factory) as s:
                add_sweep_event(
                    s,
                    sweep_id=sweep_id,
                    kind="worker_group",
                    reason=f"warm worker group #{gid} started: {w} workers, first for trial {tr.trial_id}",
                    actor=DRIVER_ACTOR,
                    trial_id=tr.trial_id,
                )
        else:
            life.phase(f"re-meshing warm worker group #{gid} ({w} workers, {jobs} trial(s) before this one)")

    warm_fit(
        pool=sweep_pool(sweep_id),
        run_id=tr.run_id,
        run_name=tr.run_name,
        spec_json=tr.spec.model_dump(mode="json", by_alias=True),
        plan=tr.plan,
        channel=channel,
        cancel=cancel,
        on_group=on_group,
        attempt=1,  # the trial's channel opens at attempt 1 (``life.channel(first_attempt=1)``)
        channel_first=True,  # a trial measures: no process starting beside it
    )


# ---------------------------------------------------------------------------------------------- sweep
def _job_id() -> str | None:
    """This Ray Job's submission id (Ray passes it in the driver's job config metadata, not as a variable)."""
    found = next((os.environ[k] for k in JOB_ID_ENVS if os.environ.get(k)), None)
    if found:
        return found
    try:
        cfg = json.loads(os.environ.get(ray_constants.RAY_JOB_CONFIG_JSON_ENV_VAR) or "{}")  # type: ignore[attr-defined]
        return (cfg.get("metadata") or {}).get("job_submission_id") or None
    except Exception:
        return None


def run_sweep(settings: Settings, sweep_id: str) -> str:
    """Run the sweep's Tuner; returns how the Tuner ended ('done' | 'cancelled: ...'), or 'superseded' (nothing run:
    a later submission of the sweep is its job)."""
    factory = shared_sessionmaker(settings.database_url)
    job_id = _job_id()
    with session_scope(factory) as s:
        sweep = get_sweep(s, sweep_id=sweep_id)
        if sweep.status in SweepStatus.TERMINAL:
            return "done"
        if job_id and submission_number(sweep.ray_job_id) > submission_number(job_id):
            # a later submission of the same sweep is its job: two drivers would run every trial twice
            logger.warning(
                "sweep %s belongs to Ray Job %s, not %s: this driver exits", sweep_id, sweep.ray_job_id, job_id
            )
            return "superseded"
        job_id = job_id or sweep.ray_job_id
        create = SweepCreate.model_validate(sweep.spec)
        pending = list_trials(s, sweep_id=sweep_id, status=TrialStatus.PENDING)
        pending.sort(key=lambda t: (-(t.predicted_tokens_per_s or 0.0), t.id))
        ids = [t.id for t in pending]
        controller.transition_sweep(  # QUEUED or RUNNING (checked above): allowed
            s,
            sweep=sweep,
            to=SweepStatus.RUNNING,
            reason=f"running {len(ids)} trials with Ray Tune (Ray Job {job_id})",
            actor=DRIVER_ACTOR,
            **({"ray_job_id": job_id} if job_id else {}),
        )
    if not ids:
        return "done"
    # the explicit GCS address: "auto" resolution can pick another cluster on a shared machine
    ray.init(address=os.environ.get(GCS_ADDRESS_ENV) or None, logging_level=logging.WARNING, log_to_driver=True)
    measured = create.budget.steps_per_trial - create.budget.warmup_steps
    stopper = (
        SlowTrialStopper(grace_steps=early_stop_grace(measured), on_stop=GracefulStop(settings.database_url))
        if create.early_stopping
        else None
    )
    storage = Path(settings.data_dir) / "tune"
    storage.mkdir(parents=True, exist_ok=True)
    tuner = tune.Tuner(
        tune.with_resources(run_trial, TRIAL_RESOURCES),
        param_space={
            "sweep_id": sweep_id,
            "job_id": job_id,
            "dashboard_url": os.environ.get(DASHBOARD_ENV),
            "trial_id": tune.grid_search(ids),
            "warm": create.budget.warm_workers,
        },
        tune_config=tune.TuneConfig(
            metric=METRIC,
            mode="max",
            max_concurrent_trials=create.budget.max_concurrent_trials,
            scheduler=stopper,
            reuse_actors=True,  # one trial actor for the trials that follow: no new process and imports per trial
        ),
        run_config=tune.RunConfig(
            name=f"{sweep_id}-{int(time.time())}",
            storage_path=str(storage),
            verbose=0,
            callbacks=[TrialRecorder(settings.database_url, sweep_id, stopper)],
            failure_config=tune.FailureConfig(max_failures=0),
        ),
    )
    pool = start_pool(sweep_id) if create.budget.warm_workers else None
    try:
        tuner.fit()
    except KeyboardInterrupt as e:
        return f"cancelled: sweep driver stopped ({e})"
    finally:
        if pool is not None:
            _close_pool(factory, sweep_id, pool)
    return "done"


def _close_pool(factory: sessionmaker[Session], sweep_id: str, pool: ActorHandle) -> None:
    """The sweep's warm groups end with it: one event says how many worker-group starts its trials took."""
    try:
        stats = cast(dict[str, Any], ray.get(pool.stats.remote(), timeout=30))
        ray.get(pool.shutdown.remote(), timeout=60)
        ray.kill(pool)
    except Exception:
        logger.exception("sweep %s: closing the warm pool failed", sweep_id)
        return
    with session_scope(factory) as s:
        add_sweep_event(
            s,
            sweep_id=sweep_id,
            kind="worker_group",
            reason=f"warm worker groups: {stats['starts']} started for the sweep's trials",
            actor=DRIVER_ACTOR,
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="meshrun sweep driver (a Ray Job entrypoint)")
    ap.add_argument("--sweep-id", required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = Settings()
    terminated: list[int] = []

    def _on_term(signum: int, _frame: FrameType | None) -> None:
        terminated.append(signum)
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _on_term)
    t0 = time.time()
    failure: str | None = None
    cancelled: str | None = None
    try:
        how = run_sweep(settings, args.sweep_id)
        if how == "superseded":
            return 0  # the sweep is the other job's to finish
    except KeyboardInterrupt as e:
        how = f"cancelled: sweep driver stopped ({e})"
    except Exception as e:
        logger.exception("sweep %s failed", args.sweep_id)
        how, failure = "failed", f"{type(e).__name__}: {e}"
    if terminated and not how.startswith("cancelled"):  # Tune swallowed the interrupt: the job was stopped
        how = f"cancelled: Ray Job stopped (signal {terminated[0]})"
    if how.startswith("cancelled"):
        cancelled = how.split(": ", 1)[1]
    sweep = finish_sweep(
        shared_sessionmaker(settings.database_url), args.sweep_id, failure=failure, cancelled=cancelled
    )
    logger.info("sweep %s: %s (%s) in %.1fs", args.sweep_id, sweep.status, sweep.status_reason, time.time() - t0)
    return 0 if sweep.status == SweepStatus.SUCCEEDED else 1


if __name__ == "__main__":
    # run from the imported module, not __main__: Tune pickles ``run_trial`` and the callbacks, which must be
    # importable by reference in the trial actors
    from service.sweeps.driver import main as _main

    sys.exit(_main())

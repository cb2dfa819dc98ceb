"""The sweep driver: the entrypoint of a sweep's Ray Job (``python -m service.sweep_driver --sweep-id ID``).

It runs a Ray Tune ``Tuner`` over the sweep's PENDING trials (a grid over the trial ids, best predicted first),
the Train V2 pattern of ../shared/notes/ray-2.60.md:

- each Tune trial runs ``run_trial`` and reserves only its driver (``TRIAL_RESOURCES``, a sliver of a CPU);
  ``run_trial`` builds the trial's ``TorchTrainer`` with the run driver's own code (``service.driver.build_trainer``,
  ``Recorder``, the run's channel actor), so a trial IS a run: a ``runs`` row (``sweep_id`` set) going
  QUEUED -> STARTING -> RUNNING -> SUCCEEDED/FAILED/CANCELLED with its attempts, events and per-step metrics;
- concurrency is bounded by ``TuneConfig(max_concurrent_trials=budget.max_concurrent_trials)``;
- ``run_trial`` reports the running mean of the objective over the post-warm-up steps to Tune (every report
  carries the metric ``objective``); ``SlowTrialStopper`` (a Tune scheduler) stops a trial that, after
  ``grace`` measured steps, reaches less than ``EARLY_STOP_RATIO`` of the best objective another trial measured;
  ``TrialRecorder`` (a Tune callback in this process) then records it EARLY_STOPPED (its run CANCELLED with the
  reason). A trial whose training fails is recorded FAILED with the workers' error, and the sweep goes on
  (``run_trial`` never raises into Tune, which sidesteps ray#54379);
- at the end ``service.sweeps.finish_sweep``: best trial, calibration of the planner, sweep SUCCEEDED/FAILED.
  A sweep cancelled meanwhile (the API marks it first, then stops this job) stays CANCELLED.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ray import tune
from ray.tune.schedulers import FIFOScheduler, TrialScheduler

from api.schemas import ClusterSpec, RunStatus, SweepCreate
from api.validation import build_plan
from service import store
from service.db import make_engine, make_sessionmaker, session_scope
from service.models import Trial
from service.settings import Settings
from service.sweeps import (SweepStatus, TrialStatus, finish_sweep, get_sweep, measure_run, record_measurement,
                            trial_spec)

logger = logging.getLogger("meshrun.sweep_driver")

TRIAL_RESOURCES = {"CPU": 0.01}
REPORT_INTERVAL_S = 0.5
EARLY_STOP_RATIO = 0.5
DASHBOARD_ENV = "MESHRUN_DASHBOARD_URL"
JOB_ID_ENVS = ("MESHRUN_RAY_JOB_ID", "RAY_JOB_SUBMISSION_ID", "RAY_SUBMISSION_ID")
METRIC = "objective"
TIME_ATTR = "steps_measured"


_FACTORIES: dict[str, Any] = {}


def _factory(settings: Settings | str):  # noqa: ANN202
    """A session factory per database URL (one engine per process)."""
    url = settings if isinstance(settings, str) else settings.database_url
    if url not in _FACTORIES:
        _FACTORIES[url] = make_sessionmaker(make_engine(url))
    return _FACTORIES[url]


# ---------------------------------------------------------------------------------------- early stopping
class SlowTrialStopper(FIFOScheduler):
    """Stop clearly slower trials: once a trial has ``grace_steps`` measured (post-warm-up) steps, it is stopped
    if its running mean objective is below ``ratio`` x the best objective another trial has reported (running
    or final). The reason is kept (``reasons[tune trial id]``).

    Stopping is graceful: ``on_stop(trial_id, run_id, reason)`` (``GracefulStop``) records the reason and asks the
    trial's workers, through the run's channel actor, to stop after their current step, so the Train run ends
    normally and releases its placement group at once (a Tune STOP kills the trial actor, and the Train placement
    group can outlive it: ray#54305). Tune is told STOP only if the trial keeps reporting ``hard_after`` more
    measured steps after the request."""

    def __init__(self, *, grace_steps: int = 2, ratio: float = EARLY_STOP_RATIO, metric: str = METRIC,
                 time_attr: str = TIME_ATTR, on_stop: Any = None, hard_after: int = 3):
        super().__init__()
        self.grace_steps, self.ratio, self.objective_key, self.time_attr = max(1, grace_steps), ratio, metric, time_attr
        self.on_stop, self.hard_after = on_stop, hard_after
        self.latest: dict[str, float] = {}
        self.labels: dict[str, str] = {}
        self.reasons: dict[str, str] = {}
        self.requested_at: dict[str, int] = {}

    def set_search_properties(self, metric: str | None, mode: str | None, **spec: Any) -> bool:
        return mode in (None, "max")

    def decide(self, trial_id: str, result: dict[str, Any], label: str = "") -> str:
        """STOP or CONTINUE for one result (pure: no side effects beyond this scheduler's bookkeeping)."""
        v, n = result.get(self.objective_key), int(result.get(self.time_attr) or 0)
        if v is None or result.get("failed") or not n:
            return TrialScheduler.CONTINUE
        others = {tid: x for tid, x in self.latest.items() if tid != trial_id}
        self.latest[trial_id] = float(v)
        if label:
            self.labels[trial_id] = label
        if result.get("final") or n < self.grace_steps or not others:
            return TrialScheduler.CONTINUE
        if trial_id in self.reasons:
            return TrialScheduler.STOP
        best_id = max(others, key=others.get)
        if v < self.ratio * others[best_id]:
            self.reasons[trial_id] = (f"early-stopped: {self.objective_key} {v:.4g} after {n} measured steps is below "
                                      f"{self.ratio:.0%} of {others[best_id]:.4g} measured by "
                                      f"{self.labels.get(best_id, 'another trial')}")
            return TrialScheduler.STOP
        return TrialScheduler.CONTINUE

    def on_trial_result(self, tune_controller, trial, result: dict[str, Any]) -> str:  # noqa: ANN001
        decision = self.decide(trial.trial_id, result, label=f"trial {trial.config.get('trial_id')}")
        if decision != TrialScheduler.STOP or self.on_stop is None:
            return decision
        n = int(result.get(self.time_attr) or 0)
        first = self.requested_at.setdefault(trial.trial_id, n)
        if first == n:
            try:
                self.on_stop(int(trial.config["trial_id"]), result.get("run_id"), self.reasons[trial.trial_id])
            except Exception:  # noqa: BLE001 - fall back to Tune's STOP below
                logger.exception("graceful stop of %s failed", trial)
                return TrialScheduler.STOP
        return TrialScheduler.STOP if n - first >= self.hard_after else TrialScheduler.CONTINUE


class GracefulStop:
    """``SlowTrialStopper.on_stop``: write the reason on the trial, ask its workers to stop (run channel).
    Plain data only (Tune pickles its scheduler with the experiment state)."""

    def __init__(self, database_url: str):
        self.database_url = database_url

    def __call__(self, trial_id: int, run_id: str | None, reason: str) -> None:
        import ray

        from service.ray_backend import channel_name

        with session_scope(_factory(self.database_url)) as s:
            t = s.get(Trial, trial_id)
            if t is not None and t.status == TrialStatus.RUNNING:
                t.reason = reason
                run_id = run_id or t.run_id
        if run_id:
            ray.get(ray.get_actor(channel_name(run_id)).request_stop.remote(), timeout=10)
            logger.info("trial %s (run %s): stop requested: %s", trial_id, run_id, reason)


# ------------------------------------------------------------------------------------------ callback
class TrialRecorder(tune.Callback):
    """Runs in this (driver) process: records trials Tune ended without ``run_trial`` finishing them (early
    stopped, errored, killed): trial status and reason, measurements, the run ended."""

    def __init__(self, database_url: str, sweep_id: str, stopper: SlowTrialStopper | None):
        # only plain data: Tune pickles its callbacks with the experiment state
        self.database_url, self.sweep_id, self.stopper = database_url, sweep_id, stopper

    @property
    def factory(self):  # noqa: ANN201
        return _factory(self.database_url)

    def on_trial_complete(self, iteration: int, trials: list, trial, **info: Any) -> None:  # noqa: ANN001
        self._close(trial, error=None)

    def on_trial_error(self, iteration: int, trials: list, trial, **info: Any) -> None:  # noqa: ANN001
        err = "the Tune trial failed"
        path = getattr(trial, "error_file", None)
        try:
            if path and Path(path).exists():
                lines = [ln for ln in Path(path).read_text().splitlines() if ln.strip()]
                err = " ".join(lines[-3:])[-1500:] or err
        except OSError:
            pass
        self._close(trial, error=err)

    def _close(self, trial, *, error: str | None) -> None:  # noqa: ANN001
        try:
            close_trial(self.factory, self.sweep_id, int(trial.config["trial_id"]),
                        early_stop_reason=self.stopper.reasons.get(trial.trial_id) if self.stopper else None,
                        error=error)
        except Exception:  # noqa: BLE001 - never break the Tune loop
            logger.exception("recording trial %s failed", trial)


def _drain_rest(run_id: str, factory) -> None:  # noqa: ANN001
    """Best effort: metrics still buffered in the run's channel actor (gone if its trial actor is gone)."""
    import ray

    from service.driver import Recorder
    from service.ray_backend import channel_name

    try:
        ch = ray.get_actor(channel_name(run_id))
        events = ray.get(ch.drain.remote(), timeout=5)
    except Exception:  # noqa: BLE001
        return
    Recorder(factory, run_id).apply([e for e in events if e.get("type") in ("metrics", "worker_error")])


def close_trial(factory, sweep_id: str, trial_id: int, *, early_stop_reason: str | None,  # noqa: ANN001
                error: str | None) -> None:
    """Record a trial Tune ended, unless ``run_trial`` already did (then nothing changes)."""
    with session_scope(factory) as s:
        t = s.get(Trial, trial_id)
        if t is None or t.status in TrialStatus.TERMINAL:
            return
        run_id = t.run_id
    if run_id:
        _drain_rest(run_id, factory)
    with session_scope(factory) as s:
        t = s.get(Trial, trial_id, populate_existing=True)
        if t is None or t.status in TrialStatus.TERMINAL:
            return
        create = SweepCreate.model_validate(get_sweep(s, sweep_id=sweep_id).spec)
        if early_stop_reason:
            status, run_to, reason = TrialStatus.EARLY_STOPPED, RunStatus.CANCELLED, early_stop_reason
        elif error:
            status, run_to, reason = TrialStatus.FAILED, RunStatus.FAILED, f"trial failed: {error}"
        else:
            status, run_to, reason = TrialStatus.FAILED, RunStatus.FAILED, "the trial ended without a result"
        t.status, t.reason = status, reason
        if t.run_id:
            m = measure_run(s, run_id=t.run_id, warmup_steps=create.budget.warmup_steps)
            record_measurement(s, t, m)
            run = store.get_run(s, run_id=t.run_id)
            if not RunStatus(run.status).terminal:
                try:
                    store.transition(s, run_id=t.run_id, to=run_to, reason=reason, actor="sweep-driver",
                                     summary=_summary(s, t.run_id, create.budget.warmup_steps, None))
                    if run.attempts:
                        store.finish_attempt(s, run_id=t.run_id, attempt=run.attempts, status=run_to.value,
                                             cause=reason[:500])
                except store.Conflict:
                    pass
    logger.info("trial %s: %s (%s)", trial_id, status, reason)


def _summary(session, run_id: str, warmup: int, recorder: Any, wall_s: float | None = None) -> dict[str, Any]:  # noqa: ANN001
    summ = store.summarize_metrics(session, run_id=run_id, warmup_steps=warmup)
    res = (recorder.summary if recorder is not None else None) or {}
    peaks = res.get("peak_memory_bytes_per_rank") or (recorder.peak_per_rank if recorder is not None else {})
    return {"steps_done": summ.get("steps_done", 0), "final_loss": summ.get("final_loss"),
            "mean_tokens_per_s": summ.get("mean_tokens_per_s"), "mean_mfu": summ.get("mean_mfu"),
            "peak_memory_bytes_per_rank": {str(k): int(v) for k, v in (peaks or {}).items()},
            "wall_time_s": wall_s}


# --------------------------------------------------------------------------------------------- trial
def prepare_trial_run(factory, sweep_id: str, trial_id: int, *, job_id: str | None, tune_trial_id: str,  # noqa: ANN001
                      dashboard_url: str | None = None) -> dict[str, Any] | None:
    """Create the trial's run (QUEUED -> STARTING in one transaction, so the scheduler never admits it; its Ray
    Job is the sweep's) and mark the trial RUNNING. None if the sweep ended or the trial is not PENDING."""
    from service.planner import Factors, predict_run

    with session_scope(factory) as s:
        sweep = get_sweep(s, sweep_id=sweep_id)
        t = s.get(Trial, trial_id)
        if sweep.status in SweepStatus.TERMINAL or t is None or t.status != TrialStatus.PENDING:
            return None
        create = SweepCreate.model_validate(sweep.spec)
        spec = trial_spec(create, t.layout, t.micro_batch_size, name=f"{sweep.name}-t{t.id}",
                          labels={"sweep": sweep_id, "trial": str(t.id)})
        plan = build_plan(spec)
        info = sweep.calibration or {}
        if info.get("cluster"):
            try:
                pred = predict_run(spec, plan, ClusterSpec.model_validate(info["cluster"]),
                                   factors=Factors.from_dict(info.get("factors_before")))
                plan = plan.model_copy(update={"predicted": pred})
            except Exception:  # noqa: BLE001 - the prediction is informative only
                logger.exception("predicting trial %s failed", trial_id)
        run, _ = store.create_run(s, spec=spec.model_dump(mode="json"), plan=plan.model_dump(mode="json"),
                                  project=sweep.project, name=spec.name, priority=spec.resources.priority,
                                  created_by=sweep.created_by, sweep_id=sweep_id)
        store.transition(s, run_id=run.id, to=RunStatus.STARTING, actor="sweep-driver",
                         reason=f"trial {t.id} of sweep {sweep_id}: started by Ray Tune (trial {tune_trial_id}) in "
                                f"Ray Job {job_id}", ray_job_id=job_id,
                         dashboard_url=f"{dashboard_url}/#/jobs/{job_id}" if dashboard_url and job_id else None)
        t.run_id, t.status, t.reason = run.id, TrialStatus.RUNNING, None
        return {"run_id": run.id, "run_name": run.name, "spec": spec, "plan": plan,
                "warmup": create.budget.warmup_steps, "objective": sweep.objective}


TRAIN_FN_ENV = "MESHRUN_TRAIN_FN"
STOPPABLE_TRAIN_FN = "service.sweep_driver:train_stoppable"
DEFAULT_TRAIN_FN = "workers.loop:train"
STOP_POLL_S = 0.5
STOP_WAIT_S = 90.0


def _load_fn(path: str):  # noqa: ANN202
    import importlib

    mod, _, fn = path.partition(":")
    return getattr(importlib.import_module(mod), fn)


def train_stoppable(job, *, sink=None, on_checkpoint=None):  # noqa: ANN001, ANN201
    """The trial's train function (in each Ray Train worker): the configured one (``MESHRUN_TRAIN_FN`` or
    ``workers.loop:train``) with ``stop=``, which polls the run channel's ``should_stop`` (a sweep's early stop or
    a cancelled trial run); the loop all-gathers the votes, so all ranks stop after the same step. A configured
    function without a ``stop`` parameter runs as is (its trials cannot be stopped early, only ended)."""
    import inspect

    import ray

    from service.ray_backend import channel_name

    path = os.environ.get(TRAIN_FN_ENV) or DEFAULT_TRAIN_FN
    inner = _load_fn(DEFAULT_TRAIN_FN if path == STOPPABLE_TRAIN_FN else path)
    try:
        takes_stop = "stop" in inspect.signature(inner).parameters
    except (TypeError, ValueError):
        takes_stop = False
    if not takes_stop:
        return inner(job, sink=sink, on_checkpoint=on_checkpoint)
    channel = ray.get_actor(channel_name(job.run_id))
    state = {"at": 0.0, "stop": False}

    def stop() -> bool:
        now = time.monotonic()
        if not state["stop"] and now - state["at"] >= STOP_POLL_S:
            state["at"] = now
            try:
                state["stop"] = bool(ray.get(channel.should_stop.remote(), timeout=10))
            except Exception:  # noqa: BLE001 - a lost channel must not fail training
                pass
        return state["stop"]

    return inner(job, sink=sink, on_checkpoint=on_checkpoint, stop=stop)


def _safe_transition(factory, run_id: str, to: RunStatus, reason: str, **fields: Any) -> bool:  # noqa: ANN001
    try:
        with session_scope(factory) as s:
            store.transition(s, run_id=run_id, to=to, reason=reason, actor="sweep-driver", **fields)
        return True
    except store.Conflict as e:
        logger.info("not moving run %s to %s: %s", run_id, to.value, e)
        return False


def run_trial(config: dict[str, Any]) -> None:
    """One Tune trial = one run: its TorchTrainer built like the run driver's, the objective reported to Tune.

    Stops (the scheduler's early stop, a cancelled trial run) go through the run channel: the workers stop after
    their current step and ``fit()`` returns normally, releasing the Train placement group."""
    import ray

    from service.driver import Recorder, _drain_loop, _final_drain, build_trainer, failure_text
    from service.ray_backend import RunChannel, channel_name, trim

    settings = Settings()
    factory = _factory(settings)
    sweep_id, trial_id = config["sweep_id"], int(config["trial_id"])
    tune_trial_id = tune.get_context().get_trial_id()
    prep = prepare_trial_run(factory, sweep_id, trial_id, job_id=config.get("job_id"), tune_trial_id=tune_trial_id,
                             dashboard_url=config.get("dashboard_url"))
    if prep is None:
        tune.report({METRIC: 0.0, TIME_ATTR: 0, "final": True, "failed": True, "not_run": True})
        return
    run_id, spec, plan, warmup, objective = (prep["run_id"], prep["spec"], prep["plan"], prep["warmup"],
                                             prep["objective"])
    _safe_transition(factory, run_id, RunStatus.RUNNING, f"trial driver started (Tune trial {tune_trial_id})")

    channel = RunChannel.options(name=channel_name(run_id), get_if_exists=True).remote(run_id, 1)
    recorder = Recorder(factory, run_id)
    drain_stop = threading.Event()
    drainer = threading.Thread(target=_drain_loop, args=(channel, recorder, drain_stop), daemon=True,
                               name="trial-drain")
    drainer.start()
    box: dict[str, Any] = {}
    if os.environ.get(TRAIN_FN_ENV) != STOPPABLE_TRAIN_FN:
        os.environ[TRAIN_FN_ENV] = STOPPABLE_TRAIN_FN  # read by build_trainer (this trial actor's process only)

    def fit() -> None:
        try:
            run = SimpleNamespace(id=run_id, name=prep["run_name"], resume_from=None)
            trainer = build_trainer(run=run, spec=spec, plan=plan, placement=None, channel=channel,
                                    settings=settings, submission=1)
            trainer.fit()
            box["ok"] = True
        except BaseException as e:  # noqa: BLE001 - reported below
            box["error"] = e

    t0 = time.time()
    fitter = threading.Thread(target=fit, daemon=True, name="trial-fit")
    fitter.start()
    reported, external, stop_sent_at = 0, None, None
    m = None
    try:
        while fitter.is_alive():
            fitter.join(REPORT_INTERVAL_S)
            with session_scope(factory) as s:
                run_status = RunStatus(store.get_run(s, run_id=run_id).status)
                m = measure_run(s, run_id=run_id, warmup_steps=warmup)
                t = s.get(Trial, trial_id)
                if t is not None and t.status == TrialStatus.RUNNING:
                    record_measurement(s, t, m)
            if run_status.terminal and external is None:  # cancelled (the trial's run, the sweep) meanwhile
                external = run_status
                channel.request_stop.remote()
                stop_sent_at = time.monotonic()
            if stop_sent_at is not None:
                if time.monotonic() - stop_sent_at > STOP_WAIT_S:
                    logger.warning("trial %s: workers did not stop within %.0fs; leaving them to Tune", trial_id,
                                   STOP_WAIT_S)
                    break
                continue
            if m.steps_measured > reported and m.objective(objective) is not None:
                reported = m.steps_measured
                tune.report({METRIC: float(m.objective(objective)), TIME_ATTR: m.steps_measured,
                             "step": m.steps_done, "run_id": run_id, "final": False})
    finally:
        drain_stop.set()
        drainer.join(timeout=5)
        _final_drain(channel, recorder)

    wall = time.time() - t0
    try:
        stop_requested = bool(ray.get(channel.should_stop.remote(), timeout=10))
    except Exception:  # noqa: BLE001
        stop_requested = False
    early = None
    with session_scope(factory) as s:
        t = s.get(Trial, trial_id)
        if box.get("ok") and stop_requested and external is None and t is not None:
            early = t.reason or "early-stopped by the sweep's scheduler"
    if external is not None:
        outcome, reason = None, f"run ended externally ({external.value})"
    elif early is not None:
        outcome, reason = RunStatus.CANCELLED, early
    elif box.get("ok"):
        outcome, reason = RunStatus.SUCCEEDED, "training finished"
    else:
        err = box.get("error")
        logger.error("trial %s failed: %s", trial_id, err)
        reason = trim(f"training failed: {failure_text(err, recorder)}" if err is not None else
                      "training ended without a result")
        outcome = RunStatus.FAILED
    with session_scope(factory) as s:
        m = measure_run(s, run_id=run_id, warmup_steps=warmup)
        summary = _summary(s, run_id, warmup, recorder, wall)
        if recorder.current_attempt is not None and outcome is not None:
            store.finish_attempt(s, run_id=run_id, attempt=recorder.current_attempt,
                                 status=outcome.value, cause=None if outcome == RunStatus.SUCCEEDED else reason[:500])
        t = s.get(Trial, trial_id)
        if t is not None:
            record_measurement(s, t, m)
            if t.status == TrialStatus.RUNNING and outcome is not None:
                t.status = {RunStatus.SUCCEEDED: TrialStatus.SUCCEEDED,
                            RunStatus.CANCELLED: TrialStatus.EARLY_STOPPED}.get(outcome, TrialStatus.FAILED)
                t.reason = None if outcome == RunStatus.SUCCEEDED else reason
            elif t.status == TrialStatus.RUNNING and external is not None:  # someone else ended the run
                run = store.get_run(s, run_id=run_id)
                t.status = TrialStatus.CANCELLED if external == RunStatus.CANCELLED else TrialStatus.FAILED
                t.reason = f"run {external.value.lower()}: {run.status_reason}"
    if outcome is not None:
        _safe_transition(factory, run_id, outcome, reason, summary=summary)
    logger.info("trial %s (run %s): %s in %.1fs, %s=%s", trial_id, run_id, outcome.value if outcome else external,
                wall, objective, m.objective(objective) if m else None)
    value = m.objective(objective) if m is not None else None
    try:
        ray.kill(channel)  # the Train run has ended; nothing reports to the channel any more
    except Exception:  # noqa: BLE001
        pass
    tune.report({METRIC: float(value or 0.0), TIME_ATTR: m.steps_measured if m else 0, "run_id": run_id,
                 "final": True, "failed": outcome not in (RunStatus.SUCCEEDED, RunStatus.CANCELLED)})


# ---------------------------------------------------------------------------------------------- main
def _job_id() -> str | None:
    """This Ray Job's submission id (Ray passes it in the driver's job config metadata, not as a variable)."""
    found = next((os.environ[k] for k in JOB_ID_ENVS if os.environ.get(k)), None)
    if found:
        return found
    try:
        import json

        from ray._private import ray_constants

        cfg = json.loads(os.environ.get(ray_constants.RAY_JOB_CONFIG_JSON_ENV_VAR) or "{}")
        return (cfg.get("metadata") or {}).get("job_submission_id") or None
    except Exception:  # noqa: BLE001 - the sweep row has it too
        return None


def run_sweep(factory, settings: Settings, sweep_id: str) -> str:  # noqa: ANN001
    """Run the sweep's Tuner; returns how the Tuner ended ('done' | 'cancelled: ...' | 'failed: ...')."""
    import ray

    job_id = _job_id()
    with session_scope(factory) as s:
        sweep = get_sweep(s, sweep_id=sweep_id)
        if sweep.status in SweepStatus.TERMINAL:
            return "done"
        job_id = job_id or sweep.ray_job_id
        create = SweepCreate.model_validate(sweep.spec)
        pending = [t for t in s.query(Trial).filter(Trial.sweep_id == sweep_id, Trial.status == TrialStatus.PENDING)]
        pending.sort(key=lambda t: (-(t.predicted_tokens_per_s or 0.0), t.id))
        ids = [t.id for t in pending]
        sweep.status = SweepStatus.RUNNING
        sweep.status_reason = f"running {len(ids)} trials with Ray Tune (Ray Job {job_id})"
        if job_id:
            sweep.ray_job_id = job_id
    if not ids:
        return "done"
    ray.init(logging_level=logging.WARNING, log_to_driver=True)
    measured = create.budget.steps_per_trial - create.budget.warmup_steps
    stopper = SlowTrialStopper(grace_steps=max(1, measured // 2), on_stop=GracefulStop(settings.database_url)) \
        if create.early_stopping else None
    storage = Path(settings.data_dir) / "tune"
    storage.mkdir(parents=True, exist_ok=True)
    tuner = tune.Tuner(
        tune.with_resources(run_trial, TRIAL_RESOURCES),
        param_space={"sweep_id": sweep_id, "job_id": job_id, "dashboard_url": os.environ.get(DASHBOARD_ENV),
                     "trial_id": tune.grid_search(ids)},
        tune_config=tune.TuneConfig(metric=METRIC, mode="max", max_concurrent_trials=create.budget.max_concurrent_trials,
                                    scheduler=stopper, reuse_actors=False),
        run_config=tune.RunConfig(name=f"{sweep_id}-{int(time.time())}", storage_path=str(storage), verbose=0,
                                  callbacks=[TrialRecorder(settings.database_url, sweep_id, stopper)],
                                  failure_config=tune.FailureConfig(max_failures=0)),
    )
    try:
        tuner.fit()
    except KeyboardInterrupt as e:
        return f"cancelled: sweep driver stopped ({e})"
    return "done"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="meshrun sweep driver (a Ray Job entrypoint)")
    ap.add_argument("--sweep-id", required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = Settings()
    factory = _factory(settings)

    terminated: list[int] = []

    def _on_term(signum, _frame):  # noqa: ANN001
        terminated.append(signum)
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _on_term)
    t0 = time.time()
    try:
        how = run_sweep(factory, settings, args.sweep_id)
    except KeyboardInterrupt as e:
        how = f"cancelled: sweep driver stopped ({e})"
    except Exception as e:  # noqa: BLE001
        logger.exception("sweep %s failed", args.sweep_id)
        how = f"failed: {type(e).__name__}: {e}"
    if terminated and not how.startswith("cancelled"):  # Tune swallowed the interrupt: the job was stopped
        how = f"cancelled: Ray Job stopped (signal {terminated[0]})"
    if how.startswith("cancelled"):
        sweep = finish_sweep(factory, args.sweep_id, cancelled=how.split(": ", 1)[1])
    elif how.startswith("failed"):
        sweep = finish_sweep(factory, args.sweep_id, failure=how.split(": ", 1)[1])
    else:
        sweep = finish_sweep(factory, args.sweep_id)
    logger.info("sweep %s: %s (%s) in %.1fs", args.sweep_id, sweep.status, sweep.status_reason, time.time() - t0)
    return 0 if sweep.status == SweepStatus.SUCCEEDED else 1


if __name__ == "__main__":
    # run from the imported module, not __main__: Tune pickles ``run_trial`` and the callbacks, which must be
    # importable by reference in the trial actors
    from service.sweep_driver import main as _main

    sys.exit(_main())

"""The run driver: the entrypoint of a run's Ray Job (``python -m service.driver --run-id ID``).

The service submits it with the database URL and the placement in the job's ``runtime_env`` env vars. It:
1. loads the run, moves it STARTING -> RUNNING (an event naming the Ray Job);
2. creates the run's channel actor and builds a ``TorchTrainer`` from the plan and placement (one worker per
   rank, resources per worker, per-worker node pinning, ``FailureConfig(max_failures)``, a unique Train run
   name per submission, short ``TorchConfig.timeout_s``);
3. while ``fit()`` runs, drains the channel every ``DRAIN_INTERVAL_S`` into the database: attempts (with their
   cause and the rank -> node map), per-step metrics (upsert per attempt/step), persisted checkpoints;
4. ends the run SUCCEEDED with its summary, or FAILED with the workers' exception text.
   On SIGTERM (``stop_job`` after a cancel) it drains once more and leaves the run CANCELLED. A terminal state set
   meanwhile by someone else (cancel) is never overwritten (``store.transition`` raises Conflict).

Debugging aid: ``MESHRUN_TRAIN_FN=pkg.module:function`` (in the service's environment, passed through) replaces
``workers.loop.train`` inside the Ray Train workers (same signature).
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
from typing import Any

from api.schemas import Plan, RunSpec, RunStatus
from service import store
from service.db import make_engine, make_sessionmaker, session_scope
from service.settings import Settings

logger = logging.getLogger("meshrun.driver")

DRAIN_INTERVAL_S = 0.5
TORCH_TIMEOUT_S = int(os.environ.get("MESHRUN_TORCH_TIMEOUT_S", "120"))
PLACEMENT_ENV = "MESHRUN_PLACEMENT"
SUBMISSION_ENV = "MESHRUN_SUBMISSION"


def dir_size_bytes(path: str) -> int | None:
    p = Path(path)
    if not p.exists():
        return None
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


class Recorder:
    """Writes what the channel collected into the run database (only the driver writes)."""

    def __init__(self, factory, run_id: str):  # noqa: ANN001
        self.factory = factory
        self.run_id = run_id
        self.current_attempt: int | None = None
        self.worker_errors: list[str] = []
        self.summary: dict[str, Any] | None = None
        self.rank_nodes: dict[str, str] | None = None
        self.peak_per_rank: dict[str, int] = {}
        self.lock = threading.Lock()

    def apply(self, events: list[dict[str, Any]]) -> None:
        if not events:
            return
        with self.lock, session_scope(self.factory) as s:
            for ev in events:
                kind = ev.get("type")
                if kind == "attempt":
                    if self.current_attempt is not None:
                        store.finish_attempt(s, run_id=self.run_id, attempt=self.current_attempt, status="FAILED",
                                             cause=self.worker_errors[-1] if self.worker_errors else None)
                    att = store.start_attempt(s, run_id=self.run_id, cause=ev.get("cause") or "start",
                                              train_run_name=os.environ.get("MESHRUN_TRAIN_RUN_NAME"))
                    if att.attempt != ev["attempt"]:
                        logger.warning("attempt numbering differs: db %s, channel %s", att.attempt, ev["attempt"])
                    self.current_attempt = ev["attempt"]
                    ranks = sorted(ev.get("ranks") or [], key=lambda r: r["rank"])
                    self.rank_nodes = {str(r["rank"]): r["node_id"] for r in ranks}
                    run = store.get_run(s, run_id=self.run_id)
                    run.rank_nodes = self.rank_nodes
                    store.add_event(s, run_id=self.run_id, kind="placement",
                                    reason="rank -> node: " + json.dumps(
                                        {str(r["rank"]): f"{r['node_id'][:12]} pid {r['pid']}" for r in ranks}))
                elif kind == "metrics":
                    rows = []
                    for r in ev["rows"]:
                        r = dict(r)
                        per = r.pop("peak_memory_bytes_per_rank", None)
                        if per:
                            for i, v in enumerate(per):
                                self.peak_per_rank[str(i)] = max(self.peak_per_rank.get(str(i), 0), int(v))
                        rows.append(r)
                    store.add_metrics(s, run_id=self.run_id, attempt=ev["attempt"], rows=rows)
                elif kind == "checkpoint":
                    if ev.get("step") is None:
                        continue
                    store.add_checkpoint(s, run_id=self.run_id, attempt=ev.get("attempt_reported") or ev["attempt"],
                                         step=int(ev["step"]), path=ev["path"], size_bytes=dir_size_bytes(ev["path"]))
                    store.add_event(s, run_id=self.run_id, kind="checkpoint",
                                    reason=f"checkpoint of step {ev['step']} at {ev['path']}")
                elif kind == "worker_error":
                    self.worker_errors.append(ev["text"])
                    store.add_event(s, run_id=self.run_id, kind="worker_error",
                                    reason=_trim(f"attempt {ev['attempt']} failed: {ev['text']}"))
                elif kind == "done":
                    self.summary = ev.get("summary") or {}


def _trim(text: str) -> str:
    from service.ray_backend import trim

    return trim(text)


def _safe_transition(factory, run_id: str, to: RunStatus, reason: str, **fields: Any) -> bool:  # noqa: ANN001
    try:
        with session_scope(factory) as s:
            store.transition(s, run_id=run_id, to=to, reason=reason, actor="driver", **fields)
        return True
    except store.Conflict as e:
        logger.info("not moving run %s to %s: %s", run_id, to.value, e)
        return False


def build_trainer(*, run, spec: RunSpec, plan: Plan, placement: dict[str, Any], channel, settings: Settings,  # noqa: ANN001
                  submission: int):
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from service.placement import Placement
    from service.ray_backend import ChannelCallback

    p = Placement.from_json(placement) if placement else None
    if p is not None and p.fits:
        scaling = ScalingConfig(**p.scaling_kwargs())
    else:
        from service.placement import worker_resources

        res = worker_resources(plan)
        scaling = ScalingConfig(num_workers=plan.world_size, use_gpu=bool(res.get("GPU")),
                                resources_per_worker=res, placement_strategy=plan.placement_strategy)
    storage = spec.checkpoint.storage or str(settings.checkpoint_root)
    if "://" not in storage:
        Path(storage).mkdir(parents=True, exist_ok=True)
    name = f"{run.id}-s{submission}"
    os.environ["MESHRUN_TRAIN_RUN_NAME"] = name
    config = {"run_id": run.id, "run_name": run.name, "spec": spec.model_dump(mode="json"),
              "plan": plan.model_dump(mode="json"), "channel": channel, "resume_from": run.resume_from,
              "local_checkpoint_root": str(Path(settings.data_dir) / "tmp"),
              "train_fn": os.environ.get("MESHRUN_TRAIN_FN") or None}
    return TorchTrainer(
        _train_fn(),
        train_loop_config=config,
        scaling_config=scaling,
        torch_config=TorchConfig(backend="nccl" if scaling.use_gpu else "gloo", timeout_s=TORCH_TIMEOUT_S),
        run_config=RunConfig(
            name=name, storage_path=storage,
            failure_config=FailureConfig(max_failures=spec.resources.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=spec.checkpoint.keep),
            callbacks=[ChannelCallback(channel)],
        ),
    )


def _train_fn():
    from workers.ray_worker import train_loop_per_worker

    return train_loop_per_worker


def _drain_loop(channel, recorder: Recorder, stop: threading.Event) -> None:  # noqa: ANN001
    import ray

    while not stop.wait(DRAIN_INTERVAL_S):
        try:
            recorder.apply(ray.get(channel.drain.remote(), timeout=30))
        except Exception:  # noqa: BLE001 - keep draining; the final drain reports errors
            logger.exception("draining the run channel failed")


def _final_drain(channel, recorder: Recorder) -> None:  # noqa: ANN001
    import ray

    try:
        recorder.apply(ray.get(channel.drain.remote(), timeout=30))
    except Exception:  # noqa: BLE001
        logger.exception("final drain failed")


def failure_text(e: BaseException, recorder: Recorder) -> str:
    from service.ray_backend import format_worker_exceptions

    failures = getattr(e, "worker_failures", None)
    if failures:
        return format_worker_exceptions(failures)
    if recorder.worker_errors:
        return recorder.worker_errors[-1]
    cause = getattr(e, "controller_failure", None)
    return f"{type(cause or e).__name__}: {cause or e}"


def _inspect_user_model(factory, run_id: str, spec: RunSpec, plan: Plan) -> Plan | None:  # noqa: ANN001
    """``service.inspect.inspect_in_driver`` (a Ray task in this job's runtime env): record the inspected size on
    the run's plan and an ``inspect`` event; on failure end the run FAILED with the reason (returns None)."""
    from service.inspect import InspectionFailed, describe, inspect_in_driver

    try:
        plan, info = inspect_in_driver(spec, plan)
    except InspectionFailed as e:
        _safe_transition(factory, run_id, RunStatus.FAILED, _trim(f"model inspection failed: {e.message}"))
        return None
    with session_scope(factory) as s:
        store.get_run(s, run_id=run_id).plan = plan.model_dump(mode="json")
        store.add_event(s, run_id=run_id, kind="inspect", reason=_trim(describe(info)))
    logger.info("run %s: %s", run_id, describe(info))
    return plan


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="meshrun run driver (a Ray Job entrypoint)")
    ap.add_argument("--run-id", required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = Settings()
    engine = make_engine(settings.database_url)
    factory = make_sessionmaker(engine)
    run_id = args.run_id
    submission = int(os.environ.get(SUBMISSION_ENV, "1"))
    placement = json.loads(os.environ.get(PLACEMENT_ENV) or "null")

    with session_scope(factory) as s:
        run = store.get_run(s, run_id=run_id)
        spec = RunSpec.model_validate(run.spec)
        plan = Plan.model_validate(run.plan) if run.plan else None
        first_attempt = (run.attempts or 0) + 1
    if plan is None:
        from api.validation import build_plan

        plan = build_plan(spec)
    job_id = os.environ.get("MESHRUN_RAY_JOB_ID") or "?"
    if not _safe_transition(factory, run_id, RunStatus.RUNNING, f"driver started (Ray Job {job_id})"):
        return 0

    import ray

    # the explicit GCS address: "auto" resolution can pick another cluster on a shared machine
    ray.init(address=os.environ.get("MESHRUN_RAY_GCS_ADDRESS") or None, logging_level=logging.WARNING,
             log_to_driver=True)
    if spec.model.entrypoint:  # a user model: inspect it on the meta device before any worker starts (issue 11)
        plan = _inspect_user_model(factory, run_id, spec, plan)
        if plan is None:
            return 1

    from service.ray_backend import RunChannel, channel_name

    channel = RunChannel.options(name=channel_name(run_id), get_if_exists=True).remote(run_id, first_attempt)
    recorder = Recorder(factory, run_id)
    stop = threading.Event()
    drainer = threading.Thread(target=_drain_loop, args=(channel, recorder, stop), daemon=True,
                               name="meshrun-drain")
    drainer.start()

    def _on_term(signum, _frame):  # noqa: ANN001
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _on_term)
    t0 = time.time()
    outcome, reason, exit_code = RunStatus.FAILED, "driver ended without a result", 1
    try:
        trainer = build_trainer(run=run, spec=spec, plan=plan, placement=placement, channel=channel,
                                settings=settings, submission=submission)
        trainer.fit()
        outcome, reason, exit_code = RunStatus.SUCCEEDED, "training finished", 0
    except KeyboardInterrupt as e:
        outcome, reason, exit_code = RunStatus.CANCELLED, f"driver stopped ({e})", 1
    except Exception as e:  # noqa: BLE001
        logger.exception("training failed")
        _final_drain(channel, recorder)
        reason = _trim(f"training failed: {failure_text(e, recorder)}")
    finally:
        stop.set()
        drainer.join(timeout=5)
        _final_drain(channel, recorder)

    wall = time.time() - t0
    with session_scope(factory) as s:
        summ = store.summarize_metrics(s, run_id=run_id)
        if recorder.current_attempt is not None:
            store.finish_attempt(s, run_id=run_id, attempt=recorder.current_attempt,
                                 status="SUCCEEDED" if outcome == RunStatus.SUCCEEDED else outcome.value,
                                 cause=None if outcome == RunStatus.SUCCEEDED else reason[:500])
    res = recorder.summary or {}
    peaks = res.get("peak_memory_bytes_per_rank") or recorder.peak_per_rank
    summary = {"steps_done": summ.get("steps_done", 0), "final_loss": summ.get("final_loss"),
               "mean_tokens_per_s": summ.get("mean_tokens_per_s"), "mean_mfu": summ.get("mean_mfu"),
               "peak_memory_bytes_per_rank": {str(k): int(v) for k, v in (peaks or {}).items()},
               "wall_time_s": wall}
    if outcome == RunStatus.CANCELLED:
        # the service moved it to CANCELLED before stopping the job; otherwise (job stopped from the dashboard)
        _safe_transition(factory, run_id, RunStatus.CANCELLED, "Ray Job stopped", summary=summary)
    else:
        _safe_transition(factory, run_id, outcome, reason, summary=summary)
    logger.info("run %s: %s (%s) in %.1fs", run_id, outcome.value, reason[:200], wall)
    return exit_code


if __name__ == "__main__":
    sys.exit(main())

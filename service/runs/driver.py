"""The run driver: the entrypoint of a run's Ray Job (``python -m service.runs.driver --run-id ID``).

The service submits it with the database URL and the placement in the job's ``runtime_env`` env vars. It follows
the run lifecycle (``service.runs.lifecycle``):

1. loads the run, moves it STARTING -> RUNNING (an event naming the Ray Job);
2. a user model (``model.entrypoint``) is inspected on the meta device first (``service.runs.inspect``);
3. opens the run's channel and builds the ``TorchTrainer`` from the plan and the placement
   (``service.runs.trainer``); while ``fit()`` runs the channel is drained into the database;
4. ends the run SUCCEEDED with its summary, or FAILED with the workers' exception text. On SIGTERM (``stop_job``
   after a cancel) it drains once more and leaves the run CANCELLED. A terminal state set meanwhile by someone else
   (a cancel) is never overwritten.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

import ray
from sqlalchemy.orm import Session

from api.spec import Plan, RunSpec, RunStatus
from api.spec.validation import build_plan
from service import store
from service.cluster.env import WARM_POOL_ENV
from service.cluster.gcs_view import gcs_port_answers
from service.cluster.jobs import channel_name, trim
from service.cluster.placement import Placement
from service.runs.disk_full import is_disk_full, retry_after_disk_full
from service.runs.inspect import InspectionFailed, describe, inspect_in_driver
from service.runs.lifecycle import Outcome, RunLifecycle, failure_text, one_sentence
from service.runs.naming import RunStart, train_run_name
from service.runs.preemption import preemption_reason, watch_preempt_requests
from service.runs.tracking import track_run
from service.runs.warm_start import NotOneNode, cold_reason, fit_warm, record_failure, restarts_left, warm_pool
from service.security.paths import project_checkpoint_root
from service.settings import Settings
from service.store.db import make_engine, make_sessionmaker, session_scope

logger = logging.getLogger("meshrun.driver")

PLACEMENT_ENV = "MESHRUN_PLACEMENT"
SUBMISSION_ENV = "MESHRUN_SUBMISSION"
JOB_ID_ENV = "MESHRUN_RAY_JOB_ID"
GCS_ADDRESS_ENV = "MESHRUN_RAY_GCS_ADDRESS"


def _inspect_user_model(life: RunLifecycle, spec: RunSpec, plan: Plan) -> Plan | None:
    """``inspect_in_driver`` (a Ray task in this job's runtime env): record the inspected size on the run's plan and
    an ``inspect`` event; on failure end the run FAILED with the reason (returns None)."""
    try:
        plan, info = inspect_in_driver(spec, plan)
    except InspectionFailed as e:
        life.request(RunStatus.FAILED, trim(f"model inspection failed: {e.message}"))
        return None
    if not record_inspection(life, plan, describe(info)):
        return None  # revoked meanwhile: the run is no longer this driver's
    logger.info("run %s: %s", life.run_id, describe(info))
    return plan


def record_inspection(life: RunLifecycle, plan: Plan, text: str) -> bool:
    """The inspected plan on the run and an ``inspect`` event, behind the driver's write fence (False: revoked,
    nothing written)."""

    def write(s: Session) -> None:
        store.get_run(s, run_id=life.run_id).plan = plan.model_dump(mode="json")
        store.add_event(s, run_id=life.run_id, kind="inspect", reason=trim(text))

    return life.write("the model inspection", write)


def head_lost(address: str | None, *, checks: int = 3) -> str | None:
    """Why the Ray head is gone (its GCS port refuses connections ``checks`` times, a second apart), else None. A
    driver whose ``fit()`` failed because the head died leaves the run to the service, which restarts the head and
    resumes the run ("Ray head lost"), instead of ending it FAILED with a socket error."""
    if not address:
        return None
    why = None
    for i in range(checks):
        why = gcs_port_answers(address)
        if why is None:
            return None
        if i + 1 < checks:
            time.sleep(1.0)
    return why


RAY_SYSTEM_ERRORS = ("ActorUnavailableError", "ActorDiedError", "RaySystemError", "RpcError", "Socket closed")
HEAD_VERDICT_S = 30.0  # how long a driver whose actors vanished waits for the service's verdict on the head


def _ray_system_error(error: BaseException) -> bool:
    """Ray's own machinery failed (an actor unreachable, a closed socket), not the user's code."""
    chain: list[BaseException] = []
    e: BaseException | None = error
    while e is not None and len(chain) < 10:
        chain.append(e)
        e = e.__cause__ or e.__context__
    text = " ".join(f"{type(x).__name__}: {x}" for x in chain)
    return any(k in text for k in RAY_SYSTEM_ERRORS)


def _head_verdict(factory: Any, run_id: str, job_id: str | None, address: str | None) -> str | None:
    """After a Ray system error: was the head lost? The service restarts a dead head within seconds, on the same
    port, so a GCS port that answers again proves nothing; the service's verdict does: it requeues the runs of a
    lost head, which revokes this driver (``store.fence``). Waits up to HEAD_VERDICT_S for that (or for the port
    to refuse), then lets the error stand."""
    deadline = time.monotonic() + HEAD_VERDICT_S
    while time.monotonic() < deadline:
        with session_scope(factory) as s:
            if not store.fence(s, run_id=run_id, job_id=job_id):
                return "the service requeued the run after its Ray head was lost"
        why = gcs_port_answers(address) if address else None
        if why is not None:
            return why
        time.sleep(1.0)
    return None


ELASTIC_VERDICT_S = 60.0  # how long an elastic run's driver waits for the service to re-plan it after a node loss
NODE_DEATH_S = 30.0  # how long Ray may take to mark a lost node dead (its health checks)
NODE_LOSS_WORDS = ("NodeDied", "ActorDied", "node died", "closed by peer", "reset by peer", "remote worker")


def _dead_nodes(rank_nodes: dict[str, str] | None) -> list[str]:
    """The run's nodes that Ray no longer lists alive."""
    if not rank_nodes:
        return []
    try:
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    except Exception:
        return []
    return sorted({n for n in rank_nodes.values() if n not in alive})


def _elastic_verdict(life: RunLifecycle, error: BaseException) -> bool:
    """An elastic run whose workers failed, maybe because a node was lost: the service re-plans such a run (it
    re-queues it in a smaller layout, which revokes this driver) once Ray has marked the node dead, which takes up to
    its health-check timeout. Wait for that instead of ending the run FAILED: up to ELASTIC_VERDICT_S when the error
    looks like a lost peer or one of the run's nodes is dead, else NODE_DEATH_S. True: the service took the run over
    (this driver just ends)."""
    text = f"{type(error).__name__}: {error} " + " ".join(life.recorder.worker_errors)
    looks_lost = _ray_system_error(error) or any(w in text for w in NODE_LOSS_WORDS)
    start = time.monotonic()
    try:
        while True:
            with session_scope(life.factory) as s:
                if not store.fence(s, run_id=life.run_id, job_id=life.job_id):
                    return True
            if _dead_nodes(life.recorder.rank_nodes):
                looks_lost = True
            if time.monotonic() - start > (ELASTIC_VERDICT_S if looks_lost else NODE_DEATH_S):
                return False
            time.sleep(1.0)
    except KeyboardInterrupt:  # the service stopped this job after taking the run over
        return True


def _retried_after_disk_full(life: RunLifecycle, spec: RunSpec, settings: Settings, error: BaseException) -> bool:
    """A full disk failed the run: requeued by its failure policy once space returns (``service.runs.disk_full``)."""
    if not is_disk_full(error, life.recorder.worker_errors):
        return False
    storage = spec.checkpoint.storage
    # the service's data_dir (its database), and where the checkpoints go: the run's own storage, or the service's
    # checkpoint root (often another disk than data_dir)
    ckpt: str | Path | None = storage if storage and "://" not in storage else None
    if not storage and settings.checkpoint_root is not None:
        ckpt = settings.checkpoint_root
    paths: list[str | Path] = [settings.data_dir, *([ckpt] if ckpt is not None else [])]
    return retry_after_disk_full(
        life.factory,
        run_id=life.run_id,
        job_id=life.job_id,
        attempt=life.recorder.current_attempt,
        sentence=one_sentence(failure_text(error, life.recorder.worker_errors)),
        max_failures=spec.resources.max_failures,
        space_paths=paths,
    )


def _drop_channel(run_id: str) -> None:
    """Kill this run's channel actor, so that the next driver of the run opens a fresh one."""
    try:
        ray.kill(ray.get_actor(channel_name(run_id)))
    except Exception:
        logger.debug("run %s: no channel actor to drop", run_id, exc_info=True)


def _on_term(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _actor_checkpoint_dir(
    spec: RunSpec, settings: Settings, run_id: str, sub: str, *, periodic_only: bool = True
) -> str | None:
    """Where the actor-based modes (async_ps servers, replica mode) checkpoint: ``<storage>/<run id>/<sub>`` (None:
    remote storage, or no every_steps where ``periodic_only``; replica mode also saves when preempted)."""
    if periodic_only and not spec.checkpoint.every_steps:
        return None
    storage = spec.checkpoint.storage or str(settings.checkpoint_root)
    if "://" in storage:
        logger.warning("run %s: %s checkpoints need a local directory, not %s: none written", run_id, sub, storage)
        return None
    local = Path(storage).expanduser()
    return str((local if local.is_absolute() else Path(settings.data_dir) / local) / run_id / sub)


def _run_async_ps(spec: RunSpec, plan: Plan, channel: Any, ckpt_dir: str | None) -> None:
    """layout.sync async_ps: parameter servers and workers as Ray actors (``workers.async_ps``), no TorchTrainer.
    Rows go to the run's channel as they come; a lost worker is a run event, not a failed attempt, and so is a
    lost parameter server (every server restored from the latest checkpoint in ``ckpt_dir``)."""
    from workers.async_ps import run_async_ps  # torch: imported by the drivers that need it only

    attempt = ray.get(channel.begin_attempt.remote({"cause": "start (async_ps: parameter servers)", "ranks": []}))

    def sink(row: dict[str, Any]) -> None:
        channel.metrics.remote(attempt, [row])

    def lost(worker: int, reason: str) -> None:
        channel.event.remote("worker_lost", f"{reason}; the run goes on, a replacement rejoins from the servers")

    def restored(servers: list[int], step: int, text: str) -> None:
        logger.warning("async_ps: %s", text)
        channel.event.remote("ps_restored", text)

    summary = run_async_ps(spec, plan, sink=sink, on_worker_lost=lost, ckpt_dir=ckpt_dir, on_ps_restored=restored)
    summary.pop("ps_restores", None)
    for key in ("final_params", "split"):
        summary.pop(key, None)
    ray.get(channel.done.remote(summary))


def _run_replicas(spec: RunSpec, plan: Plan, channel: Any, ckpt_dir: str | None) -> None:
    """fault_tolerance.mode replica: torchft replicas as Ray actors (``workers.replica_driver``), no TorchTrainer. A
    lost replica is a run event (replaced, healed from a peer), not a failed attempt; rows go to the channel as they
    come, each step once, with the replica count of that step."""
    from workers.control import ControlPoll
    from workers.replica_driver import run_replicas

    attempt = 0

    def start(ranks: list[dict[str, Any]]) -> None:
        nonlocal attempt
        lay = plan.layout
        each = f" of {lay.dp_shard} FSDP workers" if lay.dp_shard > 1 else ""
        cause = f"start (fault_tolerance replica: {lay.dp_replicate} torchft replicas{each})"
        attempt = ray.get(channel.begin_attempt.remote({"cause": cause, "ranks": ranks}))

    poll = ControlPoll(channel)

    def preempt_request() -> str | None:  # the service wants the workers back (``watch_preempt_requests``)
        got = poll()
        return str(got["preempt"]) if got and got.get("preempt") else None

    summary = run_replicas(
        spec,
        plan,
        sink=lambda row: channel.metrics.remote(attempt, [row]),
        on_event=lambda kind, text: channel.event.remote(kind, text),
        ckpt_dir=ckpt_dir,
        on_start=start,
        on_checkpoint=lambda step, path: channel.checkpoint.remote({"step": step, "path": path}),
        preempt_request=preempt_request,
    )
    summary.pop("losses", None)
    ray.get(channel.done.remote(summary))


def _fit_group(life: RunLifecycle, start: RunStart) -> None:
    """Group mode: in the service's warm pool when the run can start there (``service.runs.warm_start``), else, or
    after a failure there (one of ``max_failures``, from the latest checkpoint), a new Ray Train worker group. Ray
    Train (and torch with it) is imported only then: a warm run's driver starts without either."""
    max_failures: int | None = None
    why = cold_reason(start.spec, start.plan, start.placement)
    pool = warm_pool() if why is None else None
    if pool is not None:
        try:
            fit_warm(life, pool, start)
            return
        except NotOneNode as e:
            logger.info("run %s: %s; it starts a Ray Train worker group instead", start.run_id, e)
        except Exception as e:
            logger.exception("run %s: the attempt in the warm pool failed", start.run_id)
            record_failure(start.channel, e)
            max_failures = restarts_left(start.spec.resources.max_failures)
            if max_failures is None:
                raise
            life.recorder.drain(start.channel)  # its checkpoints recorded: resume from the latest
            with session_scope(life.factory) as s:
                ck = store.latest_checkpoint(s, run_id=start.run_id)
            start = start.resuming(ck.path if ck is not None else None)
    elif why is not None and os.environ.get(WARM_POOL_ENV):
        logger.info("run %s starts a Ray Train worker group: %s", start.run_id, why)
    from service.runs.trainer import build_trainer, placing_phase

    life.phase(placing_phase(start.plan))
    build_trainer(start, max_failures=max_failures).fit()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="meshrun run driver (a Ray Job entrypoint)")
    ap.add_argument("--run-id", required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = Settings()
    factory = make_sessionmaker(make_engine(settings.database_url))
    run_id = args.run_id
    submission = int(os.environ.get(SUBMISSION_ENV, "1"))
    placement_json = json.loads(os.environ.get(PLACEMENT_ENV) or "null")
    placement = Placement.from_json(placement_json) if placement_json else None

    with session_scope(factory) as s:
        run = store.get_run(s, run_id=run_id)
        spec = RunSpec.model_validate(run.spec)
        plan = Plan.stored(run.plan, spec.layout) if run.plan else build_plan(spec)  # old plans: flavours from spec
        run_name, resume_from, first_attempt = run.name, run.resume_from, (run.attempts or 0) + 1
        if spec.checkpoint.storage is None:  # each project's checkpoints under its own root (service.security.paths)
            own = project_checkpoint_root(settings, run.project)
            spec = spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(update={"storage": own})})
    name = train_run_name(run_id, submission)
    life = RunLifecycle(
        factory,
        run_id,
        actor="driver",
        train_run_name=name,
        job_id=os.environ.get(JOB_ID_ENV) or None,
        on_revoked=lambda: os.kill(os.getpid(), signal.SIGTERM),  # ends fit(); its workers end with this driver
        data_dir=str(settings.data_dir),
        hang_timeout_s=spec.resources.hang_timeout_s,
        checkpoint_keep=spec.checkpoint.keep,
    )
    if not life.start(f"driver started (Ray Job {os.environ.get(JOB_ID_ENV) or '?'})"):
        return 0

    track_run(
        life,
        spec,
        plan,
        defaults=settings.tracking,
        data_dir=settings.data_dir,
        run_name=run_name,
        flush_timeout_s=settings.tracking_flush_timeout_s,
    )
    # the explicit GCS address: "auto" resolution can pick another cluster on a shared machine
    ray.init(address=os.environ.get(GCS_ADDRESS_ENV) or None, logging_level=logging.WARNING, log_to_driver=True)
    if spec.model.entrypoint:  # a user model: inspect it on the meta device before any worker starts
        inspected = _inspect_user_model(life, spec, plan)
        if inspected is None:
            return 1
        plan = inspected

    signal.signal(signal.SIGTERM, _on_term)
    t0 = time.time()
    error: Exception | None = None
    outcome = Outcome(RunStatus.FAILED, "driver ended without a result")
    try:
        with life.channel(first_attempt=first_attempt) as channel, watch_preempt_requests(factory, run_id, channel):
            try:
                if spec.layout.sync == "async_ps":
                    _run_async_ps(spec, plan, channel, _actor_checkpoint_dir(spec, settings, run_id, "ps"))
                elif spec.fault_tolerance.mode == "replica":
                    ckpt_dir = _actor_checkpoint_dir(spec, settings, run_id, "replica", periodic_only=False)
                    _run_replicas(spec, plan, channel, ckpt_dir)
                else:
                    start = RunStart(
                        run_id=run_id,
                        run_name=run_name,
                        spec=spec,
                        plan=plan,
                        placement=placement,
                        channel=channel,
                        settings=settings,
                        train_run_name=name,
                        resume_from=resume_from,
                        attempt=first_attempt,
                    )
                    _fit_group(life, start)
                outcome = Outcome.succeeded()
            except Exception as e:
                logger.exception("training failed")
                error = e
    except KeyboardInterrupt as e:
        # the service moved the run to CANCELLED before stopping the job; otherwise (stopped from the dashboard)
        outcome = Outcome(RunStatus.CANCELLED, f"Ray Job stopped ({e})")
    if error is not None:
        lost = head_lost(os.environ.get(GCS_ADDRESS_ENV))
        if not lost and _ray_system_error(error):
            lost = _head_verdict(factory, run_id, os.environ.get(JOB_ID_ENV) or None, os.environ.get(GCS_ADDRESS_ENV))
        if not lost and spec.elastic is not None and _elastic_verdict(life, error):
            logger.info("run %s: the service re-planned the run after a node loss; this driver ends", run_id)
            return 0
        if not lost and _retried_after_disk_full(life, spec, settings, error):
            return 0  # back in the queue once space returned; resumes from the latest checkpoint
        # after the channel's last drain: the workers' errors are recorded
        outcome = Outcome(None, f"Ray head lost: {lost}") if lost else life.failed(error)
    elif outcome.status == RunStatus.SUCCEEDED:
        notice = preemption_reason(life.recorder.summary, total_steps=spec.train.steps)
        if notice is not None:
            _drop_channel(run_id)  # the next driver must not find this one's channel with its preemption still set
            if life.requeue(notice):
                return 0  # back in the queue; the scheduler resumes it from the emergency checkpoint
    life.finish(outcome, wall_s=time.time() - t0)
    if life.recorder.trackers is not None:  # after the run's terminal state: catching up never delays it
        life.recorder.trackers.close(settings.tracking_flush_timeout_s)
    return 0 if outcome.status == RunStatus.SUCCEEDED else 1


if __name__ == "__main__":
    sys.exit(main())

"""Admission and reconciliation: the loop that turns QUEUED runs into Ray Jobs and keeps the database honest.

``Scheduler.tick()`` (called every ``settings.scheduler_interval_s`` by ``service.runtime.Runtime``):

- admit: QUEUED runs in ``store.queued_runs`` order (priority, then FIFO) are placed on the cluster's free
  resources minus what runs admitted moments ago will claim (their workers have not started yet). A run that
  fits moves to STARTING and gets one Ray Job (``python -m service.driver --run-id ...``, submission id
  ``meshrun-<run>-<n>``, metadata run id/name/project). One that does not keeps waiting, with the reason
  on the run ("needs 8 worker slots of 1 CPU; 3 free"); runs behind it wait too (strict order, no overtaking).
- reconcile: every STARTING/RUNNING run against its Ray Job: pending/running -> keep; gone, failed, stopped or
  finished without the driver having ended the run -> FAILED "driver lost" with Ray's message. Runs keep their
  metrics. Also done once at start-up.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from api.schemas import RunStatus
from service import store
from service.db import session_scope
from service.placement import NodeCapacity, Placement, add_reservations, place, reservation
from service.ray_backend import JobsBackend, submission_id, submission_number, trim

logger = logging.getLogger(__name__)

RESERVATION_TTL_S = 180.0
STARTING_GRACE_S = 30.0
PROJECT_ROOT = Path(__file__).resolve().parents[1]
PASS_THROUGH_ENV = ("MESHRUN_TORCH_TIMEOUT_S", "MESHRUN_TRAIN_FN", "MESHRUN_PG_TIMEOUT_S",
                    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S")


@dataclass
class _Pending:
    placement: Placement
    attempts_at_admission: int
    admitted_at: float = field(default_factory=time.monotonic)


class Scheduler:
    def __init__(self, *, settings: Any, session_factory: Any, cluster: Any, jobs: JobsBackend):
        self.settings = settings
        self.factory = session_factory
        self.cluster = cluster
        self.jobs = jobs
        self.pending: dict[str, _Pending] = {}
        self.last_error: str | None = None

    # ------------------------------------------------------------------------------------------- helpers
    def capacities(self) -> list[NodeCapacity]:
        return [NodeCapacity(node_id=n.node_id, total=n.total, free=n.free) for n in self.cluster.nodes()
                if n.alive]

    def runtime_env(self, run: Any, placement: Placement, n: int) -> dict[str, Any]:
        s = self.settings
        env = {
            "MESHRUN_DATABASE_URL": s.database_url,
            "MESHRUN_DATA_DIR": str(s.data_dir),
            "MESHRUN_CHECKPOINT_ROOT": str(s.checkpoint_root),
            "MESHRUN_LOG_LEVEL": s.log_level,
            "MESHRUN_PLACEMENT": json.dumps(placement.to_json()),
            "MESHRUN_SUBMISSION": str(n),
            "MESHRUN_RAY_JOB_ID": submission_id(run.id, n),
            # the driver connects to this GCS address (not "auto", which can pick another cluster on the machine)
            "MESHRUN_RAY_GCS_ADDRESS": "" if (self.cluster.address or "").startswith("ray://")
            else (self.cluster.address or ""),
            "PYTHONPATH": os.pathsep.join(p for p in (str(PROJECT_ROOT), os.environ.get("PYTHONPATH")) if p),
        }
        for k in PASS_THROUGH_ENV:
            if os.environ.get(k):
                env[k] = os.environ[k]
        renv: dict[str, Any] = {"env_vars": env}
        wd = os.environ.get("MESHRUN_RAY_WORKING_DIR")
        if wd:  # a remote cluster without meshrun installed: ship the code
            renv["working_dir"] = wd
            renv["excludes"] = [".git", "**/__pycache__", "*.db", "tests", "bench"]
        # user code (spec.code.working_dir) ships with the job too: working_dir, or py_modules when meshrun is it
        from service.inspect import add_user_code

        add_user_code(renv, run_id=run.id, session_factory=self.factory, settings=s)
        return renv

    # ------------------------------------------------------------------------------------------- tick
    def tick(self) -> None:
        for name, step in (("reconcile", self.reconcile), ("admit", self.admit)):
            try:
                step()
            except Exception as e:  # noqa: BLE001 - the loop must survive a flaky Ray/DB call
                msg = f"{name}: {type(e).__name__}: {e}"
                if msg != self.last_error:  # log a repeated failure once, not every tick
                    logger.exception("scheduler %s failed", name)
                self.last_error = msg
                if isinstance(e, (ConnectionError, OSError)) or "Connection" in type(e).__name__:
                    self.jobs.reset()
            else:
                if self.last_error and self.last_error.startswith(name):
                    logger.info("scheduler %s works again", name)
                    self.last_error = None

    def _reserved(self) -> dict[str, dict[str, float]]:
        now = time.monotonic()
        if not self.pending:
            return {}
        with session_scope(self.factory) as s:
            for run_id, p in list(self.pending.items()):
                try:
                    run = store.get_run(s, run_id=run_id)
                except store.NotFound:
                    self.pending.pop(run_id, None)
                    continue
                claimed = (run.attempts or 0) > p.attempts_at_admission  # workers are up
                if claimed or RunStatus(run.status).terminal or run.status == RunStatus.QUEUED.value \
                        or now - p.admitted_at > RESERVATION_TTL_S:
                    self.pending.pop(run_id, None)
        return add_reservations(*(reservation(p.placement) for p in self.pending.values()))

    def admit(self) -> list[str]:
        """Admit what fits; returns the admitted run ids."""
        with session_scope(self.factory) as s:
            queued = [(r.id, r.plan, r.name, r.project, r.ray_job_id, r.attempts or 0) for r in store.queued_runs(s)]
        if not queued:
            return []
        nodes = self.capacities()
        reserved = self._reserved()
        admitted: list[str] = []
        blocked_by: str | None = None
        for run_id, plan, name, project, old_job, attempts in queued:
            if plan is None:
                with session_scope(self.factory) as s:
                    store.transition(s, run_id=run_id, to=RunStatus.FAILED, reason="the run has no plan",
                                     actor="scheduler")
                continue
            if blocked_by is not None:
                with session_scope(self.factory) as s:
                    store.set_reason(s, run_id=run_id, reason=f"waiting behind run {blocked_by} (FIFO within "
                                                              "priority)")
                continue
            p = place(plan, nodes, reserved=reserved)
            if not p.fits:
                with session_scope(self.factory) as s:
                    store.set_reason(s, run_id=run_id, reason=p.reason)
                blocked_by = run_id
                continue
            if self._submit(run_id, name=name, project=project, placement=p, old_job=old_job, attempts=attempts):
                admitted.append(run_id)
                reserved = add_reservations(reserved, reservation(p))
        return admitted

    def _submit(self, run_id: str, *, name: str, project: str, placement: Placement, old_job: str | None,
                attempts: int) -> bool:
        n = submission_number(old_job) + 1
        sid = submission_id(run_id, n)
        dash = self.cluster.dashboard_url
        nodes_desc = ", ".join(f"{k[:12]}: {v}" for k, v in placement.workers_per_node.items())
        with session_scope(self.factory) as s:
            try:
                store.transition(s, run_id=run_id, to=RunStatus.STARTING, actor="scheduler",
                                 reason=f"admitted: {placement.world_size} workers ({nodes_desc}); Ray Job {sid}",
                                 allow_from=[RunStatus.QUEUED], ray_job_id=sid,
                                 dashboard_url=f"{dash}/#/jobs/{sid}" if dash else None)
            except store.Conflict:
                return False  # cancelled meanwhile
        run_stub = type("R", (), {"id": run_id})
        try:
            self.jobs.submit(entrypoint=f"{_python()} -m service.driver --run-id {run_id}", submission_id=sid,
                             metadata={"run_id": run_id, "name": name, "project": project, "meshrun": "run"},
                             runtime_env=self.runtime_env(run_stub, placement, n))
        except Exception as e:  # noqa: BLE001
            logger.exception("submitting run %s failed", run_id)
            self.jobs.reset()
            with session_scope(self.factory) as s:
                try:
                    store.transition(s, run_id=run_id, to=RunStatus.QUEUED, actor="scheduler",
                                     reason=trim(f"Ray Job submission failed, will retry: {e}", 1000),
                                     allow_from=[RunStatus.STARTING], ray_job_id=sid)
                except store.Conflict:
                    pass
            return False
        self.pending[run_id] = _Pending(placement=placement, attempts_at_admission=attempts)
        logger.info("run %s admitted as Ray Job %s", run_id, sid)
        return True

    def reconcile(self) -> list[str]:
        """Fail runs whose driver is gone. Returns their ids."""
        with session_scope(self.factory) as s:
            active = [(r.id, r.status, r.ray_job_id, dict(r.rank_nodes or {})) for r in store.active_runs(s)]
        lost: list[str] = []
        dead: set[str] | None = None
        for run_id, status, job_id, rank_nodes in active:
            stop_after = None
            if not job_id:
                if run_id in self.pending:
                    continue
                reason = "driver lost: the run has no Ray Job (the service stopped while admitting it)"
            else:
                state = self.jobs.state(job_id)
                if state.status in ("PENDING", "RUNNING"):
                    if status != RunStatus.RUNNING.value or not rank_nodes:
                        continue
                    if dead is None:
                        dead = {n.node_id for n in self.cluster.nodes() if not n.alive}
                    gone = sorted({n for n in rank_nodes.values() if n in dead})
                    if not gone:
                        continue
                    # Workers are pinned to their nodes: Ray Train would wait forever to restart them there.
                    reason = (f"node lost: {', '.join(g[:12] for g in gone)} of this run's workers died; "
                              "resume the run (POST /v1/runs/{id}/resume) to place it on the remaining nodes"
                              .replace("{id}", run_id))
                    stop_after, state = job_id, None  # FAILED first, so the stopped driver cannot overwrite it
                if state is not None:
                    reason = f"driver lost: Ray Job {job_id} is {state.status}"
                    if state.message:
                        reason += f": {state.message}"
            with session_scope(self.factory) as s:
                run = store.get_run(s, run_id=run_id)
                if RunStatus(run.status).terminal:  # the driver finished it meanwhile
                    continue
                try:
                    store.transition(s, run_id=run_id, to=RunStatus.FAILED, reason=trim(reason, 2000),
                                     actor="scheduler")
                    if run.attempts:
                        store.finish_attempt(s, run_id=run_id, attempt=run.attempts, status="FAILED",
                                             cause=reason.split(":", 1)[0])
                    summ = store.summarize_metrics(s, run_id=run_id)
                    run.summary = {k: v for k, v in summ.items() if k != "peak_memory_bytes"}
                except store.Conflict:
                    continue
            if stop_after:
                try:
                    self.jobs.stop(stop_after)
                except Exception:  # noqa: BLE001
                    logger.exception("stopping Ray Job %s failed", stop_after)
            self.pending.pop(run_id, None)
            lost.append(run_id)
            logger.warning("run %s: %s", run_id, reason)
        return lost


def _python() -> str:
    return "python"

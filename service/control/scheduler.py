"""Admission and reconciliation: the loop that turns QUEUED runs into Ray Jobs and keeps the database honest.

``Scheduler.tick()`` (called every ``settings.scheduler_interval_s`` by ``service.control.runtime.Runtime``):

- admit, in three steps (the Ray Train V2 controller's pattern): *observe* the QUEUED runs, the alive nodes' free
  resources and the reservations of runs admitted moments ago (their workers have not started yet); *decide* with
  ``service.control.priorities.plan_admission`` over ``service.control.admission.decide``, pure functions that write
  nothing (priority, then FIFO; strict order, no overtaking; project quotas; preemption victims; the reason of every
  wait: "needs 8 worker slots of 1 CPU; 3 free"); *act* on each decision, every state change asked of the run
  controller (``service.store.controller``: a typed result, refused when the run moved meanwhile): an admitted run
  moves to STARTING and gets one Ray Job (``python -m service.runs.driver --run-id ...``, submission id
  ``meshrun-<run>-<n>``, metadata run id/name/project, the placement in its environment); a waiting one gets the
  reason; a failed submission re-queues the run with the error. A sweep trial's run (``sweep_id`` set) joins the
  same queue: admitted, it only moves to STARTING (its sweep's driver waits for that, then starts its workers).
- reconcile: every STARTING/RUNNING run against its Ray Job: pending/running -> keep; gone, failed, stopped or
  finished without the driver having ended the run: "driver lost" with Ray's message, a failure of the run:
  re-queued from its latest checkpoint while ``max_failures`` allows, else FAILED (``service.control.recovery``);
  a running run whose pinned node died -> FAILED "node lost" (and its job stopped), unless it is elastic and a
  smaller layout within its bounds fits what remains: then it is re-queued at once in that layout from its latest
  checkpoint (``service.control.elastic``) and admitted once its old job has ended. Runs keep their metrics. Also
  done once at start-up.
- grow back: with nothing queued, an elastic run below its ``max_dp`` (or with a listed layout it would rather have)
  for which a better one fits the free resources is asked to checkpoint and yield (the preemption path); queued
  again, it gets the new layout.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from sqlalchemy.orm import Session, sessionmaker

from api.spec import Plan, RunSpec, RunStatus
from service import store
from service.cluster.env import job_runtime_env, python_command
from service.cluster.head import NodeView
from service.cluster.jobs import JobsBackend, submission_id, submission_number, trim
from service.cluster.placement import NodeCapacity, Placement, add_reservations, place, reservation
from service.control.admission import Candidate, Decision
from service.control.elastic import EVENT_KIND as ELASTIC_EVENT
from service.control.elastic import Replan, grow, held_per_node, lost_nodes, may_grow, replan, with_own
from service.control.priorities import AdmissionPlan, Holding, plan_admission
from service.control.recovery import DRIVER_LOST, resume_lost_driver
from service.runs.preemption import PREEMPT_REQUEST
from service.security.policy import resolve_code_dir
from service.settings import Settings
from service.store import controller
from service.store.db import session_scope

logger = logging.getLogger(__name__)

RESERVATION_TTL_S = 180.0
STARTING_GRACE_S = 30.0


@dataclass
class _Pending:
    placement: Placement
    attempts_at_admission: int
    admitted_at: float = field(default_factory=time.monotonic)


def job_message(message: str) -> str:
    """Ray's message of an ended job as one line: its first line, without the driver's log tail Ray appends
    ("Job entrypoint command failed with exit code -9, last available logs (truncated to 20,000 chars): ...")."""
    first = next((ln.strip() for ln in message.splitlines() if ln.strip()), "")
    first = first.split(", last available logs", 1)[0].rstrip(" :,.")
    return first if len(first) <= 300 else first[:297] + "..."


class ClusterView(Protocol):
    """What the scheduler reads of the Ray cluster (``service.cluster.head.RayCluster`` is one)."""

    @property
    def address(self) -> str | None: ...

    @property
    def dashboard_url(self) -> str | None: ...

    def nodes(self) -> list[NodeView]: ...


class Scheduler:
    def __init__(
        self, *, settings: Settings, session_factory: sessionmaker[Session], cluster: ClusterView, jobs: JobsBackend
    ):
        self.settings = settings
        self.factory = session_factory
        self.cluster = cluster
        self.jobs = jobs
        self.pending: dict[str, _Pending] = {}
        self.preempting: dict[str, str] = {}  # run asked to yield -> the run it yields to
        self.replanning: dict[str, str] = {}  # run re-queued by an elastic re-plan -> its previous Ray Job
        self.growing: dict[str, Replan] = {}  # elastic runs asked to yield at a checkpoint -> their larger layout
        self.growth_restored = False  # grow-backs asked before this scheduler started: read back once
        self.last_error: str | None = None

    # ------------------------------------------------------------------------------------------- helpers
    def capacities(self) -> list[NodeCapacity]:
        return [NodeCapacity(node_id=n.node_id, total=n.total, free=n.free) for n in self.cluster.nodes() if n.alive]

    def runtime_env(self, run_id: str, placement: Placement, n: int, *, code_dir: Path | None) -> dict[str, Any]:
        return job_runtime_env(
            self.settings,
            job_id=submission_id(run_id, n),
            gcs_address=self.cluster.address,
            dashboard_url=self.cluster.dashboard_url,
            extra_env={"MESHRUN_PLACEMENT": json.dumps(placement.to_json()), "MESHRUN_SUBMISSION": str(n)},
            code_dir=code_dir,
        )

    # ------------------------------------------------------------------------------------------- tick
    def tick(self) -> None:
        for name, step in (("reconcile", self.reconcile), ("admit", self.admit)):
            try:
                step()
            except Exception as e:
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
                if (
                    claimed
                    or RunStatus(run.status).terminal
                    or run.status == RunStatus.QUEUED.value
                    or now - p.admitted_at > RESERVATION_TTL_S
                ):
                    self.pending.pop(run_id, None)
        return add_reservations(*(reservation(p.placement) for p in self.pending.values()))

    def admit(self) -> list[str]:
        """One admission pass: observe (queue, nodes, reservations, runs holding workers), decide
        (``priorities.plan_admission``: quotas, ``admission.decide``, preemption victims; pure, nothing written),
        act (``_act_on``: reasons, preemption requests, and every state change through the run controller). Returns
        the admitted run ids. With nothing queued, elastic runs below their best layout may grow back (``_grow``)."""
        self._apply_growth()
        with session_scope(self.factory) as s:
            queued = store.queued_runs(s)
            queue = [Candidate(id=r.id, plan=r.plan, priority=r.priority or 0, queued_at=r.created_at) for r in queued]
            runs = {r.id: (r.name, r.project, r.ray_job_id, r.attempts or 0) for r in queued}
            trials = {r.id for r in queued if r.sweep_id}
            # sweep trials share their sweep's Ray Job and cannot checkpoint-and-yield: never preemption victims
            holding = [
                Holding(r.id, r.project, r.priority or 0, r.plan, dict(r.rank_nodes or {}), r.started_at)
                for r in store.active_runs(s)
                if not r.sweep_id
            ]
        # a victim that yielded and came back is a run like any other: it may be asked again
        self.preempting = {k: v for k, v in self.preempting.items() if k in {h.id for h in holding}}
        if not queue:
            self._grow()
            return []
        held = {run_id: self.replanning[run_id] for run_id in self._held()}
        plan = plan_admission(
            queue,
            {k: v[1] for k, v in runs.items()},
            holding,
            held,
            self.capacities(),
            self._reserved(),
            quotas=self.settings.project_max_workers,
            preemption=self.settings.preemption,
        )
        return self._act_on(plan, runs, trials)

    def _act_on(
        self, plan: AdmissionPlan, runs: dict[str, tuple[str, str, str | None, int]], trials: set[str]
    ) -> list[str]:
        """Carry out a decided admission pass; returns the admitted run ids."""
        for run_id, reason in plan.reasons.items():
            with session_scope(self.factory) as s:
                store.set_reason(s, run_id=run_id, reason=reason)
        if plan.preempt_for is not None:
            self._ask_to_yield(plan.preempt_for, plan.victims)
        admitted = []
        for d in plan.decisions:
            if d.candidate.id in trials:
                ok = self._act_trial(d, attempts=runs[d.candidate.id][3])
            else:
                ok = self._act(d, *runs[d.candidate.id])
            if ok:
                admitted.append(d.candidate.id)
        return admitted

    def _grow(self) -> None:
        """Elastic runs below their best layout while nothing waits: when a better one fits what is free (plus what
        the run holds), ask the run to checkpoint and yield (a ``preempt_request``: its driver re-queues it from the
        checkpoint); it gets the larger layout while queued (``_apply_growth``)."""
        with session_scope(self.factory) as s:
            runs = [
                (r.id, r.spec, r.plan, dict(r.rank_nodes or {}))
                for r in store.active_runs(s)
                if r.status == RunStatus.RUNNING.value and not r.sweep_id and r.plan and r.rank_nodes
                if (r.spec or {}).get("elastic")
            ]
        reserved = self._reserved()  # also forgets admitted runs whose workers are up
        # a run admitted moments ago still names its previous attempt's nodes, and its driver may not watch for
        # requests yet: it is judged once its workers are up
        skip = set(self.growing) | set(self.preempting) | set(self.pending)
        runs = [r for r in runs if r[0] not in skip]
        if not runs:
            return
        views = self.cluster.nodes()
        free = [
            NodeCapacity(
                n.node_id, n.total, {k: v - reserved.get(n.node_id, {}).get(k, 0.0) for k, v in n.free.items()}
            )
            for n in views
            if n.alive
        ]
        for run_id, spec_json, plan_json, rank_nodes in runs:
            spec, plan = RunSpec.model_validate(spec_json), Plan.model_validate(plan_json)
            if not may_grow(spec, plan) or lost_nodes(rank_nodes, views):
                continue
            why = "capacity returned: a larger layout fits the free resources"
            new = grow(spec, plan, with_own(free, held_per_node(rank_nodes, plan)), why=why)
            if new is None:
                continue
            self.growing[run_id] = new
            with session_scope(self.factory) as s:
                store.add_event(s, run_id=run_id, kind=PREEMPT_REQUEST, reason=new.reason, actor="scheduler")
            logger.info("run %s: %s", run_id, new.reason)
            return  # one at a time: the next tick sees what it freed and took

    def _restore_growth(self) -> None:
        """Grow-backs asked before this scheduler started (a stored grow request, a ``preempt_request`` starting
        "elastic:", with no ``elastic`` event after it): the run still yields at its checkpoint (its driver survives a
        service restart), so its larger layout is planned again here for the nodes' capacity, and applied when it is
        queued (``_apply_growth`` checks that it still fits)."""
        self.growth_restored = True
        waiting = (RunStatus.STARTING, RunStatus.RUNNING, RunStatus.PREEMPTED, RunStatus.QUEUED)
        with session_scope(self.factory) as s:
            for run in store.runs_in(s, waiting):
                if run.sweep_id or not run.plan or not (run.spec or {}).get("elastic") or run.id in self.growing:
                    continue
                if not _grow_pending(s, run.id, queued=run.status in ("QUEUED", "PREEMPTED")):
                    continue
                spec, plan = RunSpec.model_validate(run.spec), Plan.model_validate(run.plan)
                nodes = [NodeCapacity(n.node_id, n.total, dict(n.total)) for n in self.capacities()]
                why = "capacity returned: a larger layout fits (asked before the service restarted)"
                new = grow(spec, plan, nodes, why=why)
                if new is not None:
                    self.growing[run.id] = new
                    logger.info("run %s: a grow-back asked before the restart is pending: %s", run.id, new.reason)

    def _apply_growth(self) -> None:
        """Runs asked to yield to grow back, now queued again (their driver re-queued them from the checkpoint): their
        larger layout, with an ``elastic`` event. Ended ones (finished first, cancelled) are forgotten."""
        if not self.growth_restored:
            self._restore_growth()
        for run_id, new in list(self.growing.items()):
            with session_scope(self.factory) as s:
                try:
                    run = store.get_run(s, run_id=run_id, lock=True)
                except store.NotFound:
                    self.growing.pop(run_id, None)
                    continue
                if run.status in (RunStatus.RUNNING.value, RunStatus.STARTING.value, RunStatus.PREEMPTED.value):
                    continue  # not yielded yet
                self.growing.pop(run_id, None)
                if run.status != RunStatus.QUEUED.value:
                    continue
                if not place(new.plan.model_dump(mode="json"), self.capacities(), use_free=False).fits:
                    continue  # the capacity went away again: it resumes in its current layout
                ck = store.latest_checkpoint(s, run_id=run_id)
                where = f" (from the checkpoint of step {ck.step})" if ck is not None else ""
                run.spec = new.spec.model_dump(mode="json")
                run.plan = new.plan.model_dump(mode="json")
                store.add_event(s, run_id=run_id, kind=ELASTIC_EVENT, reason=trim(new.reason + where, 1000))
            logger.info("run %s: %s", run_id, new.reason)

    def _act_trial(self, d: Decision, *, attempts: int) -> bool:
        """A sweep trial's run in the queue: admitted -> STARTING (its sweep's driver, waiting for this, then starts
        the workers in the sweep's Ray Job: no job of its own); waiting -> the reason."""
        run_id = d.candidate.id
        if d.action != "admit" or d.placement is None:
            return self._act(d, "", "", None, attempts)  # wait/fail as for any run
        with session_scope(self.factory) as s:
            res = controller.request_run(
                s,
                run_id=run_id,
                to=RunStatus.STARTING,
                actor="scheduler",
                reason=f"{d.reason}; the sweep's driver starts the workers",
                allow_from=[RunStatus.QUEUED],
            )
            if not res.applied:
                return False  # cancelled meanwhile
            store.add_phase(s, run_id=run_id, phase="admitted: starting in the sweep's Ray Job", actor="scheduler")
        self.pending[run_id] = _Pending(placement=d.placement, attempts_at_admission=attempts)
        logger.info("sweep trial run %s admitted", run_id)
        return True

    def _ask_to_yield(self, head: Candidate, victims: list[Holding]) -> None:
        """Ask the lower-priority runs that make room for ``head`` to checkpoint and yield (their drivers read the
        ``preempt_request`` event, see ``service.runs.preemption``); each is asked once."""
        with session_scope(self.factory) as s:
            for v in victims:
                if v.id in self.preempting:
                    continue
                self.preempting[v.id] = head.id
                why = f"preempted by run {head.id} (priority {head.priority} > {v.priority})"
                why += "; it resumes from a checkpoint"
                store.add_event(s, run_id=v.id, kind=PREEMPT_REQUEST, reason=why, actor="scheduler")
                logger.info("run %s: %s", v.id, why)

    def _act(self, d: Decision, name: str, project: str, old_job: str | None, attempts: int) -> bool:
        """Carry out one decision; True when the run was admitted (submitted as its Ray Job)."""
        run_id = d.candidate.id
        if d.action == "fail":
            with session_scope(self.factory) as s:  # refused: cancelled meanwhile
                controller.request_run(s, run_id=run_id, to=RunStatus.FAILED, reason=d.reason, actor="scheduler")
            return False
        if d.action == "wait":
            with session_scope(self.factory) as s:
                if store.get_run(s, run_id=run_id).status_reason != d.reason:  # a new reason: a phase event
                    store.add_phase(s, run_id=run_id, phase=f"queued: {d.reason}", actor="scheduler", as_reason=False)
                store.set_reason(s, run_id=run_id, reason=d.reason)
            return False
        assert d.placement is not None
        return self._submit(
            run_id,
            name=name,
            project=project,
            placement=d.placement,
            reason=d.reason,
            old_job=old_job,
            attempts=attempts,
        )

    def _submit(
        self,
        run_id: str,
        *,
        name: str,
        project: str,
        placement: Placement,
        reason: str,
        old_job: str | None,
        attempts: int,
    ) -> bool:
        n = submission_number(old_job) + 1
        sid = submission_id(run_id, n)
        dash = self.cluster.dashboard_url
        with session_scope(self.factory) as s:
            res = controller.request_run(
                s,
                run_id=run_id,
                to=RunStatus.STARTING,
                actor="scheduler",
                reason=f"{reason}; Ray Job {sid}",
                allow_from=[RunStatus.QUEUED],
                ray_job_id=sid,
                dashboard_url=f"{dash}/#/jobs/{sid}" if dash else None,
            )
            if not res.applied:
                return False  # cancelled meanwhile
            code = (store.get_run(s, run_id=run_id).spec.get("code") or {}).get("working_dir")
        code_dir = resolve_code_dir(code, self.settings) if code else None
        if old_job:
            self._stop_old_job(run_id, old_job)
        try:
            self.jobs.submit(
                entrypoint=f"{python_command()} -m service.runs.driver --run-id {run_id}",
                submission_id=sid,
                # job_name: the name Ray's job list shows
                metadata={"run_id": run_id, "name": name, "job_name": name, "project": project, "meshrun": "run"},
                runtime_env=self.runtime_env(run_id, placement, n, code_dir=code_dir),
            )
        except Exception as e:
            logger.exception("submitting run %s failed", run_id)
            self.jobs.reset()
            with session_scope(self.factory) as s:  # refused: cancelled meanwhile
                controller.request_run(
                    s,
                    run_id=run_id,
                    to=RunStatus.QUEUED,
                    actor="scheduler",
                    reason=trim(f"Ray Job submission failed, will retry: {e}", 1000),
                    allow_from=[RunStatus.STARTING],
                    ray_job_id=sid,
                )
            return False
        self.pending[run_id] = _Pending(placement=placement, attempts_at_admission=attempts)
        with session_scope(self.factory) as s:
            store.add_phase(s, run_id=run_id, phase=f"starting Ray Job {sid}", actor="scheduler")
        logger.info("run %s admitted as Ray Job %s", run_id, sid)
        return True

    def _stop_old_job(self, run_id: str, old_job: str) -> None:
        """A run never has two live drivers: the previous submission's job is stopped if it still runs (its driver
        is fenced off the database already: the run is no longer under its job)."""
        try:
            if not self.jobs.state(old_job).terminal:
                logger.warning("run %s: stopping its previous Ray Job %s before resubmitting", run_id, old_job)
                self.jobs.stop(old_job)
        except Exception:
            logger.warning("run %s: could not check its previous Ray Job %s", run_id, old_job, exc_info=True)

    def reconcile(self) -> list[str]:
        """Resume (within ``max_failures``) or fail runs whose driver is gone; fail runs whose pinned node died (an
        elastic run is re-planned instead). Returns the failed run ids."""
        with session_scope(self.factory) as s:
            # queued sweep trials too: their sweep's Ray Job gone, they would block the queue forever
            runs = store.active_runs(s) + [r for r in store.queued_runs(s) if r.sweep_id and r.ray_job_id]
            active = [(r.id, r.status, r.ray_job_id, dict(r.rank_nodes or {}), bool(r.sweep_id)) for r in runs]
        lost: list[str] = []
        views: list[NodeView] | None = None
        for run_id, status, job_id, rank_nodes, trial in active:
            stop_after: str | None = None
            detail: str | None = None  # the driver is gone: resumed while max_failures allows (a trial: FAILED)
            if not job_id:
                if run_id in self.pending:
                    continue
                detail = "the run has no Ray Job (the service stopped while admitting it)"
            else:
                try:
                    state = self.jobs.state(job_id)
                except Exception as e:
                    # a cluster this service cannot reach now says nothing about the job: judge it later
                    self.jobs.reset()
                    if self.last_error != f"unreachable: {e}":
                        logger.warning("Ray Jobs API unreachable (%s); runs are not reconciled until it answers", e)
                    self.last_error = f"unreachable: {e}"
                    return lost
                if state.status == "MISSING":
                    detail = f"Ray Job {job_id} is gone from the Ray cluster at {self.cluster.address}"
                elif state.status not in ("PENDING", "RUNNING"):
                    detail = f"Ray Job {job_id} is {state.status}"
                    if state.message:
                        detail += f": {job_message(state.message)}"
                else:
                    if status != RunStatus.RUNNING.value or not rank_nodes:
                        continue
                    if views is None:
                        views = self.cluster.nodes()
                    gone = lost_nodes(rank_nodes, views)
                    if not gone or trial:
                        continue  # a trial's job is its sweep's: the sweep's driver sees its workers die
                    if self._replan(run_id, job_id, gone):
                        continue
                    # Workers are pinned to their nodes: Ray Train would wait forever to restart them there.
                    reason = (
                        f"node lost: {', '.join(g[:12] for g in gone)} of this run's workers died; "
                        f"resume the run (POST /v1/runs/{run_id}/resume) to place it on the remaining nodes"
                    )
                    stop_after = job_id  # FAILED first, so the stopped driver cannot overwrite it
            if detail is not None and not trial:
                resumed = resume_lost_driver(self.factory, run_id, detail=detail, job_id=job_id)
                if resumed is not None:
                    self.pending.pop(run_id, None)
                if resumed is False:
                    lost.append(run_id)
                continue
            if detail is not None:
                reason = f"{DRIVER_LOST}: {detail}; resume it (POST /v1/runs/{run_id}/resume) to continue"
            if not self._fail_lost(run_id, reason):
                continue
            if stop_after:
                try:
                    self.jobs.stop(stop_after)
                except Exception:
                    logger.exception("stopping Ray Job %s failed", stop_after)
            self.pending.pop(run_id, None)
            lost.append(run_id)
            logger.warning("run %s: %s", run_id, reason)
        return lost

    def _replan(self, run_id: str, job_id: str, gone: list[str]) -> bool:
        """A running run with ``spec.elastic`` lost nodes: re-plan it for the alive nodes (``service.control.elastic``)
        and re-queue it at once in the new layout from its latest checkpoint (which revokes its driver: it writes
        nothing more), then stop its job; it is admitted again once that job has ended (``_held``). False: not
        elastic, or nothing fits (the caller fails the run)."""
        why = f"node lost: {', '.join(g[:12] for g in gone)} of this run's workers died"
        with session_scope(self.factory) as s:
            run = store.get_run(s, run_id=run_id, lock=True)
            if run.status != RunStatus.RUNNING.value or run.ray_job_id != job_id:
                return True  # ended or moved meanwhile: judged at the next tick
            spec, plan = RunSpec.model_validate(run.spec), Plan.model_validate(run.plan) if run.plan else None
            if spec.elastic is None or plan is None:
                return False
            new = replan(spec, plan, self.capacities(), why=why)
            if new is None:
                return False
            ck = store.latest_checkpoint(s, run_id=run_id)
            where = f"the checkpoint of step {ck.step}" if ck is not None else "its start (no checkpoint yet)"
            reason = trim(f"{new.reason} (from {where})", 1000)
            store.add_event(s, run_id=run_id, kind=ELASTIC_EVENT, reason=reason, actor="scheduler")
            controller.requeue_run(
                s,
                run_id=run_id,
                reason=reason,
                actor="scheduler",
                allow_from=[RunStatus.RUNNING],
                attempt_cause=why,
                spec=new.spec.model_dump(mode="json"),
                plan=new.plan.model_dump(mode="json"),
                resume_from=ck.path if ck is not None else run.resume_from,
                summary=None,
            )
        self.replanning[run_id] = job_id
        self.pending.pop(run_id, None)
        self.growing.pop(run_id, None)  # a grow asked before the loss is void
        logger.warning("run %s: %s", run_id, reason)
        try:
            self.jobs.stop(job_id)
        except Exception:
            logger.exception("stopping Ray Job %s failed", job_id)
        return True

    def _held(self) -> set[str]:
        """Re-planned runs whose previous Ray Job still runs: not admitted until it ended (a run never has two
        drivers, and the next one must not find the old one's channel)."""
        for run_id, job_id in list(self.replanning.items()):
            try:
                ended = self.jobs.state(job_id).terminal
            except Exception:
                ended = False
            if ended:
                self.replanning.pop(run_id, None)
        return set(self.replanning)

    def _fail_lost(self, run_id: str, reason: str) -> bool:
        """FAILED with ``reason`` (its attempt too, its summary from the stored metrics), unless the driver ended
        the run meanwhile."""
        with session_scope(self.factory) as s:
            if RunStatus(store.get_run(s, run_id=run_id).status).terminal:
                return False
            summ = store.summarize_metrics(s, run_id=run_id)
            res = controller.end_run(
                s,
                run_id=run_id,
                to=RunStatus.FAILED,
                reason=trim(reason, 2000),
                actor="scheduler",
                attempt_cause=reason.split(":", 1)[0],
                summary={k: v for k, v in summ.items() if k != "peak_memory_bytes"},
            )
        return res.changed


def _grow_pending(session: Session, run_id: str, *, queued: bool) -> bool:
    """The run's newest grow request (a ``preempt_request`` starting "elastic:") is not yet applied: no ``elastic``
    event after it and, unless the run waits in the queue now, no return to the queue after it either (a yield whose
    larger layout no longer fit resumed in the old one)."""
    kinds = [PREEMPT_REQUEST, ELASTIC_EVENT, "state"]
    for ev in store.list_events(session, run_id=run_id, kinds=kinds, newest_first=True, limit=50):
        if ev.kind == ELASTIC_EVENT or (ev.kind == "state" and ev.to_status == "QUEUED" and not queued):
            return False
        if ev.kind == PREEMPT_REQUEST and (ev.reason or "").startswith("elastic:"):
            return True
    return False

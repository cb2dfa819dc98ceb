"""The service's Ray runtime: cluster connection + admission/reconcile loop + run operations for the API.

``Runtime(settings, session_factory)`` is created by the API's lifespan: ``start()`` starts (embedded) or
connects to (``MESHRUN_RAY_ADDRESS``) the Ray cluster and the scheduler thread; ``stop()`` ends both (an owned
head is stopped; an existing cluster is left alone). The API routes call ``cancel_run``, ``run_logs``,
``resume_run``, ``never_fits``, ``planning_cluster``, ``cluster`` and ``health``; the sweeps use it as their
``SweepHost``.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from api.spec import BatchSpec, ClusterPublic, ClusterSpec, Layout, NodePublic, Plan, RunSpec, RunStatus
from api.spec.schedule import resume_anchor
from api.spec.validation import build_plan
from service import store, sweeps
from service.cluster.capacity import planning_cluster
from service.cluster.head import NodeView, RayCluster
from service.cluster.jobs import JobsBackend, trim
from service.cluster.placement import NodeCapacity
from service.cluster.placement import never_fits as _never_fits
from service.control.recovery import requeue_lost_runs
from service.control.scheduler import Scheduler
from service.control.warm_pool import WarmHost
from service.settings import Settings
from service.store import controller
from service.store.db import session_scope
from service.store.run_calibration import calibrate_from_runs

logger = logging.getLogger(__name__)
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # colour and cursor sequences in a Ray Job's log

CANCEL_WAIT_S = 20.0
CLUSTER_CACHE_S = 2.0
HEALTH_CACHE_S = 1.5
HEALTH_PROBE_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class RayHealth:
    """The Ray cluster's health as last probed: ``reason`` says what is wrong when not ``ok``."""

    ok: bool
    reason: str | None
    checked_at: float


FAST_ADMIT_S = 0.2  # admission passes between full ticks while a sweep runs
CALIBRATE_EVERY_S = 60.0  # at most this often: fit the planner to newly finished runs (settings.calibrate_from_runs)


class Runtime:
    def __init__(
        self, settings: Settings, session_factory: sessionmaker[Session], *, cluster: RayCluster | None = None
    ):
        self.settings = settings
        self.factory = session_factory
        self.ray_cluster = cluster or RayCluster.from_settings(settings)
        self._jobs: JobsBackend | None = None
        self.scheduler: Scheduler | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._tick_lock = threading.Lock()
        self._nodes_cache: tuple[float, list[NodeView]] | None = None
        self._health: RayHealth | None = None
        self._health_lock = threading.Lock()
        self._calibrated_at = 0.0
        self.warm: WarmHost | None = None
        self._sweeps_running = False  # the last tick saw a running sweep: admission passes in between (``_loop``)

    # ------------------------------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self.ray_cluster.start()
        lost = self.ray_cluster.lost_head
        if lost is not None:  # the head a crashed service left behind died too: its runs resume on the new one
            requeue_lost_runs(self.factory, detail=f"the Ray head (pid {lost.pid}, GCS {lost.address}) died")
        if not self.ray_cluster.dashboard_url:
            raise RuntimeError(
                f"no dashboard URL for the Ray cluster at {self.ray_cluster.address}; set MESHRUN_RAY_DASHBOARD_URL"
            )
        self._jobs = JobsBackend(self.ray_cluster.dashboard_url)
        self.warm = WarmHost(
            self.settings, self._jobs, gcs_address=self.ray_cluster.address, dashboard_url=self.dashboard_url
        )
        self.warm.ensure(force=True)  # prestarts while the service starts: the first run finds it warm
        self.scheduler = Scheduler(
            settings=self.settings, session_factory=self.factory, cluster=self.ray_cluster, jobs=self._jobs
        )
        self.tick()  # reconcile what a previous service left behind before serving
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="meshrun-scheduler", daemon=True)
        self._thread.start()
        logger.info(
            "runtime started: Ray %s (%s), dashboard %s",
            self.ray_cluster.address,
            "owned" if self.ray_cluster.owned else "existing",
            self.dashboard_url,
        )

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        if self.warm is not None:
            self.warm.stop()
        self.ray_cluster.stop()

    def _loop(self) -> None:
        """A full tick every ``scheduler_interval_s`` (or when woken); while a sweep runs, admission passes alone
        every FAST_ADMIT_S between them: its next trial's run waits for admission, and that wait is part of the gap
        between two trials."""
        interval = float(self.settings.scheduler_interval_s)
        next_full = 0.0
        while not self._stop.is_set():
            fast = self._sweeps_running and FAST_ADMIT_S < interval
            woken = self._wake.wait(FAST_ADMIT_S if fast else interval)
            self._wake.clear()
            if self._stop.is_set():
                break
            if fast and not woken and time.monotonic() < next_full:
                self.admit_only()
                continue
            self.tick()
            next_full = time.monotonic() + interval

    def admit_only(self) -> None:
        """One admission pass (no reconcile): queued runs only, nothing else is looked at."""
        if self.scheduler is None:
            return
        with self._tick_lock:
            try:
                self.scheduler.admit()
            except Exception:
                logger.debug("admission pass failed (the next full tick logs it)", exc_info=True)

    def tick(self) -> None:
        """One admission + reconcile pass for runs and sweeps (also callable from tests)."""
        if self.scheduler is None:
            return
        with self._tick_lock:
            if self.ray_cluster.owned and self.ray_cluster.head_dead():
                self._restart_head()
            self.scheduler.tick()
            if self.warm is not None:
                self.warm.ensure()
            try:
                sweeps.reconcile_sweeps(self)
                sweeps.start_queued_sweeps(self)
                with session_scope(self.factory) as s:
                    self._sweeps_running = bool(
                        sweeps.sweeps_in(s, statuses=[sweeps.SweepStatus.RUNNING], with_job=True)
                    )
            except Exception:
                logger.exception("sweep reconcile/admission failed")
        if self.settings.calibrate_from_runs and time.monotonic() - self._calibrated_at >= CALIBRATE_EVERY_S:
            self._calibrated_at = time.monotonic()
            self.calibrate_from_runs()

    def calibrate_from_runs(self) -> None:
        """Fit the planner's factors term by term to the latest finished runs' measured breakdowns, when a run
        finished since the cluster's latest calibration (``service.store.run_calibration``)."""
        cluster = self.planning_cluster()
        if cluster is None:
            return
        try:
            with session_scope(self.factory) as s:
                calibrate_from_runs(s, cluster=cluster, only_if_new=True)
        except Exception:
            logger.exception("calibrating the planner from finished runs failed")

    def _restart_head(self) -> None:
        """The owned head died: start it again on its ports, then requeue its runs to resume (``recovery``)."""
        rec = self.ray_cluster.record
        detail = f"the Ray head (pid {rec.pid if rec else '?'}, GCS {self.ray_cluster.address}) died"
        logger.error("%s; restarting it", detail)
        with self._health_lock:
            self._health = RayHealth(ok=False, reason=f"{detail}; restarting it", checked_at=time.monotonic())
        try:
            self.ray_cluster.restart()
        except Exception:
            logger.exception("restarting the Ray head failed; trying again at the next tick")
            return
        finally:
            self._nodes_cache = None
            if self._jobs is not None:
                self._jobs.reset()
            if self.warm is not None:
                self.warm.job_id, self.warm.checked_at = None, 0.0  # its job died with the head: start it again
        if self.scheduler is not None:
            self.scheduler.pending.clear()
            self.scheduler.replanning.clear()
            self.scheduler.growing.clear()
            self.scheduler.preempting.clear()
        requeued = requeue_lost_runs(self.factory, detail=detail)
        logger.warning("Ray head restarted at %s; %d run(s) requeued", self.ray_cluster.address, len(requeued))

    def wake(self) -> None:
        self._wake.set()

    # ------------------------------------------------------------------------------------- what sweeps use
    @property
    def jobs(self) -> JobsBackend | None:
        return self._jobs

    @property
    def gcs_address(self) -> str | None:
        return self.ray_cluster.address

    @property
    def dashboard_url(self) -> str | None:
        return self.ray_cluster.dashboard_url

    # --------------------------------------------------------------------------------------------- health
    def health(self) -> RayHealth:
        """The Ray cluster's health, probed at most every ``HEALTH_CACHE_S`` (``RayCluster.probe``: a dead head
        shows within one probe, each check bounded by ``HEALTH_PROBE_TIMEOUT_S``; concurrent callers share one
        probe)."""
        with self._health_lock:
            now = time.monotonic()
            if self._health is not None and now - self._health.checked_at < HEALTH_CACHE_S:
                return self._health
            reason = (
                self.ray_cluster.probe(timeout_s=HEALTH_PROBE_TIMEOUT_S)
                if self.scheduler is not None
                else "the runtime is not started"
            )
            if reason is not None:
                logger.warning("Ray cluster unhealthy: %s", reason)
            self._health = RayHealth(ok=reason is None, reason=reason, checked_at=time.monotonic())
            return self._health

    # -------------------------------------------------------------------------------------------- cluster
    def _nodes(self) -> list[NodeView]:
        now = time.monotonic()
        if self._nodes_cache is None or now - self._nodes_cache[0] > CLUSTER_CACHE_S:
            self._nodes_cache = (now, self.ray_cluster.nodes())
        return self._nodes_cache[1]

    def cluster(self) -> ClusterPublic:
        nodes = self._nodes()
        alive = [n for n in nodes if n.alive]
        return ClusterPublic(
            address=self.ray_cluster.address,
            dashboard_url=self.dashboard_url,
            nodes=[
                NodePublic(
                    node_id=n.node_id,
                    alive=n.alive,
                    address=n.address,
                    cpus=n.total.get("CPU", 0.0),
                    gpus=n.total.get("GPU", 0.0),
                    memory_bytes=int(n.total["memory"]) if "memory" in n.total else None,
                )
                for n in nodes
            ],
            cpus_total=sum(n.total.get("CPU", 0.0) for n in alive),
            cpus_free=sum(n.free.get("CPU", 0.0) for n in alive),
            gpus_total=sum(n.total.get("GPU", 0.0) for n in alive),
            gpus_free=sum(n.free.get("GPU", 0.0) for n in alive),
        )

    def capacities(self) -> list[NodeCapacity]:
        return [NodeCapacity(node_id=n.node_id, total=n.total, free=n.free) for n in self._nodes() if n.alive]

    def planning_cluster(self) -> ClusterSpec | None:
        """The live cluster as the planner sees it: GPU nodes by accelerator type, else 'cpu' with the memory
        a CPU worker may use (node memory shared by its CPUs)."""
        try:
            alive = [n for n in self._nodes() if n.alive]
        except Exception:
            logger.exception("cluster state unavailable for planning")
            return None
        return planning_cluster([n.total for n in alive])

    def never_fits(self, plan: Plan | dict[str, Any], *, reserved_cpu: float = 0.0) -> str | None:
        try:
            nodes = self.capacities()
        except Exception:
            logger.exception("cluster state unavailable for the capacity check")
            return None
        if not nodes:
            return None
        return _never_fits(
            plan,
            nodes,
            cpu_setting="MESHRUN_RAY_NUM_CPUS" if self.ray_cluster.owned else None,
            reserved_cpu=reserved_cpu,
        )

    # ------------------------------------------------------------------------------------------- runs
    def cancel_run(self, run_id: str, actor: str | None = None) -> None:
        """CANCELLED first (the driver then never overwrites it), then stop the Ray Job and wait for it to end
        (its driver, the Train controller and the workers are gone afterwards)."""
        with session_scope(self.factory) as s:
            run = store.get_run(s, run_id=run_id)
            job_id = run.ray_job_id
            if not RunStatus(run.status).terminal:  # refused (it ended meanwhile): 409
                controller.end_run(
                    s, run_id=run_id, to=RunStatus.CANCELLED, reason=f"cancelled by {actor or 'user'}", actor=actor
                ).or_raise()
        if self.scheduler is not None:
            self.scheduler.pending.pop(run_id, None)
            self.scheduler.replanning.pop(run_id, None)  # a cancel during an elastic re-plan stays a cancel
            self.scheduler.growing.pop(run_id, None)
            self.scheduler.preempting.pop(run_id, None)
        if not job_id or self._jobs is None:
            return
        try:
            self._jobs.stop(job_id)
        except Exception:
            logger.exception("stopping Ray Job %s failed", job_id)
            return
        deadline = time.monotonic() + CANCEL_WAIT_S
        while time.monotonic() < deadline:
            try:
                if self._jobs.state(job_id).terminal:
                    break
            except Exception:
                break
            time.sleep(0.5)
        with session_scope(self.factory) as s:
            store.add_event(s, run_id=run_id, kind="ray", reason=f"Ray Job {job_id} stopped", actor=actor)

    def run_logs(self, run_id: str) -> str:
        with session_scope(self.factory) as s:
            job_id = store.get_run(s, run_id=run_id).ray_job_id
        if not job_id or self._jobs is None:
            return ""
        try:
            # text for people and programs, never a terminal: Ray colours its "[repeated Nx across cluster]"
            # notes whatever RAY_COLOR_PREFIX says, so colour and cursor sequences are taken out here
            return _ANSI.sub("", self._jobs.logs(job_id))
        except Exception as e:
            return f"(logs of Ray Job {job_id} unavailable: {e})"

    def resume_run(
        self,
        run_id: str,
        layout: Layout | None = None,
        batch: BatchSpec | None = None,
        steps: int | None = None,
        actor: str | None = None,
        fresh: bool = False,
    ) -> None:
        """FAILED/CANCELLED -> QUEUED from the latest checkpoint that exists (``fresh``: from step 0 when there is
        none), with the spec/plan updated to a new layout, batch or step count (the checkpoint reshards on load; a
        new horizon continues the LR schedule from the checkpoint's step without a jump)."""
        with session_scope(self.factory) as s:
            run = store.get_run(s, run_id=run_id)
            spec = RunSpec.model_validate(run.spec)
            ck = store.latest_checkpoint(s, run_id=run_id)
            update: dict[str, Any] = {}
            if layout is not None:
                update["layout"] = Layout.model_validate(layout)
            if batch is not None:
                update["batch"] = BatchSpec.model_validate(batch)
            if steps is not None:
                update["train"] = spec.train.model_copy(update={"steps": int(steps)})
                if ck is not None:
                    update["optimizer"] = _continued_schedule(spec, ck.step, int(steps))
            new_spec = RunSpec.model_validate(spec.model_copy(update=update).model_dump())
            plan = build_plan(new_spec, device=(Plan.model_validate(run.plan).device if run.plan else "auto"))
            old = Plan.model_validate(run.plan) if run.plan else None
            if old is not None and old.predicted is not None and not update:
                plan = plan.model_copy(update={"predicted": old.predicted})
            resume_from = ck.path if ck is not None else None
            what = f"from checkpoint of step {ck.step}" if ck is not None else "fresh from step 0 (no checkpoint)"
            if layout is not None:
                what += f" with layout dp={plan.dp} tp={plan.tp} pp={plan.pp}"
            controller.request_run(  # refused (it moved meanwhile): 409
                s,
                run_id=run_id,
                to=RunStatus.QUEUED,
                reason=trim(f"resumed by {actor or 'user'} {what}", 1000),
                actor=actor,
                allow_from=[RunStatus.FAILED, RunStatus.CANCELLED],
                spec=new_spec.model_dump(mode="json"),
                plan=plan.model_dump(mode="json"),
                resume_from=resume_from,
                summary=None,
            ).or_raise()
        self.wake()


def _continued_schedule(spec: RunSpec, step: int, new_steps: int) -> Any:
    """The optimizer spec whose LR schedule continues from the checkpoint's ``step`` to the new horizon."""
    o = spec.optimizer
    anchor = resume_anchor(
        step,
        old_total_steps=spec.train.steps,
        new_total_steps=new_steps,
        warmup_steps=o.warmup_steps,
        schedule=o.schedule,
        min_lr_ratio=o.min_lr_ratio,
        old_anchor=(o.lr_anchor_step, o.lr_anchor_factor or 0.0) if o.lr_anchor_step is not None else None,
    )
    if anchor is None:
        return o
    return o.model_copy(update={"lr_anchor_step": anchor[0], "lr_anchor_factor": anchor[1]})

"""Run submission, cancellation and resumption: the logic behind ``/v1/runs`` (routes stay thin).

``submit_run`` validates (spec rules, permissions, paths), resolves the Plan, asks the planner whether it fits the
cluster the runtime plans for, and stores the run (idempotently). ``cancel_run`` / ``resume_run`` delegate to the
runtime for runs it owns. Errors are the store's (NotFound/Conflict), SpecError, PolicyViolation and
``RunRefused`` (422 with a code: ``insufficient_memory``/``insufficient_capacity``) or ``RuntimeUnavailable`` (503).
"""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy.orm import Session

from api.spec import Candidate, ClusterSpec, Plan, ResumeRequest, RunSpec, RunStatus
from api.spec.validation import build_plan
from service import store
from service.control.runtime import Runtime
from service.errors import InvalidRequest, Unavailable
from service.planner import Factors, best_alternative, predict_run
from service.security.policy import check_spec_policy
from service.settings import Settings
from service.store import controller
from service.store.calibrations import cluster_key, latest_calibration, latest_factors
from service.store.models import Run
from service.sweeps import cancel_trial_run

log = logging.getLogger(__name__)
GIB = 1024**3


class RunRefused(InvalidRequest):
    """A valid spec the cluster cannot run (422, code insufficient_memory / insufficient_capacity)."""

    def __init__(self, code: str, message: str, param: str = "layout"):
        super().__init__(message, code=code, param=param)


class RuntimeUnavailable(Unavailable):
    """The operation needs the Ray runtime, which this API process does not run (503)."""

    code = "runtime_unavailable"


def _gib(n: int | float | None) -> str:
    return f"{(n or 0) / GIB:.2f} GiB"


def _describe_candidate(c: Candidate) -> str:
    lay = c.layout
    return (
        f"dp={lay.dp} tp={lay.tp} pp={lay.pp} zero_stage={lay.zero_stage} micro_batch_size={c.micro_batch_size} "
        f"activation_checkpointing={c.activation_checkpointing} ({_gib(c.memory_bytes.total)} per rank, "
        f"~{c.tokens_per_s:,.0f} tokens/s)"
    )


def predict(
    session: Session, spec: RunSpec, plan: Plan, runtime: Runtime | None, prices: dict[str, float] | None = None
) -> tuple[Candidate | None, ClusterSpec | None, Factors | None]:
    """The planner's prediction for this plan on the runtime's cluster, with the cluster and the calibrated factors
    the prediction used (None without a runtime or a cluster). Its cost is priced with the spec's price, else
    ``prices`` (the settings' ``device_prices``) or the default table for the cluster's device."""
    cluster = runtime.planning_cluster() if runtime is not None else None
    if cluster is None:
        return None, None, None
    key = cluster_key(cluster)
    factors = latest_factors(session, key)  # fitted by a sweep on this cluster (not rejected), or the defaults
    cal = latest_calibration(session, key) if factors is not None else None
    pred = predict_run(spec, plan, cluster, factors=factors, prices=prices)
    used = f"calibration {cal.id}" if cal is not None else "defaults"
    return pred.model_copy(update={"calibration": used}), cluster, factors


def check_fits(
    session: Session, spec: RunSpec, plan: Plan, runtime: Runtime | None, prices: dict[str, float] | None = None
) -> Plan:
    """Attach the prediction; refuse layouts predicted not to fit (unless skip_memory_check) or that can never
    be placed on the cluster."""
    cand, cluster, factors = predict(session, spec, plan, runtime, prices)
    if cand is not None:
        plan = plan.model_copy(update={"predicted": cand})
        if not cand.feasible and not spec.skip_memory_check:
            m = cand.memory_bytes
            # the planner's reason holds the per-rank memory breakdown and the device's memory: say it once
            msg = "layout predicted not to fit in device memory: " + (
                cand.reason
                or f"{_gib(m.total)} per rank (params {_gib(m.params)}, grads {_gib(m.grads)}, optimizer "
                f"{_gib(m.optimizer)}, activations {_gib(m.activations)}, buffers {_gib(m.buffers)})"
            )
            alt = None
            if cluster is not None:
                try:
                    alt = best_alternative(spec, cluster, factors=factors)
                except Exception:
                    log.exception("planner.best_alternative failed")
            msg += (
                f"; best feasible alternative: {_describe_candidate(alt)}"
                if alt is not None
                else "; no feasible layout found for this model on this cluster"
            )
            msg += "; or set skip_memory_check: true to submit anyway"
            raise RunRefused("insufficient_memory", msg)
    if runtime is not None:
        reason = runtime.never_fits(plan)
        if reason:
            raise RunRefused("insufficient_capacity", reason)
    return plan


def validate_run(
    session: Session,
    *,
    spec: RunSpec,
    can_run_code: bool,
    settings: Settings,
    runtime: Runtime | None = None,
    admin: bool = False,
) -> tuple[Plan, list[str], list[str]]:
    """``submit_run``'s checks, nothing stored: (the plan with its prediction, the checks run, those not run)."""
    spec = check_spec_policy(spec, can_run_code=can_run_code, settings=settings, admin=admin)
    plan = check_fits(session, spec, build_plan(spec), runtime, settings.device_prices)
    checked = ["spec", "policy (permissions, paths, user code)"]
    if runtime is None:
        why = "this service runs no Ray runtime (--no-scheduler)"
        return plan, checked, [f"memory fit: {why}", f"cluster capacity: {why}"]
    cluster = runtime.planning_cluster()
    if cluster is None:
        return plan, checked + ["cluster capacity"], ["memory fit: the Ray cluster reports no devices yet"]
    where = f"{cluster.nodes} node(s) x {cluster.gpus_per_node} {cluster.device}"
    return plan, checked + [f"memory fit on the service's cluster ({where})", "cluster capacity"], []


def submit_run(
    session: Session,
    *,
    spec: RunSpec,
    project: str,
    actor: str,
    can_run_code: bool,
    settings: Settings,
    runtime: Runtime | None = None,
    idempotency_key: str | None = None,
    admin: bool = False,
) -> tuple[Run, bool]:
    """Validate, plan and store a QUEUED run. Returns (run, created); created=False for an idempotent retry."""
    spec = check_spec_policy(spec, can_run_code=can_run_code, settings=settings, admin=admin, project=project)
    spec_json = spec.model_dump(mode="json")
    if idempotency_key:
        existing = store.find_by_idempotency_key(session, model=Run, project=project, key=idempotency_key)
        if existing is not None:
            return _same_request(existing, spec_json, idempotency_key), False
    plan = check_fits(session, spec, build_plan(spec), runtime, settings.device_prices)
    run, created = store.create_run(
        session,
        spec=spec_json,
        plan=plan.model_dump(mode="json"),
        project=project,
        name=spec.name,
        priority=spec.resources.priority,
        created_by=actor,
        idempotency_key=idempotency_key,
    )
    if not created:
        return _same_request(run, spec_json, idempotency_key), False
    store.add_event(
        session, run_id=run.id, kind="audit", reason=f"submitted by {actor} (project {project})", actor=actor
    )
    session.commit()  # the write transaction ends here, not after the response is built (short write locks)
    return run, True


def _same_request(run: Run, spec_json: dict[str, Any], key: str | None) -> Run:
    if run.spec != spec_json:
        raise store.Conflict(
            f"Idempotency-Key '{key}' was already used for run '{run.id}' with a different spec; "
            "use a new key for a new run",
            param="Idempotency-Key",
        )
    return run


def cancel_run(session: Session, *, run_id: str, scope: str | None, actor: str, runtime: Runtime | None) -> Run:
    """QUEUED -> CANCELLED here; STARTING/RUNNING through the runtime; terminal -> Conflict."""
    # lock the row before writing anything that references it (an event's FK check share-locks the run row;
    # taking the exclusive lock after that deadlocks concurrent cancels on PostgreSQL)
    run = store.get_run(session, run_id=run_id, project=scope, lock=True)
    status = RunStatus(run.status)
    if status.terminal:
        raise store.Conflict(f"run '{run_id}' is already {status.value}; nothing to cancel", param="status")
    store.add_event(session, run_id=run_id, kind="audit", reason=f"cancel requested by {actor}", actor=actor)
    if status == RunStatus.QUEUED:
        res = controller.request_run(
            session,
            run_id=run_id,
            to=RunStatus.CANCELLED,
            reason=f"cancelled by {actor}",
            actor=actor,
            allow_from=[RunStatus.QUEUED],
        )
        if res.applied:
            return res.subject
        status = RunStatus(res.from_)  # admitted meanwhile: cancel through the runtime
        if status.terminal:
            raise store.Conflict(f"run '{run_id}' is already {status.value}; nothing to cancel", param="status")
    if run.sweep_id and status in (RunStatus.STARTING, RunStatus.RUNNING):
        return cancel_trial_run(session, run=run, actor=actor)  # a trial's Ray Job is its sweep's: stop only this
    if runtime is None:
        raise RuntimeUnavailable(
            f"run '{run_id}' is {status.value} and this API process runs no scheduler to stop "
            "it; send the request to the service that runs the scheduler"
        )
    session.commit()  # the audit event is durable before the runtime acts; the runtime uses its own session
    runtime.cancel_run(run_id, actor=actor)
    session.expire(run)
    return store.get_run(session, run_id=run_id)


def resume_run(
    session: Session,
    *,
    run_id: str,
    scope: str | None,
    actor: str,
    can_run_code: bool,
    settings: Settings,
    request: ResumeRequest,
    runtime: Runtime | None,
    admin: bool = False,
) -> Run:
    """Re-queue a FAILED/CANCELLED run from its latest checkpoint, optionally with a new layout/batch/steps."""
    run = store.get_run(session, run_id=run_id, project=scope, lock=True)
    status = RunStatus(run.status)
    if status not in (RunStatus.FAILED, RunStatus.CANCELLED):
        raise store.Conflict(
            f"run '{run_id}' is {status.value}; only FAILED or CANCELLED runs can be resumed", param="status"
        )
    spec = RunSpec.model_validate(run.spec)
    update: dict[str, Any] = {}
    if request.layout is not None:
        update["layout"] = request.layout
    if request.batch is not None:
        update["batch"] = request.batch
    if request.steps is not None:
        update["train"] = spec.train.model_copy(update={"steps": request.steps})
    new_spec = RunSpec.model_validate(spec.model_copy(update=update).model_dump())
    check_spec_policy(new_spec, can_run_code=can_run_code, settings=settings, admin=admin, project=run.project)
    check_fits(session, new_spec, build_plan(new_spec), runtime, settings.device_prices)  # 422 before anything changes
    if not request.fresh and store.latest_checkpoint(session, run_id=run_id) is None:
        done = run.summary.get("steps_done") if isinstance(run.summary, dict) else None
        lost = f" (its {done} finished steps would be lost)" if done else ""
        raise store.Conflict(
            f"run '{run_id}' has no checkpoint to resume from{lost}; start it again from step 0 with "
            "fresh: true (meshrun resume RUN --fresh), or give it checkpoint.every_steps next time",
            param="fresh",
        )
    if runtime is None:
        raise RuntimeUnavailable(
            "resuming needs the scheduler (Ray runtime), which this API process does not run; "
            "start the service with the scheduler enabled"
        )
    store.add_event(session, run_id=run_id, kind="audit", reason=f"resume requested by {actor}", actor=actor)
    session.commit()
    runtime.resume_run(
        run_id, layout=request.layout, batch=request.batch, steps=request.steps, actor=actor, fresh=request.fresh
    )
    session.expire(run)
    return store.get_run(session, run_id=run_id)

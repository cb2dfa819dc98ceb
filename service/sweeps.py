"""Layout sweeps: expansion of a search space into trials, the sweep/trial store, and orchestration.

A sweep (``api.schemas.SweepCreate``) is a base run spec, a search space (explicit layouts x micro-batch sizes, or
``auto``: the planner's top feasible candidates for the live cluster), an objective (``tokens_per_s`` | ``mfu``)
and a budget. ``create_sweep`` expands it into trials, each checked like a submitted run:

- ``api.validation.check_spec`` errors -> trial SKIPPED with ``"<param>: <message>"``;
- the planner's prediction (``service.planner.predict_run`` on ``runtime.planning_cluster()``, with the latest
  calibration of that cluster) is recorded per trial; a layout predicted NOT to fit in memory is SKIPPED with
  the planner's reason -- unless the base spec sets ``skip_memory_check: true``, in which case it runs so that
  the real failure (OOM) is recorded. (Auto candidates are feasible by construction.)
- a layout the cluster can never place (``runtime.never_fits``) -> SKIPPED with the reason;
- the runnable trials are ranked by predicted objective; those beyond ``budget.max_trials`` are SKIPPED
  ("over budget"), so the budget goes to the predicted contenders.

The sweep then runs as ONE Ray Job (``python -m service.sweep_driver --sweep-id ID``, submission id
``meshrun-<sweep id>-<n>``), whose driver runs a Ray Tune ``Tuner`` over the trials (see
``service.sweep_driver``). Every executed trial is a row in ``runs`` (``sweep_id`` set, ``ray_job_id`` = the
sweep's job) with its own attempts, events and per-step metrics, written exactly as a normal run's.

Statuses. Sweep: QUEUED -> RUNNING -> SUCCEEDED | FAILED | CANCELLED. Trial: PENDING -> RUNNING -> SUCCEEDED |
FAILED | EARLY_STOPPED, or SKIPPED / CANCELLED. An early-stopped trial's run ends CANCELLED with the reason.
Measured objective = mean over the steps after ``budget.warmup_steps``; best trial = highest measured objective
among SUCCEEDED / EARLY_STOPPED trials. Spec fields a trial overrides: layout, micro-batch size, ``train.steps``
(= ``budget.steps_per_trial``), ``checkpoint.every_steps`` (0: trials measure throughput, they do not
checkpoint), name (``<sweep name>-t<trial id>``), labels (``sweep``, ``trial``). ``activation_checkpointing``
stays the base's (the trial table stores layout and micro-batch only).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timezone
from typing import Any

from pydantic import ValidationError
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api.schemas import (NAME_RE, Candidate, ClusterSpec, Layout, PlanRequest, RunSpec, RunStatus, SweepCreate,
                         SweepPublic, TrialPublic)
from api.validation import SpecError, SpecIssue, build_plan, check_spec
from service import store
from service.db import session_scope
from service.models import Run, Sweep, Trial, utcnow
from service.ray_backend import trim

log = logging.getLogger(__name__)


class SweepStatus:
    QUEUED = "QUEUED"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    TERMINAL = frozenset({"SUCCEEDED", "FAILED", "CANCELLED"})


class TrialStatus:
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    EARLY_STOPPED = "EARLY_STOPPED"
    SKIPPED = "SKIPPED"
    CANCELLED = "CANCELLED"
    TERMINAL = frozenset({"SUCCEEDED", "FAILED", "EARLY_STOPPED", "SKIPPED", "CANCELLED"})
    MEASURED = frozenset({"SUCCEEDED", "EARLY_STOPPED"})


SUBMISSION_PREFIX = "meshrun-"
DRIVER_MODULE = "service.sweep_driver"
MAX_CANDIDATES = 1024
CANCEL_WAIT_S = 20.0
AUTO_WORLD_SIZES = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


# ------------------------------------------------------------------------------------------- expansion
@dataclass
class TrialDraft:
    layout: Layout
    micro_batch_size: int
    status: str = TrialStatus.PENDING
    reason: str | None = None
    predicted: Candidate | None = None
    explicit: bool = True

    def predicted_objective(self, objective: str) -> float | None:
        if self.predicted is None:
            return None
        return self.predicted.mfu if objective == "mfu" else self.predicted.tokens_per_s


def trial_spec(create: SweepCreate, layout: Layout | dict[str, Any], micro_batch_size: int, *,
               name: str | None = None, labels: dict[str, str] | None = None) -> RunSpec:
    """The run spec of one trial: the base with the trial's layout and micro-batch, ``steps_per_trial`` steps,
    no periodic checkpoints. Validated (raises pydantic ValidationError for out-of-range values)."""
    base = create.base.model_dump(mode="json")
    base["layout"] = Layout.model_validate(layout).model_dump(mode="json")
    base["batch"] = {**base["batch"], "micro_batch_size": int(micro_batch_size)}
    base["train"] = {**base["train"], "steps": create.budget.steps_per_trial}
    base["checkpoint"] = {**base["checkpoint"], "every_steps": 0}
    if name:
        base["name"] = name
    if labels:
        base["labels"] = {**base.get("labels", {}), **labels}
    return RunSpec.model_validate(base)


def _layout_key(layout: Layout, mb: int) -> tuple:
    return (tuple(sorted(layout.model_dump(mode="json").items())), mb)


def _auto_clusters(create: SweepCreate, cluster: ClusterSpec) -> list[tuple[int, ClusterSpec]]:
    """(world size, cluster of exactly that many worker slots) to search: the base's world size when it sets one,
    else powers of two up to the cluster's capacity, and the capacity itself."""
    per_node = cluster.gpus_per_node
    if cluster.device.strip().lower() == "cpu":
        per_node = max(1, int(per_node // max(1.0, math.ceil(create.base.resources.cpus_per_worker))))
    capacity = per_node * cluster.nodes
    base_world = create.base.layout.world_size
    worlds = [base_world] if base_world > 1 else sorted({w for w in AUTO_WORLD_SIZES if w <= capacity} | {capacity})
    out = []
    for w in worlds:
        if w <= per_node:
            out.append((w, cluster.model_copy(update={"nodes": 1, "gpus_per_node": w})))
        elif w % per_node == 0:
            out.append((w, cluster.model_copy(update={"nodes": w // per_node, "gpus_per_node": per_node})))
    if not out:
        raise SpecError([SpecIssue("search.layouts", f"layouts 'auto': world size {base_world} does not fill whole "
                                   f"nodes of {per_node} workers on this cluster; list the layouts explicitly",
                                   "invalid_spec")])
    return out


def auto_candidates(create: SweepCreate, cluster: ClusterSpec, *, factors: Any = None) -> list[Candidate]:
    """The planner's top feasible candidates for the base model on the live cluster, best predicted first."""
    from service.planner import search

    base = create.base
    mbs: list[int | None] = list(create.search.micro_batch_sizes or [None])
    found: dict[tuple, Candidate] = {}
    for _world, cl in _auto_clusters(create, cluster):
        for mb in mbs:
            req = PlanRequest(model=base.model, cluster=cl, global_batch_size=base.batch.global_batch_size,
                              precision=base.precision, top_k=create.budget.max_trials, micro_batch_size=mb,
                              activation_checkpointing=base.activation_checkpointing)
            for cand in search(req, factors=factors).candidates:
                if cand.feasible:
                    found.setdefault(_layout_key(cand.layout, cand.micro_batch_size), cand)
    key = (lambda c: c.mfu) if create.objective == "mfu" else (lambda c: c.tokens_per_s)
    return sorted(found.values(), key=key, reverse=True)


def _issue_text(issues: Sequence[SpecIssue]) -> str:
    return "; ".join(f"{i.param}: {i.message}" for i in issues)


def expand(create: SweepCreate, *, cluster: ClusterSpec | None, factors: Any = None,
           never_fits: Callable[[Any], str | None] | None = None) -> list[TrialDraft]:
    """The sweep's trials in display order (explicit: layouts x micro-batches as listed; auto: best predicted
    first), each PENDING or SKIPPED with its reason, with the planner's prediction when a cluster is known."""
    from service.planner import predict_run

    if create.budget.warmup_steps >= create.budget.steps_per_trial:
        raise SpecError([SpecIssue("budget.warmup_steps", f"warmup_steps={create.budget.warmup_steps} leaves no "
                                   f"measured step of steps_per_trial={create.budget.steps_per_trial}; use "
                                   f"warmup_steps < steps_per_trial", "invalid_spec")])
    drafts: list[TrialDraft] = []
    if create.search.layouts == "auto":
        if cluster is None:
            raise SpecError([SpecIssue("search.layouts", "layouts 'auto' needs the service's Ray cluster to plan "
                                       "for, which this API process does not run (or has no nodes yet); list the "
                                       "layouts explicitly", "live_cluster_unavailable")])
        cands = auto_candidates(create, cluster, factors=factors)
        if not cands:
            raise SpecError([SpecIssue("search.layouts", "layouts 'auto': the planner found no feasible layout for "
                                       "this model, batch and precision on the cluster; see POST /v1/plans with "
                                       "cluster.device 'live' for the rejections", "no_feasible_layout")])
        drafts = [TrialDraft(c.layout, c.micro_batch_size, explicit=False) for c in cands]
    else:
        mbs = create.search.micro_batch_sizes or [create.base.batch.micro_batch_size]
        if not create.search.layouts:
            raise SpecError([SpecIssue("search.layouts", "give at least one layout, or 'auto'", "invalid_spec")])
        if len(create.search.layouts) * len(mbs) > MAX_CANDIDATES:
            raise SpecError([SpecIssue("search", f"{len(create.search.layouts)} layouts x {len(mbs)} micro-batch "
                                       f"sizes exceed {MAX_CANDIDATES} candidates; narrow the search", "too_large")])
        seen: set[tuple] = set()
        for lay in create.search.layouts:
            for mb in mbs:
                k = _layout_key(lay, mb)
                if k not in seen:
                    seen.add(k)
                    drafts.append(TrialDraft(lay, int(mb)))

    for d in drafts:
        try:
            spec = trial_spec(create, d.layout, d.micro_batch_size)
        except ValidationError as e:
            err = e.errors()[0]
            d.status, d.reason = TrialStatus.SKIPPED, f"invalid: {'.'.join(map(str, err['loc']))}: {err['msg']}"
            continue
        chk = check_spec(spec)
        if not chk.ok:
            d.status, d.reason = TrialStatus.SKIPPED, f"invalid: {_issue_text(chk.errors)}"
            continue
        plan = build_plan(spec)
        if cluster is not None:
            try:
                d.predicted = predict_run(spec, plan, cluster, factors=factors)
            except SpecError as e:
                d.status, d.reason = TrialStatus.SKIPPED, f"cannot be planned: {_issue_text(e.issues)}"
                continue
            if not d.predicted.feasible:
                if spec.skip_memory_check:
                    d.reason = f"predicted not to fit, run anyway (skip_memory_check): {d.predicted.reason}"
                else:
                    d.status = TrialStatus.SKIPPED
                    d.reason = (f"predicted not to fit: {d.predicted.reason} (set base.skip_memory_check: true to "
                                "run it anyway and record the real failure)")
                    continue
        if never_fits is not None:
            why = never_fits(plan)
            if why:
                d.status, d.reason = TrialStatus.SKIPPED, f"cannot be placed on this cluster: {why}"

    runnable = [d for d in drafts if d.status == TrialStatus.PENDING]
    order = sorted(range(len(runnable)), key=lambda i: (-(runnable[i].predicted_objective(create.objective)
                                                          or -math.inf), i))
    budget = create.budget.max_trials
    for rank, i in enumerate(order):
        if rank >= budget:
            d = runnable[i]
            pred = d.predicted_objective(create.objective)
            d.status = TrialStatus.SKIPPED
            d.reason = (f"over budget: max_trials={budget}" +
                        (f"; predicted {create.objective} {pred:.4g} is below the {budget} selected" if pred is not None
                         else ""))
    return drafts


# ----------------------------------------------------------------------------------------------- store
def new_sweep_id() -> str:
    return store.new_id("sweep")


def get_sweep(session: Session, *, sweep_id: str, project: str | None = None, lock: bool = False) -> Sweep:
    stmt = select(Sweep).where(Sweep.id == sweep_id)
    if project is not None:
        stmt = stmt.where(Sweep.project == project)
    if lock:
        stmt = stmt.execution_options(populate_existing=True)
    sweep = session.scalar(stmt)
    if sweep is None:
        raise store.NotFound(f"sweep '{sweep_id}' not found", param="sweep_id")
    return sweep


def list_sweeps(session: Session, *, project: str | None = None, status: Sequence[str] | None = None,
                limit: int = 50, offset: int = 0) -> tuple[list[Sweep], int]:
    stmt = select(Sweep)
    if project is not None:
        stmt = stmt.where(Sweep.project == project)
    if status:
        stmt = stmt.where(Sweep.status.in_([s.upper() for s in status]))
    total = session.scalar(select(func.count()).select_from(stmt.subquery())) or 0
    rows = session.scalars(stmt.order_by(Sweep.created_at.desc(), Sweep.id.desc()).limit(limit).offset(offset)).all()
    return list(rows), int(total)


def list_trials(session: Session, *, sweep_id: str) -> list[Trial]:
    return list(session.scalars(select(Trial).where(Trial.sweep_id == sweep_id).order_by(Trial.id)).all())


def objective_of(trial: Trial, objective: str) -> float | None:
    return trial.measured_mfu if objective == "mfu" else trial.measured_tokens_per_s


def best_trial(trials: Sequence[Trial], objective: str) -> Trial | None:
    """Highest measured objective among SUCCEEDED / EARLY_STOPPED trials (ties: the earlier trial)."""
    best, best_v = None, -math.inf
    for t in trials:
        v = objective_of(t, objective)
        if t.status in TrialStatus.MEASURED and v is not None and v > best_v:
            best, best_v = t, v
    return best


def _utc(dt):  # noqa: ANN001, ANN202
    if dt is not None and dt.tzinfo is None:
        return dt.replace(tzinfo=timezone.utc)
    return dt


def trial_public(t: Trial) -> TrialPublic:
    return TrialPublic(id=t.id, run_id=t.run_id, layout=Layout.model_validate(t.layout),
                       micro_batch_size=t.micro_batch_size, status=t.status, reason=t.reason,
                       predicted_tokens_per_s=t.predicted_tokens_per_s, measured_tokens_per_s=t.measured_tokens_per_s,
                       measured_mfu=t.measured_mfu, peak_memory_bytes=t.peak_memory_bytes)


def sweep_public(session: Session, sweep: Sweep) -> SweepPublic:
    trials = list_trials(session, sweep_id=sweep.id)
    pub = [trial_public(t) for t in trials]
    best = next((p for p in pub if p.id == sweep.best_trial_id), None) if sweep.best_trial_id else None
    return SweepPublic(id=sweep.id, name=sweep.name, project=sweep.project, status=sweep.status,
                       status_reason=sweep.status_reason, objective=sweep.objective,
                       spec=SweepCreate.model_validate(sweep.spec), trials=pub, best_trial=best,
                       calibration=sweep.calibration, ray_job_id=sweep.ray_job_id, created_at=_utc(sweep.created_at),
                       updated_at=_utc(sweep.updated_at), finished_at=_utc(sweep.finished_at))


def _planning(runtime: Any, session: Session) -> tuple[ClusterSpec | None, Any, str | None]:
    """(cluster, calibrated factors or None, cluster key) of the runtime's live cluster."""
    if runtime is None or not hasattr(runtime, "planning_cluster"):
        return None, None, None
    cluster = runtime.planning_cluster()
    if cluster is None:
        return None, None, None
    from service.calibration import cluster_key, latest_factors

    key = cluster_key(cluster)
    return cluster, latest_factors(session, key), key


def create_sweep(session: Session, *, create: SweepCreate, project: str, actor: str, can_run_code: bool,
                 settings: Any, runtime: Any | None = None,
                 idempotency_key: str | None = None) -> tuple[Sweep, bool]:
    """Validate and expand a sweep, store it QUEUED with its trials. Returns (sweep, created); created=False for
    an idempotent retry. Raises SpecError (422) when nothing can run, PolicyViolation (403/422) like a run."""
    from service.auth import check_spec_policy

    spec_json = create.model_dump(mode="json")
    if idempotency_key:
        existing = session.scalar(select(Sweep).where(Sweep.project == project,
                                                      Sweep.idempotency_key == idempotency_key))
        if existing is not None:
            if existing.spec != spec_json:
                raise store.Conflict(f"Idempotency-Key '{idempotency_key}' was already used for sweep "
                                     f"'{existing.id}' with a different spec; use a new key", param="Idempotency-Key")
            return existing, False
    if not NAME_RE.match(create.name) or len(create.name) > 100:
        raise SpecError([SpecIssue("name", "sweep name must be 1-100 characters of letters, digits, '.', '_' or "
                                   "'-', starting with a letter or digit", "invalid_value")])
    check_spec_policy(create.base, can_run_code=can_run_code, settings=settings)
    base_chk = check_spec(create.base.model_copy(update={"layout": Layout()}))
    model_issues = [i for i in base_chk.errors if i.param.startswith("model")]
    if model_issues:
        raise SpecError([SpecIssue(f"base.{i.param}", i.message, i.code) for i in model_issues])

    cluster, factors, key = _planning(runtime, session)
    never = getattr(runtime, "never_fits", None) if runtime is not None else None
    drafts = expand(create, cluster=cluster, factors=factors, never_fits=never)
    if not any(d.status == TrialStatus.PENDING for d in drafts):
        reasons = "; ".join(f"[{_short_layout(d.layout)} mb={d.micro_batch_size}] {d.reason}" for d in drafts[:5])
        raise SpecError([SpecIssue("search.layouts", trim(f"no candidate of the sweep can run: {reasons}", 3000),
                                   "no_runnable_trial")])

    sweep = Sweep(id=new_sweep_id(), name=create.name, project=project, status=SweepStatus.QUEUED,
                  status_reason="waiting for the sweep's Ray Job", objective=create.objective, spec=spec_json,
                  created_by=actor, idempotency_key=idempotency_key)
    if cluster is not None:
        from service.planner import default_factors, resolve_device

        used = factors or default_factors(is_cpu=resolve_device(cluster).is_cpu)
        sweep.calibration = {"status": "pending", "cluster_key": key, "cluster": cluster.model_dump(mode="json"),
                             "factors_before": used.to_dict(), "calibrated_before": factors is not None}
    session.add(sweep)
    session.flush()
    for d in drafts:
        session.add(Trial(sweep_id=sweep.id, layout=d.layout.model_dump(mode="json"), micro_batch_size=d.micro_batch_size,
                          status=d.status, reason=d.reason,
                          predicted_tokens_per_s=d.predicted.tokens_per_s if d.predicted is not None else None))
    session.flush()
    n_run = sum(d.status == TrialStatus.PENDING for d in drafts)
    log.info("sweep %s (%s): %d trials, %d to run, %d skipped", sweep.id, create.name, len(drafts), n_run,
             len(drafts) - n_run)
    return sweep, True


def _short_layout(layout: Layout | dict[str, Any]) -> str:
    lay = Layout.model_validate(layout)
    s = f"dp{lay.dp} tp{lay.tp} pp{lay.pp}"
    if lay.zero_stage:
        s += f" z{lay.zero_stage}"
    if lay.sequence_parallel:
        s += " sp"
    if lay.pp > 1 and lay.pp_schedule != "1f1b":
        s += f" {lay.pp_schedule}"
    return s


# ------------------------------------------------------------------------------------------- execution
def submission_id(sweep_id: str, n: int) -> str:
    return f"{SUBMISSION_PREFIX}{sweep_id}-{n}"


def _submission_number(job_id: str | None) -> int:
    try:
        return int(job_id.rsplit("-", 1)[1]) if job_id else 0
    except (IndexError, ValueError):
        return 0


def _runtime_env(runtime: Any, n: int, *, job_id: str, base_spec: dict[str, Any] | None = None) -> dict[str, Any]:
    """The run jobs' runtime env (database URL, data dirs, PYTHONPATH, pass-through variables, working_dir for
    remote clusters) without the per-run placement, with this sweep job's id, the dashboard URL, and the base
    spec's user code directory (``code.working_dir``) when it has one."""
    from service.placement import Placement

    sched = getattr(runtime, "scheduler", None)
    stub = type("SweepStub", (), {"id": job_id})  # not a run id: the scheduler's user-code hook skips it
    if sched is not None and hasattr(sched, "runtime_env"):
        renv = sched.runtime_env(stub, Placement(fits=False, reason="sweep trials place their own workers"), n)
    else:  # pragma: no cover - a runtime without a scheduler
        import os

        from service.scheduler import PASS_THROUGH_ENV, PROJECT_ROOT

        s = runtime.settings
        env = {"MESHRUN_DATABASE_URL": s.database_url, "MESHRUN_DATA_DIR": str(s.data_dir),
               "MESHRUN_CHECKPOINT_ROOT": str(s.checkpoint_root), "MESHRUN_LOG_LEVEL": s.log_level,
               "PYTHONPATH": os.pathsep.join(p for p in (str(PROJECT_ROOT), os.environ.get("PYTHONPATH")) if p)}
        env.update({k: os.environ[k] for k in PASS_THROUGH_ENV if os.environ.get(k)})
        renv = {"env_vars": env}
    env = dict(renv.get("env_vars") or {})
    env.pop("MESHRUN_PLACEMENT", None)
    env.pop("MESHRUN_SUBMISSION", None)
    env["MESHRUN_RAY_JOB_ID"] = job_id
    dash = getattr(runtime, "dashboard_url", None)
    if dash:
        env["MESHRUN_DASHBOARD_URL"] = str(dash)
    renv = {**renv, "env_vars": env}
    code = ((base_spec or {}).get("code") or {}).get("working_dir")
    if code:
        try:
            from service.inspect import code_runtime_env, resolve_code_dir

            p = resolve_code_dir(code, runtime.settings)
            if p.is_dir():
                renv = code_runtime_env(renv, p)
            else:
                log.warning("sweep job %s: code.working_dir %s is gone; the job starts without it", job_id, p)
        except ImportError:  # pragma: no cover - a build without user-code support
            pass
    return renv


def start_sweep(runtime: Any, sweep_id: str) -> bool:
    """Submit a QUEUED sweep as its Ray Job. False when there is no runtime (it stays QUEUED) or the submission
    failed (it stays QUEUED with the reason; ``start_queued_sweeps`` retries)."""
    jobs = getattr(runtime, "jobs", None) if runtime is not None else None
    if jobs is None:
        return False
    factory = runtime.factory
    with session_scope(factory) as s:
        sweep = get_sweep(s, sweep_id=sweep_id)
        if sweep.status != SweepStatus.QUEUED:
            return False
        n = _submission_number(sweep.ray_job_id) + 1
        name, project, base_spec = sweep.name, sweep.project, (sweep.spec or {}).get("base")
    sid = submission_id(sweep_id, n)
    try:
        jobs.submit(entrypoint=f"python -m {DRIVER_MODULE} --sweep-id {sweep_id}", submission_id=sid,
                    metadata={"sweep_id": sweep_id, "name": name, "project": project, "meshrun": "sweep"},
                    runtime_env=_runtime_env(runtime, n, job_id=sid, base_spec=base_spec))
    except Exception as e:  # noqa: BLE001
        if "already exists" in str(e):  # submitted concurrently (the route and the runtime's tick)
            return False
        log.exception("submitting sweep %s failed", sweep_id)
        if hasattr(jobs, "reset"):
            jobs.reset()
        with session_scope(factory) as s:
            sweep = get_sweep(s, sweep_id=sweep_id)
            sweep.status_reason = trim(f"Ray Job submission failed, will retry: {e}", 1000)
            sweep.ray_job_id = sid
        return False
    with session_scope(factory) as s:
        sweep = get_sweep(s, sweep_id=sweep_id)
        sweep.ray_job_id = sid
        if sweep.status == SweepStatus.QUEUED:
            sweep.status_reason = f"submitted as Ray Job {sid}"
        sweep.updated_at = utcnow()
    log.info("sweep %s submitted as Ray Job %s", sweep_id, sid)
    return True


def start_queued_sweeps(runtime: Any) -> list[str]:
    """Submit every QUEUED sweep without a running job (a hook for the runtime's admission tick: sweeps created
    while no scheduler ran, or whose submission failed)."""
    started = []
    with session_scope(runtime.factory) as s:
        queued = [(sw.id, sw.ray_job_id) for sw in
                  s.scalars(select(Sweep).where(Sweep.status == SweepStatus.QUEUED).order_by(Sweep.created_at))]
    for sweep_id, job_id in queued:
        if job_id:
            try:
                state = runtime.jobs.state(job_id)
            except Exception:  # noqa: BLE001
                continue
            if not state.terminal:
                continue  # submitted; the driver has not started yet
        if start_sweep(runtime, sweep_id):
            started.append(sweep_id)
    return started


def reconcile_sweep(runtime: Any, sweep_id: str) -> bool:
    """A QUEUED/RUNNING sweep whose Ray Job ended without the driver finishing it -> FAILED ("sweep driver
    lost"), its unfinished trials FAILED. True when it changed something."""
    jobs = getattr(runtime, "jobs", None) if runtime is not None else None
    if jobs is None:
        return False
    with session_scope(runtime.factory) as s:
        sweep = get_sweep(s, sweep_id=sweep_id)
        if sweep.status in SweepStatus.TERMINAL or not sweep.ray_job_id:
            return False
        job_id = sweep.ray_job_id
    try:
        state = jobs.state(job_id)
    except Exception:  # noqa: BLE001 - cannot tell now
        log.exception("reading the state of sweep job %s failed", job_id)
        return False
    if not state.terminal:
        return False
    with session_scope(runtime.factory) as s:  # the driver may have finished it meanwhile
        if get_sweep(s, sweep_id=sweep_id).status in SweepStatus.TERMINAL:
            return False
    reason = f"sweep driver lost: Ray Job {job_id} is {state.status}" + (f": {state.message}" if state.message else "")
    finish_sweep(runtime.factory, sweep_id, failure=trim(reason, 2000))
    return True


def reconcile_sweeps(runtime: Any) -> list[str]:
    """``reconcile_sweep`` for every QUEUED/RUNNING sweep with a job (a hook for the runtime's tick)."""
    with session_scope(runtime.factory) as s:
        ids = [sw.id for sw in s.scalars(select(Sweep).where(Sweep.status.in_([SweepStatus.QUEUED,
                                                                               SweepStatus.RUNNING]),
                                                           Sweep.ray_job_id.is_not(None)))]
    return [i for i in ids if reconcile_sweep(runtime, i)]


def _end_trial_run(session: Session, run_id: str, to: RunStatus, reason: str, actor: str) -> None:
    try:
        run = store.get_run(session, run_id=run_id)
        if RunStatus(run.status).terminal:
            return
        store.transition(session, run_id=run_id, to=to, reason=reason, actor=actor)
        if run.attempts:
            store.finish_attempt(session, run_id=run_id, attempt=run.attempts, status=to.value, cause=reason[:500])
    except (store.Conflict, store.NotFound):
        pass


def cancel_sweep(session: Session, *, sweep_id: str, scope: str | None, actor: str, runtime: Any | None) -> Sweep:
    """CANCELLED at once (so the driver never overwrites it), unfinished trials and their runs CANCELLED, then
    the sweep's Ray Job stopped (its Tune trials, Train controllers and workers go with it). Terminal -> 409."""
    sweep = get_sweep(session, sweep_id=sweep_id, project=scope)
    if sweep.status in SweepStatus.TERMINAL:
        raise store.Conflict(f"sweep '{sweep_id}' is already {sweep.status}; nothing to cancel", param="status")
    reason = f"cancelled by {actor}"
    sweep.status, sweep.status_reason, sweep.finished_at, sweep.updated_at = (SweepStatus.CANCELLED, reason, utcnow(),
                                                                             utcnow())
    for t in list_trials(session, sweep_id=sweep_id):
        if t.status in TrialStatus.TERMINAL:
            continue
        if t.run_id:
            _end_trial_run(session, t.run_id, RunStatus.CANCELLED, f"sweep {sweep_id} {reason}", actor)
        t.status, t.reason = TrialStatus.CANCELLED, f"sweep {reason}"
    job_id = sweep.ray_job_id
    session.commit()
    jobs = getattr(runtime, "jobs", None) if runtime is not None else None
    if job_id and jobs is not None:
        try:
            jobs.stop(job_id)
            deadline = time.monotonic() + CANCEL_WAIT_S
            while time.monotonic() < deadline and not jobs.state(job_id).terminal:
                time.sleep(0.5)
        except Exception:  # noqa: BLE001 - the database already says CANCELLED; the driver checks it
            log.exception("stopping sweep job %s failed", job_id)
    session.expire_all()
    return get_sweep(session, sweep_id=sweep_id)


def cancel_trial_run(session: Session, *, run: Run, actor: str) -> Run:
    """Cancel ONE trial's run without stopping its sweep (the run's Ray Job is the sweep's): CANCELLED here; the
    trial's driver sees it within a second and ends the trial (its Train workers are released), the sweep goes
    on. For ``service.submission.cancel_run`` when ``run.sweep_id`` is set."""
    _end_trial_run(session, run.id, RunStatus.CANCELLED, f"cancelled by {actor}", actor)
    t = session.scalar(select(Trial).where(Trial.run_id == run.id))
    if t is not None and t.status not in TrialStatus.TERMINAL:
        t.status, t.reason = TrialStatus.CANCELLED, f"run cancelled by {actor}"
    session.flush()
    return store.get_run(session, run_id=run.id)


# --------------------------------------------------------------------------------------- measurement
@dataclass
class Measurement:
    steps_done: int = 0
    steps_measured: int = 0
    tokens_per_s: float | None = None
    mfu: float | None = None
    peak_memory_bytes: int | None = None

    def objective(self, objective: str) -> float | None:
        return self.mfu if objective == "mfu" else self.tokens_per_s


def measure_run(session: Session, *, run_id: str, warmup_steps: int) -> Measurement:
    """Means of tokens/s and MFU over the steps after ``warmup_steps``; peak memory over all steps."""
    rows = store.list_metrics(session, run_id=run_id)
    if not rows:
        return Measurement()
    steady = [r for r in rows if r.step > warmup_steps]
    tps = [r.tokens_per_s for r in steady if r.tokens_per_s is not None]
    mfu = [r.mfu for r in steady if r.mfu is not None]
    peak = max((r.peak_memory_bytes or 0) for r in rows) or None
    return Measurement(steps_done=rows[-1].step, steps_measured=len(tps),
                       tokens_per_s=sum(tps) / len(tps) if tps else None, mfu=sum(mfu) / len(mfu) if mfu else None,
                       peak_memory_bytes=peak)


def record_measurement(session: Session, trial: Trial, m: Measurement) -> None:
    trial.measured_tokens_per_s = m.tokens_per_s
    trial.measured_mfu = m.mfu
    trial.peak_memory_bytes = m.peak_memory_bytes


# ------------------------------------------------------------------------------------------- finishing
def _observations(sweep: Sweep, trials: Sequence[Trial]) -> tuple[list[Any], list[str]]:
    from api.validation import resolve_model
    from service.calibration import Observation

    create = SweepCreate.model_validate(sweep.spec)
    cfg = resolve_model(create.base.model)
    obs, labels = [], []
    for t in trials:
        if t.status in TrialStatus.MEASURED and t.measured_tokens_per_s:
            obs.append(Observation(model=cfg, layout=Layout.model_validate(t.layout), micro_batch_size=t.micro_batch_size,
                                   global_batch_size=create.base.batch.global_batch_size,
                                   measured_tokens_per_s=float(t.measured_tokens_per_s),
                                   precision=create.base.precision,
                                   activation_checkpointing=create.base.activation_checkpointing,
                                   label=str(t.id)))
            labels.append(str(t.id))
    return obs, labels


def calibrate_sweep(session: Session, sweep: Sweep, trials: Sequence[Trial]) -> dict[str, Any] | None:
    """Fit the planner's factors to the sweep's measured trials, store a ``calibrations`` row for the cluster,
    and return the sweep's ``calibration`` JSON (None without a cluster or measurements)."""
    from service.calibration import fit_factors, store_calibration
    from service.planner import Factors

    info = dict(sweep.calibration or {})
    if not info.get("cluster"):
        return {**info, "status": "skipped", "reason": "no cluster was known when the sweep was created"} \
            if info else None
    obs, labels = _observations(sweep, trials)
    if not obs:
        return {**info, "status": "skipped", "reason": "no trial was measured"}
    cluster = ClusterSpec.model_validate(info["cluster"])
    start = Factors.from_dict(info.get("factors_before")) if info.get("factors_before") else None
    fit = fit_factors(obs, cluster, start=start)
    cal = store_calibration(session, cluster_key=info["cluster_key"], factors=fit.factors,
                            error_before=_finite(fit.error_before), error_after=_finite(fit.error_after),
                            sweep_id=sweep.id)
    out = {**info, **fit.to_json(labels), "status": "fitted", "calibration_id": cal.id}
    log.info("sweep %s calibration for %s: mean relative error %.1f%% -> %.1f%% over %d trials", sweep.id,
             info["cluster_key"], 100 * fit.error_before, 100 * fit.error_after, len(obs))
    return out


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def finish_sweep(factory: Any, sweep_id: str, *, failure: str | None = None, cancelled: str | None = None) -> Sweep:
    """End a sweep: unfinished trials closed (their runs ended), best trial chosen, calibration fitted, status
    SUCCEEDED (some trial measured) or FAILED. A sweep CANCELLED meanwhile stays CANCELLED. ``failure``: the
    driver failed (reason); ``cancelled``: the driver was stopped (reason)."""
    with session_scope(factory) as s:
        sweep = get_sweep(s, sweep_id=sweep_id, lock=True)
        was_cancelled = sweep.status == SweepStatus.CANCELLED or cancelled is not None
        trials = list_trials(s, sweep_id=sweep_id)
        for t in trials:
            if t.status in TrialStatus.TERMINAL:
                continue
            why = (cancelled or sweep.status_reason or "sweep cancelled") if was_cancelled else \
                (failure or "the sweep ended before this trial finished")
            if t.run_id:
                to = RunStatus.CANCELLED if was_cancelled else RunStatus.FAILED
                _end_trial_run(s, t.run_id, to, f"sweep {sweep_id}: {why}", "sweep-driver")
                create = SweepCreate.model_validate(sweep.spec)
                record_measurement(s, t, measure_run(s, run_id=t.run_id, warmup_steps=create.budget.warmup_steps))
            t.status = TrialStatus.CANCELLED if was_cancelled else TrialStatus.FAILED
            t.reason = why if t.run_id else f"not run: {why}"
        if sweep.status in SweepStatus.TERMINAL:
            return sweep
        now = utcnow()
        if was_cancelled:
            sweep.status, sweep.status_reason = SweepStatus.CANCELLED, cancelled
            sweep.finished_at = sweep.updated_at = now
            return sweep
        best = best_trial(trials, sweep.objective)
        try:
            cal = calibrate_sweep(s, sweep, trials)
        except Exception as e:  # noqa: BLE001 - the sweep's answer does not depend on calibration
            log.exception("calibration of sweep %s failed", sweep_id)
            cal = {**(sweep.calibration or {}), "status": "failed", "reason": f"{type(e).__name__}: {e}"}
        sweep.calibration = cal
        counts: dict[str, int] = {}
        for t in trials:
            counts[t.status] = counts.get(t.status, 0) + 1
        tally = ", ".join(f"{v} {k.lower()}" for k, v in sorted(counts.items()))
        if best is not None:
            v = objective_of(best, sweep.objective)
            sweep.status, sweep.best_trial_id = SweepStatus.SUCCEEDED, best.id
            sweep.status_reason = trim(f"best: trial {best.id} ({_short_layout(best.layout)} mb="
                                       f"{best.micro_batch_size}) {sweep.objective}={v:.4g}; trials: {tally}" +
                                       (f"; driver: {failure}" if failure else ""), 2000)
        else:
            sweep.status = SweepStatus.FAILED
            sweep.status_reason = trim(f"no trial was measured ({tally})" + (f": {failure}" if failure else ""), 2000)
        sweep.finished_at = sweep.updated_at = now
        return sweep

"""Expansion of a sweep into trials, and the creation of a sweep.

A sweep (``api.spec.SweepCreate``) is a base run spec, a search space (explicit layouts x micro-batch sizes, or
``auto``: the planner's top feasible candidates for the live cluster; ``add_auto``: both, the listed ones first),
an objective (``tokens_per_s`` | ``mfu`` | ``cost``: tokens per device-second, so that with ``auto`` a smaller world
that is cheaper per token can win)
and a budget. ``create_sweep`` expands it into trials, each checked like a submitted run:

- ``api.spec.validation.check_spec`` errors -> trial SKIPPED with ``"<param>: <message>"``;
- the planner's prediction (``service.planner.predict_run`` on the host's ``planning_cluster()``, with the latest
  calibration of that cluster) is recorded per trial; a layout predicted NOT to fit in memory is SKIPPED with
  the planner's reason -- unless the base spec sets ``skip_memory_check: true``, in which case it runs so that
  the real failure (OOM) is recorded. (Auto candidates are feasible by construction.)
- a layout the cluster can never place beside the sweep's own trial drivers (``TRIAL_DRIVER_CPU`` x
  ``max_concurrent_trials``, the host's ``never_fits``) -> SKIPPED with the reason, before anything starts;
- the runnable trials are ranked by predicted objective; those beyond ``budget.max_trials`` are SKIPPED
  ("over budget"), so the budget goes to the predicted contenders.

Spec fields a trial overrides: layout, micro-batch size, ``train.steps`` (= ``budget.steps_per_trial``),
``checkpoint.every_steps`` (0: trials measure throughput, they do not checkpoint), name (``<sweep name>-t<trial
id>``), labels (``sweep``, ``trial``). ``activation_checkpointing`` stays the base's (the trial table stores layout
and micro-batch only).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from sqlalchemy.orm import Session

from api.spec import NAME_RE, Candidate, ClusterSpec, Layout, Plan, PlanRequest, RunSpec, SweepCreate, layout_label
from api.spec.validation import SpecError, SpecIssue, build_plan, check_spec
from service import store
from service.cluster.jobs import trim
from service.planner import Factors, default_factors, predict_run, resolve_device, search
from service.security.policy import check_spec_policy
from service.settings import Settings
from service.store.calibrations import cluster_key, latest_factors
from service.store.models import Sweep, SweepEvent
from service.sweeps.host import SweepHost
from service.sweeps.measurement import objective_value
from service.sweeps.state import SweepStatus, TrialStatus, add_trial, new_sweep_id

log = logging.getLogger(__name__)

MAX_CANDIDATES = 1024
TRIAL_DRIVER_CPU = 0.01  # what each Tune trial's driver reserves (service.sweeps.driver.TRIAL_RESOURCES)
AUTO_WORLD_SIZES = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


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
        return _predicted_value(self.predicted, objective)


def _predicted_value(c: Candidate, objective: str) -> float | None:
    return objective_value(objective, tokens_per_s=c.tokens_per_s, mfu=c.mfu, devices=c.layout.world_size)


def trial_spec(
    create: SweepCreate,
    layout: Layout | dict[str, Any],
    micro_batch_size: int,
    *,
    name: str | None = None,
    labels: dict[str, str] | None = None,
) -> RunSpec:
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
    return (json.dumps(layout.model_dump(mode="json"), sort_keys=True), mb)  # nested fields (outer_optimizer) too


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
        raise SpecError(
            [
                SpecIssue(
                    "search.layouts",
                    f"layouts 'auto': world size {base_world} does not fill whole "
                    f"nodes of {per_node} workers on this cluster; list the layouts explicitly",
                    "invalid_spec",
                )
            ]
        )
    return out


def auto_candidates(create: SweepCreate, cluster: ClusterSpec, *, factors: Factors | None = None) -> list[Candidate]:
    """The planner's top feasible candidates for the base model on the live cluster, best predicted first: those
    the planner cannot tell from the best (their predicted objective within the uncertainty of the best's,
    ``within_best``), so that the sweep measures exactly the layouts the plan calls tied. Priced as meshrun's own
    loop (``kernels`` eager, megatron when the base compiles), as its trials will run."""
    base = create.base
    if cluster.kernels is None:
        cluster = cluster.model_copy(update={"kernels": "megatron" if base.compile else "eager"})
    mbs: list[int | None] = [*create.search.micro_batch_sizes] if create.search.micro_batch_sizes else [None]
    found: dict[tuple, Candidate] = {}
    for _world, cl in _auto_clusters(create, cluster):
        for mb in mbs:
            req = PlanRequest(
                model=base.model,
                cluster=cl,
                global_batch_size=base.batch.global_batch_size,
                precision=base.precision,
                top_k=create.budget.max_trials,
                micro_batch_size=mb,
                activation_checkpointing=base.activation_checkpointing,
            )
            for cand in search(req, factors=factors).candidates:
                if cand.feasible:
                    found.setdefault(_layout_key(cand.layout, cand.micro_batch_size), cand)
    ranked = sorted(found.values(), key=lambda c: _predicted_value(c, create.objective) or 0.0, reverse=True)
    return within_best(ranked, create.objective)


def within_best(ranked: list[Candidate], objective: str) -> list[Candidate]:
    """The candidates (best predicted first) whose objective's interval reaches the best's: every objective is
    inversely proportional to the step time, so a step-time interval ``[t (1 - below), t (1 + above)]`` maps to
    ``[v / (1 + above), v / (1 - below)]``. Candidates without an interval are kept (nothing says they tie)."""
    if not ranked:
        return ranked

    def span(c: Candidate) -> tuple[float, float]:
        v = _predicted_value(c, objective) or 0.0
        iv = c.step_time_interval
        if iv is None:
            return v, v
        return v / (1 + iv.above), v / (1 - iv.below) if iv.below < 1 else math.inf

    best_low = span(ranked[0])[0]
    return [c for c in ranked if c.step_time_interval is None or span(c)[1] >= best_low]


def _issue_text(issues: Sequence[SpecIssue]) -> str:
    return "; ".join(f"{i.param}: {i.message}" for i in issues)


def expand(
    create: SweepCreate,
    *,
    cluster: ClusterSpec | None,
    factors: Factors | None = None,
    never_fits: Callable[[Plan], str | None] | None = None,
) -> list[TrialDraft]:
    """The sweep's trials in display order (explicit: layouts x micro-batches as listed; auto: best predicted
    first), each PENDING or SKIPPED with its reason, with the planner's prediction when a cluster is known."""
    if create.budget.warmup_steps >= create.budget.steps_per_trial:
        raise SpecError(
            [
                SpecIssue(
                    "budget.warmup_steps",
                    f"warmup_steps={create.budget.warmup_steps} leaves no "
                    f"measured step of steps_per_trial={create.budget.steps_per_trial}; use "
                    f"warmup_steps < steps_per_trial",
                    "invalid_spec",
                )
            ]
        )
    drafts: list[TrialDraft] = []
    auto = create.search.layouts == "auto" or create.search.add_auto
    if auto:
        if cluster is None:
            raise SpecError(
                [
                    SpecIssue(
                        "search.layouts",
                        "layouts 'auto' needs the service's Ray cluster to plan "
                        "for, which this API process does not run (or has no nodes yet); list the "
                        "layouts explicitly",
                        "live_cluster_unavailable",
                    )
                ]
            )
        cands = auto_candidates(create, cluster, factors=factors)
        if not cands and create.search.layouts == "auto":
            raise SpecError(
                [
                    SpecIssue(
                        "search.layouts",
                        "layouts 'auto': the planner found no feasible layout for "
                        "this model, batch and precision on the cluster; see POST /v1/plans with "
                        "cluster.device 'live' for the rejections",
                        "no_feasible_layout",
                    )
                ]
            )
        drafts = [TrialDraft(c.layout, c.micro_batch_size, explicit=False) for c in cands]
    if create.search.layouts != "auto":
        auto_drafts, drafts = drafts, []
        mbs = create.search.micro_batch_sizes or [create.base.batch.micro_batch_size]
        if not create.search.layouts:
            raise SpecError([SpecIssue("search.layouts", "give at least one layout, or 'auto'", "invalid_spec")])
        if len(create.search.layouts) * len(mbs) > MAX_CANDIDATES:
            raise SpecError(
                [
                    SpecIssue(
                        "search",
                        f"{len(create.search.layouts)} layouts x {len(mbs)} micro-batch "
                        f"sizes exceed {MAX_CANDIDATES} candidates; narrow the search",
                        "too_large",
                    )
                ]
            )
        seen: set[tuple] = set()
        for lay in create.search.layouts:
            for mb in mbs:
                k = _layout_key(lay, mb)
                if k not in seen:
                    seen.add(k)
                    drafts.append(TrialDraft(lay, int(mb)))
        # add_auto: the planner's candidates after the listed layouts (the listed ones are kept)
        drafts += [d for d in auto_drafts if _layout_key(d.layout, d.micro_batch_size) not in seen]

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
                    d.reason = (
                        f"predicted not to fit: {d.predicted.reason} (set base.skip_memory_check: true to "
                        "run it anyway and record the real failure)"
                    )
                    continue
        if never_fits is not None:
            why = never_fits(plan)
            if why:
                d.status, d.reason = TrialStatus.SKIPPED, f"cannot be placed on this cluster: {why}"

    runnable = [d for d in drafts if d.status == TrialStatus.PENDING]
    order = sorted(
        range(len(runnable)), key=lambda i: (-(runnable[i].predicted_objective(create.objective) or -math.inf), i)
    )
    budget = create.budget.max_trials
    for rank, i in enumerate(order):
        if rank >= budget:
            d = runnable[i]
            pred = d.predicted_objective(create.objective)
            d.status = TrialStatus.SKIPPED
            d.reason = f"over budget: max_trials={budget}" + (
                f"; predicted {create.objective} {pred:.4g} is below the {budget} selected" if pred is not None else ""
            )
    return drafts


def _planning(host: SweepHost | None, session: Session) -> tuple[ClusterSpec | None, Factors | None, str | None]:
    """(cluster, calibrated factors or None, cluster key) of the host's live cluster."""
    cluster = host.planning_cluster() if host is not None else None
    if cluster is None:
        return None, None, None
    key = cluster_key(cluster)
    return cluster, latest_factors(session, key), key


def create_sweep(
    session: Session,
    *,
    create: SweepCreate,
    project: str,
    actor: str,
    can_run_code: bool,
    settings: Settings,
    runtime: SweepHost | None = None,
    idempotency_key: str | None = None,
    admin: bool = False,
) -> tuple[Sweep, bool]:
    """Validate and expand a sweep, store it QUEUED with its trials. Returns (sweep, created); created=False for
    an idempotent retry. Raises SpecError (422) when nothing can run, PolicyViolation (403/422) like a run."""
    create = create.model_copy(
        update={
            "base": check_spec_policy(
                create.base, can_run_code=can_run_code, settings=settings, admin=admin, project=project
            )
        }
    )
    spec_json = create.model_dump(mode="json")
    if idempotency_key:
        existing = store.find_by_idempotency_key(session, model=Sweep, project=project, key=idempotency_key)
        if existing is not None:
            if existing.spec != spec_json:
                raise store.Conflict(
                    f"Idempotency-Key '{idempotency_key}' was already used for sweep "
                    f"'{existing.id}' with a different spec; use a new key",
                    param="Idempotency-Key",
                )
            return existing, False
    if not NAME_RE.fullmatch(create.name) or len(create.name) > 100:
        raise SpecError(
            [
                SpecIssue(
                    "name",
                    "sweep name must be 1-100 characters of letters, digits, '.', '_' or "
                    "'-', starting with a letter or digit",
                    "invalid_value",
                )
            ]
        )
    base_chk = check_spec(create.base.model_copy(update={"layout": Layout()}))
    model_issues = [i for i in base_chk.errors if i.param.startswith("model")]
    if model_issues:
        raise SpecError([SpecIssue(f"base.{i.param}", i.message, i.code) for i in model_issues])

    cluster, factors, key = _planning(runtime, session)
    # the sweep's own reservations: each concurrent Tune trial holds its driver's CPU sliver beside its workers
    held = TRIAL_DRIVER_CPU * create.budget.max_concurrent_trials
    host = runtime
    drafts = expand(
        create,
        cluster=cluster,
        factors=factors,
        never_fits=(lambda plan: host.never_fits(plan, reserved_cpu=held)) if host is not None else None,
    )
    if not any(d.status == TrialStatus.PENDING for d in drafts):
        reasons = "; ".join(f"[{layout_label(d.layout)} mb={d.micro_batch_size}] {d.reason}" for d in drafts[:5])
        raise SpecError(
            [
                SpecIssue(
                    "search.layouts", trim(f"no candidate of the sweep can run: {reasons}", 3000), "no_runnable_trial"
                )
            ]
        )

    sweep = Sweep(
        id=new_sweep_id(),
        name=create.name,
        project=project,
        status=SweepStatus.QUEUED,
        status_reason="waiting for the sweep's Ray Job",
        objective=create.objective,
        spec=spec_json,
        created_by=actor,
        idempotency_key=idempotency_key,
    )
    if cluster is not None:
        used = factors or default_factors(is_cpu=resolve_device(cluster).is_cpu)
        sweep.calibration = {
            "status": "pending",
            "cluster_key": key,
            "cluster": cluster.model_dump(mode="json"),
            "factors_before": used.to_dict(),
            "calibrated_before": factors is not None,
        }
    n_run = sum(d.status == TrialStatus.PENDING for d in drafts)
    session.add(sweep)
    session.flush()
    session.add(
        SweepEvent(
            sweep_id=sweep.id,
            to_status=SweepStatus.QUEUED,
            actor=actor,
            reason=f"created by {actor} (project {project}): {len(drafts)} trials, {n_run} to run, "
            f"{len(drafts) - n_run} skipped",
        )
    )
    for d in drafts:
        add_trial(
            session,
            sweep=sweep,
            status=d.status,
            reason=d.reason,
            actor=actor,
            layout=d.layout.model_dump(mode="json"),
            micro_batch_size=d.micro_batch_size,
            predicted_tokens_per_s=d.predicted.tokens_per_s if d.predicted is not None else None,
        )
    session.flush()
    log.info(
        "sweep %s (%s): %d trials, %d to run, %d skipped",
        sweep.id,
        create.name,
        len(drafts),
        n_run,
        len(drafts) - n_run,
    )
    return sweep, True

"""Elastic recovery: when a run's layout can no longer be placed (a node lost for good), re-plan it within its
``spec.elastic`` for the capacity that remains, keeping the global batch (more gradient accumulation); when
capacity returns, change it back (at a checkpoint boundary).

Pure decisions (no Ray, no database), in two modes:

- dp bounds (``min_dp``/``max_dp``): ``replan`` takes the largest dp in [min_dp, min(max_dp, dp - 1)] whose plan
  fits the alive nodes' total resources (whole tensor-parallel groups per node, ``service.cluster.placement``);
  ``grow`` the largest dp in (dp, max_dp] that fits the nodes' *free* resources (the caller adds back what the run
  itself holds);
- a list (``layouts``, best first, ``api.spec.elastic.preferences``): ``replan`` takes the first other layout that
  fits, ``grow`` the first layout listed before the current one that fits the free resources.

Both return None when nothing fits, keep the global batch and, when it still divides, the micro-batch size
(``api.spec.elastic.candidate``), and record in the new spec how far the run may change back (``max_dp``, the
original dp when unset, or the list with the original layout in it). The scheduler (``service.control.scheduler``)
acts: a shrink re-queues the run at once in the new layout from its latest checkpoint (which reshards on load; the
data position is kept, ``workers.data``); a grow asks the run to checkpoint and yield (the preemption path), then
applies the new layout while it is queued. Each is an ``elastic`` event naming the old and new layout and why.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from api.spec import Plan, RunSpec
from api.spec.elastic import Degrees, candidate, preferences
from api.spec.validation import SpecError, build_plan
from service.cluster.head import NodeView
from service.cluster.placement import NodeCapacity, place, worker_resources

EVENT_KIND = "elastic"


@dataclass(frozen=True)
class Replan:
    spec: RunSpec
    plan: Plan
    reason: str


def max_dp(spec: RunSpec, plan: Plan) -> int:
    """How far the run may grow in the dp-bounds mode: ``elastic.max_dp``, else the layout's dp."""
    assert spec.elastic is not None
    return spec.elastic.max_dp or plan.dp


def may_grow(spec: RunSpec, plan: Plan) -> bool:
    """Is there a layout the run would rather have: a larger dp below ``max_dp``, or one listed before its own."""
    if spec.elastic is None:
        return False
    ranked = preferences(spec)
    if ranked:
        return ranked.index((plan.dp, plan.tp, plan.pp)) > 0 if (plan.dp, plan.tp, plan.pp) in ranked else True
    return plan.dp < max_dp(spec, plan)


def _layout(spec: RunSpec, plan: Plan, to: Degrees) -> tuple[RunSpec, Plan, int, int] | None:
    """``spec`` and its plan in layout ``to`` (dp, tp, pp) with the same global batch (``api.spec.elastic``), and
    (micro-batches per rank, micro-batch size); None when no valid plan."""
    try:
        new_spec, accum, micro = candidate(spec, *to)
        new_plan = build_plan(new_spec, device=plan.device)
    except (SpecError, ValueError):
        return None
    return new_spec, new_plan, accum, micro


def _first_fit(
    spec: RunSpec, plan: Plan, layouts: Iterable[Degrees], nodes: Sequence[NodeCapacity], *, use_free: bool,
    why: str, then: str,
) -> Replan | None:  # fmt: skip
    gbs, mbs = spec.batch.global_batch_size, spec.batch.micro_batch_size
    for to in layouts:
        cand = _layout(spec, plan, to)
        if cand is None:
            continue
        new_spec, new_plan, accum_new, micro = cand
        if not place(new_plan.model_dump(mode="json"), list(nodes), use_free=use_free).fits:
            continue
        accum_old = gbs // (plan.dp * mbs)
        reason = (
            f"elastic: {why}; layout {plan.layout} -> {new_plan.layout} (global batch {gbs} kept: "
            f"{accum_new} micro-batches of {micro} per rank instead of {accum_old} of {mbs}); {then}"
        )
        return Replan(new_spec, new_plan, reason)
    return None


def replan(spec: RunSpec, plan: Plan, nodes: Sequence[NodeCapacity], *, why: str) -> Replan | None:
    """The best other layout within ``spec.elastic`` that fits ``nodes`` (their total resources): the largest smaller
    dp, or the first listed layout; None if none."""
    if spec.elastic is None:
        return None
    then = "resuming from the latest checkpoint, resharded"
    here = (plan.dp, plan.tp, plan.pp)
    ranked = preferences(spec)
    if ranked:
        options = [d for d in ranked if d != here]
    else:
        hi = min(max_dp(spec, plan), plan.dp - 1)
        options = [(dp, plan.tp, plan.pp) for dp in range(hi, spec.elastic.min_dp - 1, -1)]
    return _first_fit(spec, plan, options, nodes, use_free=False, why=why, then=then)


def grow(spec: RunSpec, plan: Plan, nodes: Sequence[NodeCapacity], *, why: str) -> Replan | None:
    """A layout the run would rather have that fits ``nodes`` (their free resources, with what the run holds now
    added back by the caller): the largest dp above the current one up to ``max_dp``, or the first layout listed
    before the current one; None if the run has its best layout or nothing better fits."""
    if spec.elastic is None:
        return None
    then = "stopping at a checkpoint, resuming from it resharded"
    here = (plan.dp, plan.tp, plan.pp)
    ranked = preferences(spec)
    if ranked:
        options = ranked[: ranked.index(here)] if here in ranked else ranked
    else:
        options = [(dp, plan.tp, plan.pp) for dp in range(max_dp(spec, plan), plan.dp, -1)]
    return _first_fit(spec, plan, options, nodes, use_free=True, why=why, then=then)


def with_own(nodes: Sequence[NodeCapacity], held: dict[str, dict[str, float]]) -> list[NodeCapacity]:
    """``nodes`` with the resources a run holds (per node) added back to their free resources: what it could use if
    it restarted."""
    out = []
    for n in nodes:
        free = dict(n.free)
        for k, v in held.get(n.node_id, {}).items():
            free[k] = min(float(n.total.get(k, 0.0)), free.get(k, 0.0) + v)
        out.append(NodeCapacity(n.node_id, n.total, free))
    return out


def lost_nodes(rank_nodes: Mapping[str, str], nodes: Sequence[NodeView]) -> list[str]:
    """The nodes of a run's ranks that are dead, or gone from the cluster's node table (when it lists any node)."""
    alive = {n.node_id for n in nodes if n.alive}
    if not nodes:
        return []
    return sorted({n for n in rank_nodes.values() if n not in alive})


def held_per_node(rank_nodes: Mapping[str, str], plan: Plan) -> dict[str, dict[str, float]]:
    """What a running run's workers hold on each node (one worker per rank)."""
    res = worker_resources(plan)
    out: dict[str, dict[str, float]] = {}
    for node in rank_nodes.values():
        acc = out.setdefault(node, {})
        for k, v in res.items():
            acc[k] = acc.get(k, 0.0) + v
    return out

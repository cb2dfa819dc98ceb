"""Elastic recovery: when a run's layout can no longer be placed (a node lost for good), re-plan it within its
``spec.elastic`` bounds for the capacity that remains, keeping the global batch (more gradient accumulation); when
capacity returns, grow it back (at a checkpoint boundary) up to ``max_dp``.

Pure decisions (no Ray, no database):

- ``replan(spec, plan, nodes)``: the largest dp in [min_dp, min(max_dp, dp - 1)] whose plan fits the alive nodes'
  total resources (whole tensor-parallel groups per node, ``service.cluster.placement``); None when nothing fits.
- ``grow(spec, plan, nodes)``: the largest dp in (dp, max_dp] whose plan fits the nodes' *free* resources (the
  caller adds back what the run itself holds); None when no larger layout fits.

Both keep the global batch and, when it still divides, the micro-batch size, and record ``max_dp`` in the new spec
(the original dp when unset), so that a shrunk run knows how far it may grow back. The scheduler
(``service.control.scheduler``) acts: a shrink re-queues the run at once in the new layout from its latest
checkpoint (which reshards on load; the data position is kept, ``workers.data``); a grow asks the run to checkpoint
and yield (the preemption path), then applies the larger layout while it is queued. Each is an ``elastic`` event
naming the old and new layout and why.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from api.spec import Plan, RunSpec
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
    """How far the run may grow: ``elastic.max_dp``, else the layout's dp."""
    assert spec.elastic is not None
    return spec.elastic.max_dp or plan.dp


def _layout(spec: RunSpec, plan: Plan, dp: int) -> tuple[RunSpec, Plan, int, int] | None:
    """``spec`` and its plan at data-parallel degree ``dp`` with the same global batch (micro-batch size kept when it
    divides the per-rank batch), and (micro-batches per rank, micro-batch size); None when no valid plan."""
    assert spec.elastic is not None
    gbs, mbs = spec.batch.global_batch_size, spec.batch.micro_batch_size
    if dp < 1 or gbs % dp:
        return None
    per_rank = gbs // dp
    micro = mbs if per_rank % mbs == 0 else max(d for d in range(1, mbs + 1) if per_rank % d == 0)
    new_spec = spec.model_copy(
        update={
            "layout": spec.layout.model_copy(update={"dp": dp}),
            "batch": spec.batch.model_copy(update={"micro_batch_size": micro}),
            "elastic": spec.elastic.model_copy(update={"max_dp": max_dp(spec, plan)}),
        }
    )
    try:
        new_spec = RunSpec.model_validate(new_spec.model_dump())
        new_plan = build_plan(new_spec, device=plan.device)
    except (SpecError, ValueError):
        return None
    return new_spec, new_plan, per_rank // micro, micro


def _first_fit(
    spec: RunSpec, plan: Plan, dps: Iterable[int], nodes: Sequence[NodeCapacity], *, use_free: bool, why: str, then: str
) -> Replan | None:
    gbs, mbs = spec.batch.global_batch_size, spec.batch.micro_batch_size
    for dp in dps:
        cand = _layout(spec, plan, dp)
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
    """The best smaller layout within ``spec.elastic`` that fits ``nodes`` (their total resources); None if none."""
    if spec.elastic is None:
        return None
    hi = min(max_dp(spec, plan), plan.dp - 1)
    then = "resuming from the latest checkpoint, resharded"
    return _first_fit(spec, plan, range(hi, spec.elastic.min_dp - 1, -1), nodes, use_free=False, why=why, then=then)


def grow(spec: RunSpec, plan: Plan, nodes: Sequence[NodeCapacity], *, why: str) -> Replan | None:
    """The largest layout above the current dp, up to ``max_dp``, that fits ``nodes`` (their free resources, with
    what the run holds now added back by the caller); None if the run is at its maximum or nothing larger fits."""
    if spec.elastic is None:
        return None
    then = "stopping at a checkpoint, resuming from it resharded"
    return _first_fit(spec, plan, range(max_dp(spec, plan), plan.dp, -1), nodes, use_free=True, why=why, then=then)


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

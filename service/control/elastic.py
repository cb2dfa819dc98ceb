"""Elastic recovery: when a run's layout can no longer be placed (a node lost for good), re-plan it within its
``spec.elastic`` bounds for the capacity that remains, keeping the global batch (more gradient accumulation).

``replan(spec, plan, nodes)`` is pure: the largest dp in [min_dp, min(max_dp, dp)] whose plan fits the alive nodes'
total resources (whole tensor-parallel groups per node, ``service.cluster.placement``), with the same global batch
and, when it still divides, the same micro-batch size; None when nothing fits. The scheduler
(``service.control.scheduler``) stops the run's job, then re-queues it with the new spec and plan from its latest
checkpoint (which reshards on load; the data position is kept, ``workers.data``), with an ``elastic`` event naming
the old and new layout and why.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from api.spec import Plan, RunSpec
from api.spec.validation import SpecError, build_plan
from service.cluster.placement import NodeCapacity, place


@dataclass(frozen=True)
class Replan:
    spec: RunSpec
    plan: Plan
    reason: str


def layout_str(plan: Plan) -> str:
    return f"dp={plan.dp} tp={plan.tp} pp={plan.pp}"


def replan(spec: RunSpec, plan: Plan, nodes: Sequence[NodeCapacity], *, why: str) -> Replan | None:
    """The best smaller layout within ``spec.elastic`` that fits ``nodes`` (their total resources); None if none."""
    if spec.elastic is None:
        return None
    hi = min(spec.elastic.max_dp or plan.dp, plan.dp - 1)
    gbs, mbs = spec.batch.global_batch_size, spec.batch.micro_batch_size
    for dp in range(hi, spec.elastic.min_dp - 1, -1):
        if gbs % dp:
            continue
        per_rank = gbs // dp
        micro = mbs if per_rank % mbs == 0 else max(d for d in range(1, mbs + 1) if per_rank % d == 0)
        new_spec = spec.model_copy(
            update={
                "layout": spec.layout.model_copy(update={"dp": dp}),
                "batch": spec.batch.model_copy(update={"micro_batch_size": micro}),
            }
        )
        try:
            new_spec = RunSpec.model_validate(new_spec.model_dump())
            new_plan = build_plan(new_spec, device=plan.device)
        except (SpecError, ValueError):
            continue
        if not place(new_plan.model_dump(mode="json"), list(nodes), use_free=False).fits:
            continue
        accum_old = gbs // (plan.dp * mbs)
        accum_new = per_rank // micro
        reason = (
            f"elastic: {why}; layout {layout_str(plan)} -> {layout_str(new_plan)} (global batch {gbs} kept: "
            f"{accum_new} micro-batches of {micro} per rank instead of {accum_old} of {mbs}); resuming from the "
            "latest checkpoint, resharded"
        )
        return Replan(new_spec, new_plan, reason)
    return None

"""Priorities that do not lose work, and per-project quotas: pure decisions next to ``service.control.admission``.

- ``quota_waits(queue, holding, quotas)``: the queued candidates that would take their project over its quota
  (``settings.project_max_workers``: project -> max workers at once, ``"*"`` for every other project), each with the
  reason naming the quota. They wait without blocking other projects' runs behind them.
- ``choose_victims(candidate, project, nodes, reserved, holding, mode)``: when the head of the queue cannot be
  placed, the lower-priority runs to preempt so that it fits (``settings.preemption``: ``off``; ``project``: only
  runs of its own project; ``any``), lowest priority first, then the most recently started (it loses the least).
  None when no set of them would make room. The scheduler asks them to checkpoint and yield (they go PREEMPTED, then
  QUEUED, and resume later from that checkpoint: no step is lost).
- ``plan_admission(...)``: one whole admission pass decided (held re-plans, quotas, ``admission.decide``, the
  victims for the head of the queue) as an ``AdmissionPlan``; the scheduler acts on it, writing every state change
  through the run controller (``service.store.controller``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, Literal

from service.cluster.placement import NodeCapacity, place, worker_resources
from service.control.admission import Candidate, Decision, admission_order, decide

PreemptionMode = Literal["off", "project", "any"]


@dataclass(frozen=True)
class Holding:
    """A run that holds (or is about to hold) workers: STARTING or RUNNING."""

    id: str
    project: str
    priority: int
    plan: Mapping[str, Any] | None
    rank_nodes: Mapping[str, str] = field(default_factory=dict)  # rank -> node id (empty while starting)
    started_at: datetime | None = None

    @property
    def workers(self) -> int:
        return int((self.plan or {}).get("world_size") or 0)

    def usage(self) -> dict[str, dict[str, float]]:
        """Resources it holds per node (from its ranks' nodes)."""
        res = worker_resources(self.plan) if self.plan else {}
        out: dict[str, dict[str, float]] = {}
        for node in self.rank_nodes.values():
            acc = out.setdefault(node, {})
            for k, v in res.items():
                acc[k] = acc.get(k, 0.0) + v
        return out


def _workers(plan: Mapping[str, Any] | None) -> int:
    return int((plan or {}).get("world_size") or 0)


def quota_of(project: str, quotas: Mapping[str, int]) -> int | None:
    q = quotas.get(project, quotas.get("*"))
    return None if q is None else int(q)


def quota_waits(
    queue: Sequence[Candidate], projects: Mapping[str, str], holding: Sequence[Holding], quotas: Mapping[str, int]
) -> dict[str, str]:
    """Candidate id -> the reason it waits for its project's quota (``projects``: candidate id -> project)."""
    if not quotas:
        return {}
    in_use: dict[str, int] = {}
    for h in holding:
        in_use[h.project] = in_use.get(h.project, 0) + h.workers
    out: dict[str, str] = {}
    for c in admission_order(queue):
        project = projects.get(c.id, "")
        quota = quota_of(project, quotas)
        need = _workers(c.plan)
        if quota is None or c.plan is None:
            continue
        used = in_use.get(project, 0)
        if used + need > quota:
            out[c.id] = (
                f"project '{project}' quota: at most {quota} workers at once; {used} in use, this run needs {need} "
                "(raise MESHRUN_PROJECT_MAX_WORKERS or wait for the project's runs to end)"
            )
            continue
        in_use[project] = used + need  # assume it starts: later runs of the project count it
    return out


def choose_victims(
    candidate: Candidate,
    project: str,
    nodes: Sequence[NodeCapacity],
    reserved: Mapping[str, Mapping[str, float]],
    holding: Sequence[Holding],
    mode: PreemptionMode,
) -> list[Holding] | None:
    """The fewest lower-priority runs (in preemption order) whose workers make room for ``candidate``; None if none."""
    if mode == "off" or candidate.plan is None:
        return None
    pool = [
        h
        for h in holding
        if h.priority < candidate.priority and h.rank_nodes and (mode == "any" or h.project == project)
    ]
    pool.sort(key=lambda h: (h.priority, -(h.started_at.timestamp() if h.started_at else 0.0), h.id))
    chosen: list[Holding] = []
    for h in pool:
        chosen.append(h)
        freed: dict[str, dict[str, float]] = {}
        for v in chosen:
            for node, res in v.usage().items():
                acc = freed.setdefault(node, {})
                for k, x in res.items():
                    acc[k] = acc.get(k, 0.0) + x
        after = [
            NodeCapacity(
                node_id=n.node_id,
                total=n.total,
                free={k: float(n.free.get(k, 0.0)) + freed.get(n.node_id, {}).get(k, 0.0) for k in n.total},
            )
            for n in nodes
        ]
        if place(candidate.plan, after, reserved=reserved).fits:
            return chosen
    return None


@dataclass(frozen=True)
class AdmissionPlan:
    """One admission pass, decided: nothing is written until the scheduler acts on it."""

    reasons: dict[str, str]  # queued runs that only get a new reason (held by a re-plan, over their quota)
    decisions: list[Decision]  # the other queued runs, in admission order
    victims: list[Holding]  # asked to checkpoint and yield so that ``preempt_for`` fits (may be empty)
    preempt_for: Candidate | None = None


def plan_admission(
    queue: Sequence[Candidate],
    projects: Mapping[str, str],
    holding: Sequence[Holding],
    held: Mapping[str, str],
    nodes: Sequence[NodeCapacity],
    reserved: Mapping[str, Mapping[str, float]],
    *,
    quotas: Mapping[str, int],
    preemption: PreemptionMode,
) -> AdmissionPlan:
    """Decide one admission pass (pure). ``projects``: candidate id -> project; ``held``: re-planned runs whose
    previous Ray Job still runs -> that job (they wait for it to stop); the rest as in ``quota_waits``,
    ``admission.decide`` and ``choose_victims``."""
    wait = "re-planned: waiting for its previous Ray Job {} to stop"
    reasons = {c.id: wait.format(held[c.id]) for c in queue if c.id in held}
    queue = [c for c in queue if c.id not in held]
    over = quota_waits(queue, projects, holding, quotas)
    reasons.update(over)
    decisions = decide([c for c in queue if c.id not in over], nodes, reserved).decisions
    head = next((d for d in decisions if d.action == "wait" and d.placement is not None), None)
    if head is None or preemption == "off":
        return AdmissionPlan(reasons, decisions, [])
    c = head.candidate
    victims = choose_victims(c, projects.get(c.id, ""), nodes, reserved, holding, preemption) or []
    if not victims:
        return AdmissionPlan(reasons, decisions, [])
    why = f"{head.reason}; preempting lower-priority {', '.join(v.id for v in victims)} (they checkpoint first)"
    decisions = [replace(d, reason=why) if d is head else d for d in decisions]
    return AdmissionPlan(reasons, decisions, victims, c)

"""Admission decides without side effects: which queued work starts now, which waits and why.

``decide(queue, nodes, reserved)`` is a pure function of plain data (no database, no Ray): the queued candidates,
the alive nodes' free and total resources, and what work admitted moments ago will still claim (its workers have
not started yet). It returns one ``Decision`` per candidate, in admission order:

- ``admit`` with the ``Placement`` (which node runs which rank): the candidate fits in what is free now, minus the
  reservations, minus what the candidates admitted before it in this pass take;
- ``wait`` with the reason ("needs 8 worker slots of 1 CPU; 3 free", or "waiting behind run X"): strict order, no
  overtaking: once one candidate waits, every later one waits behind it;
- ``fail`` with the reason (a run without a plan can never start).

Order: priority high first, then FIFO (queued time, then id). The scheduler (``service.control.scheduler``) acts on
the decisions: transitions, Ray Job submissions and reasons written to the database. A candidate is any queued unit
of work with a plan (``kind`` "run" today; a sweep's trials can join the same queue as kind "trial").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from service.cluster.placement import NodeCapacity, Placement, add_reservations, place, reservation

Action = Literal["admit", "wait", "fail"]
Reservations = Mapping[str, Mapping[str, float]]


@dataclass(frozen=True)
class Candidate:
    """One queued unit of work. ``plan``: the stored plan (``api.spec.Plan`` as JSON), None if it has none."""

    id: str
    plan: Mapping[str, Any] | None
    priority: int = 0
    queued_at: datetime | None = None
    kind: str = "run"
    label: str = ""  # how decisions name it ("run run-1a2b"); default: kind and id

    @property
    def name(self) -> str:
        return self.label or f"{self.kind} {self.id}"


@dataclass(frozen=True)
class Decision:
    candidate: Candidate
    action: Action
    reason: str
    placement: Placement | None = None


@dataclass
class Pass:
    """The result of one admission pass: decisions in admission order and the reservations they add."""

    decisions: list[Decision] = field(default_factory=list)
    reserved: dict[str, dict[str, float]] = field(default_factory=dict)

    def of(self, action: Action) -> list[Decision]:
        return [d for d in self.decisions if d.action == action]


def admission_order(queue: Iterable[Candidate]) -> list[Candidate]:
    """Priority high first, FIFO within a priority (queued time, then id)."""
    return sorted(queue, key=lambda c: (-c.priority, c.queued_at is None, c.queued_at or datetime.min, c.id))


def decide(queue: Sequence[Candidate], nodes: Sequence[NodeCapacity], reserved: Reservations | None = None) -> Pass:
    """Decide admission for ``queue`` on ``nodes`` (free resources minus ``reserved`` per node). Pure."""
    out = Pass(reserved=add_reservations(reserved or {}))
    blocked_by: Candidate | None = None
    for c in admission_order(queue):
        if c.plan is None:
            out.decisions.append(Decision(c, "fail", f"the {c.kind} has no plan"))
            continue
        if blocked_by is not None:
            out.decisions.append(Decision(c, "wait", f"waiting behind {blocked_by.name} (FIFO within priority)"))
            continue
        p = place(c.plan, list(nodes), reserved=out.reserved)
        if not p.fits:
            out.decisions.append(Decision(c, "wait", p.reason, p))
            blocked_by = c
            continue
        nodes_desc = ", ".join(f"{k[:12]}: {v}" for k, v in p.workers_per_node.items())
        out.decisions.append(Decision(c, "admit", f"admitted: {p.world_size} workers ({nodes_desc})", p))
        out.reserved = add_reservations(out.reserved, reservation(p))
    return out

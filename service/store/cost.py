"""What a run has cost, computed from what is stored (no table of its own): its devices (the plan's world size) x
the wall time of each of its attempts (``run_attempts``: started to finished, or to now while one runs), in
device-hours, and in US dollars where a price is known.

The price: the spec's ``cluster.price_per_device_hour`` (``request``), else the one its prediction was priced with
at submission (``Plan.predicted.cost``: the service's ``MESHRUN_DEVICE_PRICES`` or the planner's default table
for the cluster's device), else none (``usd`` null, not 0).
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy.orm import Session

from api.spec import RunCost, RunSpec
from api.spec.plan import layout_of
from service.store.models import Run, RunAttempt
from service.store.runs import list_attempts


def _utc(dt: datetime) -> datetime:
    return dt.replace(tzinfo=UTC) if dt.tzinfo is None else dt


def cost_of(run: Run, attempts: list[RunAttempt], *, now: datetime | None = None) -> RunCost | None:
    """The run's cost from its row and its attempts; None for a run without a plan."""
    if not run.plan:
        return None
    devices = layout_of(run.plan).world_size
    end = now or datetime.now(UTC)
    wall = sum(max(0.0, (_utc(a.finished_at or end) - _utc(a.started_at)).total_seconds()) for a in attempts)
    price, source = RunSpec.model_validate(run.spec).cluster.price_per_device_hour, "request"
    if price is None:
        predicted = (run.plan.get("predicted") or {}).get("cost") or {}
        price, source = predicted.get("price_per_device_hour"), predicted.get("price_source") or "none"
        if price is None:
            source = "none"
    device_hours = devices * wall / 3600.0
    return RunCost(
        devices=devices,
        attempts_wall_s=wall,
        device_hours=device_hours,
        price_per_device_hour=price,
        price_source=source,
        usd=device_hours * price if price is not None else None,
    )


def run_cost(session: Session, run: Run, *, now: datetime | None = None) -> RunCost | None:
    """``cost_of`` with the run's attempts read from the database."""
    return cost_of(run, list_attempts(session, run_id=run.id), now=now)

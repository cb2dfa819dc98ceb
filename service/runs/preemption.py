"""What a run driver does with a preemption: the workers' summary says ``preempted`` (a SIGTERM on some rank, see
``workers.preemption``; or the service asked the run to yield its workers) and the run has steps left -> the run goes
PREEMPTED, then QUEUED to resume from the emergency checkpoint (``RunLifecycle.requeue``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def preemption_reason(summary: Mapping[str, Any] | None, *, total_steps: int) -> str | None:
    """The reason to re-queue the run, or None (not preempted, or it finished all ``total_steps`` anyway)."""
    if not summary or not summary.get("preempted"):
        return None
    done = summary.get("steps_done") or 0
    if done >= total_steps:
        return None
    ranks = summary.get("preempted_ranks") or []
    who = f"rank{'s' if len(ranks) != 1 else ''} {', '.join(str(r) for r in ranks)}" if ranks else "a worker"
    cause = summary.get("preempt_cause") or "preemption notice: SIGTERM"
    saved = f"; checkpoint of step {done} saved" if summary.get("last_checkpoint") else "; no checkpoint saved"
    return f"{cause} on {who}: stopped after step {done}{saved}"

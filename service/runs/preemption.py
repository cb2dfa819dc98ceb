"""What a run driver does with a preemption: the workers' summary says ``preempted`` (a SIGTERM on some rank, see
``workers.preemption``; or the service asked the run to yield its workers) and the run has steps left -> the run goes
PREEMPTED, then QUEUED to resume from the emergency checkpoint (``RunLifecycle.requeue``)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from ray.actor import ActorHandle
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from service.store.db import session_scope
from service.store.models import RunEvent

logger = logging.getLogger(__name__)

PREEMPT_REQUEST = "preempt_request"  # the run event kind the scheduler writes to ask a run to yield its workers
WATCH_INTERVAL_S = 1.0


def preemption_reason(summary: Mapping[str, Any] | None, *, total_steps: int) -> str | None:
    """The reason to re-queue the run, or None (not preempted, or it finished all ``total_steps`` anyway)."""
    if not summary or not summary.get("preempted"):
        return None
    done = summary.get("steps_done") or 0
    if done >= total_steps:
        return None
    ranks = summary.get("preempted_ranks") or []
    who = f"rank{'s' if len(ranks) != 1 else ''} {', '.join(str(r) for r in ranks)}" if ranks else "a worker"
    if summary.get("preempt_cause"):  # the service asked (a higher-priority run)
        done_what = "checkpoint saved" if summary.get("last_checkpoint") else "no checkpoint saved"
        return f"{summary['preempt_cause']}: stopped after step {done}, {done_what}"
    cause = "preemption notice: SIGTERM"
    saved = f"; checkpoint of step {done} saved" if summary.get("last_checkpoint") else "; no checkpoint saved"
    return f"{cause} on {who}: stopped after step {done}{saved}"


@contextmanager
def watch_preempt_requests(factory: sessionmaker[Session], run_id: str, channel: ActorHandle) -> Iterator[None]:
    """While the block runs, forward the scheduler's ``preempt_request`` events of this run (written after the block
    began) to its channel, whose ``control()`` the workers poll at each report."""
    with session_scope(factory) as s:
        since = s.scalar(select(func.max(RunEvent.id)).where(RunEvent.run_id == run_id)) or 0
    stop = threading.Event()

    def loop() -> None:
        sent = False
        while not sent and not stop.wait(WATCH_INTERVAL_S):
            try:
                with session_scope(factory) as s:
                    reason = s.scalar(
                        select(RunEvent.reason)
                        .where(RunEvent.run_id == run_id, RunEvent.kind == PREEMPT_REQUEST, RunEvent.id > since)
                        .order_by(RunEvent.id.desc())
                        .limit(1)
                    )
                if reason:
                    channel.request_preempt.remote(reason)
                    sent = True
            except Exception:
                logger.exception("reading preemption requests of run %s failed", run_id)

    t = threading.Thread(target=loop, daemon=True, name=f"preempt-{run_id}")
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(timeout=5)

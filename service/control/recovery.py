"""Runs of a lost Ray head: requeued to resume from their latest checkpoint, or failed past ``max_failures``.

When the Ray head this service owns dies (the runtime restarts it) or is found dead at start, every run that was
STARTING or RUNNING on it lost its driver and workers with it. ``requeue_lost_runs`` moves each back to QUEUED with
``resume_from`` = its latest checkpoint (the scheduler then submits it to the new head), ends its current attempt
FAILED with the cause, and records a ``head_lost`` event with the reason "Ray head lost". Each loss counts against
the run's ``resources.max_failures`` (-1: unlimited); past it the run ends FAILED with the same reason. The move to
QUEUED also revokes the old attempt's driver, should one still run: it may only write while its run is STARTING or
RUNNING under its own Ray Job (``service.store.runs.fence``).
"""

from __future__ import annotations

import logging

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from api.spec import RunSpec, RunStatus
from service import store
from service.store import controller
from service.store.db import session_scope
from service.store.models import RunEvent

logger = logging.getLogger(__name__)

HEAD_LOST = "Ray head lost"
EVENT_KIND = "head_lost"


def head_losses(session: Session, *, run_id: str) -> int:
    stmt = select(func.count()).select_from(RunEvent).where(RunEvent.run_id == run_id, RunEvent.kind == EVENT_KIND)
    return int(session.scalar(stmt) or 0)


def requeue_lost_runs(factory: sessionmaker[Session], *, detail: str) -> list[str]:
    """Requeue (or fail, past ``max_failures``) every STARTING/RUNNING run; returns the requeued run ids."""
    with session_scope(factory) as s:
        ids = [r.id for r in store.active_runs(s)]
    requeued = []
    for run_id in ids:
        try:
            if _recover(factory, run_id, detail=detail):
                requeued.append(run_id)
        except Exception:
            logger.exception("recovering run %s after the Ray head was lost failed", run_id)
    return requeued


def _recover(factory: sessionmaker[Session], run_id: str, *, detail: str) -> bool:
    with session_scope(factory) as s:
        run = store.get_run(s, run_id=run_id, lock=True)
        if run.status not in (RunStatus.STARTING.value, RunStatus.RUNNING.value):
            return False
        allowed = RunSpec.model_validate(run.spec).resources.max_failures
        losses = head_losses(s, run_id=run_id) + 1
        s.add(RunEvent(run_id=run_id, kind=EVENT_KIND, reason=f"{HEAD_LOST}: {detail}", actor="service"))
        if allowed != -1 and losses > allowed:
            controller.end_run(
                s,
                run_id=run_id,
                to=RunStatus.FAILED,
                reason=f"{HEAD_LOST}: {detail}; not resumed: max_failures={allowed} reached",
                actor="service",
                attempt_cause=HEAD_LOST,
            )
            logger.warning("run %s: %s; max_failures=%s reached, FAILED", run_id, HEAD_LOST, allowed)
            return False
        ck = store.latest_checkpoint(s, run_id=run_id)
        what = f"from the checkpoint of step {ck.step}" if ck is not None else "from scratch (no checkpoint yet)"
        budget = "unlimited" if allowed == -1 else f"{losses} of max_failures={allowed}"
        res = controller.requeue_run(
            s,
            run_id=run_id,
            reason=f"{HEAD_LOST}: {detail}; resuming {what} (failure {budget})",
            actor="service",
            attempt_cause=HEAD_LOST,
            resume_from=ck.path if ck is not None else None,
            summary=None,
        )
        if not res.changed:
            return False
    logger.warning("run %s: %s; requeued to resume", run_id, HEAD_LOST)
    return True

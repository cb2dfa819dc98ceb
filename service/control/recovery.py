"""Runs that lost their driver: requeued to resume from their latest checkpoint, or failed past ``max_failures``.

Two causes, one path:

- a lost Ray head (``requeue_lost_runs``): when the Ray head this service owns dies (the runtime restarts it) or is
  found dead at start, every run that was STARTING or RUNNING on it lost its driver and workers with it;
- a lost driver (``resume_lost_driver``, from the scheduler's reconcile step): the run's Ray Job is gone, failed or
  stopped without the driver having ended the run (its process killed, or lost with its node).

Each moves the run back to QUEUED with ``resume_from`` = its latest checkpoint (the scheduler then submits it again),
ends its current attempt FAILED with the cause, and records one event (``head_lost`` / ``driver_lost``) that says
why and from which step it resumes. Each loss counts against the run's ``resources.max_failures`` (-1: unlimited;
head and driver losses together); past it the run ends FAILED with the same reason and "not resumed". The move to
QUEUED also revokes the old attempt's driver, should one still run: it may only write while its run is STARTING or
RUNNING under its own Ray Job (``service.store.runs.fence``).
"""

from __future__ import annotations

import logging

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from api.spec import RunSpec, RunStatus
from service import store
from service.cluster.jobs import trim
from service.store import controller
from service.store.db import session_scope
from service.store.models import RunEvent

logger = logging.getLogger(__name__)

HEAD_LOST = "Ray head lost"
EVENT_KIND = "head_lost"
DRIVER_LOST = "driver lost"
DRIVER_EVENT_KIND = "driver_lost"
LOSS_KINDS = (EVENT_KIND, DRIVER_EVENT_KIND)


def head_losses(session: Session, *, run_id: str) -> int:
    """The run's driver losses so far (its head's and its own), what ``max_failures`` bounds here."""
    stmt = select(func.count()).select_from(RunEvent).where(RunEvent.run_id == run_id, RunEvent.kind.in_(LOSS_KINDS))
    return int(session.scalar(stmt) or 0)


def requeue_lost_runs(factory: sessionmaker[Session], *, detail: str) -> list[str]:
    """Requeue (or fail, past ``max_failures``) every STARTING/RUNNING run; returns the requeued run ids."""
    with session_scope(factory) as s:
        ids = [r.id for r in store.active_runs(s)]
    requeued = []
    for run_id in ids:
        try:
            if _recover(factory, run_id, cause=HEAD_LOST, kind=EVENT_KIND, detail=detail):
                requeued.append(run_id)
        except Exception:
            logger.exception("recovering run %s after the Ray head was lost failed", run_id)
    return requeued


def resume_lost_driver(factory: sessionmaker[Session], run_id: str, *, detail: str, job_id: str | None) -> bool | None:
    """The run's driver is gone (``detail`` says how): requeue it to resume while ``max_failures`` allows, else
    FAILED. True: requeued; False: FAILED; None: nothing done (it ended or moved to another job meanwhile)."""
    return _recover(factory, run_id, cause=DRIVER_LOST, kind=DRIVER_EVENT_KIND, detail=detail, job_id=job_id)


def _recover(
    factory: sessionmaker[Session], run_id: str, *, cause: str, kind: str, detail: str, job_id: str | None = None
) -> bool | None:
    with session_scope(factory) as s:
        run = store.get_run(s, run_id=run_id, lock=True)
        if run.status not in (RunStatus.STARTING.value, RunStatus.RUNNING.value):
            return None
        if kind == DRIVER_EVENT_KIND and run.ray_job_id != job_id:
            return None  # admitted again meanwhile: its new job is judged at the next reconcile
        allowed = RunSpec.model_validate(run.spec).resources.max_failures
        losses = head_losses(s, run_id=run_id) + 1
        budget = "unlimited" if allowed == -1 else f"{losses} of max_failures={allowed}"
        if allowed != -1 and losses > allowed:
            s.add(RunEvent(run_id=run_id, kind=kind, reason=trim(f"{cause}: {detail}", 1000), actor="service"))
            summ = store.summarize_metrics(s, run_id=run_id)
            controller.end_run(
                s,
                run_id=run_id,
                to=RunStatus.FAILED,
                reason=trim(
                    f"{cause}: {detail}; not resumed: max_failures={allowed} reached; resume it "
                    f"(POST /v1/runs/{run_id}/resume) to continue from its latest checkpoint",
                    2000,
                ),
                actor="service",
                attempt_cause=cause,
                summary={k: v for k, v in summ.items() if k != "peak_memory_bytes"},
            )
            logger.warning("run %s: %s; max_failures=%s reached, FAILED", run_id, cause, allowed)
            return False
        ck = store.latest_checkpoint(s, run_id=run_id)
        what = f"from the checkpoint of step {ck.step}" if ck is not None else "from scratch (no checkpoint yet)"
        reason = trim(f"{cause}: {detail}; resuming {what} (failure {budget})", 1000)
        s.add(RunEvent(run_id=run_id, kind=kind, reason=reason, actor="service"))
        res = controller.requeue_run(
            s,
            run_id=run_id,
            reason=reason,
            actor="service",
            attempt_cause=cause,
            resume_from=ck.path if ck is not None else None,
            summary=None,
        )
        if not res.changed:
            return None
    logger.warning("run %s: %s; requeued to resume", run_id, cause)
    return True

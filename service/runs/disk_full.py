"""A run that failed because a disk was full (ENOSPC in a checkpoint save, "database or disk is full" from SQLite,
PostgreSQL's DiskFull) is not the user's fault and not final: the driver waits for space to return on the disks the
run writes to (its checkpoint root, the service's data_dir), then requeues the run to resume from its latest
checkpoint, as long as the run's failure policy allows (``resources.max_failures``: each disk-full retry counts
one failure; -1 unlimited, 0 none). Past the budget, or when no space returns within ``SPACE_WAIT_S``, the run
ends FAILED as before. Each retry is a ``disk_full`` event, which is also what the budget counts.

A partial checkpoint of the failed save is already gone (``workers.checkpoint_manifest.removed_on_failure``)."""

from __future__ import annotations

import errno
import logging
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from api.spec import RunStatus
from service import store
from service.store import controller
from service.store.db import session_scope
from service.store.models import RunEvent

logger = logging.getLogger(__name__)

EVENT_KIND = "disk_full"
WAIT_EVENT_KIND = "disk_full_wait"
CAUSE = "disk full"
# what a full disk looks like in the text of an error (the OSError is often wrapped: DCP's CheckpointException,
# a worker's formatted traceback, SQLAlchemy's OperationalError)
DISK_FULL_WORDS = (
    "No space left on device",
    "[Errno 28]",
    "database or disk is full",  # SQLite
    "DiskFull",  # psycopg's class for PostgreSQL's 53100
    "could not extend file",  # PostgreSQL
)
SPACE_WAIT_S = 600.0  # how long the driver waits for space to return before the failure stands
POLL_S = 5.0
MIN_FREE_BYTES = 64 << 20  # free space that counts as "returned" (at least; else the latest checkpoint's size)


def is_disk_full(error: BaseException | None, texts: Iterable[str] = ()) -> bool:
    """True when ``error`` (or an exception it was raised from) is ENOSPC, or the error's or the workers' error
    ``texts`` say the disk or the database is full."""
    e, seen = error, 0
    while e is not None and seen < 10:
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        if any(w in f"{type(e).__name__}: {e}" for w in DISK_FULL_WORDS):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return any(w in t for t in texts for w in DISK_FULL_WORDS)


def may_retry(failures_so_far: int, max_failures: int) -> bool:
    """The run's failure policy: one more disk-full retry after ``failures_so_far`` of them?"""
    return max_failures == -1 or failures_so_far < max_failures


def disk_full_failures(session: Session, *, run_id: str) -> int:
    stmt = select(func.count()).select_from(RunEvent).where(RunEvent.run_id == run_id, RunEvent.kind == EVENT_KIND)
    return int(session.scalar(stmt) or 0)


def _existing(path: str | Path) -> Path:
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def wait_for_space(
    paths: Iterable[str | Path], need_bytes: int, *, timeout_s: float = SPACE_WAIT_S, poll_s: float = POLL_S
) -> bool:
    """Poll until every path's file system has ``need_bytes`` free; False after ``timeout_s``."""
    where = [_existing(p) for p in paths]
    deadline = time.monotonic() + timeout_s
    while True:
        short = [str(p) for p in where if shutil.disk_usage(p).free < need_bytes]
        if not short:
            return True
        if time.monotonic() >= deadline:
            logger.warning("still under %d free bytes on %s after %.0f s", need_bytes, short, timeout_s)
            return False
        time.sleep(poll_s)


def retry_after_disk_full(
    factory: sessionmaker[Session],
    *,
    run_id: str,
    job_id: str | None,
    attempt: int | None,
    sentence: str,
    max_failures: int,
    space_paths: Iterable[str | Path],
    min_free_bytes: int = MIN_FREE_BYTES,
    timeout_s: float = SPACE_WAIT_S,
    poll_s: float = POLL_S,
) -> bool:
    """After a disk-full failure: True when the run was requeued (space returned, budget left); False when the
    failure stands (budget spent, no space in time, or the driver's attempt was revoked meanwhile)."""
    space_paths = list(space_paths)
    with session_scope(factory) as s:  # reads only: they work on a full disk
        used = disk_full_failures(s, run_id=run_id)
        ck = store.latest_checkpoint(s, run_id=run_id)
    if not may_retry(used, max_failures):
        logger.warning("run %s: disk full, max_failures=%d spent: the failure stands", run_id, max_failures)
        return False
    need = max(min_free_bytes, _dir_bytes(ck.path) if ck is not None else 0)
    logger.warning("run %s: disk full (%s); waiting for %d free bytes", run_id, sentence[:200], need)
    where_short = ", ".join(str(p) for p in space_paths)
    _note(factory, run_id, f"{CAUSE}: waiting up to {timeout_s:.0f} s for {need >> 20} MiB free on {where_short}")
    if not wait_for_space(space_paths, need, timeout_s=timeout_s, poll_s=poll_s):
        return False
    budget = "unlimited" if max_failures == -1 else f"{used + 1} of max_failures={max_failures}"
    where = f"the checkpoint of step {ck.step}" if ck is not None else "its start (no checkpoint)"
    fields: dict[str, Any] = {"resume_from": ck.path} if ck is not None else {}
    with session_scope(factory) as s:
        if not store.fence(s, run_id=run_id, job_id=job_id):
            return False
        store.add_event(s, run_id=run_id, kind=EVENT_KIND, reason=f"{CAUSE}: {sentence}"[:2000], actor="driver")
        res = controller.requeue_run(
            s,
            run_id=run_id,
            reason=f"{CAUSE}: {sentence[:300]}; space is back, resuming from {where} (failure {budget})",
            actor="driver",
            allow_from=[RunStatus.RUNNING, RunStatus.STARTING],
            attempt=attempt,
            attempt_cause=f"{CAUSE}: {sentence}"[:500],
            **fields,
        )
    if res.changed:
        logger.warning("run %s: requeued after a full disk (failure %s)", run_id, budget)
    return res.changed


def _note(factory: sessionmaker[Session], run_id: str, reason: str) -> None:
    """A ``disk_full_wait`` event, so the run's page says why it stalls; best effort (the database itself may be
    on the full disk). Not counted against the failure budget (``EVENT_KIND`` is)."""
    try:
        with session_scope(factory) as s:
            store.add_event(s, run_id=run_id, kind=WAIT_EVENT_KIND, reason=reason[:2000], actor="driver")
    except Exception as e:  # a note must never turn a retry into a failure
        logger.warning("run %s: could not record the wait for space: %s", run_id, e)


def _dir_bytes(path: str) -> int:
    if "://" in path:
        return 0
    p = Path(path)
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else 0

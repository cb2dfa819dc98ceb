"""``GET /healthz``: liveness and the state of the service's dependencies (no authentication, never rate limited).

200 when the database answers and the Ray cluster (if this process runs the runtime) is healthy; 503 otherwise,
with ``reason`` saying what is wrong ("the Ray GCS at 10.0.0.5:6389 does not answer: connection refused"). The Ray
check is ``Runtime.health()``: cached for a second or two and bounded by short timeouts, in the thread pool.

Reads alone do not show a full disk or a read-only database (SQLite answers ``SELECT 1`` and then fails every
commit), so the check also writes: a no-op update committed to the database (``db: unwritable`` when it fails) and
a small file written, flushed and removed in the checkpoint storage (``storage: full`` on ENOSPC/EDQUOT). The write
probes run at most once per ``PROBE_INTERVAL_S``; the last result is reported in between.
"""

from __future__ import annotations

import errno
import os
import threading
import time
import uuid

from fastapi import APIRouter, Response
from pydantic import BaseModel, Field
from sqlalchemy import text

from service.app.deps import RuntimeDep, SessionFactoryDep, SettingsDep
from service.meta import VERSION
from service.security.paths import storage_problem

router = APIRouter(tags=["health"])


class Health(BaseModel):
    status: str = Field(description='"ok", or "degraded" when a dependency is down (HTTP 503).')
    db: str = Field(description='"ok", "error" (does not answer) or "unwritable" (answers, but commits fail).')
    ray: str = Field(description='"ok", "error", or "absent" when this process runs no Ray runtime.')
    storage: str = Field(
        "ok", description='"ok", "full" (no space left) or "error": can the default checkpoint storage be written.'
    )
    reason: str | None = Field(None, description="What is wrong, when something is.")
    auth: bool
    version: str


@router.get(
    "/healthz",
    response_model=Health,
    response_model_exclude_none=True,
    summary="Liveness and dependencies",
    responses={
        503: {
            "model": Health,
            "description": "The database or the Ray cluster is unreachable, or the database or the checkpoint "
            "storage cannot be written.",
        }
    },
)
def healthz(response: Response, factory: SessionFactoryDep, settings: SettingsDep, runtime: RuntimeDep) -> Health:
    problems: list[str] = []
    db = "ok"
    try:
        with factory() as session:
            session.execute(text("SELECT 1"))
    except Exception as e:
        db = "error"
        problems.append(f"the database does not answer: {type(e).__name__}")
    else:
        why = _probe(factory, settings)[0]
        if why:
            db = "unwritable"
            problems.append(why)
    ray = "absent"
    if runtime is not None:
        health = runtime.health()
        ray = "ok" if health.ok else "error"
        if health.reason:
            problems.append(health.reason)
    storage = "ok"
    unwritable = storage_problem(str(settings.checkpoint_root))
    if unwritable:
        storage = "error"
        problems.append(f"checkpoint storage: {unwritable}")
    else:
        full = _probe(factory, settings)[1]
        if full:
            storage = "full" if "no space" in full or "quota" in full else "error"
            problems.append(f"checkpoint storage: {full}")
    if problems:
        response.status_code = 503
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
    return Health(
        status="degraded" if problems else "ok",
        db=db,
        ray=ray,
        storage=storage,
        reason="; ".join(problems) or None,
        auth=settings.auth_enabled,
        version=VERSION,
    )


PROBE_INTERVAL_S = 2.0
RETRY_AFTER_S = 5
PROBE_BYTES = 64 * 1024
_probe_lock = threading.Lock()
_probes: dict[int, tuple[float, str | None, str | None]] = {}  # id(factory) -> (when, db problem, storage problem)


def _probe(factory: object, settings: object) -> tuple[str | None, str | None]:
    """(why the database cannot be written, why the checkpoint storage cannot be written), each None when fine;
    measured at most once per PROBE_INTERVAL_S per database."""
    key = id(factory)
    with _probe_lock:
        cached = _probes.get(key)
        if cached is not None and time.monotonic() - cached[0] < PROBE_INTERVAL_S:
            return cached[1], cached[2]
        result = _write_db(factory), _write_storage(str(settings.checkpoint_root))  # type: ignore[attr-defined]
        _probes[key] = (time.monotonic(), *result)
        return result


def _write_db(factory: object) -> str | None:
    try:
        with factory() as session:  # type: ignore[operator]
            session.execute(text("UPDATE alembic_version SET version_num = version_num"))
            session.commit()
    except Exception as e:
        detail = str(getattr(e, "orig", e)).splitlines()[0][:200]
        return f"the database answers but cannot be written ({detail}): free disk space or fix its permissions"
    return None


def _write_storage(root: str) -> str | None:
    if "://" in root:
        return None
    path = os.path.join(root, f".meshrun-health-{uuid.uuid4().hex}")
    try:
        os.makedirs(root, exist_ok=True)
        with open(path, "wb") as f:
            f.write(b"\0" * PROBE_BYTES)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return f"no space left in {root}: free disk space"
        return f"{root} cannot be written ({e.strerror})"
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    return None

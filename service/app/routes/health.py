"""``GET /healthz``: liveness and the state of the service's dependencies (no authentication, never rate limited).

200 when the database answers and the Ray cluster (if this process runs the runtime) is healthy; 503 otherwise,
with ``reason`` saying what is wrong ("the Ray GCS at 10.0.0.5:6389 does not answer: connection refused"). The Ray
check is ``Runtime.health()``: cached for a second or two and bounded by short timeouts, in the thread pool.
"""

from __future__ import annotations

from fastapi import APIRouter, Response
from pydantic import BaseModel, Field
from sqlalchemy import text

from service.app.deps import RuntimeDep, SessionFactoryDep, SettingsDep
from service.meta import VERSION
from service.security.paths import storage_problem

router = APIRouter(tags=["health"])


class Health(BaseModel):
    status: str = Field(description='"ok", or "degraded" when a dependency is down (HTTP 503).')
    db: str = Field(description='"ok" or "error".')
    ray: str = Field(description='"ok", "error", or "absent" when this process runs no Ray runtime.')
    storage: str = Field("ok", description='"ok" or "error": can the default checkpoint storage be written.')
    reason: str | None = Field(None, description="What is wrong, when something is.")
    auth: bool
    version: str


@router.get(
    "/healthz",
    response_model=Health,
    response_model_exclude_none=True,
    summary="Liveness and dependencies",
    responses={503: {"model": Health, "description": "The database or the Ray cluster is unreachable."}},
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
    if problems:
        response.status_code = 503
    return Health(
        status="degraded" if problems else "ok",
        db=db,
        ray=ray,
        storage=storage,
        reason="; ".join(problems) or None,
        auth=settings.auth_enabled,
        version=VERSION,
    )

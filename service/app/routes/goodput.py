"""``GET /v1/runs/{id}/goodput``: productive step time over the wall time since submission, and the time lost per
cause (``service.store.goodput``)."""

from __future__ import annotations

from fastapi import APIRouter

from api.spec import RunGoodput
from service import store
from service.app.deps import PrincipalDep, SessionDep
from service.app.errors import error_responses
from service.app.routes.runs import RunId
from service.store.goodput import run_goodput

router = APIRouter(prefix="/v1/runs", tags=["runs"])


@router.get(
    "/{run_id}/goodput",
    response_model=RunGoodput,
    summary="Goodput and the time lost per cause",
    responses=error_responses(404, 422),
)
def get_goodput(run_id: RunId, session: SessionDep, principal: PrincipalDep) -> RunGoodput:
    """Productive step time / wall time since submission (until the run ended, or now), with the seconds lost to
    the queue, start-up, failure detection, restarts, recomputed steps and the rest."""
    run = store.get_run(session, run_id=run_id, project=principal.scope)
    return RunGoodput.model_validate({"run_id": run.id, "status": run.status, **run_goodput(session, run=run)})

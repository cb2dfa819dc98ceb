"""Where the time goes, per run: the measured step-time breakdown against the plan (``/v1/runs/{id}/breakdown``).
Thin: the numbers come from ``service.store.breakdown``."""

from __future__ import annotations

from fastapi import APIRouter

from api.spec import RunBreakdown
from service import store
from service.app.deps import PrincipalDep, SessionDep
from service.app.errors import error_responses
from service.app.routes.runs import RunId
from service.store.breakdown import run_breakdown

router = APIRouter(prefix="/v1/runs", tags=["runs"])


@router.get(
    "/{run_id}/breakdown",
    response_model=RunBreakdown,
    summary="Measured step-time breakdown vs the plan",
    responses=error_responses(404, 422),
)
def get_breakdown(run_id: RunId, session: SessionDep, principal: PrincipalDep) -> RunBreakdown:
    """Per term (compute, tp/pp/dp communication, pipeline bubble, optimizer, data wait, other): the plan's
    prediction, the measured median over steady-state steps (warm-up excluded; communication: the exposed part) and
    the median of every rank; per rank its node, step and compute time, and compute relative to its peers."""
    run = store.get_run(session, run_id=run_id, project=principal.scope)
    return run_breakdown(session, run)

"""``POST /v1/runs/validate``: a submission's checks without the submission (``meshrun validate FILE --cluster live``).

The body is a run spec, parsed as ``POST /v1/runs`` parses it; the answer is the same 4xx error a submission would
get (the field and the fix: the spec, the project's policy, the planner's memory check on the service's cluster,
the cluster's capacity), or 200 with the resolved plan, the checks that ran and those this service cannot run.
Nothing is stored."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends

from api.spec import RunSpec
from api.spec.checks import RunValidation
from service.app.deps import PrincipalDep, RuntimeDep, SessionDep, SettingsDep
from service.app.errors import error_responses
from service.app.routes.runs import spec_body
from service.control import submission

router = APIRouter(tags=["runs"])


@router.post(
    "/v1/runs/validate",
    response_model=RunValidation,
    summary="Validate a run spec as a submission would (nothing stored)",
    responses=error_responses(400, 403, 413, 415, 422),
)
def validate_run(
    session: SessionDep,
    principal: PrincipalDep,
    settings: SettingsDep,
    runtime: RuntimeDep,
    spec: Annotated[RunSpec, Depends(spec_body)],
) -> RunValidation:
    """The checks of ``POST /v1/runs`` (422 names the field and the fix, e.g. a layout predicted not to fit in
    device memory, with the best feasible alternative); 200: the plan it would run."""
    plan, checked, not_checked = submission.validate_run(
        session,
        spec=spec,
        can_run_code=principal.can_run_code,
        settings=settings,
        runtime=runtime,
        admin=principal.admin,
    )
    return RunValidation(plan=plan, checked=checked, not_checked=not_checked)

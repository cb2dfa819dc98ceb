"""Where the time goes, per run: the measured step-time breakdown against the plan (``/breakdown``), profiles on
demand (``POST /profile``) and the run's artifacts (profiles as Chrome-trace JSON, pipeline timelines, stack dumps
of a hung attempt). Thin: the numbers come from ``service.store.breakdown``, the files from
``service.store.artifacts``; a profile request is an event the run's driver picks up (``service.runs.lifecycle``)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Response

from api.spec import ArtifactList, ArtifactPublic, ProfileAccepted, ProfileRequest, RunBreakdown, RunStatus
from service import store
from service.app.deps import PrincipalDep, SessionDep
from service.app.errors import ApiError, error_responses
from service.app.routes.runs import RunId, _utc
from service.store.artifacts import PROFILE_REQUEST, list_artifacts, read_artifact
from service.store.breakdown import run_breakdown
from service.store.models import Artifact

router = APIRouter(prefix="/v1/runs", tags=["runs"])


@router.get(
    "/{run_id}/breakdown",
    response_model=RunBreakdown,
    summary="Measured step-time breakdown vs the plan",
    responses=error_responses(404, 422),
)
def get_breakdown(run_id: RunId, session: SessionDep, principal: PrincipalDep) -> RunBreakdown:
    """Per term (compute, tp/pp/dp communication, pipeline bubble, optimizer, data wait, other): the plan's
    prediction, the measured mean over the typical steady-state steps (warm-up excluded, step time in the middle
    half; communication: the exposed part) and the same per rank, so the terms add up to the step time
    (``unaccounted_s``: the rest); per rank its node, step and compute time, and compute relative to its peers."""
    run = store.get_run(session, run_id=run_id, project=principal.scope)
    return run_breakdown(session, run)


@router.post(
    "/{run_id}/profile",
    status_code=202,
    response_model=ProfileAccepted,
    summary="Profile the next steps of a running run",
    responses=error_responses(404, 409, 422),
)
def request_profile(
    run_id: RunId, body: ProfileRequest, session: SessionDep, principal: PrincipalDep
) -> ProfileAccepted:
    """torch.profiler on every rank over the next ``steps`` steps (from the run's next report on). The Chrome
    traces (one per rank) become artifacts: ``GET /v1/runs/{id}/artifacts``."""
    run = store.get_run(session, run_id=run_id, project=principal.scope)
    if run.status != RunStatus.RUNNING.value:
        raise ApiError(
            409, f"run '{run_id}' is {run.status}; only a RUNNING run can be profiled", code="conflict", param="status"
        )
    store.add_event(
        session,
        run_id=run_id,
        kind=PROFILE_REQUEST,
        reason=f"profile {body.steps} steps requested by {principal.token_name}",
        actor=principal.token_name,
    )
    return ProfileAccepted(
        run_id=run_id,
        steps=body.steps,
        message=f"profiling the next {body.steps} steps of {run_id} on every rank; the traces appear in "
        f"GET /v1/runs/{run_id}/artifacts (meshrun artifact {run_id})",
    )


def _artifact(a: Artifact) -> ArtifactPublic:
    return ArtifactPublic(
        run_id=a.run_id,
        attempt=a.attempt,
        rank=a.rank,
        name=a.name,
        kind=a.kind,
        size_bytes=a.size_bytes,
        created_at=_utc(a.created_at) or a.created_at,
    )


@router.get(
    "/{run_id}/artifacts", response_model=ArtifactList, summary="Run artifacts", responses=error_responses(404, 422)
)
def get_artifacts(run_id: RunId, session: SessionDep, principal: PrincipalDep) -> ArtifactList:
    """Profiles (Chrome-trace JSON per rank: open in Perfetto), pipeline timelines and stack dumps; newest attempt
    first."""
    store.get_run(session, run_id=run_id, project=principal.scope)
    return ArtifactList(run_id=run_id, items=[_artifact(a) for a in list_artifacts(session, run_id=run_id)])


@router.get(
    "/{run_id}/artifacts/{name:path}",
    summary="Download one artifact",
    responses={200: {"content": {"application/json": {}, "text/plain": {}}}, **error_responses(404, 422)},
)
def get_artifact(
    run_id: RunId,
    name: Annotated[str, Path(max_length=512, description="e.g. profile/steps_00000005-00000007/rank0.trace.json")],
    session: SessionDep,
    principal: PrincipalDep,
    attempt: Annotated[int | None, Query(ge=1, le=100_000, description="Default: the newest attempt.")] = None,
) -> Response:
    """The file as it was written: JSON for traces and timelines (Chrome-trace format), text for stack dumps."""
    store.get_run(session, run_id=run_id, project=principal.scope)
    art, content = read_artifact(session, run_id=run_id, name=name, attempt=attempt)
    media = "application/json" if name.endswith(".json") else "text/plain; charset=utf-8"
    filename = name.rsplit("/", 1)[-1]
    return Response(content, media_type=media, headers={"Content-Disposition": f'attachment; filename="{filename}"'})

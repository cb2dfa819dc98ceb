"""``/v1/sweeps``: create (layouts x micro-batches, or ``auto``), list, read, cancel. Project-scoped like runs.
Thin: the logic is in ``service.sweeps`` (expansion, store, orchestration) and ``service.sweeps.driver``."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Path, Query, Request, Response
from sqlalchemy.orm import Session

from api.spec import SweepCreate, SweepEventList, SweepList, SweepPublic
from service import sweeps
from service.app.deps import Principal, PrincipalDep, RuntimeDep, SessionDep, SettingsDep
from service.app.errors import ApiError, error_responses
from service.app.pagination import decode_cursor, encode_cursor, no_cursor_with_offset
from service.app.routes.runs import (
    ID_PATTERN,
    IDEMPOTENCY_KEY_PATTERN,
    MAX_LIST_LIMIT,
    MAX_OFFSET,
    Cursor,
    parse_body,
)
from service.control.runtime import Runtime
from service.settings import Settings
from service.store.models import Sweep

router = APIRouter(prefix="/v1/sweeps", tags=["sweeps"])

SweepId = Annotated[str, Path(pattern=ID_PATTERN, description="Sweep id, e.g. sweep-1a2b3c4d5e6f.")]
SWEEP_STATUSES = sweeps.SweepStatus.ALL

_SWEEP_REF = {"$ref": "#/components/schemas/SweepCreate"}
_CREATE_OPENAPI = {
    "requestBody": {
        "required": True,
        "description": "The sweep: base run spec, search space, objective, budget (JSON or YAML).",
        "content": {"application/json": {"schema": _SWEEP_REF}, "application/yaml": {"schema": _SWEEP_REF}},
    }
}


async def sweep_body(request: Request) -> SweepCreate:
    """JSON strictly, YAML leniently (like run specs); ValidationError -> 422 naming the field."""
    data, is_json = parse_body(await request.body(), request.headers.get("content-type"))
    if is_json:
        return SweepCreate.model_validate_json(json.dumps(data), strict=True)
    return SweepCreate.model_validate(data)


def _reconcile(runtime: Runtime | None, sweep: Sweep) -> bool:
    """A running sweep whose Ray Job is gone is failed here too (the runtime's tick may not do it)."""
    if runtime is None or sweep.status in sweeps.SweepStatus.TERMINAL or not sweep.ray_job_id:
        return False
    return sweeps.reconcile_sweep(runtime, sweep.id)


@router.post(
    "",
    status_code=201,
    response_model=SweepPublic,
    openapi_extra=_CREATE_OPENAPI,
    summary="Start a layout sweep",
    responses={
        200: {
            "model": SweepPublic,
            "description": "Idempotent retry: the sweep created earlier with this Idempotency-Key.",
        },
        201: {"description": "Created: the sweep (QUEUED) with every trial, skipped ones with their reason."},
        **error_responses(400, 403, 409, 413, 415, 422),
    },
)
def create_sweep(
    response: Response,
    session: SessionDep,
    principal: PrincipalDep,
    settings: SettingsDep,
    runtime: RuntimeDep,
    create: Annotated[SweepCreate, Depends(sweep_body)],
    idempotency_key: Annotated[
        str | None,
        Header(
            alias="Idempotency-Key",
            pattern=IDEMPOTENCY_KEY_PATTERN,
            description="Retry-safe creation: the same key in the same project returns the same sweep.",
        ),
    ] = None,
) -> SweepPublic:
    """Expand the search space into trials (invalid / predicted-infeasible / unplaceable / over-budget ones
    SKIPPED with the reason), store them, and start the sweep's Ray Job (a Ray Tune run over the trials)."""
    return _create(response, session, principal, settings, runtime, create, idempotency_key)


def _create(
    response: Response,
    session: Session,
    principal: Principal,
    settings: Settings,
    runtime: Runtime | None,
    create: SweepCreate,
    idempotency_key: str | None,
) -> SweepPublic:
    sweep, created = sweeps.create_sweep(
        session,
        create=create,
        project=principal.project,
        actor=principal.token_name,
        can_run_code=principal.can_run_code,
        settings=settings,
        runtime=runtime,
        idempotency_key=idempotency_key,
        admin=principal.admin,
    )
    if not created:
        response.status_code = 200
        response.headers["Idempotent-Replayed"] = "true"
        return sweeps.sweep_public(session, sweep)
    session.commit()  # the driver reads it from its own session
    if runtime is not None:
        sweeps.start_sweep(runtime, sweep.id)
        session.expire_all()
        sweep = sweeps.get_sweep(session, sweep_id=sweep.id)
    return sweeps.sweep_public(session, sweep)


@router.get("", response_model=SweepList, summary="List sweeps", responses=error_responses(422))
def list_sweeps(
    session: SessionDep,
    principal: PrincipalDep,
    status: Annotated[
        list[str] | None,
        Query(description="Filter (QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED); repeat for several."),
    ] = None,
    project: Annotated[str | None, Query(pattern=ID_PATTERN, description="Admins: only this project.")] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIST_LIMIT)] = 50,
    cursor: Cursor = None,
    offset: Annotated[int, Query(ge=0, le=MAX_OFFSET, description="Prefer ``cursor`` (constant cost per page).")] = 0,
) -> SweepList:
    """Newest first, with their trials, one page at a time (pass ``next_cursor`` back as ``cursor``). Non-admin
    tokens see their project's sweeps only."""
    wanted = [s.upper() for s in status or []]
    bad = [s for s in wanted if s not in SWEEP_STATUSES]
    if bad:
        raise ApiError(422, f"unknown sweep status {bad[0]!r}; use one of {list(SWEEP_STATUSES)}", param="status")
    no_cursor_with_offset(cursor, offset)
    after = decode_cursor(cursor, "sweeps", datetime, str) if cursor else None
    scope = principal.scope if principal.scope is not None else project
    rows, total, exact = sweeps.list_sweeps(
        session,
        project=scope,
        status=wanted or None,
        limit=limit + 1,
        offset=offset,
        after=after,
    )
    more, rows = len(rows) > limit, rows[:limit]
    return SweepList(
        items=[sweeps.sweep_public(session, s) for s in rows],
        total=total,
        total_exact=exact,
        limit=limit,
        offset=offset,
        next_cursor=encode_cursor("sweeps", rows[-1].created_at, rows[-1].id) if more else None,
    )


@router.get(
    "/{sweep_id}",
    response_model=SweepPublic,
    summary="Get a sweep with its trials",
    responses=error_responses(404, 422),
)
def get_sweep(sweep_id: SweepId, session: SessionDep, principal: PrincipalDep, runtime: RuntimeDep) -> SweepPublic:
    """Status, every trial (layout, micro-batch, predicted and measured tokens/s, MFU, peak memory, status and
    reason), the best trial and the calibration of the planner."""
    sweep = sweeps.get_sweep(session, sweep_id=sweep_id, project=principal.scope)
    if _reconcile(runtime, sweep):
        session.expire_all()
        sweep = sweeps.get_sweep(session, sweep_id=sweep_id, project=principal.scope)
    return sweeps.sweep_public(session, sweep)


@router.get(
    "/{sweep_id}/events",
    response_model=SweepEventList,
    summary="State changes of the sweep and its trials",
    responses=error_responses(404, 422),
)
def get_sweep_events(sweep_id: SweepId, session: SessionDep, principal: PrincipalDep) -> SweepEventList:
    """Every stored transition of the sweep (``trial_id`` null) and of its trials, oldest first, with reason and
    actor; plus other events (``kind`` other than "state": the sweep's Ray Job submissions)."""
    sweeps.get_sweep(session, sweep_id=sweep_id, project=principal.scope)
    events = sweeps.list_sweep_events(session, sweep_id=sweep_id)
    return SweepEventList(sweep_id=sweep_id, items=[sweeps.sweep_event_public(e) for e in events])


@router.post(
    "/{sweep_id}/cancel", response_model=SweepPublic, summary="Cancel a sweep", responses=error_responses(404, 409, 422)
)
def cancel_sweep(sweep_id: SweepId, session: SessionDep, principal: PrincipalDep, runtime: RuntimeDep) -> SweepPublic:
    """Stops the sweep's Ray Job (its trials' runs -> CANCELLED); a finished sweep -> 409."""
    sweep = sweeps.cancel_sweep(
        session, sweep_id=sweep_id, scope=principal.scope, actor=principal.token_name, runtime=runtime
    )
    return sweeps.sweep_public(session, sweep)

"""``/v1/runs``: submit, list, read, metrics, events, checkpoints, logs, cancel, resume. Thin: logic lives in
``service.submission`` and ``service.store``."""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Path, Query, Request, Response
from pydantic import BaseModel

from api.deps import PrincipalDep, RuntimeDep, SessionDep, SettingsDep
from api.errors import ApiError, error_responses
from api.yamlio import YAMLError, load_yaml, parse_run_spec
from api.schemas import (NAME_RE, CheckpointPublic, EventList, EventPublic, LogsPublic, MetricList, MetricRow,
                         ResumeRequest, RunList, RunPublic, RunSpec, RunStatus, RunSummary)
from service import store, submission
from service.models import Checkpoint, Metric, Run, RunEvent

ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
IDEMPOTENCY_KEY_PATTERN = r"^[\x21-\x7e]{1,128}$"
MAX_LIST_LIMIT = 500
MAX_OFFSET = 1_000_000_000
MAX_BODY_NODES = 100_000
MAX_BODY_DEPTH = 64
JSON_TYPES = ("application/json",)
YAML_TYPES = ("application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml")

router = APIRouter(prefix="/v1/runs", tags=["runs"])

RunId = Annotated[str, Path(pattern=ID_PATTERN, description="Run id, e.g. run-1a2b3c4d5e6f.")]

_RUN_SPEC_REF = {"$ref": "#/components/schemas/RunSpec"}
_SUBMIT_OPENAPI = {
    "requestBody": {
        "required": True,
        "description": "The run spec, as JSON or YAML.",
        "content": {"application/json": {"schema": _RUN_SPEC_REF},
                    "application/yaml": {"schema": _RUN_SPEC_REF}},
    }
}


# -------------------------------------------------------------------------------------------- mapping
def _utc(dt: datetime | None) -> datetime | None:
    if dt is not None and dt.tzinfo is None:
        return dt.replace(tzinfo=timezone.utc)
    return dt


def run_public(run: Run, *, summary: dict[str, Any] | None = None) -> RunPublic:
    """ORM run -> API model (timestamps UTC-aware on every database)."""
    summ = summary if summary is not None else run.summary
    return RunPublic(
        id=run.id, name=run.name, project=run.project, status=RunStatus(run.status), status_reason=run.status_reason,
        priority=run.priority or 0, spec=RunSpec.model_validate(run.spec), plan=run.plan, attempts=run.attempts or 0,
        sweep_id=run.sweep_id, ray_job_id=run.ray_job_id, dashboard_url=run.dashboard_url,
        rank_nodes={str(k): str(v) for k, v in run.rank_nodes.items()} if run.rank_nodes else None,
        summary=RunSummary.model_validate(summ) if summ else None,
        created_at=_utc(run.created_at), updated_at=_utc(run.updated_at), started_at=_utc(run.started_at),
        finished_at=_utc(run.finished_at))


def _metric_row(m: Metric) -> MetricRow:
    row = MetricRow.model_validate(m)
    return row.model_copy(update={"time": _utc(m.time)})


def _event(e: RunEvent) -> EventPublic:
    ev = EventPublic.model_validate(e)
    return ev.model_copy(update={"time": _utc(e.time)})


def _checkpoint(c: Checkpoint) -> CheckpointPublic:
    ck = CheckpointPublic.model_validate(c)
    return ck.model_copy(update={"created_at": _utc(c.created_at)})


# ---------------------------------------------------------------------------------------- body parsing
def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows; use a finite number")


def check_plain_data(obj: Any, *, max_nodes: int = MAX_BODY_NODES, max_depth: int = MAX_BODY_DEPTH) -> None:
    """Refuse anything that is not plain JSON data or that the database could not store: non-finite floats,
    strings with NUL or lone surrogates, non-string keys, YAML-only types, too deep or too many nodes."""
    stack: list[tuple[Any, int, str]] = [(obj, 0, "")]
    seen = 0
    while stack:
        x, depth, where = stack.pop()
        seen += 1
        if seen > max_nodes:
            raise ApiError(422, f"request body has more than {max_nodes} values; send a smaller spec",
                           code="too_large")
        if depth > max_depth:
            raise ApiError(422, f"request body is nested deeper than {max_depth} levels", code="too_large",
                           param=where or None)
        if isinstance(x, str):
            if "\x00" in x:
                raise ApiError(422, f"{where or 'value'} contains a NUL character; remove it", param=where or None)
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                raise ApiError(422, f"{where or 'value'} is not valid Unicode (lone surrogate); fix the text",
                               param=where or None) from None
        elif isinstance(x, bool) or x is None or isinstance(x, int):
            continue
        elif isinstance(x, float):
            if not math.isfinite(x):
                raise ApiError(422, f"{where or 'value'} must be a finite number (got {x})", param=where or None)
        elif isinstance(x, dict):
            for k, v in x.items():
                if not isinstance(k, str):
                    raise ApiError(422, f"keys must be strings (got {k!r} in {where or 'the body'})",
                                   param=where or None)
                stack.append((k, depth + 1, where))
                stack.append((v, depth + 1, f"{where}.{k}" if where else k))
        elif isinstance(x, list):
            stack.extend((v, depth + 1, f"{where}.{i}" if where else str(i)) for i, v in enumerate(x))
        else:
            raise ApiError(422, f"{where or 'value'}: unsupported value of type {type(x).__name__}; use JSON types "
                           "(quote dates and other special YAML values)", param=where or None)


def parse_body(body: bytes, content_type: str | None) -> tuple[Any, bool]:
    """JSON (default) or YAML bytes -> (plain data, is_json). 400 for malformed input, 415 for other media."""
    media = (content_type or "application/json").split(";", 1)[0].strip().lower()
    if not body.strip():
        raise ApiError(400, "request body is empty; send a run spec as JSON (or YAML)", code="malformed_body")
    if media in JSON_TYPES or media.endswith("+json"):
        try:
            data = json.loads(body, parse_constant=_reject_constant)
        except (ValueError, RecursionError) as e:
            why = str(e).splitlines()[0][:200] if not isinstance(e, RecursionError) else "nested too deeply"
            raise ApiError(400, f"request body is not valid JSON ({why}); send a JSON object",
                           code="malformed_body") from None
    elif media in YAML_TYPES:
        try:
            data = load_yaml(body)  # YAML-1.2 numbers: 3e-4 is a float, as in the SDK and the CLI
        except (YAMLError, ValueError, RecursionError) as e:
            why = str(e).splitlines()[0][:200] if not isinstance(e, RecursionError) else "nested too deeply"
            raise ApiError(400, f"request body is not valid YAML ({why}); send a YAML mapping",
                           code="malformed_body") from None
    else:
        raise ApiError(415, f"unsupported Content-Type '{media}'; send application/json or application/yaml",
                       code="unsupported_media_type")
    check_plain_data(data)
    if not isinstance(data, dict):
        raise ApiError(422, f"request body must be an object (a run spec), got {type(data).__name__}",
                       code="invalid_value")
    return data, media not in YAML_TYPES


async def spec_body(request: Request) -> RunSpec:
    """The RunSpec of the body. JSON is validated strictly (programs send proper types: `true` is not 1);
    hand-written YAML leniently (``"3e-4"`` is a number). ValidationError -> 422 naming the field."""
    data, is_json = parse_body(await request.body(), request.headers.get("content-type"))
    if is_json:
        return parse_run_spec(data)  # the same strict parse `meshrun validate` uses
    return RunSpec.model_validate(data)


# ----------------------------------------------------------------------------------------------- routes
@router.post(
    "", status_code=201, response_model=RunPublic, openapi_extra=_SUBMIT_OPENAPI,
    summary="Submit a run",
    responses={200: {"model": RunPublic, "description": "Idempotent retry: the run created earlier with this "
                                                        "Idempotency-Key (header Idempotent-Replayed: true)."},
               201: {"description": "Created: the stored run (QUEUED)."},
               **error_responses(400, 403, 409, 413, 415, 422)})
def submit_run(response: Response, session: SessionDep, principal: PrincipalDep, settings: SettingsDep,
               runtime: RuntimeDep, spec: Annotated[RunSpec, Depends(spec_body)],
               idempotency_key: Annotated[str | None, Header(
                   alias="Idempotency-Key", pattern=IDEMPOTENCY_KEY_PATTERN,
                   description="Retry-safe submission: the same key in the same project returns the same run "
                               "(200) instead of creating another.")] = None) -> RunPublic:
    """Validate the spec (422 names the field), check it fits the cluster (planner), store it QUEUED (201)."""
    run, created = submission.submit_run(session, spec=spec, project=principal.project, actor=principal.token_name,
                                         can_run_code=principal.can_run_code, settings=settings, runtime=runtime,
                                         idempotency_key=idempotency_key)
    if not created:
        response.status_code = 200
        response.headers["Idempotent-Replayed"] = "true"
    return run_public(run)


@router.get("", response_model=RunList, summary="List runs", responses=error_responses(422))
def list_runs(session: SessionDep, principal: PrincipalDep,
              status: Annotated[list[RunStatus] | None, Query(description="Filter; repeat for several.")] = None,
              name: Annotated[str | None, Query(pattern=NAME_RE.pattern)] = None,
              sweep_id: Annotated[str | None, Query(pattern=ID_PATTERN)] = None,
              project: Annotated[str | None, Query(pattern=ID_PATTERN,
                                                   description="Admins: only this project.")] = None,
              limit: Annotated[int, Query(ge=1, le=MAX_LIST_LIMIT)] = 50,
              offset: Annotated[int, Query(ge=0, le=MAX_OFFSET)] = 0) -> RunList:
    """Newest first. Non-admin tokens see their project's runs only."""
    scope = principal.scope if principal.scope is not None else project
    rows, total = store.list_runs(session, project=scope, status=[s.value for s in status or []] or None,
                                  name=name, sweep_id=sweep_id, limit=limit, offset=offset)
    return RunList(items=[run_public(r) for r in rows], total=total, limit=limit, offset=offset)


@router.get("/{run_id}", response_model=RunPublic, summary="Get a run", responses=error_responses(404, 422))
def get_run(run_id: RunId, session: SessionDep, principal: PrincipalDep) -> RunPublic:
    run = store.get_run(session, run_id=run_id, project=principal.scope)
    summary = run.summary
    if summary is None and run.status != RunStatus.QUEUED.value:
        s = store.summarize_metrics(session, run_id=run_id)
        summary = s if s.get("steps_done") else None
    return run_public(run, summary=summary)


@router.get("/{run_id}/metrics", response_model=MetricList, summary="Per-step metrics",
            responses=error_responses(404, 422))
def get_metrics(run_id: RunId, session: SessionDep, principal: PrincipalDep,
                since_step: Annotated[int, Query(ge=0, le=2**31 - 1, description="Exclusive.")] = 0,
                attempt: Annotated[int | None, Query(ge=1, le=100_000)] = None,
                limit: Annotated[int | None, Query(ge=1, le=100_000)] = None) -> MetricList:
    """Each step once (the latest attempt's row), in step order; ``attempt`` selects one attempt's rows."""
    store.get_run(session, run_id=run_id, project=principal.scope)
    rows = store.list_metrics(session, run_id=run_id, since_step=since_step, attempt=attempt, limit=limit)
    return MetricList(run_id=run_id, items=[_metric_row(m) for m in rows])


@router.get("/{run_id}/events", response_model=EventList, summary="State changes and audit events",
            responses=error_responses(404, 422))
def get_events(run_id: RunId, session: SessionDep, principal: PrincipalDep) -> EventList:
    store.get_run(session, run_id=run_id, project=principal.scope)
    return EventList(run_id=run_id, items=[_event(e) for e in store.list_events(session, run_id=run_id)])


@router.get("/{run_id}/checkpoints", response_model=list[CheckpointPublic], summary="Checkpoints",
            responses=error_responses(404, 422))
def get_checkpoints(run_id: RunId, session: SessionDep, principal: PrincipalDep) -> list[CheckpointPublic]:
    store.get_run(session, run_id=run_id, project=principal.scope)
    return [_checkpoint(c) for c in store.list_checkpoints(session, run_id=run_id)]


@router.get("/{run_id}/logs", response_model=LogsPublic, summary="Driver and worker logs",
            responses=error_responses(404, 422, 503))
def get_logs(run_id: RunId, session: SessionDep, principal: PrincipalDep, runtime: RuntimeDep) -> LogsPublic:
    store.get_run(session, run_id=run_id, project=principal.scope)
    if runtime is None or not hasattr(runtime, "run_logs"):
        raise ApiError(503, "logs come from the Ray runtime, which this API process does not run; query the service "
                       "that runs the scheduler", code="runtime_unavailable")
    return LogsPublic(run_id=run_id, logs=runtime.run_logs(run_id) or "")


@router.post("/{run_id}/cancel", response_model=RunPublic, summary="Cancel a run",
             responses=error_responses(404, 409, 422, 503))
def cancel_run(run_id: RunId, session: SessionDep, principal: PrincipalDep, runtime: RuntimeDep) -> RunPublic:
    """QUEUED runs are cancelled at once; STARTING/RUNNING ones are stopped by the runtime; finished -> 409."""
    run = submission.cancel_run(session, run_id=run_id, scope=principal.scope, actor=principal.token_name,
                                runtime=runtime)
    return run_public(run)


@router.post("/{run_id}/resume", response_model=RunPublic, summary="Resume a failed or cancelled run",
             responses=error_responses(404, 409, 422, 503))
def resume_run(run_id: RunId, body: ResumeRequest, session: SessionDep, principal: PrincipalDep,
               settings: SettingsDep, runtime: RuntimeDep) -> RunPublic:
    """Re-queue from the latest checkpoint, optionally with a new layout (resharded on load), batch or steps."""
    run = submission.resume_run(session, run_id=run_id, scope=principal.scope, actor=principal.token_name,
                                can_run_code=principal.can_run_code, settings=settings, request=body,
                                runtime=runtime)
    return run_public(run)


class Health(BaseModel):
    status: str
    db: str
    ray: str
    auth: bool
    version: str


health_router = APIRouter(tags=["health"])


@health_router.get("/healthz", response_model=Health, summary="Liveness and dependencies",
                   responses={503: {"model": Health, "description": "The database is unreachable."}})
def healthz(request: Request, response: Response) -> Health:
    from sqlalchemy import text

    from api.server import VERSION
    db = "ok"
    try:
        with request.app.state.session_factory() as session:
            session.execute(text("SELECT 1"))
    except Exception:  # noqa: BLE001 - health reports, never raises
        db = "error"
    runtime = getattr(request.app.state, "runtime", None)
    ray = "absent"
    if runtime is not None:
        ok = getattr(runtime, "healthy", None)
        try:
            ray = "ok" if (ok() if callable(ok) else True) else "error"
        except Exception:  # noqa: BLE001
            ray = "error"
    if db != "ok":
        response.status_code = 503
    return Health(status="ok" if db == "ok" else "degraded", db=db, ray=ray,
                  auth=request.app.state.settings.auth_enabled, version=VERSION)

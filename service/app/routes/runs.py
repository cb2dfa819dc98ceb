"""``/v1/runs``: submit, list, read, metrics, events, checkpoints, logs, cancel, resume. Thin: logic lives in
``service.control.submission`` and ``service.store``."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Header, Path, Query, Request, Response
from starlette.concurrency import run_in_threadpool

from api.spec import (
    NAME_RE,
    CheckpointList,
    CheckpointPublic,
    EventList,
    EventPublic,
    LogsPublic,
    MetricList,
    MetricRow,
    ResumeRequest,
    RunCost,
    RunList,
    RunPublic,
    RunSpec,
    RunStatus,
    RunSummary,
)
from api.spec.metrics import METRIC_ROW_FIELDS
from api.spec.yamlio import (
    MAX_MAPPING_KEYS,
    MAX_YAML_DEPTH,
    MAX_YAML_NODES,
    YAMLError,
    YamlLimitError,
    load_yaml,
    parse_run_spec,
)
from service import store
from service.app.deps import PrincipalDep, RuntimeDep, SessionDep, SettingsDep
from service.app.errors import ApiError, error_responses
from service.app.pagination import decode_cursor, encode_cursor, no_cursor_with_offset
from service.control import submission
from service.runs.tracking import tracking_for
from service.store.cost import run_cost
from service.store.db import session_scope
from service.store.metrics import METRIC_FIELDS
from service.store.models import Checkpoint, Metric, Run, RunEvent, RunStats

ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
IDEMPOTENCY_KEY_PATTERN = r"^[\x21-\x7e]{1,128}$"
MAX_LIST_LIMIT = 500
MAX_OFFSET = 1_000_000_000
MAX_METRICS_PAGE = 10_000
MAX_POINTS = 10_000
MAX_EVENTS_PAGE = 1_000
MAX_LOG_CHARS = 1 << 20
Cursor = Annotated[
    str | None,
    Query(
        max_length=512,
        pattern=r"^[A-Za-z0-9_-]*$",
        description="The ``next_cursor`` of the previous page (opaque); omit for the first page.",
    ),
]
MAX_BODY_NODES = MAX_YAML_NODES  # values in one request body (JSON or YAML)
MAX_BODY_DEPTH = MAX_YAML_DEPTH
MAX_BODY_KEYS = MAX_MAPPING_KEYS  # keys of one mapping (labels, model.args, ...)
MAX_BODY_INT = 2**63 - 1  # what a database integer and every JSON reader hold exactly
JSON_TYPES = ("application/json",)
YAML_TYPES = ("application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml")

router = APIRouter(prefix="/v1/runs", tags=["runs"])

RunId = Annotated[str, Path(pattern=ID_PATTERN, description="Run id, e.g. run-1a2b3c4d5e6f.")]

_RUN_SPEC_REF = {"$ref": "#/components/schemas/RunSpec"}
_SUBMIT_OPENAPI = {
    "requestBody": {
        "required": True,
        "description": "The run spec, as JSON or YAML.",
        "content": {"application/json": {"schema": _RUN_SPEC_REF}, "application/yaml": {"schema": _RUN_SPEC_REF}},
    }
}


# -------------------------------------------------------------------------------------------- mapping
def _utc(dt: datetime | None) -> datetime | None:
    if dt is not None and dt.tzinfo is None:
        return dt.replace(tzinfo=UTC)
    return dt


def run_public(
    run: Run,
    *,
    summary: dict[str, Any] | None = None,
    stats: RunStats | None = None,
    request: Request | None = None,
    cost: RunCost | None = None,
) -> RunPublic:
    """ORM run -> API model (timestamps UTC-aware on every database). The summary is the final one the driver
    wrote, else the live one maintained with the metrics (``stats``). With ``request``, ``dashboard_url`` is the
    run's Ray job through this service's dashboard proxy when the caller may use it (Ray's own page asks for a
    token a meshrun user does not have)."""
    summ = summary if summary is not None else (run.summary or store.stats_summary(stats))
    dashboard_url = run.dashboard_url
    if request is not None and run.ray_job_id:
        from service.app.links import ray_job_link

        link = ray_job_link(request, getattr(request.state, "principal", None), run.ray_job_id, None)
        if link is not None:
            dashboard_url = link
    return RunPublic(
        id=run.id,
        name=run.name,
        project=run.project,
        status=RunStatus(run.status),
        status_reason=run.status_reason,
        priority=run.priority or 0,
        spec=RunSpec.model_validate(run.spec),
        plan=run.plan,
        attempts=run.attempts or 0,
        sweep_id=run.sweep_id,
        ray_job_id=run.ray_job_id,
        dashboard_url=dashboard_url,
        rank_nodes={str(k): str(v) for k, v in run.rank_nodes.items()} if run.rank_nodes else None,
        summary=RunSummary.model_validate(summ) if summ else None,
        cost=cost,
        tracking=tracking_for(run.id, run.spec, request.app.state.settings if request is not None else None),
        created_at=_utc(run.created_at),
        updated_at=_utc(run.updated_at),
        started_at=_utc(run.started_at),
        finished_at=_utc(run.finished_at),
    )


_EXTRA_FIELDS = tuple(n for n, f in METRIC_ROW_FIELDS.items() if not f.column)


def _metric_row(m: Metric) -> MetricRow:
    """A stored row; the declared fields kept in the row's ``extra`` JSON (breakdowns, the sync modes' staleness,
    divergence and cross-group bytes) are served too."""
    extra = m.extra or {}
    if any(n in extra for n in _EXTRA_FIELDS):
        data = {n: getattr(m, n) for n in MetricRow.model_fields if hasattr(m, n)}
        data.update({n: extra[n] for n in _EXTRA_FIELDS if n in extra})
        row = MetricRow.model_validate(data)
    else:
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
            raise ApiError(422, f"request body has more than {max_nodes} values; send a smaller spec", code="too_large")
        if depth > max_depth:
            raise ApiError(
                422, f"request body is nested deeper than {max_depth} levels", code="too_large", param=where or None
            )
        if isinstance(x, str):
            if "\x00" in x:
                raise ApiError(422, f"{where or 'value'} contains a NUL character; remove it", param=where or None)
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                raise ApiError(
                    422, f"{where or 'value'} is not valid Unicode (lone surrogate); fix the text", param=where or None
                ) from None
        elif isinstance(x, bool) or x is None:
            continue
        elif isinstance(x, int):
            if abs(x) > MAX_BODY_INT:
                raise ApiError(
                    422,
                    f"{where or 'value'} is an integer beyond 64 bits; use a number within +-{MAX_BODY_INT}",
                    param=where or None,
                )
        elif isinstance(x, float):
            if not math.isfinite(x):
                raise ApiError(422, f"{where or 'value'} must be a finite number (got {x})", param=where or None)
        elif isinstance(x, dict):
            if len(x) > MAX_BODY_KEYS:
                raise ApiError(
                    422,
                    f"{where or 'the body'} has {len(x)} keys, more than {MAX_BODY_KEYS}; send fewer",
                    code="too_large",
                    param=where or None,
                )
            for k, v in x.items():
                if not isinstance(k, str):
                    raise ApiError(
                        422, f"keys must be strings (got {k!r} in {where or 'the body'})", param=where or None
                    )
                stack.append((k, depth + 1, where))
                stack.append((v, depth + 1, f"{where}.{k}" if where else k))
        elif isinstance(x, list):
            stack.extend((v, depth + 1, f"{where}.{i}" if where else str(i)) for i, v in enumerate(x))
        else:
            raise ApiError(
                422,
                f"{where or 'value'}: unsupported value of type {type(x).__name__}; use JSON types "
                "(quote dates and other special YAML values)",
                param=where or None,
            )


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
            raise ApiError(
                400, f"request body is not valid JSON ({why}); send a JSON object", code="malformed_body"
            ) from None
    elif media in YAML_TYPES:
        try:
            data = load_yaml(body)  # YAML-1.2 numbers: 3e-4 is a float, as in the SDK and the CLI
        except YamlLimitError as e:
            raise ApiError(422, f"request body: {e}", code="too_large") from None
        except (YAMLError, ValueError, RecursionError) as e:
            why = str(e).splitlines()[0][:200] if not isinstance(e, RecursionError) else "nested too deeply"
            raise ApiError(
                400, f"request body is not valid YAML ({why}); send a YAML mapping", code="malformed_body"
            ) from None
    else:
        raise ApiError(
            415,
            f"unsupported Content-Type '{media}'; send application/json or application/yaml",
            code="unsupported_media_type",
        )
    check_plain_data(data)
    if not isinstance(data, dict):
        raise ApiError(
            422, f"request body must be an object (a run spec), got {type(data).__name__}", code="invalid_value"
        )
    return data, media not in YAML_TYPES


async def spec_body(request: Request) -> RunSpec:
    """The RunSpec of the body. JSON is validated strictly (programs send proper types: `true` is not 1);
    hand-written YAML leniently (``"3e-4"`` is a number). ValidationError -> 422 naming the field. Parsed in a
    worker thread: a big spec's parse would otherwise stall the event loop, and every queued request's deadline
    with it (``service.app.overload``)."""
    return await run_in_threadpool(_parse_spec, await request.body(), request.headers.get("content-type"))


def _parse_spec(body: bytes, content_type: str | None) -> RunSpec:
    data, is_json = parse_body(body, content_type)
    if is_json:
        return parse_run_spec(data)  # the same strict parse `meshrun validate` uses
    return RunSpec.model_validate(data)


# ----------------------------------------------------------------------------------------------- routes
@router.post(
    "",
    status_code=201,
    response_model=RunPublic,
    openapi_extra=_SUBMIT_OPENAPI,
    summary="Submit a run",
    responses={
        200: {
            "model": RunPublic,
            "description": "Idempotent retry: the run created earlier with this "
            "Idempotency-Key (header Idempotent-Replayed: true).",
        },
        201: {"description": "Created: the stored run (QUEUED)."},
        **error_responses(400, 403, 409, 413, 415, 422),
    },
)
def submit_run(
    req: Request,
    response: Response,
    session: SessionDep,
    principal: PrincipalDep,
    settings: SettingsDep,
    runtime: RuntimeDep,
    spec: Annotated[RunSpec, Depends(spec_body)],
    idempotency_key: Annotated[
        str | None,
        Header(
            alias="Idempotency-Key",
            pattern=IDEMPOTENCY_KEY_PATTERN,
            description="Retry-safe submission: the same key in the same project returns the same run "
            "(200) instead of creating another.",
        ),
    ] = None,
) -> RunPublic:
    """Validate the spec (422 names the field), check it fits the cluster (planner), store it QUEUED (201)."""
    run, created = submission.submit_run(
        session,
        spec=spec,
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
    out = run_public(run, request=req)  # as stored (QUEUED), whatever the scheduler does next
    if created and runtime is not None:
        session.commit()  # the scheduler reads it from its own session
        runtime.wake()  # admitted now, not at the next tick (scheduler_interval_s)
    return out


@router.get("", response_model=RunList, summary="List runs", responses=error_responses(422))
def list_runs(
    req: Request,
    session: SessionDep,
    principal: PrincipalDep,
    status: Annotated[list[RunStatus] | None, Query(description="Filter; repeat for several.")] = None,
    name: Annotated[str | None, Query(pattern=NAME_RE.pattern)] = None,
    sweep_id: Annotated[str | None, Query(pattern=ID_PATTERN)] = None,
    project: Annotated[str | None, Query(pattern=ID_PATTERN, description="Admins: only this project.")] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIST_LIMIT)] = 50,
    cursor: Cursor = None,
    offset: Annotated[int, Query(ge=0, le=MAX_OFFSET, description="Prefer ``cursor`` (constant cost per page).")] = 0,
) -> RunList:
    """Newest first, one page at a time: pass ``next_cursor`` back as ``cursor``. Non-admin tokens see their
    project's runs only."""
    no_cursor_with_offset(cursor, offset)
    after = decode_cursor(cursor, "runs", datetime, str) if cursor else None
    scope = principal.scope if principal.scope is not None else project
    rows, total, exact = store.list_runs(
        session,
        project=scope,
        status=[s.value for s in status or []] or None,
        name=name,
        sweep_id=sweep_id,
        limit=limit + 1,
        offset=offset,
        after=after,
    )
    more, rows = len(rows) > limit, rows[:limit]
    stats = store.get_stats(session, run_ids=[r.id for r in rows if r.summary is None])
    return RunList(
        items=[run_public(r, stats=stats.get(r.id), request=req) for r in rows],
        total=total,
        total_exact=exact,
        limit=limit,
        offset=offset,
        next_cursor=encode_cursor("runs", rows[-1].created_at, rows[-1].id) if more else None,
    )


def live_stats(session: Any, run: Run) -> RunStats | None:
    """The run's maintained metric summary; built once for a run from before ``run_stats`` existed."""
    if run.summary is not None:
        return None
    stats = store.get_stats(session, run_ids=[run.id]).get(run.id)
    if stats is None and run.attempts:
        stats = store.recompute_stats(session, run_id=run.id)
    return stats


@router.get("/{run_id}", response_model=RunPublic, summary="Get a run", responses=error_responses(404, 422))
async def get_run(run_id: RunId, req: Request, principal: PrincipalDep) -> RunPublic:
    """The run with its summary: final once it ended, live (maintained as metrics arrive) while it runs. The
    most polled endpoint (``wait()``, the console): the database work is one thread-pool hop, and the answer is
    serialized on the event loop (a sync route would take a second hop for that)."""

    def read() -> RunPublic:
        with session_scope(req.app.state.session_factory) as session:
            run = store.get_run(session, run_id=run_id, project=principal.scope)
            return run_public(run, stats=live_stats(session, run), request=req, cost=run_cost(session, run))

    return await run_in_threadpool(read)


@router.get(
    "/{run_id}/metrics", response_model=MetricList, summary="Per-step metrics", responses=error_responses(404, 422)
)
def get_metrics(
    run_id: RunId,
    session: SessionDep,
    principal: PrincipalDep,
    since_step: Annotated[int, Query(ge=0, le=2**31 - 1, description="Exclusive.")] = 0,
    attempt: Annotated[int | None, Query(ge=1, le=100_000)] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_METRICS_PAGE, description="Rows per page.")] = 1000,
    cursor: Cursor = None,
    points: Annotated[
        int | None,
        Query(
            ge=2,
            le=MAX_POINTS,
            description="Downsample: at most this many rows over the whole run, keeping each bucket's smallest "
            "and largest ``field`` (for charts). Not paged.",
        ),
    ] = None,
    field: Annotated[
        Literal[METRIC_FIELDS],  # type: ignore[valid-type]
        Query(description="The field whose minima and maxima a downsampled series keeps."),
    ] = "loss",
) -> MetricList:
    """Each step once, in step order (a resumed attempt replaces the steps it replays), one page of ``limit``
    rows: pass ``next_cursor`` back as ``cursor`` (or the last step as ``since_step``). ``attempt`` selects one
    attempt's raw rows. ``points`` returns a downsampled series of the whole run instead."""
    store.get_run(session, run_id=run_id, project=principal.scope)
    if points is not None:
        if attempt is not None or cursor:
            raise ApiError(422, "points downsamples the whole series; drop attempt and cursor", param="points")
        rows, n = store.downsample_metrics(session, run_id=run_id, points=points, field=field)
        items = [_metric_row(m) for m in rows]
        return MetricList(run_id=run_id, items=items, downsampled=len(items) < n, series_rows=n)
    if cursor:
        cur_attempt, last_step = decode_cursor(cursor, "metrics", int, int)
        if cur_attempt != (attempt or 0):
            raise ApiError(422, "cursor was made for another attempt filter; keep attempt as it was", param="cursor")
        since_step = max(since_step, last_step)
    rows = store.list_metrics(session, run_id=run_id, since_step=since_step, attempt=attempt, limit=limit + 1)
    more, rows = len(rows) > limit, rows[:limit]
    nxt = encode_cursor("metrics", attempt or 0, rows[-1].step) if more else None
    return MetricList(run_id=run_id, items=[_metric_row(m) for m in rows], next_cursor=nxt)


@router.get(
    "/{run_id}/events",
    response_model=EventList,
    summary="State changes and audit events",
    responses=error_responses(404, 422),
)
def get_events(
    run_id: RunId,
    session: SessionDep,
    principal: PrincipalDep,
    kind: Annotated[
        list[str] | None,
        Query(
            max_length=32,
            description="Only these kinds (state, attempt, placement, checkpoint, worker_error, "
            "straggler, ...); repeat for several.",
        ),
    ] = None,
    order: Annotated[Literal["asc", "desc"], Query(description="asc: oldest first; desc: newest first.")] = "asc",
    limit: Annotated[int, Query(ge=1, le=MAX_EVENTS_PAGE)] = 500,
    cursor: Cursor = None,
) -> EventList:
    """One page of the run's events in time order; pass ``next_cursor`` back as ``cursor``."""
    store.get_run(session, run_id=run_id, project=principal.scope)
    after = decode_cursor(cursor, f"events-{order}", datetime, int) if cursor else None
    rows = store.list_events(
        session,
        run_id=run_id,
        kinds=kind,
        after=after,
        limit=limit + 1,
        newest_first=order == "desc",
    )
    more, rows = len(rows) > limit, rows[:limit]
    nxt = encode_cursor(f"events-{order}", rows[-1].time, rows[-1].id) if more else None
    return EventList(run_id=run_id, items=[_event(e) for e in rows], next_cursor=nxt)


@router.get(
    "/{run_id}/checkpoints",
    response_model=CheckpointList,
    summary="Checkpoints",
    responses=error_responses(404, 422),
)
def get_checkpoints(
    run_id: RunId,
    session: SessionDep,
    principal: PrincipalDep,
    limit: Annotated[int, Query(ge=1, le=MAX_LIST_LIMIT)] = 100,
    cursor: Cursor = None,
) -> CheckpointList:
    """The checkpoints that exist (pruned ones are left out), by step, one page at a time; pass ``next_cursor``
    back as ``cursor``."""
    store.get_run(session, run_id=run_id, project=principal.scope)
    after = decode_cursor(cursor, "checkpoints", int, int) if cursor else None
    rows = store.list_checkpoints(session, run_id=run_id, after=after, limit=limit + 1)
    more, rows = len(rows) > limit, rows[:limit]
    nxt = encode_cursor("checkpoints", rows[-1].step, rows[-1].attempt) if more else None
    # only checkpoints that still exist (``checkpoint.keep`` prunes older ones); a page may hold fewer than limit
    items = [_checkpoint(c) for c in rows if store.checkpoint_exists(c.path)]
    return CheckpointList(run_id=run_id, items=items, next_cursor=nxt)


@router.get(
    "/{run_id}/logs",
    response_model=LogsPublic,
    summary="Driver and worker logs",
    responses=error_responses(404, 422, 503),
)
def get_logs(
    run_id: RunId,
    session: SessionDep,
    principal: PrincipalDep,
    runtime: RuntimeDep,
    limit: Annotated[int, Query(ge=1, le=MAX_LOG_CHARS, description="Characters per page.")] = 256 * 1024,
    cursor: Cursor = None,
    tail: Annotated[bool, Query(description="Without cursor: the last ``limit`` characters.")] = False,
) -> LogsPublic:
    """One page of the run's output from the start (or its tail); ``next_cursor`` continues after it, also to
    follow new output of a running run."""
    store.get_run(session, run_id=run_id, project=principal.scope)
    after = decode_cursor(cursor, "logs", int)[0] if cursor else None  # a bad cursor is a 422 before anything else
    if runtime is None:
        raise ApiError(
            503,
            "logs come from the Ray runtime, which this API process does not run; query the service "
            "that runs the scheduler",
            code="runtime_unavailable",
        )
    text = runtime.run_logs(run_id) or ""
    n = len(text)
    if after is not None:
        start = min(after, n)
    else:
        start = max(0, n - limit) if tail else 0
    end = min(n, start + limit)
    return LogsPublic(
        run_id=run_id,
        logs=text[start:end],
        offset=start,
        total_chars=n,
        has_more=end < n,
        next_cursor=encode_cursor("logs", end),
    )


@router.post(
    "/{run_id}/cancel", response_model=RunPublic, summary="Cancel a run", responses=error_responses(404, 409, 422, 503)
)
def cancel_run(
    run_id: RunId, req: Request, session: SessionDep, principal: PrincipalDep, runtime: RuntimeDep
) -> RunPublic:
    """QUEUED runs are cancelled at once; STARTING/RUNNING ones are stopped by the runtime; finished -> 409."""
    run = submission.cancel_run(
        session, run_id=run_id, scope=principal.scope, actor=principal.token_name, runtime=runtime
    )
    return run_public(run, request=req)


@router.post(
    "/{run_id}/resume",
    response_model=RunPublic,
    summary="Resume a failed or cancelled run",
    responses=error_responses(404, 409, 422, 503),
)
def resume_run(
    run_id: RunId,
    req: Request,
    body: ResumeRequest,
    session: SessionDep,
    principal: PrincipalDep,
    settings: SettingsDep,
    runtime: RuntimeDep,
) -> RunPublic:
    """Re-queue from the latest checkpoint, optionally with a new layout (resharded on load), batch or steps."""
    run = submission.resume_run(
        session,
        run_id=run_id,
        scope=principal.scope,
        actor=principal.token_name,
        can_run_code=principal.can_run_code,
        settings=settings,
        request=body,
        runtime=runtime,
        admin=principal.admin,
    )
    return run_public(run, request=req)

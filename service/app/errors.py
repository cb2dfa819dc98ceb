"""One error body for every failure: ``{"error": {"code": "...", "message": "...", "param": "layout.tp"}}``.

``install_error_handlers(app)`` maps every exception the API can meet onto that shape (``api.spec.ErrorBody``):

======================================  ======  =========================================================
exception                               status  code
======================================  ======  =========================================================
malformed JSON / YAML body              400     ``malformed_body``
RequestValidationError, ValidationError 422     ``invalid_value`` / ``missing_field`` / ``unknown_field``
api.spec.SpecError                      422     its code (``invalid_spec``, ``unknown_preset``, ...)
service.errors.ServiceError (any)       its     its code (NotFound 404, Conflict 409, PolicyViolation
                                                403/422, RunRefused 422, Unavailable 503, and ApiError:
                                                the routes' 401/413/429/422 on query parameters, ...)
HTTPException (404 route, 405, ...)     any     derived from the status
sqlalchemy DataError / OperationalError 422/503 ``invalid_value`` / ``database_unavailable``
anything else                           500     ``internal_error`` (logged with its traceback; never in the body)
======================================  ======  =========================================================

Every error raised on purpose is a ``ServiceError`` and goes through one handler (``service_error_response``).
``error_responses(*statuses)`` documents them in OpenAPI (use it in ``responses=`` of routers and routes).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from sqlalchemy.exc import DataError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException

from api import spec as schemas
from api.spec import ErrorBody
from api.spec.messages import describe_errors
from api.spec.validation import SpecError
from service.errors import ServiceError

log = logging.getLogger(__name__)


STATUS_CODES: dict[int, str] = {
    400: "malformed_body",
    401: "unauthenticated",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    406: "not_acceptable",
    409: "conflict",
    413: "request_too_large",
    415: "unsupported_media_type",
    422: "invalid_value",
    429: "rate_limited",
    500: "internal_error",
    503: "unavailable",
}

_DESCRIPTIONS: dict[int, str] = {
    400: "Malformed request body (not valid JSON/YAML).",
    401: "Missing or invalid `Authorization: Bearer <token>` (auth is on).",
    403: "The token is not allowed to do this (e.g. run user code).",
    404: "Not found (or belongs to another project).",
    409: "Conflict with the resource's current state.",
    413: "Request body larger than the service's limit.",
    415: "Unsupported Content-Type.",
    422: "Invalid request: `param` names the field, `message` says how to fix it.",
    429: "Rate limit exceeded; retry after `Retry-After` seconds.",
    500: "Internal error (logged by the service).",
    503: "A required backend (Ray runtime) is not available.",
}


class ApiError(ServiceError, StarletteHTTPException):
    """A transport error a route or middleware raises on purpose (status first). A ``ServiceError`` like the rest;
    also an HTTPException so that FastAPI's body parsing re-raises it (the 413 of a streamed body) instead of
    turning it into a 400."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ):
        StarletteHTTPException.__init__(self, status_code=status_code, detail=message)
        ServiceError.__init__(
            self,
            message,
            param=param,
            code=code or STATUS_CODES.get(status_code, "error"),
            status_code=status_code,
            headers=headers,
        )


class SafeJSONResponse(JSONResponse):
    """The app's JSON response: text the request brought in (a lone surrogate such as ``"\\ud800"`` echoed in a
    message or a stored label) cannot be UTF-8 encoded as is; it is then sent as ASCII JSON with ``\\uXXXX``
    escapes (valid JSON, the same value), never a 500."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def error_body(code: str, message: str, param: str | None = None) -> dict[str, Any]:
    return ErrorBody.model_validate({"error": {"code": code, "message": message, "param": param}}).model_dump()


def error_response(
    status_code: int, code: str, message: str, param: str | None = None, *, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    return SafeJSONResponse(
        error_body(code, message, param), status_code=status_code, headers=dict(headers) if headers else None
    )


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses=`` entries for these statuses, all with the ErrorBody schema."""
    return {s: {"model": ErrorBody, "description": _DESCRIPTIONS.get(s, "Error.")} for s in statuses}


# validation messages: ``api.spec.messages.describe_errors`` (the CLI's offline validate says the same)


# ---------------------------------------------------------------------------------------------- handlers
async def _request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    if errors and errors[0].get("type") == "json_invalid":
        ctx = errors[0].get("ctx") or {}
        why = f" ({ctx['error']})" if ctx.get("error") else ""
        return error_response(400, "malformed_body", f"request body is not valid JSON{why}; send a JSON object")
    code, message, param = describe_errors(errors)
    return error_response(422, code, message, param)


async def _pydantic_validation(request: Request, exc: ValidationError) -> JSONResponse:
    model = getattr(schemas, exc.title, None)
    model = model if isinstance(model, type) and issubclass(model, BaseModel) else None
    code, message, param = describe_errors(exc.errors(include_url=False), model=model)
    return error_response(422, code, message, param)


async def _spec_error(request: Request, exc: SpecError) -> JSONResponse:
    first = exc.issues[0]
    message = first.message
    if len(exc.issues) > 1:
        message += "; also: " + "; ".join(f"{i.param}: {i.message}" for i in exc.issues[1:4])
    return error_response(422, first.code, message, first.param)


def service_error_response(exc: ServiceError) -> JSONResponse:
    """The one mapping of a ServiceError onto HTTP: its status, headers and error body."""
    return error_response(exc.status_code, exc.code, exc.message, exc.param, headers=exc.headers)


async def _service_error(request: Request, exc: ServiceError) -> JSONResponse:
    return service_error_response(exc)


async def _http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = STATUS_CODES.get(exc.status_code, "error")
    detail = exc.detail if isinstance(exc.detail, str) else "request failed"
    if exc.status_code == 404 and detail == "Not Found":
        detail = f"no such endpoint {request.method} {request.url.path}; see /docs for the API"
    headers = dict(exc.headers or {})
    if exc.status_code == 405:
        allowed = _allowed_methods(request)
        if allowed:
            headers["Allow"] = ", ".join(allowed)
        detail = (
            f"method {request.method} is not allowed on {request.url.path}"
            + (f"; use {', '.join(allowed)}" if allowed else "")
            + "; see /docs for the API"
        )
    return error_response(exc.status_code, code, detail, headers=headers or None)


def _allowed_methods(request: Request) -> list[str]:
    """Every documented method on this path (Starlette's own Allow names only the first matching route's)."""
    import re

    try:
        paths = request.app.openapi().get("paths", {})
    except Exception:
        return []
    path = request.url.path
    methods: set[str] = set()
    for template, item in paths.items():
        pattern = "^" + re.sub(r"\\\{[^/]+?\\\}", "[^/]+", re.escape(template)) + "$"
        if re.match(pattern, path):
            methods |= {
                m.upper()
                for m in item
                if m.lower() in ("get", "put", "post", "delete", "patch", "head", "options", "trace")
            }
    return sorted(methods)


async def _data_error(request: Request, exc: DataError) -> JSONResponse:
    # The database refused a value the validators let through (e.g. a NUL byte): the client's fault, say so.
    log.warning("database rejected a value on %s %s: %s", request.method, request.url.path, exc.orig)
    return error_response(
        422,
        "invalid_value",
        "a value in the request cannot be stored (control characters or out-of-range numbers); remove it",
    )


async def _operational_error(request: Request, exc: OperationalError) -> JSONResponse:
    log.error("database unavailable on %s %s: %s", request.method, request.url.path, exc.orig)
    return error_response(
        503,
        "database_unavailable",
        "the run database is unavailable or busy; retry shortly",
        headers={"Retry-After": "1"},
    )


async def _pool_timeout(request: Request, exc: PoolTimeout) -> JSONResponse:
    log.warning("no database connection free on %s %s: %s", request.method, request.url.path, exc)
    return error_response(
        503,
        "database_busy",
        "every database connection is in use; retry shortly",
        headers={"Retry-After": "1"},
    )


async def _unhandled(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(
        500, "internal_error", "internal error; the service logged the details. Retry, and report it if it persists"
    )


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _request_validation)  # type: ignore[arg-type]
    app.add_exception_handler(ValidationError, _pydantic_validation)  # type: ignore[arg-type]
    app.add_exception_handler(SpecError, _spec_error)  # type: ignore[arg-type]
    # every ServiceError, ApiError included (its MRO names ServiceError before HTTPException)
    app.add_exception_handler(ServiceError, _service_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_exception)  # type: ignore[arg-type]
    app.add_exception_handler(DataError, _data_error)  # type: ignore[arg-type]
    app.add_exception_handler(OperationalError, _operational_error)  # type: ignore[arg-type]
    app.add_exception_handler(PoolTimeout, _pool_timeout)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _unhandled)

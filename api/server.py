"""The meshrun service process: ``create_app(settings)`` (FastAPI, OpenAPI at /docs) and ``serve(settings)``.

Start-up (lifespan): engine + sessionmaker on ``app.state``, database migrated to the newest revision, then — when
``settings.start_scheduler`` — the Ray runtime (``service.runtime.Runtime``) started and stopped with the app.
Routers: runs, plus the optional ones in ``OPTIONAL_ROUTERS`` that exist; all but /healthz (and the docs) are
behind authentication when auth is on.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import APIRouter, FastAPI
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.deps import auth_dependencies
from api.errors import ApiError, error_response, error_responses, install_error_handlers
from api.routes import runs
from service import migrate
from service.db import make_engine, make_sessionmaker, redact_url
from service.ratelimit import RateLimiter
from service.settings import Settings, get_settings

log = logging.getLogger(__name__)

try:
    VERSION = version("meshrun")
except PackageNotFoundError:  # running from a checkout
    VERSION = "0.1.0"

# (module, attribute) of routers written by other workstreams; mounted when importable.
OPTIONAL_ROUTERS: list[tuple[str, str]] = [
    ("api.routes.plans", "router"),
    ("api.routes.sweeps", "router"),
    ("api.routes.cluster", "router"),
]

COMMON_ERRORS = (400, 401, 413, 429, 500, 503)


# ----------------------------------------------------------------------------------------- body limit
class BodySizeLimitMiddleware:
    """413 for bodies over ``max_bytes``: at once from Content-Length, or while streaming (chunked bodies)."""

    def __init__(self, app: ASGIApp, *, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> ApiError:
        return ApiError(413, f"request body exceeds the limit of {self.max_bytes} bytes; send a smaller body",
                        code="request_too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    n = int(value)
                except ValueError:
                    await error_response(400, "malformed_body", "invalid Content-Length header")(scope, receive, send)
                    return
                if n > self.max_bytes:
                    e = self._too_large()
                    await error_response(413, e.code, e.message)(scope, receive, send)
                    return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self._too_large()
            return message

        await self.app(scope, limited_receive, send)


# ------------------------------------------------------------------------------------------------ app
def _optional_router(module: str, attr: str) -> APIRouter | None:
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name == module:
            return None
        log.exception("router %s failed to import; its endpoints are not served", module)
        return None
    except Exception:  # noqa: BLE001 - one broken optional router must not take the API down
        log.exception("router %s failed to import; its endpoints are not served", module)
        return None
    return getattr(mod, attr, None)


def _include(app: FastAPI, router: APIRouter, settings: Settings) -> None:
    """Mount under /v1 unless the router already carries it; behind auth; with the common error responses."""
    paths = [getattr(r, "path", "") for r in router.routes]
    has_v1 = router.prefix.startswith("/v1") or (paths and all(p.startswith("/v1") for p in paths))
    app.include_router(router, prefix="" if has_v1 else "/v1", dependencies=auth_dependencies(settings),
                       responses=error_responses(*COMMON_ERRORS))


def _start_runtime(settings: Settings, session_factory: Any) -> Any | None:
    if not settings.start_scheduler:
        return None
    try:
        from service.runtime import Runtime
    except ModuleNotFoundError as e:
        if e.name != "service.runtime":
            raise
        log.warning("service.runtime is not available: runs stay QUEUED (no scheduler in this process)")
        return None
    runtime = Runtime(settings, session_factory)
    runtime.start()
    return runtime


def create_app(settings: Settings | None = None) -> FastAPI:
    """The meshrun API. Nothing touches the database or Ray until the app starts (lifespan)."""
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = make_engine(settings.database_url)
        await run_in_threadpool(migrate.upgrade, settings.database_url)
        app.state.engine = engine
        app.state.session_factory = make_sessionmaker(engine)
        app.state.runtime = await run_in_threadpool(_start_runtime, settings, app.state.session_factory)
        _log_startup(settings, app.state.runtime)
        try:
            yield
        finally:
            runtime, app.state.runtime = app.state.runtime, None
            if runtime is not None:
                await run_in_threadpool(runtime.stop)
            engine.dispose()

    app = FastAPI(
        title="meshrun", version=VERSION, lifespan=lifespan, docs_url="/docs", openapi_url="/openapi.json",
        separate_input_output_schemas=False,
        description="Plan, run and sweep distributed training runs on Ray. Errors always have the body "
                    '`{"error": {"code", "message", "param"}}`.')
    app.state.settings = settings
    app.state.runtime = None
    app.state.rate_limiter = RateLimiter(settings.rate_limit_per_minute)
    install_error_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_request_bytes)  # type: ignore[arg-type]

    app.include_router(runs.health_router)
    _include(app, runs.router, settings)
    for module, attr in OPTIONAL_ROUTERS:
        router = _optional_router(module, attr)
        if router is not None:
            _include(app, router, settings)

    try:
        from service.observability import instrument_app
    except ModuleNotFoundError:
        pass
    else:
        instrument_app(app, settings)
    _use_error_body_in_openapi(app)
    return app


def _use_error_body_in_openapi(app: FastAPI) -> None:
    """FastAPI documents 422 as its own HTTPValidationError; meshrun answers with ErrorBody everywhere."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if getattr(app.state, "openapi_patched", False):
            return app.openapi_schema  # type: ignore[return-value]
        schema = generate()
        ref = {"$ref": "#/components/schemas/ErrorBody"}
        for item in schema.get("paths", {}).values():
            for op in item.values():
                if not isinstance(op, dict) or "responses" not in op:
                    continue
                resp = op["responses"].get("422")
                if resp and "HTTPValidationError" in str(resp):
                    op["responses"]["422"] = {"description": "Invalid request: `param` names the field, `message` "
                                                             "says how to fix it.",
                                              "content": {"application/json": {"schema": ref}}}
        comps = schema.get("components", {}).get("schemas", {})
        if "ErrorBody" in comps and "HTTPValidationError" not in str(schema.get("paths")):
            comps.pop("HTTPValidationError", None)
            comps.pop("ValidationError", None)
        app.openapi_schema = schema
        app.state.openapi_patched = True
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _log_startup(settings: Settings, runtime: Any | None) -> None:
    if settings.auth_enabled:
        auth = "auth ON: every endpoint but /healthz needs 'Authorization: Bearer <token>' (meshrun token create)"
    elif settings.listens_on_loopback:
        auth = ("auth OFF: embedded single-user default on loopback (set MESHRUN_AUTH=on, or listen beyond "
                "loopback, to require tokens)")
    else:
        auth = f"auth OFF on {settings.host} (MESHRUN_AUTH=off): anyone who can reach this port can launch runs"
    sched = "scheduler running" if runtime is not None else "no scheduler in this process (runs stay QUEUED)"
    log.info("meshrun %s: database %s; %s; %s", VERSION, redact_url(settings.database_url or ""), auth, sched)
    if not settings.auth_enabled and not settings.listens_on_loopback:
        log.warning("authentication is OFF while listening on %s", settings.host)


def serve(settings: Settings | None = None) -> None:
    """Run the service with uvicorn on settings.host:settings.port (blocks until stopped)."""
    import uvicorn

    settings = settings or get_settings()
    log_config: Any = None
    try:
        from service.observability import configure_logging
    except ModuleNotFoundError:
        logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    else:
        configure_logging(settings)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_config=log_config,
                log_level=settings.log_level.lower(), proxy_headers=False, server_header=False)

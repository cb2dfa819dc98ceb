"""The meshrun service process: ``create_app(settings)`` (FastAPI, OpenAPI at /docs) and ``serve(settings)``.

Start-up (lifespan): engine + sessionmaker on ``app.state``, database migrated to the newest revision, then — when
``settings.start_scheduler`` — the Ray runtime (``service.control.runtime.Runtime``) started and stopped with the app.
Routers: runs, plans, sweeps, cluster (all behind authentication when auth is on) and /healthz (open); Prometheus
``/metrics`` (``service.app.observability``). The web console (``service.app.console``) is served at ``/`` with the
offline API docs at ``/docs`` and ``/redoc``.
"""

from __future__ import annotations

import logging
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.app.console import install_console
from service.app.console.web import HERE as CONSOLE_DIR
from service.app.deps import auth_dependencies
from service.app.errors import ApiError, SafeJSONResponse, error_response, error_responses, install_error_handlers
from service.app.middleware import (
    HostAllowListMiddleware,
    SameOriginMiddleware,
    SecurityHeadersMiddleware,
    content_security_policy,
    template_script_hashes,
)
from service.app.observability import configure_logging, instrument_app
from service.app.overload import OverloadGate
from service.app.ratelimit import RateLimiter
from service.app.ray_origin import RayOriginMiddleware
from service.app.routes import cluster, export, goodput, health, observe, plans, runs, sweeps, validate, webhooks
from service.control import service_record
from service.control.runtime import Runtime
from service.control.webhooks import WebhookDispatcher
from service.errors import ServiceError
from service.meta import VERSION
from service.security.hosts import HostPolicy
from service.security.paths import storage_problem
from service.settings import Settings, get_settings
from service.store import migrate
from service.store.db import make_engine, make_sessionmaker, redact_url

log = logging.getLogger(__name__)


PROTECTED_ROUTERS: tuple[APIRouter, ...] = (
    validate.router,  # POST /v1/runs/validate
    runs.router,
    goodput.router,
    observe.router,
    export.router,  # POST /v1/runs/{id}/export
    plans.router,
    sweeps.router,
    cluster.router,
    webhooks.router,
)
COMMON_ERRORS = (400, 401, 413, 429, 500, 503)
TEMPLATES = CONSOLE_DIR / "templates"


# ----------------------------------------------------------------------------------------- body limit
class BodySizeLimitMiddleware:
    """413 for bodies over ``max_bytes``: at once from Content-Length, or while streaming (chunked bodies)."""

    def __init__(self, app: ASGIApp, *, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> ApiError:
        return ApiError(
            413,
            f"request body exceeds the limit of {self.max_bytes} bytes; send a smaller body",
            code="request_too_large",
        )

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
def _include(app: FastAPI, router: APIRouter, settings: Settings) -> None:
    """Mount a router (its routes carry their full /v1 paths) behind auth, with the common error responses."""
    app.include_router(router, dependencies=auth_dependencies(settings), responses=error_responses(*COMMON_ERRORS))


def _start_runtime(settings: Settings, session_factory: sessionmaker[Session]) -> Runtime | None:
    if not settings.start_scheduler:
        return None
    runtime = Runtime(settings, session_factory)
    runtime.start()
    return runtime


def _start_webhooks(settings: Settings, session_factory: sessionmaker[Session]) -> WebhookDispatcher | None:
    """Webhook delivery runs in every service process, with or without the Ray runtime (docs/webhooks.md)."""
    if not settings.webhooks:
        return None
    dispatcher = WebhookDispatcher(settings, session_factory)
    dispatcher.start()
    return dispatcher


def create_app(settings: Settings | None = None) -> FastAPI:
    """The meshrun API. Nothing touches the database or Ray until the app starts (lifespan)."""
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        url = settings.database_url or ""  # Settings fills it in (sqlite under data_dir) when unset
        engine = make_engine(
            url,
            pool_size=settings.db_pool_size,
            max_overflow=settings.db_max_overflow,
            pool_timeout_s=settings.db_pool_timeout_s,
        )
        await run_in_threadpool(migrate.upgrade, url)
        app.state.engine = engine
        app.state.session_factory = make_sessionmaker(engine)
        app.state.runtime = await run_in_threadpool(_start_runtime, settings, app.state.session_factory)
        app.state.webhooks = _start_webhooks(settings, app.state.session_factory)
        _log_startup(settings, app.state.runtime)
        if app.state.record_service:  # ``serve``: doctor and demo find this service by its data directory
            service_record.write(
                settings.data_dir,
                url=console_url(settings),
                host=settings.host,
                port=settings.port,
                runtime=app.state.runtime,
            )
        try:
            yield
        finally:
            if app.state.record_service:
                service_record.clear(settings.data_dir)
            dispatcher, app.state.webhooks = app.state.webhooks, None
            if dispatcher is not None:
                await run_in_threadpool(dispatcher.stop)
            runtime, app.state.runtime = app.state.runtime, None
            if runtime is not None:
                await run_in_threadpool(runtime.stop)
            engine.dispose()

    app = FastAPI(
        title="meshrun",
        version=VERSION,
        lifespan=lifespan,
        default_response_class=SafeJSONResponse,
        docs_url=None,  # served offline by the console (vendored Swagger UI and ReDoc)
        redoc_url=None,
        openapi_url="/openapi.json",
        separate_input_output_schemas=False,
        description="Plan, run and sweep distributed training runs on Ray. Errors always have the body "
        '`{"error": {"code", "message", "param"}}`.',
    )
    app.state.settings = settings
    app.state.runtime = None
    app.state.webhooks = None
    app.state.record_service = False
    app.state.rate_limiter = RateLimiter(settings.rate_limit_per_minute)
    install_error_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_request_bytes)
    app.add_middleware(
        OverloadGate,
        slots=settings.max_concurrent_requests,
        queue_timeout_s=settings.request_queue_timeout_s,
        write_slots=settings.max_concurrent_writes,
        read_priority_s=settings.read_priority_ms / 1000,
    )
    app.include_router(health.router)
    for router in PROTECTED_ROUTERS:
        _include(app, router, settings)
    install_console(app)
    instrument_app(app, settings)
    # outermost (added last): every request is checked, and every response carries the headers
    policy = app.state.host_policy = HostPolicy(settings)
    app.add_middleware(SameOriginMiddleware, policy=policy)
    app.add_middleware(RayOriginMiddleware, ray_port=settings.ray_proxy_listen_port, service_port=settings.port)
    app.add_middleware(HostAllowListMiddleware, policy=policy)
    app.add_middleware(SecurityHeadersMiddleware, csp=content_security_policy(template_script_hashes(TEMPLATES)))
    _use_error_body_in_openapi(app)
    return app


def _use_error_body_in_openapi(app: FastAPI) -> None:
    """FastAPI documents 422 as its own HTTPValidationError; meshrun answers with ErrorBody everywhere."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = generate()
        ref = {"$ref": "#/components/schemas/ErrorBody"}
        for item in schema.get("paths", {}).values():
            for op in item.values():
                if not isinstance(op, dict) or "responses" not in op:
                    continue
                resp = op["responses"].get("422")
                if resp and "HTTPValidationError" in str(resp):
                    op["responses"]["422"] = {
                        "description": "Invalid request: `param` names the field, `message` says how to fix it.",
                        "content": {"application/json": {"schema": ref}},
                    }
        comps = schema.get("components", {}).get("schemas", {})
        if "ErrorBody" in comps and "HTTPValidationError" not in str(schema.get("paths")):
            comps.pop("HTTPValidationError", None)
            comps.pop("ValidationError", None)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _log_startup(settings: Settings, runtime: Runtime | None) -> None:
    unwritable = storage_problem(str(settings.checkpoint_root))
    if unwritable:
        log.warning(
            "checkpoint storage (MESHRUN_CHECKPOINT_ROOT) is not usable: %s; runs without their own "
            "checkpoint.storage are refused until it is fixed (/healthz reports it)",
            unwritable,
        )
    if settings.auth_enabled:
        auth = "auth ON: every endpoint but /healthz needs 'Authorization: Bearer <token>' (meshrun token create)"
    elif settings.listens_on_loopback:
        auth = (
            "auth OFF: embedded single-user default on loopback (set MESHRUN_AUTH=on, or listen beyond "
            "loopback, to require tokens)"
        )
    else:
        auth = f"auth OFF on {settings.host} (MESHRUN_AUTH=off): anyone who can reach this port can launch runs"
    sched = "scheduler running" if runtime is not None else "no scheduler in this process (runs stay QUEUED)"
    log.info(
        "meshrun %s: database %s; %s; %s; web console at %s/",
        VERSION,
        redact_url(settings.database_url),
        auth,
        sched,
        console_url(settings),
    )
    if not settings.auth_enabled and not settings.listens_on_loopback:
        log.warning("authentication is OFF while listening on %s", settings.host)


def console_url(settings: Settings, port: int | None = None) -> str:
    """Where a browser on this machine reaches the console (or, with ``port``, another listener of the service)."""
    host = settings.host
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    elif ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port or settings.port}"


def serve(settings: Settings | None = None) -> None:
    """Run the service with uvicorn on settings.host:settings.port (blocks until stopped)."""
    import uvicorn

    settings = settings or get_settings()
    configure_logging(settings)
    # A thread that computes (a plan search, a big validation) holds the GIL for up to the switch interval before
    # a request thread waiting on it may run; 5 ms (CPython's default) per hand-over adds up to tens of ms on a
    # read that waits for the GIL several times. 1 ms keeps reads quick under CPU-bound requests
    # (bench/bench_heavy_requests.py) for a little more switching overhead.
    sys.setswitchinterval(0.001)
    sockets = listen_sockets(settings)  # first: the dashboard's port may be picked here, and the app uses it
    app = create_app(settings)
    app.state.record_service = True
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        log_level=settings.log_level.lower(),
        proxy_headers=False,
        server_header=False,
        # a keep-alive connection idle for uvicorn's default 5 s is closed by the server, racing a client that
        # reuses it at that moment (a reset, "dropped" under load); idle connections stay longer than a request
        # may queue (request_queue_timeout_s), so a waiting client never sees its connection closed
        timeout_keep_alive=int(settings.request_queue_timeout_s) + 45,
    )
    if settings.ray_proxy_listen_port is not None:
        log.info("the Ray dashboard: %s/ray/", console_url(settings, settings.ray_proxy_listen_port))
    uvicorn.Server(config).run(sockets=sockets)


def listen_sockets(settings: Settings) -> list[socket.socket]:
    """The service's socket and, unless it shares the console's origin, the Ray dashboard proxy's
    (``service.app.ray_origin``); one app serves both, so call this before ``create_app``. When the proxy's port
    was not set and the service's port + 1 is taken, the system picks a free one and ``settings.ray_proxy_port``
    records it (links and the origin check use it). A taken port that was asked for is a ServiceError naming
    the setting."""
    out = [_bind(settings.host, settings.port, "MESHRUN_PORT")]
    ray_port = settings.ray_proxy_listen_port
    if ray_port is not None:
        try:
            out.append(_bind(settings.host, ray_port, "MESHRUN_RAY_PROXY_PORT"))
        except ServiceError:
            if settings.ray_proxy_port is not None:
                out[0].close()
                raise
            out.append(_bind(settings.host, 0, "MESHRUN_RAY_PROXY_PORT"))
        settings.ray_proxy_port = out[-1].getsockname()[1]
    return out


def _bind(host: str, port: int, name: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        hint = " (or 0 to serve the Ray dashboard on the service's own port)" if name != "MESHRUN_PORT" else ""
        raise ServiceError(f"cannot listen on {host}:{port} ({name}): {e}; set another port{hint}") from e
    sock.set_inheritable(True)
    return sock

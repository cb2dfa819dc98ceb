"""Service observability: Prometheus ``/metrics`` and structured (JSON) logs with run ids.

``instrument_app(app, settings)`` (called by ``service.app.server.create_app``) adds:
- a pure-ASGI middleware counting requests and timing them by route *template* (``/v1/runs/{run_id}``, never
  the raw path), method and status, and counting errors (5xx and unhandled exceptions);
- ``GET /metrics`` (Prometheus text format). With auth off (the loopback embedded default) it is open; with auth
  on (``settings.auth_enabled``) it needs ``Authorization: Bearer <token>`` with either an *admin* API token or
  the dedicated scrape token ``MESHRUN_METRICS_TOKEN`` (401/403 with the standard error body otherwise: the
  metrics name runs of every project);
- a scrape-time collector that reads the run database through ``app.state.session_factory``: runs by status,
  queue length (QUEUED runs), database reachability and ping latency, and the latest training metrics of
  active and recently finished runs (loss, tokens/s, MFU, step time, peak memory, step) labelled by run;
- SQLAlchemy cursor-event timings of every statement of the service's engine (histogram by operation).

Each app gets its own ``CollectorRegistry`` (``app.state.metrics_registry``), so tests may build many apps.

``configure_logging(settings)`` installs one root handler: JSON lines when ``MESHRUN_LOG_JSON=true`` (ts,
level, logger, message, run_id, exception, any extra fields), a readable line otherwise. Run ids come from
``logging`` extras (``logger.info("...", extra={"run_id": rid})``) or from the ``run_context(run_id)``
context manager (a contextvar, so it follows asyncio tasks and ``contextvars.copy_context`` threads).
"""

from __future__ import annotations

import contextlib
import contextvars
import hmac
import json
import logging
import sys
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any, TextIO

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.spec.metrics import GAUGES as METRIC_GAUGES
from api.spec.metrics import METRIC_ROW_FIELDS
from service.settings import Settings

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------- metric names
HTTP_REQUESTS = "meshrun_http_requests_total"
HTTP_LATENCY = "meshrun_http_request_duration_seconds"
HTTP_ERRORS = "meshrun_http_errors_total"
HTTP_IN_FLIGHT = "meshrun_http_requests_in_flight"
DB_QUERY_LATENCY = "meshrun_db_query_duration_seconds"
DB_UP = "meshrun_db_up"
DB_PING_LATENCY = "meshrun_db_ping_seconds"
RUNS = "meshrun_runs"
QUEUE_LENGTH = "meshrun_queue_length"
RUN_METRIC_PREFIX = "meshrun_run_"
# metrics-table column -> (gauge, help): every field of the metric row with a gauge name (api.spec.metrics)
RUN_METRICS: dict[str, tuple[str, str]] = {
    field: (RUN_METRIC_PREFIX + gauge, f"{METRIC_ROW_FIELDS[field].description} Latest recorded value of the run.")
    for field, gauge in METRIC_GAUGES.items()
}
RUN_INFO = "meshrun_run_info"

METRIC_NAMES: frozenset[str] = frozenset(
    {
        HTTP_REQUESTS,
        HTTP_LATENCY,
        HTTP_ERRORS,
        HTTP_IN_FLIGHT,
        DB_QUERY_LATENCY,
        DB_UP,
        DB_PING_LATENCY,
        RUNS,
        QUEUE_LENGTH,
        RUN_INFO,
        *(name for name, _ in RUN_METRICS.values()),
    }
)

RUN_STATUSES = ("QUEUED", "STARTING", "RUNNING", "PREEMPTED", "SUCCEEDED", "FAILED", "CANCELLED")
ACTIVE_STATUSES = ("STARTING", "RUNNING")
RECENT_RUN_WINDOW_S = 15 * 60  # finished runs keep their per-run series this long
MAX_RUN_SERIES = 100
UNMATCHED_ROUTE = "<unmatched>"
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
DB_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)


class _HttpMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            HTTP_REQUESTS.removesuffix("_total"),
            "HTTP requests by route template, method and status.",
            ["method", "route", "status"],
            registry=registry,
        )
        self.latency = Histogram(
            HTTP_LATENCY,
            "HTTP request latency by route template and method.",
            ["method", "route"],
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.errors = Counter(
            HTTP_ERRORS.removesuffix("_total"),
            "HTTP requests answered 5xx or raising an unhandled exception.",
            ["method", "route", "status"],
            registry=registry,
        )
        self.in_flight = Gauge(HTTP_IN_FLIGHT, "HTTP requests being served.", registry=registry)


def _route_template(scope: Scope) -> str:
    route = scope.get("route")
    path = getattr(route, "path_format", None) or getattr(route, "path", None)
    return path if path else UNMATCHED_ROUTE


class PrometheusMiddleware:
    """Pure ASGI middleware (no BaseHTTPMiddleware: streaming responses and background tasks stay intact)."""

    def __init__(self, app: ASGIApp, *, metrics: _HttpMetrics, on_request: Callable[[], object] | None = None) -> None:
        self.app = app
        self.metrics = metrics
        self.on_request = on_request

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.on_request is not None:
            self.on_request()
        status = 500
        start = time.perf_counter()

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        m = self.metrics
        m.in_flight.inc()
        raised = False
        try:
            await self.app(scope, receive, send_wrapper)
        except BaseException:
            raised = True
            status = 500
            raise
        finally:
            m.in_flight.dec()
            route = _route_template(scope)
            if route != "/metrics":  # the scrapes themselves are not counted
                method = scope.get("method", "GET")
                m.requests.labels(method, route, str(status)).inc()
                m.latency.labels(method, route).observe(time.perf_counter() - start)
                if raised or status >= 500:
                    m.errors.labels(method, route, str(status)).inc()


# ------------------------------------------------------------------------------------- database instruments
class _DbTimer:
    """SQLAlchemy cursor events -> histogram of statement latency by operation (SELECT, INSERT, ...)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.histogram = Histogram(
            DB_QUERY_LATENCY,
            "Latency of the service's SQL statements.",
            ["operation"],
            buckets=DB_BUCKETS_S,
            registry=registry,
        )
        self._engines: weakref.WeakSet[Any] = weakref.WeakSet()

    def attach(self, engine: Engine | None) -> None:
        if engine is None or engine in self._engines:
            return
        from sqlalchemy import event

        event.listen(engine, "before_cursor_execute", self._before)
        event.listen(engine, "after_cursor_execute", self._after)
        self._engines.add(engine)

    @staticmethod
    def _before(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool) -> None:
        conn.info.setdefault("meshrun_query_start", []).append(time.perf_counter())

    def _after(self, conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool) -> None:
        starts = conn.info.get("meshrun_query_start")
        if not starts:
            return
        elapsed = time.perf_counter() - starts.pop()
        op = statement.lstrip().split(None, 1)[0].upper() if statement.strip() else "OTHER"
        if op not in ("SELECT", "INSERT", "UPDATE", "DELETE", "WITH"):
            op = "OTHER"
        self.histogram.labels(op).observe(elapsed)


def _engine_of(session_factory: sessionmaker[Session]) -> Engine | None:
    bind = session_factory.kw.get("bind")
    return bind if isinstance(bind, Engine) else None


class RunsCollector(Collector):
    """Reads the run database at scrape time. Never raises: a failing database gives ``meshrun_db_up 0``."""

    def __init__(self, get_session_factory: Callable[[], sessionmaker[Session] | None]) -> None:
        self._get_session_factory = get_session_factory

    def describe(self) -> list[Any]:
        return []  # dynamic: do not run a query at registration time

    def collect(self) -> Iterator[Any]:
        factory = self._get_session_factory()
        up = GaugeMetricFamily(DB_UP, "1 if the run database answered the last scrape's queries.")
        ping = GaugeMetricFamily(DB_PING_LATENCY, "Round-trip time of SELECT 1 at the last scrape (seconds).")
        if factory is None:
            up.add_metric([], 0.0)
            yield up
            return
        try:
            by_status, ping_s, latest = self._query(factory)
        except Exception as exc:
            logger.warning("metrics scrape could not read the run database: %s", exc)
            up.add_metric([], 0.0)
            yield up
            return
        up.add_metric([], 1.0)
        ping.add_metric([], ping_s)
        yield up
        yield ping

        runs = GaugeMetricFamily(RUNS, "Runs by status (all projects).", labels=["status"])
        for status in sorted(set(RUN_STATUSES) | set(by_status)):
            runs.add_metric([status], float(by_status.get(status, 0)))
        yield runs
        queue = GaugeMetricFamily(QUEUE_LENGTH, "Runs waiting for admission (status QUEUED).")
        queue.add_metric([], float(by_status.get("QUEUED", 0)))
        yield queue

        labels = ["run_id", "run_name", "project", "status"]
        info = GaugeMetricFamily(
            RUN_INFO, "1 per active or recently finished run (labels carry the run).", labels=labels
        )
        families = {col: GaugeMetricFamily(name, help_, labels=labels) for col, (name, help_) in RUN_METRICS.items()}
        for run in latest:
            values = [run["id"], run["name"], run["project"], run["status"]]
            info.add_metric(values, 1.0)
            for col, fam in families.items():
                v = run.get(col)
                if v is not None:
                    fam.add_metric(values, float(v))
        yield info
        yield from families.values()

    @staticmethod
    def _query(factory: sessionmaker[Session]) -> tuple[dict[str, int], float, list[dict[str, Any]]]:
        from sqlalchemy import func, or_, select, text

        from service.store.models import Metric, Run

        session = factory()
        try:
            t0 = time.perf_counter()
            session.execute(text("SELECT 1")).scalar()
            ping_s = time.perf_counter() - t0
            by_status = {s: int(n) for s, n in session.execute(select(Run.status, func.count()).group_by(Run.status))}

            cutoff = datetime.now(UTC) - timedelta(seconds=RECENT_RUN_WINDOW_S)
            runs = session.execute(
                select(Run.id, Run.name, Run.project, Run.status)
                .where(or_(Run.status.in_(ACTIVE_STATUSES), Run.finished_at >= cutoff))
                .order_by(Run.created_at.desc())
                .limit(MAX_RUN_SERIES)
            ).all()
            latest: list[dict[str, Any]] = []
            if runs:
                ids = [r.id for r in runs]
                rn = (
                    func.row_number()
                    .over(partition_by=Metric.run_id, order_by=(Metric.attempt.desc(), Metric.step.desc()))
                    .label("rn")
                )
                cols = [getattr(Metric, c) for c in RUN_METRICS]
                sub = select(Metric.run_id, *cols, rn).where(Metric.run_id.in_(ids)).subquery()
                rows = {r.run_id: r for r in session.execute(select(sub).where(sub.c.rn == 1))}
                for r in runs:
                    entry: dict[str, Any] = {"id": r.id, "name": r.name, "project": r.project, "status": r.status}
                    m = rows.get(r.id)
                    if m is not None:
                        entry.update({c: getattr(m, c) for c in RUN_METRICS})
                    latest.append(entry)
            return by_status, ping_s, latest
        finally:
            session.rollback()
            session.close()


# ------------------------------------------------------------------------------------------- app wiring
def _refuse_scrape(request: Request, settings: Settings | None) -> Response | None:
    """None when this request may read /metrics, else the error response (standard error body).

    Auth off: open. Auth on: the bearer token must equal ``settings.metrics_token`` (MESHRUN_METRICS_TOKEN) or be
    a live admin API token (verified like every API request, see ``service.app.deps.principal_from_secret``)."""
    if settings is None or not settings.auth_enabled:
        return None
    from service.app.errors import ApiError, error_response, service_error_response

    scheme, _, secret = request.headers.get("authorization", "").partition(" ")
    secret = secret.strip() if scheme.lower() == "bearer" else ""
    if not secret:
        return error_response(
            401,
            "unauthenticated",
            "authentication required: send 'Authorization: Bearer "
            "<token>' with the scrape token MESHRUN_METRICS_TOKEN or an admin API token",
            headers={"WWW-Authenticate": "Bearer"},
        )
    metrics_token = settings.metrics_token
    if metrics_token and hmac.compare_digest(secret.encode(), metrics_token.encode()):
        return None
    if getattr(request.app.state, "session_factory", None) is None:
        return error_response(
            401, "unauthenticated", "invalid token for /metrics", headers={"WWW-Authenticate": "Bearer"}
        )
    from service.app.deps import principal_from_secret

    try:
        principal = principal_from_secret(request, secret)
    except ApiError as exc:
        return service_error_response(exc)
    if not principal.admin:
        return error_response(
            403,
            "forbidden",
            "/metrics needs an admin token or the scrape token MESHRUN_METRICS_TOKEN: it exposes runs of every project",
        )
    return None


def instrument_app(app: Starlette, settings: Settings | None = None) -> CollectorRegistry:
    """Add request metrics, DB metrics and ``GET /metrics`` to a FastAPI/Starlette app (before it starts).

    The run-database collector looks up ``app.state.session_factory`` at scrape time, so the lifespan may
    set it after this call. Returns the app's registry (also ``app.state.metrics_registry``).
    """
    existing = getattr(app.state, "metrics_registry", None)
    if existing is not None:
        return existing
    registry = CollectorRegistry(auto_describe=False)

    def session_factory() -> sessionmaker[Session] | None:
        factory = getattr(app.state, "session_factory", None)
        if factory is not None:
            try:
                db_timer.attach(_engine_of(factory))
            except Exception as exc:
                logger.debug("could not attach SQL timing events: %s", exc)
        return factory

    # The DB collector first: a scrape's own queries then show in the same scrape's timing histogram.
    registry.register(RunsCollector(session_factory))
    http = _HttpMetrics(registry)
    db_timer = _DbTimer(registry)
    app.add_middleware(PrometheusMiddleware, metrics=http, on_request=session_factory)

    def metrics_endpoint(request: Request) -> Response:
        refused = _refuse_scrape(
            request, settings if settings is not None else getattr(request.app.state, "settings", None)
        )
        if refused is not None:
            return refused
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    app.add_route("/metrics", metrics_endpoint, methods=["GET"], include_in_schema=False)
    app.state.metrics_registry = registry
    return registry


# ------------------------------------------------------------------------------------------------- logging
run_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("meshrun_run_id", default=None)


@contextlib.contextmanager
def run_context(run_id: str | None) -> Iterator[None]:
    """Tag every log record emitted inside the block (this task/thread context) with ``run_id``."""
    token = run_id_var.set(run_id)
    try:
        yield
    finally:
        run_id_var.reset(token)


class RunIdFilter(logging.Filter):
    """Sets ``record.run_id`` from the extras or the ``run_context`` contextvar (None if neither)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "run_id", None) is None:
            record.run_id = run_id_var.get()
        return True


_STD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "run_id",
    "taskName",
    "run",
    "color_message",
}  # color_message: uvicorn's ANSI copy


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, message, run_id (if any), exception, extra fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        run_id = getattr(record, "run_id", None)
        if run_id is not None:
            out["run_id"] = run_id
        for key, value in vars(record).items():
            if key not in _STD_ATTRS and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exception"] = "".join(traceback.format_exception(*record.exc_info)).rstrip()
        elif record.exc_text:
            out["exception"] = record.exc_text
        if record.stack_info:
            out["stack"] = record.stack_info
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s%(run)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        run_id = getattr(record, "run_id", None)
        record.run = f" [run {run_id}]" if run_id else ""
        return super().format(record)


_HANDLER_NAME = "meshrun"


def configure_logging(settings: Settings | None = None, *, stream: TextIO | None = None) -> logging.Handler:
    """Install the meshrun root handler (idempotent: replaces the one a previous call installed).

    Uses ``settings.log_json`` and ``settings.log_level``; uvicorn's loggers are routed through the same
    handler so access logs are JSON too.
    """
    log_json = settings.log_json if settings is not None else False
    level_name = (settings.log_level if settings is not None else "INFO").upper()
    level = logging.getLevelName(level_name)
    if not isinstance(level, int):
        raise ValueError(
            f"MESHRUN_LOG_LEVEL={level_name!r} is not a logging level; use DEBUG, INFO, WARNING, ERROR or CRITICAL"
        )
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(JsonFormatter() if log_json else TextFormatter())
    handler.addFilter(RunIdFilter())
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == _HANDLER_NAME]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        lg.handlers.clear()
        lg.propagate = True
    return handler

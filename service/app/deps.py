"""FastAPI dependencies: the database session, the settings, the caller (Principal) and the runtime.

- ``SessionDep``: one transaction per request, committed when the route returns (before the response is sent,
  so an acknowledged write is durable), rolled back on any error.
- ``SettingsDep``: the app's Settings.
- ``PrincipalDep``: who calls. With auth on, from ``Authorization: Bearer <token>``, or from the web console's
  session cookie (unsafe methods then need the session's ``X-CSRF-Token``), 401 otherwise; with auth off the single
  local user (project "default", admin, may run code unless MESHRUN_LOCAL_CODE_RIGHTS=false; never a request a
  browser sends for another site). Rate limiting per token happens here too.
- ``RuntimeDep``: ``app.state.runtime`` (None when the scheduler does not run in this process).
- ``SessionFactoryDep``: the app's sessionmaker (for work outside the request's transaction, e.g. health checks).

``create_app`` sets every ``app.state`` attribute these read (settings, session_factory, runtime, rate_limiter).

Routers get authentication via ``auth_dependencies(settings)`` in ``service.app.server`` (so routers written by others
are protected too); ``PrincipalDep`` reuses what it found.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from service.app.errors import ApiError
from service.app.ratelimit import RateLimiter
from service.control.runtime import Runtime
from service.settings import Settings
from service.store.db import session_scope

LOCAL_PROJECT = "default"


@dataclass(frozen=True)
class Principal:
    """The caller of a request."""

    project: str
    token_name: str
    admin: bool = False
    can_run_code: bool = False
    token_id: int | None = None

    @property
    def scope(self) -> str | None:
        """Project filter for store queries: None (all projects) for admins."""
        return None if self.admin else self.project


LOCAL_PRINCIPAL = Principal(project=LOCAL_PROJECT, token_name="local", admin=True, can_run_code=True)
LOCAL_PRINCIPAL_NO_CODE = Principal(project=LOCAL_PROJECT, token_name="local", admin=True, can_run_code=False)


# ---------------------------------------------------------------------------------------------- settings
# Dependencies that only read attributes are ``async def``: FastAPI then calls them on the event loop instead of
# handing each to the thread pool (a thread hop per dependency adds up on a busy machine).
async def get_app_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


SettingsDep = Annotated[Settings, Depends(get_app_settings)]


# ----------------------------------------------------------------------------------------------- session
def get_session_factory(request: Request) -> sessionmaker[Session]:
    factory: sessionmaker[Session] = request.app.state.session_factory
    return factory


SessionFactoryDep = Annotated[sessionmaker[Session], Depends(get_session_factory)]


def get_session(request: Request) -> Iterator[Session]:
    with session_scope(get_session_factory(request)) as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session, scope="function")]


# ----------------------------------------------------------------------------------------------- runtime
async def get_runtime(request: Request) -> Runtime | None:
    runtime: Runtime | None = request.app.state.runtime
    return runtime


RuntimeDep = Annotated[Runtime | None, Depends(get_runtime)]


# ------------------------------------------------------------------------------------------------- auth
bearer_scheme = HTTPBearer(
    auto_error=False, scheme_name="BearerToken", description="API token from `meshrun token create --project P`."
)


def _limiter(request: Request) -> RateLimiter:
    limiter: RateLimiter = request.app.state.rate_limiter
    return limiter


def _rate_limit(request: Request, key: str) -> None:
    limiter = _limiter(request)
    wait_s = limiter.hit(key)
    if wait_s is not None:
        raise ApiError(
            429,
            f"rate limit of {limiter.limit} requests per minute exceeded; retry in "
            f"{limiter.retry_after_header(wait_s)} s",
            headers={"Retry-After": limiter.retry_after_header(wait_s)},
        )


def _unauthenticated(message: str) -> ApiError:
    return ApiError(401, message, headers={"WWW-Authenticate": "Bearer"})


def principal_from_secret(request: Request, secret: str | None) -> Principal:
    """The Principal of an API token secret (401 ApiError when missing/invalid/revoked, 429 when rate limited)."""
    if not secret:
        raise _unauthenticated(
            "authentication required: send 'Authorization: Bearer <token>' (create a token "
            "with `meshrun token create --project P`)"
        )
    from service.security.tokens import verify_token

    with get_session_factory(request)() as session:
        tok = verify_token(session, secret)
        if tok is None:
            # failed attempts are limited per client address (valid tokens only per token): 429 once exhausted
            limiter = _limiter(request)
            wait_s = limiter.hit(f"auth-failures:{request.client.host if request.client else '?'}")
            if wait_s is not None:
                raise ApiError(
                    429,
                    "too many failed authentication attempts from this address; retry in "
                    f"{limiter.retry_after_header(wait_s)} s",
                    headers={"Retry-After": limiter.retry_after_header(wait_s)},
                )
            raise _unauthenticated("invalid or revoked token; create a new one with `meshrun token create`")
        principal = Principal(
            project=tok.project,
            token_name=tok.name,
            admin=bool(tok.admin),
            can_run_code=bool(tok.can_run_code),
            token_id=tok.id,
        )
    _rate_limit(request, f"token:{principal.token_id}")
    return principal


SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def principal_from_cookie(request: Request) -> Principal | None:
    """The Principal of the web console's session cookie (None without a live session). Unsafe methods with the
    cookie must carry the session's CSRF token (403 otherwise: another site cannot make the browser act)."""
    from service.security.sessions import CSRF_HEADER, SESSION_COOKIE, csrf_ok, find_session

    secret = request.cookies.get(SESSION_COOKIE)
    if not secret:
        return None
    with request.app.state.session_factory() as session:
        found = find_session(session, secret)
        if found is None:
            return None
        row, tok = found
        if request.method.upper() not in SAFE_METHODS and not csrf_ok(row, request.headers.get(CSRF_HEADER)):
            raise ApiError(
                403,
                f"requests with the console's session cookie must send its {CSRF_HEADER} header; reload the page",
                code="csrf_failed",
            )
        principal = Principal(
            project=tok.project,
            token_name=tok.name,
            admin=bool(tok.admin),
            can_run_code=bool(tok.can_run_code),
            token_id=tok.id,
        )
        request.state.csrf_token = row.csrf_token
    _rate_limit(request, f"token:{principal.token_id}")
    return principal


def authenticate(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)]
) -> Principal:
    """Router dependency with auth on (documents the Bearer scheme in OpenAPI); the console's cookie works too."""
    principal = getattr(request.state, "principal", None)
    if principal is None:
        principal = None if credentials else principal_from_cookie(request)
        if principal is None:
            principal = principal_from_secret(request, credentials.credentials if credentials else None)
        request.state.principal = principal
    return principal


def _local_user(request: Request) -> Principal:
    principal = getattr(request.state, "principal", None)
    if principal is None:
        principal = local_principal(request)
        client = request.client.host if request.client else "unknown"
        _rate_limit(request, f"client:{client}")
        request.state.principal = principal
    return principal


def local_principal(request: Request) -> Principal:
    """With auth off, the single local user: admin of project "default", with code rights unless
    ``MESHRUN_LOCAL_CODE_RIGHTS=false``. A request that a browser sends for another site (an ``Origin`` outside
    the service's allow-list, or ``Sec-Fetch-Site: cross-site`` on anything but a top-level page load) is never
    that user: 403."""
    settings: Settings = request.app.state.settings
    policy = getattr(request.app.state, "host_policy", None)
    navigation = request.method.upper() in SAFE_METHODS and request.headers.get("sec-fetch-mode") == "navigate"
    if policy is not None and not navigation and policy.browser_foreign(request.headers):
        raise ApiError(
            403,
            "a request from another site's page is not the local user of this service; use the API from a "
            "program or the console (a page served under another name needs that name in MESHRUN_ALLOWED_HOSTS)",
            code="cross_origin",
            param="Origin",
        )
    return LOCAL_PRINCIPAL if settings.local_code_rights else LOCAL_PRINCIPAL_NO_CODE


async def local_user(request: Request) -> Principal:
    """Router dependency with auth off: the single local user, rate-limited per client address (no I/O: it runs
    on the event loop)."""
    return _local_user(request)


async def get_principal(request: Request) -> Principal:
    """The caller; authenticates now (in the thread pool: it reads the database) if no router dependency did
    (routes outside the protected routers)."""
    principal = getattr(request.state, "principal", None)
    if principal is not None:
        return principal
    return await run_in_threadpool(_authenticate_now, request)


def _authenticate_now(request: Request) -> Principal:
    settings: Settings = request.app.state.settings
    if not settings.auth_enabled:
        return _local_user(request)
    header = request.headers.get("authorization", "")
    scheme, _, secret = header.partition(" ")
    principal = None if header else principal_from_cookie(request)
    if principal is None:
        principal = principal_from_secret(request, secret.strip() if scheme.lower() == "bearer" else None)
    request.state.principal = principal
    return principal


PrincipalDep = Annotated[Principal, Depends(get_principal)]


def auth_dependencies(settings: Settings) -> list[Any]:
    """Dependencies to put on every protected router."""
    return [Depends(authenticate if settings.auth_enabled else local_user)]

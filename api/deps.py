"""FastAPI dependencies: the database session, the settings, the caller (Principal) and the runtime.

- ``SessionDep``: one transaction per request, committed when the route returns (before the response is sent,
  so an acknowledged write is durable), rolled back on any error.
- ``SettingsDep``: the app's Settings.
- ``PrincipalDep``: who calls. With auth on, from ``Authorization: Bearer <token>`` (401 otherwise); with auth off
  the single local user (project "default", admin, may run code). Rate limiting per token happens here too.
- ``RuntimeDep``: ``app.state.runtime`` (None when the scheduler does not run in this process).

Routers get authentication via ``auth_dependencies(settings)`` in ``api.server`` (so routers written by others
are protected too); ``PrincipalDep`` reuses what it found.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from api.errors import ApiError
from service.db import session_scope
from service.settings import Settings

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


# ---------------------------------------------------------------------------------------------- settings
def get_app_settings(request: Request) -> Settings:
    return request.app.state.settings


SettingsDep = Annotated[Settings, Depends(get_app_settings)]


# ----------------------------------------------------------------------------------------------- session
def get_session(request: Request) -> Iterator[Session]:
    with session_scope(request.app.state.session_factory) as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session, scope="function")]


# ----------------------------------------------------------------------------------------------- runtime
def get_runtime(request: Request) -> Any | None:
    return getattr(request.app.state, "runtime", None)


RuntimeDep = Annotated[Any, Depends(get_runtime)]


# ------------------------------------------------------------------------------------------------- auth
bearer_scheme = HTTPBearer(auto_error=False, scheme_name="BearerToken",
                           description="API token from `meshrun token create --project P`.")


def _rate_limit(request: Request, key: str) -> None:
    limiter = getattr(request.app.state, "rate_limiter", None)
    if limiter is None:
        return
    wait_s = limiter.hit(key)
    if wait_s is not None:
        raise ApiError(429, f"rate limit of {limiter.limit} requests per minute exceeded; retry in "
                       f"{limiter.retry_after_header(wait_s)} s", headers={"Retry-After": limiter.retry_after_header(wait_s)})


def _unauthenticated(message: str) -> ApiError:
    return ApiError(401, message, headers={"WWW-Authenticate": "Bearer"})


def principal_from_secret(request: Request, secret: str | None) -> Principal:
    """The Principal of an API token secret (401 ApiError when missing/invalid/revoked, 429 when rate limited)."""
    if not secret:
        raise _unauthenticated("authentication required: send 'Authorization: Bearer <token>' (create a token "
                               "with `meshrun token create --project P`)")
    from service.auth import verify_token
    factory = request.app.state.session_factory
    with factory() as session:
        tok = verify_token(session, secret)
        if tok is None:
            # failed attempts are limited per client address (valid tokens only per token): 429 once exhausted
            limiter = getattr(request.app.state, "rate_limiter", None)
            wait_s = limiter.hit(f"auth-failures:{request.client.host if request.client else '?'}") \
                if limiter is not None else None
            if wait_s is not None:
                raise ApiError(429, "too many failed authentication attempts from this address; retry in "
                               f"{limiter.retry_after_header(wait_s)} s",
                               headers={"Retry-After": limiter.retry_after_header(wait_s)})
            raise _unauthenticated("invalid or revoked token; create a new one with `meshrun token create`")
        principal = Principal(project=tok.project, token_name=tok.name, admin=bool(tok.admin),
                              can_run_code=bool(tok.can_run_code), token_id=tok.id)
    _rate_limit(request, f"token:{principal.token_id}")
    return principal


def authenticate(request: Request,
                 credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)]) -> Principal:
    """Router dependency with auth on (documents the Bearer scheme in OpenAPI)."""
    principal = getattr(request.state, "principal", None)
    if principal is None:
        principal = principal_from_secret(request, credentials.credentials if credentials else None)
        request.state.principal = principal
    return principal


def local_user(request: Request) -> Principal:
    """Router dependency with auth off: the single local user, rate-limited per client address."""
    principal = getattr(request.state, "principal", None)
    if principal is None:
        client = request.client.host if request.client else "unknown"
        _rate_limit(request, f"client:{client}")
        principal = request.state.principal = LOCAL_PRINCIPAL
    return principal


def get_principal(request: Request) -> Principal:
    """The caller; authenticates now if no router dependency did (routes outside the protected routers)."""
    principal = getattr(request.state, "principal", None)
    if principal is not None:
        return principal
    settings: Settings = request.app.state.settings
    if not settings.auth_enabled:
        return local_user(request)
    header = request.headers.get("authorization", "")
    scheme, _, secret = header.partition(" ")
    principal = principal_from_secret(request, secret.strip() if scheme.lower() == "bearer" else None)
    request.state.principal = principal
    return principal


PrincipalDep = Annotated[Principal, Depends(get_principal)]


def auth_dependencies(settings: Settings) -> list[Any]:
    """Dependencies to put on every protected router."""
    return [Depends(authenticate if settings.auth_enabled else local_user)]

"""What every console page shares: the templates (Jinja2, autoescaped), their filters, who the browser is, and the
Ray dashboard link policy.

Pages authenticate like the API: with auth off the local user; with auth on the session cookie of a sign-in (or a
Bearer header, for scripts); without either, pages redirect to ``/signin``. Everything a page shows is scoped to
the caller's project exactly as the API scopes it (admins see every project).
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

from fastapi import Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates
from jinja2 import is_undefined

from api.spec import layout_label
from api.spec.units import format_bytes
from service.app.deps import Principal, local_principal, principal_from_cookie, principal_from_secret
from service.app.errors import ApiError
from service.app.links import ray_job_link, ray_proxy_allowed, ray_proxy_url, service_base_url
from service.meta import VERSION

HERE = Path(__file__).resolve().parent
templates = Jinja2Templates(directory=str(HERE / "templates"))

__all__ = ["ray_job_link", "ray_proxy_allowed", "service_base_url"]  # re-exported for the console's modules

STATUS_ORDER = ("QUEUED", "STARTING", "RUNNING", "PREEMPTED", "SUCCEEDED", "FAILED", "CANCELLED")


# ------------------------------------------------------------------------------------------------ filters
def _num(x: Any, fmt: str = ".4g") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    return format(x, fmt)


def _rate(x: float | None) -> str:
    """Tokens/s with a k/M suffix."""
    if x is None:
        return "–"
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{suffix}"
    return f"{x:.3g}"


def _pct(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{100 * x:.{digits}f}%"


def _bytes(x: float | None) -> str:
    return format_bytes(x, missing="–")  # the one size format (binary units), also the CLI's and console.js's


def _seconds(x: float | None) -> str:
    if x is None:
        return "–"
    if x < 1e-3:
        return f"{x * 1e6:.0f} µs"
    if x < 1:
        return f"{x * 1e3:.3g} ms"
    if x < 120:
        return f"{x:.3g} s"
    if x < 7200:
        return f"{x / 60:.1f} min"
    return f"{x / 3600:.1f} h"


def _usd(x: float | None) -> str:
    """US dollars: '$1,234', '$24.00', '$0.000315' (three significant figures below a cent); '–' when unknown."""
    if x is None:
        return "–"
    if x >= 1000:
        return f"${x:,.0f}"
    return f"${x:.2f}" if x >= 0.01 or x == 0 else f"${x:.3g}"


def _utc(dt: datetime | None) -> datetime | None:
    if dt is not None and dt.tzinfo is None:
        return dt.replace(tzinfo=UTC)
    return dt


def _age(dt: datetime | None) -> str:
    dt = _utc(dt)
    if dt is None:
        return "–"
    s = (datetime.now(UTC) - dt).total_seconds()
    if s < 60:
        return f"{max(0, int(s))} s ago"
    if s < 3600:
        return f"{int(s // 60)} min ago"
    if s < 86400:
        return f"{s / 3600:.1f} h ago"
    return f"{int(s // 86400)} d ago"


def _iso(dt: datetime | None) -> str:
    dt = _utc(dt)
    return dt.isoformat(timespec="seconds") if dt is not None else ""


def _clock(dt: datetime | None) -> str:
    dt = _utc(dt)
    return dt.strftime("%Y-%m-%d %H:%M:%S UTC") if dt is not None else "–"


def _defined(fn: Any) -> Any:
    """A filter that reads a missing value (Jinja's Undefined) as None."""

    def wrapped(x: Any, *args: Any) -> Any:
        return fn(None if is_undefined(x) else x, *args)

    return wrapped


for name, fn in {
    "num": _num,
    "rate": _rate,
    "pct": _pct,
    "bytes": _bytes,
    "seconds": _seconds,
    "usd": _usd,
    "age": _age,
    "iso": _iso,
    "clock": _clock,
    "layout": layout_label,
}.items():
    templates.env.filters[name] = _defined(fn)
templates.env.globals["VERSION"] = VERSION
templates.env.globals["STATUS_ORDER"] = STATUS_ORDER


# -------------------------------------------------------------------------------------------------- auth
def console_principal(request: Request) -> Principal | None:
    """Who the browser is: the local user (auth off), the session cookie's or a Bearer token's principal, or None
    (sign in first)."""
    settings = request.app.state.settings
    if not settings.auth_enabled:
        request.state.principal = local = local_principal(request)
        return local
    principal = getattr(request.state, "principal", None)
    if principal is not None:
        return principal
    header = request.headers.get("authorization", "")
    if header:
        scheme, _, secret = header.partition(" ")
        principal = principal_from_secret(request, secret.strip() if scheme.lower() == "bearer" else None)
    else:
        principal = principal_from_cookie(request)
    request.state.principal = principal
    return principal


def sign_in_redirect(request: Request) -> Response:
    """To the sign-in page, coming back here afterwards (htmx requests get an HX-Redirect)."""
    here = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    target = f"/signin?next={quote(here, safe='')}"
    if request.headers.get("hx-request"):
        return Response(status_code=200, headers={"HX-Redirect": target})
    return RedirectResponse(target, status_code=303)


def safe_next(target: str | None) -> str:
    """A local path to go to after signing in (never another site)."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/"
    return target


def page(request: Request, template: str, principal: Principal | None, **context: Any) -> HTMLResponse:
    """Render a page with what the layout needs (the caller, the CSRF token for scripts, auth mode)."""
    settings = request.app.state.settings
    ctx = {
        "principal": principal,
        "auth": settings.auth_enabled,
        "csrf_token": getattr(request.state, "csrf_token", "") or request.app.state.console_csrf,
        "ray_proxy": ray_proxy_allowed(request, principal),
        "ray_url": ray_proxy_url(request),
        "path": request.url.path,
        **context,
    }
    return templates.TemplateResponse(request, template, ctx)


def not_found_page(request: Request, principal: Principal | None, what: str) -> HTMLResponse:
    resp = page(request, "error.html", principal, title="Not found", message=what)
    resp.status_code = 404
    return resp


def api_error_page(request: Request, principal: Principal | None, e: ApiError) -> HTMLResponse:
    resp = page(request, "error.html", principal, title=f"Error {e.status_code}", message=e.message)
    resp.status_code = e.status_code
    return resp

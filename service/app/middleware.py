"""ASGI middleware that guards every request before routing, and the headers every response carries.

- ``HostAllowListMiddleware``: 400 for a ``Host`` that is not one of this service's names
  (``service.security.hosts.HostPolicy``): the API, the console and ``/ray/`` alike. This is what stops DNS
  rebinding (a page of another site that resolves its own name to this machine).
- ``SameOriginMiddleware``: 403 for unsafe requests (POST, PUT, PATCH, DELETE) whose ``Origin`` is not one of the
  service's own origins (compared with the allow-list, not with the ``Host`` the request names).
- ``SecurityHeadersMiddleware``: Content-Security-Policy, X-Frame-Options, X-Content-Type-Options and
  Referrer-Policy on every response (a route may set its own CSP: the API docs and the Ray dashboard do), and a
  ``Retry-After`` on every 503 that has none.
"""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Iterable
from pathlib import Path

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.app.errors import error_response
from service.security.hosts import HostPolicy

__all__ = [
    "HostAllowListMiddleware",
    "SameOriginMiddleware",
    "SecurityHeadersMiddleware",
    "content_security_policy",
    "inline_script_hashes",
]

_INLINE_SCRIPT = re.compile(r"<script>(.*?)</script>", re.S)


def inline_script_hashes(html: str) -> list[str]:
    """CSP source expressions (``'sha256-...'``) for the inline ``<script>`` blocks of a page or template that
    contain no template expressions (their text is fixed, so a hash pins exactly that script)."""
    out = []
    for body in _INLINE_SCRIPT.findall(html):
        if "{{" in body or "{%" in body:
            continue
        digest = base64.b64encode(hashlib.sha256(body.encode()).digest()).decode()
        out.append(f"'sha256-{digest}'")
    return sorted(set(out))


def template_script_hashes(directory: Path) -> list[str]:
    """The hashes of every fixed inline script in a template directory (the console's few one-line page inits)."""
    found: set[str] = set()
    for path in sorted(directory.glob("*.html")):
        found.update(inline_script_hashes(path.read_text(encoding="utf-8")))
    return sorted(found)


def content_security_policy(script_hashes: Iterable[str] = (), *, inline_styles: bool = False) -> str:
    """The console's policy: everything from this origin only, no plugins, never framed. Inline scripts only by
    hash; style attributes (the console's progress bars) are allowed, ``<style>`` elements only with
    ``inline_styles`` (the vendored API docs renderers inject theirs)."""
    scripts = " ".join(["'self'", *script_hashes])
    styles = "'self' 'unsafe-inline'" if inline_styles else "'self'"
    return (
        f"default-src 'self'; script-src {scripts}; style-src {styles}; style-src-attr 'unsafe-inline'; "
        "img-src 'self' data: blob:; font-src 'self' data:; connect-src 'self'; worker-src 'self' blob:; "
        "object-src 'none'; base-uri 'self'; form-action 'self'; frame-ancestors 'none'"
    )


# the Ray dashboard (a bundled single-page app with inline scripts and styles of its own) keeps its own rules
# but is never framed and loads nothing from other sites
RAY_CSP = (
    "default-src 'self'; script-src 'self' 'unsafe-inline' 'unsafe-eval'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data: blob:; font-src 'self' data:; connect-src 'self'; object-src 'none'; base-uri 'self'; "
    "form-action 'self'; frame-ancestors 'none'"
)


DEFAULT_RETRY_AFTER_S = "5"


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers") or ()}


class HostAllowListMiddleware:
    """400 before routing for a request whose ``Host`` is not an allowed name; the policy is on
    ``app.state.host_policy`` for the dependencies (the local user check)."""

    def __init__(self, app: ASGIApp, *, policy: HostPolicy):
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            host = Headers(scope=scope).get("host")
            if not self.policy.host_allowed(host):
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                    return
                why = self.policy.refusal(host or "")
                await error_response(400, "host_not_allowed", why, "Host")(scope, receive, send)
                return
        await self.app(scope, receive, send)


class SameOriginMiddleware:
    """403 for unsafe requests that a browser sends from a page that is not one of the service's own origins.
    Programs (SDK, CLI, curl) send no Origin and pass; so do the console's own requests. With auth off this is
    what keeps a web page from driving a local service."""

    SAFE = frozenset({"GET", "HEAD", "OPTIONS"})

    def __init__(self, app: ASGIApp, *, policy: HostPolicy):
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method", "GET").upper() not in self.SAFE:
            headers = _headers(scope)
            origin = headers.get("origin")
            if origin is not None and not self.policy.origin_allowed(origin.strip(), headers):
                why = (
                    "cross-site requests are refused; use the API from a program or the console (a page served "
                    "under another name of this service needs that name in MESHRUN_ALLOWED_HOSTS)"
                )
                await error_response(403, "cross_origin", why, "Origin")(scope, receive, send)
                return
        await self.app(scope, receive, send)


class SecurityHeadersMiddleware:
    """Security headers on every response; a response that brings its own Content-Security-Policy keeps it."""

    def __init__(self, app: ASGIApp, *, csp: str):
        self.app = app
        self.csp = csp

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope.get("path", "")
        csp = RAY_CSP if path == "/ray" or path.startswith("/ray/") else self.csp

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                if "content-security-policy" not in headers:
                    headers["Content-Security-Policy"] = csp
                headers["X-Frame-Options"] = "DENY"
                headers["X-Content-Type-Options"] = "nosniff"
                headers["Referrer-Policy"] = "same-origin"
                headers.setdefault("Cross-Origin-Opener-Policy", "same-origin")
                if message.get("status") == 503 and "retry-after" not in headers:
                    # every 503 says when to come back (the SDK waits that long and retries)
                    headers["Retry-After"] = DEFAULT_RETRY_AFTER_S
            await send(message)

        await self.app(scope, receive, send_with_headers)

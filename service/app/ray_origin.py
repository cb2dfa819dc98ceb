"""The Ray dashboard on an origin of its own.

The dashboard proxy (``service.app.console.ray_proxy``) serves Ray's dashboard, a third-party single-page app with
inline scripts, to signed-in users. On the console's origin its scripts would run with the viewer's rights: a flaw
in it (or a job name it renders) could read the console and act on the API as that viewer. So the service listens
on a second port (``settings.ray_proxy_listen_port``, by default the service's port + 1) that serves ``/ray/`` and
nothing else, and the browser keeps the two apart:

- on the service's port, ``/ray`` and ``/ray/...`` answer 307 to the same path on the dashboard's port;
- on the dashboard's port, every other path answers 404 (no API, no console, no sign-in form there);
- a browser request whose ``Origin`` is the dashboard's port is never one of the service's own
  (``HostPolicy.origin_allowed``), so an unsafe request from a dashboard page gets 403 and, with auth off, is not
  the local user; nothing answers it with CORS headers, so its reads stay unreadable.

The sign-in cookie is a host cookie, which browsers send to every port of the host, so a signed-in user opens the
dashboard without signing in again. ``MESHRUN_RAY_PROXY_PORT=0`` keeps the old single origin.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.responses import RedirectResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from service.app.errors import error_response
from service.security.hosts import host_name

__all__ = ["RayOriginMiddleware", "is_ray_path", "origin_url"]


def is_ray_path(path: str) -> bool:
    return path == "/ray" or path.startswith("/ray/")


def origin_url(scope: Scope, port: int) -> str:
    """``scheme://host:port`` under the host name the caller used (the Host header, already allow-listed)."""
    host = host_name(Headers(scope=scope).get("host") or "") or "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"{scope.get('scheme', 'http')}://{host}:{port}"


class RayOriginMiddleware:
    """Keeps the dashboard proxy and the service apart by listener port (see the module docstring)."""

    def __init__(self, app: ASGIApp, *, ray_port: int | None, service_port: int):
        self.app = app
        self.ray_port = ray_port
        self.service_port = service_port

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.ray_port is None or scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        server = scope.get("server") or (None, None)
        path = scope.get("path", "")
        on_ray_port = server[1] == self.ray_port
        if on_ray_port and not is_ray_path(path):
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
                return
            why = (
                f"this port serves only the Ray dashboard (/ray/); the console and the API are on port "
                f"{self.service_port}"
            )
            await error_response(404, "not_found", why)(scope, receive, send)
            return
        if not on_ray_port and is_ray_path(path) and scope["type"] == "http":
            query = scope.get("query_string", b"").decode("latin-1")
            target = origin_url(scope, self.ray_port) + path + (f"?{query}" if query else "")
            await RedirectResponse(target, status_code=307)(scope, receive, send)
            return
        await self.app(scope, receive, send)

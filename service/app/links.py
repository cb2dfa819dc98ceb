"""Links the service hands out: its own base URL, and where a run's Ray job opens.

The embedded Ray head uses token auth, so Ray's own dashboard URL asks a meshrun user for a token they do not
have. When ``settings.ray_dashboard_proxy`` lets the caller use it, links go through the service's read-only
dashboard proxy at ``/ray/`` (``service.app.console.ray_proxy``), on its own origin (``service.app.ray_origin``),
instead.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request

from service.app.ray_origin import origin_url


def service_base_url(request: Request) -> str:
    """This service's URL as the caller reached it (its Host header). Not ``settings.public_url``: that is how Ray
    Job drivers reach the service, often an address browsers cannot use."""
    return str(request.base_url).rstrip("/")


def ray_proxy_allowed(request: Request, principal: Any | None) -> bool:
    """Whether this caller may open the Ray dashboard through the service."""
    policy = request.app.state.settings.ray_dashboard_proxy
    if principal is None or policy == "off" or getattr(request.app.state, "runtime", None) is None:
        return False
    return policy in ("signed-in", "project") or bool(principal.admin)


def ray_proxy_url(request: Request) -> str:
    """The dashboard proxy's URL as this caller reaches the service: ``/ray/`` on the dashboard's own origin
    (``service.app.ray_origin``), or on the service's when it shares the console's origin."""
    port = request.app.state.settings.ray_proxy_listen_port
    base = service_base_url(request) if port is None else origin_url(request.scope, port)
    return f"{base}/ray/"


def ray_job_link(request: Request, principal: Any | None, ray_job_id: str | None, direct: str | None) -> str | None:
    """Where the run's Ray job opens: through the service's dashboard proxy when allowed, else ``direct``
    (Ray's own URL)."""
    if ray_job_id and ray_proxy_allowed(request, principal):
        return f"{ray_proxy_url(request)}#/jobs/{ray_job_id}"
    return direct

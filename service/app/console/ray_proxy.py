"""The Ray dashboard through the service, at ``/ray/``, for signed-in users.

The embedded Ray head uses token auth: opened directly, its dashboard asks for a token that a meshrun user does not
have. Here the service forwards GET/HEAD requests to the dashboard with the cluster's token added
(``service.cluster.head.auth_headers``), so every Ray link meshrun shows (``/ray/#/jobs/<submission id>``) opens the
run's job for whoever may use the console. Read-only on purpose: Ray's job submission and stop endpoints run
arbitrary code and are not reachable through it. Who may use it: ``settings.ray_dashboard_proxy``.

The browser's cookies and Authorization header are not forwarded; Ray's Set-Cookie headers are not returned. The
dashboard's own pages use relative URLs, so they work under the ``/ray/`` prefix.
"""

from __future__ import annotations

import logging

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from service.app.console.web import console_principal, page, ray_proxy_allowed, sign_in_redirect

log = logging.getLogger(__name__)
router = APIRouter(include_in_schema=False)

FORWARD_REQUEST_HEADERS = ("accept", "accept-encoding", "if-none-match", "if-modified-since", "range")
RETURN_HEADERS = ("content-type", "content-encoding", "cache-control", "etag", "last-modified", "content-range")
TIMEOUT_S = 30.0


@router.get("/ray")
def ray_root() -> Response:
    return RedirectResponse("/ray/", status_code=307)


@router.api_route("/ray/{path:path}", methods=["GET", "HEAD"])
async def ray_dashboard(request: Request, path: str) -> Response:
    principal = console_principal(request)
    if principal is None:
        return sign_in_redirect(request)
    runtime = getattr(request.app.state, "runtime", None)
    base = getattr(runtime, "dashboard_url", None) if runtime is not None else None
    if not ray_proxy_allowed(request, principal) or not base:
        why = (
            "This service runs no Ray runtime."
            if not base
            else "The Ray dashboard is not shared with your token here (MESHRUN_RAY_DASHBOARD_PROXY)."
        )
        resp: HTMLResponse = page(request, "error.html", principal, title="Ray dashboard", message=why)
        resp.status_code = 403 if base else 503
        return resp
    from service.cluster.head import auth_headers

    headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARD_REQUEST_HEADERS}
    headers.update(auth_headers())
    url = f"{base.rstrip('/')}/{path}"
    client = httpx.AsyncClient(timeout=TIMEOUT_S, follow_redirects=False)
    upstream = client.build_request(request.method, url, params=request.query_params, headers=headers)
    try:
        r = await client.send(upstream, stream=True)
    except httpx.HTTPError as e:
        await client.aclose()
        log.warning("Ray dashboard proxy: %s %s failed: %s", request.method, path[:200], e)
        return Response(f"the Ray dashboard is not reachable: {e}", status_code=502, media_type="text/plain")

    async def close() -> None:
        await r.aclose()
        await client.aclose()

    out = {k: v for k, v in r.headers.items() if k.lower() in RETURN_HEADERS}
    return StreamingResponse(r.aiter_raw(), status_code=r.status_code, headers=out, background=BackgroundTask(close))

"""The Ray dashboard through the service, at ``/ray/``, for signed-in users.

The embedded Ray head uses token auth: opened directly, its dashboard asks for a token that a meshrun user does not
have. Here the service forwards GET/HEAD requests to the dashboard with the cluster's token added
(``service.cluster.head.auth_headers``), so every Ray link meshrun shows (``/ray/#/jobs/<submission id>``) opens the
run's job for whoever may use the console. Read-only on purpose: Ray's job submission and stop endpoints run
arbitrary code and are not reachable through it. Who may use it: ``settings.ray_dashboard_proxy``:

- ``admins`` (default): admin tokens only.
- ``project``: every signed-in user; a non-admin sees the dashboard's pages and, of its data, only the job list,
  job details, job logs and driver log files of its own project's jobs (meshrun puts the project in every job's
  metadata). Everything else (nodes, actors, tasks, other logs, other projects' jobs) answers 404.
- ``signed-in``: every signed-in user sees everything (every project's jobs).

It is served on an origin of its own (``service.app.ray_origin``). The browser's cookies and Authorization header
are not forwarded; Ray's Set-Cookie headers are not returned. The
dashboard's own pages use relative URLs, so they work under the ``/ray/`` prefix.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from service.app.console.web import console_principal, page, ray_proxy_allowed, sign_in_redirect
from service.app.deps import Principal
from service.app.errors import error_response
from service.app.ray_origin import origin_url

log = logging.getLogger(__name__)
router = APIRouter(include_in_schema=False)

FORWARD_REQUEST_HEADERS = ("accept", "accept-encoding", "if-none-match", "if-modified-since", "range")
RETURN_HEADERS = ("content-type", "content-encoding", "cache-control", "etag", "last-modified", "content-range")
TIMEOUT_S = 30.0

# what a project-walled caller may reach: the dashboard's own files, and its project's jobs
_ASSET = re.compile(r"^(|index\.html|favicon\.ico|logo\.(png|svg)|manifest\.json|static/[A-Za-z0-9_./-]+|api/version)$")
_JOB_LIST = re.compile(r"^api/jobs/?$")
_JOB = re.compile(r"^api/jobs/([A-Za-z0-9_-]{1,200})/?$")
_JOB_LOGS = re.compile(r"^api/jobs/([A-Za-z0-9_-]{1,200})/logs(/tail)?/?$")
_LOG_FILE = re.compile(r"^api/v0/logs/(file|stream)/?$")
_DRIVER_LOG = re.compile(r"^job-driver-([A-Za-z0-9_-]{1,200})\.log$")
_OTHER_LOG_SELECTORS = ("task_id", "actor_id", "pid", "glob")


@router.get("/ray")
def ray_root() -> Response:
    return RedirectResponse("/ray/", status_code=307)


def _sign_in(request: Request) -> Response:
    """The sign-in page, which lives on the service's origin when the dashboard has its own
    (``service.app.ray_origin``); the sign-in cookie then opens both."""
    resp = sign_in_redirect(request)
    settings = request.app.state.settings
    location = resp.headers.get("location")
    if settings.ray_proxy_listen_port is not None and location and location.startswith("/"):
        resp.headers["location"] = origin_url(request.scope, settings.port) + location
    return resp


def _not_found() -> Response:
    return error_response(
        404, "not_found", "not found (the Ray dashboard shows your project's jobs only: MESHRUN_RAY_DASHBOARD_PROXY)"
    )


def _walled(request: Request, principal: Principal) -> bool:
    return request.app.state.settings.ray_dashboard_proxy == "project" and not principal.admin


def _job_project(job: Any) -> str | None:
    meta = job.get("metadata") if isinstance(job, dict) else None
    project = meta.get("project") if isinstance(meta, dict) else None
    return project if isinstance(project, str) else None


async def _get_json(base: str, path: str, params: Any = None) -> tuple[int, Any]:
    from service.cluster.head import auth_headers

    async with httpx.AsyncClient(timeout=TIMEOUT_S, follow_redirects=False) as client:
        r = await client.get(f"{base.rstrip('/')}/{path}", params=params, headers=auth_headers())
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, None


async def _owns_job(base: str, job_id: str, project: str) -> bool:
    status, job = await _get_json(base, f"api/jobs/{job_id}")
    return status == 200 and _job_project(job) == project


async def _project_view(request: Request, path: str, base: str, project: str) -> Response | None:
    """For a project-walled caller: the answer itself (a filtered job list or job, a 404), or None to forward the
    request as it is (an asset, or data of one of the caller's own jobs)."""
    if ".." in path.split("/"):
        return _not_found()
    if _ASSET.match(path):
        return None
    if _JOB_LIST.match(path):
        status, jobs = await _get_json(base, path, request.query_params)
        if status != 200 or not isinstance(jobs, list):
            return JSONResponse(jobs, status_code=status) if status != 200 else _not_found()
        return JSONResponse([j for j in jobs if _job_project(j) == project])
    m = _JOB.match(path) or _JOB_LOGS.match(path)
    if m:
        return None if await _owns_job(base, m.group(1), project) else _not_found()
    if _LOG_FILE.match(path):
        q = request.query_params
        if any(k in q for k in _OTHER_LOG_SELECTORS):
            return _not_found()
        owned = [q["submission_id"]] if "submission_id" in q else []
        if "filename" in q:
            driver = _DRIVER_LOG.match(q["filename"])
            if driver is None:
                return _not_found()
            owned.append(driver.group(1))
        if not owned or not all(re.fullmatch(r"[A-Za-z0-9_-]{1,200}", sid) for sid in owned):
            return _not_found()
        for sid in owned:
            if not await _owns_job(base, sid, project):
                return _not_found()
        return None
    return _not_found()


@router.api_route("/ray/{path:path}", methods=["GET", "HEAD"])
async def ray_dashboard(request: Request, path: str) -> Response:
    principal = console_principal(request)
    if principal is None:
        return _sign_in(request)
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
    if _walled(request, principal):
        try:
            answer = await _project_view(request, path, base, principal.project)
        except httpx.HTTPError as e:
            return _unreachable(path, e)
        if answer is not None:
            return answer
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
        return _unreachable(path, e)

    async def close() -> None:
        await r.aclose()
        await client.aclose()

    out = {k: v for k, v in r.headers.items() if k.lower() in RETURN_HEADERS}
    return StreamingResponse(r.aiter_raw(), status_code=r.status_code, headers=out, background=BackgroundTask(close))


def _unreachable(path: str, e: Exception) -> Response:
    log.warning("Ray dashboard proxy: %s failed: %s", path[:200], e)
    return Response(f"the Ray dashboard is not reachable: {e}", status_code=502, media_type="text/plain")

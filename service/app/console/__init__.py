"""The web console, served by the service itself at ``/`` (no second server, no build step).

Server-rendered Jinja2 pages with htmx for live tables and forms, uPlot for charts; every browser asset is vendored
under ``static/vendor`` with its license (nothing comes from a CDN: the console and the API docs work air-gapped).
``install_console(app)`` mounts the pages, the static files, the offline ``/docs`` and ``/redoc``, and the Ray
dashboard proxy at ``/ray/``.
"""

from __future__ import annotations

import secrets

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles

from service.app.console import forms, pages, ray_proxy, webhooks_page
from service.app.console.web import HERE
from service.app.middleware import content_security_policy, inline_script_hashes

STATIC = "/static"
FAVICON = f"{STATIC}/console/favicon.svg"


def install_console(app: FastAPI) -> None:
    app.state.console_csrf = secrets.token_urlsafe(24)  # echoed by the pages' scripts when auth is off
    app.mount(STATIC, StaticFiles(directory=str(HERE / "static")), name="static")
    app.include_router(pages.router)
    app.include_router(forms.router)
    app.include_router(webhooks_page.router)
    app.include_router(ray_proxy.router)

    @app.get("/docs", include_in_schema=False)
    def swagger_ui() -> HTMLResponse:
        return _own_csp(
            get_swagger_ui_html(
                openapi_url=app.openapi_url or "/openapi.json",
                title=f"{app.title} API",
                swagger_js_url=f"{STATIC}/vendor/swagger-ui/swagger-ui-bundle.js",
                swagger_css_url=f"{STATIC}/vendor/swagger-ui/swagger-ui.css",
                swagger_favicon_url=FAVICON,
                swagger_ui_parameters={"validatorUrl": None, "persistAuthorization": False},
            )
        )

    @app.get("/redoc", include_in_schema=False)
    def redoc() -> HTMLResponse:
        return _own_csp(
            get_redoc_html(
                openapi_url=app.openapi_url or "/openapi.json",
                title=f"{app.title} API",
                redoc_js_url=f"{STATIC}/vendor/redoc/redoc.standalone.js",
                redoc_favicon_url=FAVICON,
                with_google_fonts=False,
            )
        )

    @app.get("/favicon.ico", include_in_schema=False)
    def favicon() -> Response:
        return RedirectResponse(FAVICON, status_code=308)


def _own_csp(resp: HTMLResponse) -> HTMLResponse:
    """The API docs pages: FastAPI's HTML has one inline script (allowed by its hash) and the renderers inject
    their own ``<style>`` elements."""
    html = bytes(resp.body).decode()
    resp.headers["Content-Security-Policy"] = content_security_policy(inline_script_hashes(html), inline_styles=True)
    return resp

"""The console's forms: the planner (a form that returns ranked layouts, rendered by the server for htmx) and
signing in and out.

Form bodies are ``application/x-www-form-urlencoded`` and parsed here (no multipart dependency). The API token
typed into the sign-in form travels only in that POST body: it opens a session (``service.security.sessions``) and
is never put in a cookie, a URL or a log.
"""

from __future__ import annotations

import math
from typing import Any
from urllib.parse import parse_qs

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from api.spec import PlanRequest, PlanResponse, SpecError
from api.spec.presets import GPT_PRESETS
from service.app.console.web import console_principal, page, safe_next, sign_in_redirect, templates
from service.planner.devices import DEVICES
from service.security.sessions import SESSION_COOKIE, close_session, open_session
from service.store.db import session_scope

router = APIRouter(include_in_schema=False)

MAX_FORM_BYTES = 16 * 1024
PLAN_DEFAULTS = {
    "preset": "7b",
    "n_layers": "",
    "d_model": "",
    "n_heads": "",
    "vocab_size": "",
    "seq_len": "",
    "device": "H100",
    "gpus_per_node": "8",
    "nodes": "4",
    "global_batch_size": "512",
    "precision": "bf16",
    "top_k": "10",
    "peak_tflops": "",
    "memory_gib": "",
    "price": "",
    "rank_by": "time",
}


MAX_CLUSTER_VALUE = 1e24  # bytes or FLOP/s per device: far beyond any device, far inside an int64 and a float


async def read_form(request: Request) -> dict[str, str]:
    body = await request.body()
    if len(body) > MAX_FORM_BYTES:
        return {}
    return {k: v[-1] for k, v in parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True).items()}


# ------------------------------------------------------------------------------------------------- plan
def plan_request(form: dict[str, str]) -> dict[str, Any]:
    """The PlanRequest body a plan form describes (a preset, or the sizes typed in)."""

    def num(key: str) -> int | None:
        v = (form.get(key) or "").strip()
        return int(v) if v.isdigit() else None

    preset = (form.get("preset") or "").strip()
    model: dict[str, Any] = {"name": "gpt", "preset": preset or None}
    for key in ("n_layers", "d_model", "n_heads", "vocab_size"):
        if num(key) is not None:
            model[key] = num(key)
    body: dict[str, Any] = {
        "model": model,
        "cluster": {
            "device": (form.get("device") or "H100").strip(),
            "gpus_per_node": num("gpus_per_node") or 1,
            "nodes": num("nodes") or 1,
        },
        "global_batch_size": num("global_batch_size") or 1,
        "precision": form.get("precision") or "bf16",
        "top_k": min(num("top_k") or 10, 50),
    }
    if num("seq_len"):
        body["seq_len"] = num("seq_len")
    for key, field, scale in (("peak_tflops", "peak_flops_per_s", 1e12), ("memory_gib", "memory_bytes", 2**30)):
        try:
            value = float((form.get(key) or "").strip() or "nan")
        except ValueError:
            continue
        if value == value and value > 0:  # not NaN
            scaled = value * scale
            if not math.isfinite(scaled) or scaled > MAX_CLUSTER_VALUE:
                raise ValueError(f"{key}: {form.get(key, '').strip()[:40]} is out of range; give a realistic number")
            body["cluster"][field] = int(scaled) if field == "memory_bytes" else scaled
    price = (form.get("price") or "").strip()
    if price:
        try:  # a negative or infinite price is the planner's 422 (cluster.price_per_device_hour)
            body["cluster"]["price_per_device_hour"] = float(price)
        except ValueError:
            raise ValueError(f"price: {price[:40]} is not a number; give US dollars per GPU-hour") from None
    if form.get("rank_by") == "cost":
        body["rank_by"] = "cost"
    return body


def _device_choices(request: Request) -> list[str]:
    live = ["live"] if getattr(request.app.state, "runtime", None) is not None else []
    return live + list(DEVICES)


@router.get("/plan", response_class=HTMLResponse)
def plan_page(request: Request) -> Response:
    principal = console_principal(request)
    if principal is None:
        return sign_in_redirect(request)
    return page(
        request,
        "plan.html",
        principal,
        title="Plan",
        form=PLAN_DEFAULTS,
        presets=list(GPT_PRESETS),
        devices=_device_choices(request),
    )


def _plan(request: Request, body: dict[str, Any]) -> tuple[PlanRequest, PlanResponse]:
    """The same search as ``POST /v1/plans`` (live cluster, calibrated factors), under the same limiter."""
    from service.app.routes import plans

    req = PlanRequest.model_validate(body)
    if not plans.limiter.try_acquire():
        raise ValueError(f"the planner is busy with {plans.limiter.slots} searches; try again in a second")
    try:
        app = request.app.state
        return req, plans._plan(req, app.runtime, app.session_factory, app.settings.device_prices)
    finally:
        plans.limiter.release()


@router.post("/ui/plan", response_class=HTMLResponse)
async def plan_results(request: Request) -> Response:
    principal = console_principal(request)
    if principal is None:
        return sign_in_redirect(request)
    form = await read_form(request)
    try:
        body = plan_request(form)
    except ValueError as e:  # a number no device has (1e308 GiB): 422, the fragment says which
        ctx0: dict[str, Any] = {"principal": principal, "form": form, "request_body": {}, "error": str(e)}
        return templates.TemplateResponse(request, "_plan_results.html", ctx0, status_code=422)
    ctx: dict[str, Any] = {"principal": principal, "form": form, "request_body": body}
    try:
        req, resp = await run_in_threadpool(_plan, request, body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        ctx["error"] = f"{where}: {first.get('msg')}" if where else str(first.get("msg"))
    except (SpecError, ValueError) as e:
        ctx["error"] = str(e)
    else:
        device_memory = resp.cluster.get("memory_bytes") if isinstance(resp.cluster, dict) else None
        cands = resp.candidates
        ctx.update(
            response=resp,
            request_model=req,
            best_tps=max((c.tokens_per_s for c in cands), default=0.0),
            max_step_s=max((c.step_time_s.total for c in cands + resp.rejected), default=0.0) or 1.0,
            max_memory=max([c.memory_bytes.total for c in cands] + [device_memory or 0]) or 1,
            device_memory=device_memory,
        )
    return templates.TemplateResponse(request, "_plan_results.html", ctx)


# -------------------------------------------------------------------------------------------- sign in/out
@router.get("/signin", response_class=HTMLResponse)
def signin_page(request: Request, next: str = "/") -> Response:
    if not request.app.state.settings.auth_enabled:
        return RedirectResponse(safe_next(next), status_code=303)
    return page(request, "signin.html", None, title="Sign in", next=safe_next(next), error=None)


@router.post("/signin", response_class=HTMLResponse)
async def signin(request: Request) -> Response:
    settings = request.app.state.settings
    form = await read_form(request)
    target = safe_next(form.get("next"))
    if not settings.auth_enabled:
        return RedirectResponse(target, status_code=303)
    token = (form.get("token") or "").strip()

    def open_it() -> str | None:
        with session_scope(request.app.state.session_factory) as s:
            opened = open_session(s, token_secret=token, ttl_s=settings.console_session_hours * 3600)
            return opened[0] if opened else None

    secret = await run_in_threadpool(open_it) if token else None
    if secret is None:
        failed = page(
            request,
            "signin.html",
            None,
            title="Sign in",
            next=target,
            error="That token is not valid (or was revoked). Create one with `meshrun token create --project P`.",
        )
        failed.status_code = 401
        return failed
    resp = RedirectResponse(target, status_code=303)
    resp.set_cookie(
        SESSION_COOKIE,
        secret,
        max_age=int(settings.console_session_hours * 3600),
        httponly=True,
        samesite="lax",
        secure=request.url.scheme == "https",
        path="/",
    )
    return resp


@router.post("/signout")
async def signout(request: Request) -> Response:
    secret = request.cookies.get(SESSION_COOKIE)
    if secret:
        await run_in_threadpool(_close, request, secret)
    resp = RedirectResponse("/signin" if request.app.state.settings.auth_enabled else "/", status_code=303)
    resp.delete_cookie(SESSION_COOKIE, path="/")
    return resp


def _close(request: Request, secret: str) -> None:
    with session_scope(request.app.state.session_factory) as s:
        close_session(s, secret)

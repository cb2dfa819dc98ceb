"""The console's pages: runs, a run, compare, sweeps, a sweep, cluster (plan and sign-in live in ``forms``).

Thin like the API routes: each reads through ``service.store`` with the caller's project scope and renders a
template; charts and actions run in the browser against the public ``/v1`` API (``static/console.js``).
"""

from __future__ import annotations

import re
from collections import Counter
from datetime import datetime
from typing import Annotated, Any

import yaml
from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, Response
from starlette.concurrency import run_in_threadpool

from api.spec import Plan, RunSpec, RunStatus
from service import store, sweeps
from service.app.console.web import (
    STATUS_ORDER,
    console_principal,
    not_found_page,
    page,
    ray_job_link,
    sign_in_redirect,
    templates,
)
from service.app.deps import Principal
from service.app.pagination import decode_cursor, encode_cursor
from service.errors import NotFound
from service.store.cost import cost_of
from service.store.db import session_scope
from service.store.goodput import run_goodput
from service.store.models import Run

router = APIRouter(include_in_schema=False)

RUNS_PAGE = 50
ACTIVE = {RunStatus.QUEUED.value, RunStatus.STARTING.value, RunStatus.RUNNING.value, RunStatus.PREEMPTED.value}
TIMELINE_EVENTS = 300
MAX_COMPARE = 10


def _scope(principal: Principal) -> str | None:
    return principal.scope


# ------------------------------------------------------------------------------------------------- runs
def run_row(run: Run, summary: dict[str, Any] | None) -> dict[str, Any]:
    """What a runs-table row shows."""
    steps = int((run.spec.get("train") or {}).get("steps") or 0)
    s = summary or {}
    done = int(s.get("steps_done") or 0)
    early = bool(
        run.sweep_id
        and run.status == RunStatus.CANCELLED.value
        and (run.status_reason or "").startswith("early-stopped")
    )
    return {
        "id": run.id,
        "name": run.name,
        "project": run.project,
        "status": run.status,
        "reason": run.status_reason,
        "layout": run.spec.get("layout") or {},
        "steps": steps,
        "steps_done": done,
        "progress": min(1.0, done / steps) if steps else 0.0,
        "loss": s.get("final_loss"),
        "tokens_per_s": s.get("mean_tokens_per_s"),
        "mfu": s.get("mean_mfu"),
        "created_at": run.created_at,
        "sweep_id": run.sweep_id,
        "attempts": run.attempts or 0,
        "active": run.status in ACTIVE,
        # a sweep trial its scheduler stopped early is CANCELLED with the scheduler's reason: shown as what it is,
        # and not offered a resume (the sweep measured what it needed)
        "shown_status": "EARLY_STOPPED" if early else run.status,
        "resumable": run.status in (RunStatus.FAILED.value, RunStatus.CANCELLED.value) and not early,
    }


def _summaries(session: Any, runs: list[Run]) -> dict[str, dict[str, Any] | None]:
    stats = store.get_stats(session, run_ids=[r.id for r in runs if r.summary is None])
    return {r.id: r.summary or store.stats_summary(stats.get(r.id)) for r in runs}


def _runs_table(request: Request, principal: Principal, status: list[str], q: str, sweep: str, cursor: str | None):
    wanted = [s for s in status if s in STATUS_ORDER]
    after = decode_cursor(cursor, "runs", datetime, str) if cursor else None
    with session_scope(request.app.state.session_factory) as s:
        rows, total, exact = store.list_runs(
            s,
            project=_scope(principal),
            status=wanted or None,
            name_contains=q.strip()[:128] or None,
            sweep_id=sweep.strip()[:64] or None,
            limit=RUNS_PAGE + 1,
            after=after,
        )
        more, rows = len(rows) > RUNS_PAGE, rows[:RUNS_PAGE]
        summ = _summaries(s, rows)
        items = [run_row(r, summ[r.id]) for r in rows]
    nxt = encode_cursor("runs", rows[-1].created_at, rows[-1].id) if more else None
    return {
        "runs": items,
        "total": total,
        "total_exact": exact,
        "next_cursor": nxt,
        "filters": {"status": wanted, "q": q, "sweep": sweep},
        "cursor": cursor,
        "any_active": any(i["active"] for i in items),
    }


StatusQ = Annotated[list[str] | None, Query(max_length=16)]
TextQ = Annotated[str, Query(max_length=128)]
CursorQ = Annotated[str | None, Query(max_length=512)]


@router.get("/", response_class=HTMLResponse)
def runs_page(
    request: Request, status: StatusQ = None, q: TextQ = "", sweep: TextQ = "", cursor: CursorQ = None
) -> Response:
    principal = console_principal(request)
    if principal is None:
        return sign_in_redirect(request)
    ctx = _runs_table(request, principal, status or [], q, sweep, cursor)
    return page(request, "runs.html", principal, title="Runs", **ctx)


@router.get("/ui/runs", response_class=HTMLResponse)
def runs_table(
    request: Request, status: StatusQ = None, q: TextQ = "", sweep: TextQ = "", cursor: CursorQ = None
) -> Response:
    principal = console_principal(request)
    if principal is None:
        return sign_in_redirect(request)
    ctx = _runs_table(request, principal, status or [], q, sweep, cursor)
    return templates.TemplateResponse(request, "_runs_table.html", {"principal": principal, **ctx})


# -------------------------------------------------------------------------------------------------- run
def _plan(run: Run) -> Plan | None:
    try:
        return Plan.model_validate(run.plan) if run.plan else None
    except ValueError:
        return None


def _run_context(request: Request, principal: Principal, run_id: str) -> dict[str, Any]:
    with session_scope(request.app.state.session_factory) as s:
        run = store.get_run(s, run_id=run_id, project=_scope(principal))
        summary = _summaries(s, [run])[run.id]
        events = store.list_events(s, run_id=run.id, limit=TIMELINE_EVENTS + 1, newest_first=True)
        attempts = store.list_attempts(s, run_id=run.id)
        checkpoints = store.list_checkpoints(s, run_id=run.id, limit=101)
        stragglers = store.list_events(s, run_id=run.id, kinds=["straggler"], limit=50, newest_first=True)
        goodput = run_goodput(s, run=run) if run.started_at is not None else None
    more_events = len(events) > TIMELINE_EVENTS
    spec = RunSpec.model_validate(run.spec)
    return {
        "run": run,
        "row": run_row(run, summary),
        "summary": summary or {},
        "spec": spec,
        "spec_yaml": yaml.safe_dump(spec.model_dump(mode="json", exclude_none=True), sort_keys=False),
        "plan": _plan(run),
        "events": list(reversed(events[:TIMELINE_EVENTS])),
        "more_events": more_events,
        "attempts": attempts,
        "checkpoints": checkpoints[:100],
        "more_checkpoints": len(checkpoints) > 100,
        "stragglers": stragglers,
        "straggler_ranks": sorted(
            Counter(int(r) for e in stragglers for r in re.findall(r"\brank[ =:]?(\d+)", e.reason or "")).items()
        ),
        "goodput": goodput,
        "cost": cost_of(run, attempts),
        "goodput_lost": sorted(
            ((k.replace("_", " "), v) for k, v in (goodput or {}).get("lost_s", {}).items() if v >= 0.5),
            key=lambda kv: -kv[1],
        ),
        "goodput_by_attempt": {d["attempt"]: d for d in (goodput or {}).get("attempts_detail", [])},
        "ray_link": ray_job_link(request, principal, run.ray_job_id, run.dashboard_url),
        "per_rank_peaks": sorted(
            ((int(k), int(v)) for k, v in ((summary or {}).get("peak_memory_bytes_per_rank") or {}).items()),
        ),
    }


@router.get("/runs/{run_id}", response_class=HTMLResponse)
def run_page(request: Request, run_id: str) -> Response:
    principal = console_principal(request)
    if principal is None:
        return sign_in_redirect(request)
    try:
        ctx = _run_context(request, principal, run_id[:64])
    except NotFound:
        return not_found_page(request, principal, f"There is no run '{run_id[:64]}' in your project.")
    return page(request, "run.html", principal, title=ctx["run"].name, **ctx)


@router.get("/ui/runs/{run_id}/timeline", response_class=HTMLResponse)
def run_timeline(request: Request, run_id: str) -> Response:
    principal = console_principal(request)
    if principal is None:
        return sign_in_redirect(request)
    try:
        ctx = _run_context(request, principal, run_id[:64])
    except NotFound:
        return Response(status_code=404)
    return templates.TemplateResponse(request, "_run_live.html", {"principal": principal, **ctx})


# ---------------------------------------------------------------------------------------------- compare
def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists and scalars are leaves."""
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        out.update(flatten(v, key) if isinstance(v, dict) else {key: v})
    return out


def differing_fields(specs: list[dict[str, Any]]) -> list[tuple[str, list[Any]]]:
    """The spec fields whose values are not all equal, with each run's value (missing = None)."""
    flat = [flatten(s) for s in specs]
    keys = sorted({k for f in flat for k in f})
    out = []
    for k in keys:
        vals = [f.get(k) for f in flat]
        if len({repr(v) for v in vals}) > 1:
            out.append((k, vals))
    return out


@router.get("/compare", response_class=HTMLResponse)
def compare_page(request: Request, run: Annotated[list[str] | None, Query(max_length=64)] = None) -> Response:
    principal = console_principal(request)
    if principal is None:
        return sign_in_redirect(request)
    ids = list(dict.fromkeys(run or []))[:MAX_COMPARE]
    with session_scope(request.app.state.session_factory) as s:
        chosen: list[Run] = []
        missing: list[str] = []
        for rid in ids:
            try:
                chosen.append(store.get_run(s, run_id=rid, project=_scope(principal)))
            except NotFound:
                missing.append(rid)
        recent, _, _ = store.list_runs(s, project=_scope(principal), limit=50, count=False)
        summ = _summaries(s, chosen + recent)
        rows = [run_row(r, summ[r.id]) for r in chosen]
        recent_rows = [run_row(r, summ[r.id]) for r in recent]
        specs = [RunSpec.model_validate(r.spec).model_dump(mode="json") for r in chosen]
    return page(
        request,
        "compare.html",
        principal,
        title="Compare",
        runs=rows,
        recent=recent_rows,
        chosen_ids=[r["id"] for r in rows],
        missing=missing,
        diffs=differing_fields(specs) if len(specs) >= 2 else [],
        max_compare=MAX_COMPARE,
    )


# ----------------------------------------------------------------------------------------------- sweeps
@router.get("/sweeps", response_class=HTMLResponse)
def sweeps_page(request: Request, cursor: CursorQ = None) -> Response:
    principal = console_principal(request)
    if principal is None:
        return sign_in_redirect(request)
    after = decode_cursor(cursor, "sweeps", datetime, str) if cursor else None
    with session_scope(request.app.state.session_factory) as s:
        rows, total, _ = sweeps.list_sweeps(s, project=_scope(principal), limit=RUNS_PAGE + 1, after=after)
        more, rows = len(rows) > RUNS_PAGE, rows[:RUNS_PAGE]
        items = [sweeps.sweep_public(s, sw) for sw in rows]
    nxt = encode_cursor("sweeps", rows[-1].created_at, rows[-1].id) if more else None
    return page(request, "sweeps.html", principal, title="Sweeps", sweeps=items, total=total, next_cursor=nxt)


@router.get("/sweeps/{sweep_id}", response_class=HTMLResponse)
def sweep_page(request: Request, sweep_id: str) -> Response:
    principal = console_principal(request)
    if principal is None:
        return sign_in_redirect(request)
    with session_scope(request.app.state.session_factory) as s:
        try:
            sw = sweeps.get_sweep(s, sweep_id=sweep_id[:64], project=_scope(principal))
        except NotFound:
            return not_found_page(request, principal, f"There is no sweep '{sweep_id[:64]}' in your project.")
        pub = sweeps.sweep_public(s, sw)
    counts: dict[str, int] = {}
    for t in pub.trials:
        counts[t.status] = counts.get(t.status, 0) + 1
    points = sorted(
        (t.predicted_tokens_per_s, t.measured_tokens_per_s, t.id)
        for t in pub.trials
        if t.predicted_tokens_per_s is not None and t.measured_tokens_per_s is not None
    )
    return page(
        request,
        "sweep.html",
        principal,
        title=pub.name,
        sweep=pub,
        counts=counts,
        scatter={"x": [p[0] for p in points], "y": [p[1] for p in points], "trial": [p[2] for p in points]},
        calibration=pub.calibration or {},
    )


# ---------------------------------------------------------------------------------------------- cluster
@router.get("/cluster", response_class=HTMLResponse)
async def cluster_page(request: Request) -> Response:
    principal = console_principal(request)
    if principal is None:
        return sign_in_redirect(request)
    runtime = getattr(request.app.state, "runtime", None)
    cluster, cluster_error = None, None
    if runtime is None:
        cluster_error = "This service process runs no Ray runtime (started with --no-scheduler)."
    else:
        try:
            cluster = await run_in_threadpool(runtime.cluster)
        except Exception as e:  # the page still shows the queue
            cluster_error = f"The Ray cluster is not reachable: {e}"

    def read() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        with session_scope(request.app.state.session_factory) as s:
            queued = store.queued_runs(s)
            active = store.active_runs(s)
            mine = [(i + 1, r) for i, r in enumerate(queued) if principal.scope is None or r.project == principal.scope]
            act = [r for r in active if principal.scope is None or r.project == principal.scope]
            summ = _summaries(s, [r for _, r in mine] + act)
            q = [{"position": pos, "priority": r.priority or 0, **run_row(r, summ[r.id])} for pos, r in mine]
            return q, [run_row(r, summ[r.id]) for r in act]

    queue, active = await run_in_threadpool(read)
    return page(
        request,
        "cluster.html",
        principal,
        title="Cluster",
        cluster=cluster,
        cluster_error=cluster_error,
        queue=queue,
        active=active,
    )

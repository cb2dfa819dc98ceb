"""Run commands: ``submit``, ``runs``, ``show``, ``metrics``, ``events``, ``checkpoints``, ``logs``, ``cancel``,
``resume``."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from api.cli._common import (
    EXIT_CANCELLED,
    EXIT_CONFLICT,
    EXIT_OK,
    EXIT_RUN_FAILED,
    EXIT_USAGE,
    _escape,
    _fail,
    _gib,
    _load_or_usage,
    _num,
    _pct,
    _rate,
    _state,
    _status,
    _ts,
    _usage,
    _usd,
    app,
    command,
    cost_line,
    emit_json,
    err,
    out,
)
from api.cli.observe import print_breakdown
from api.sdk import (
    MeshrunError,
    NotFoundError,
    RunStatus,
    parse_layout,
)
from api.sdk._specs import apply_overrides
from api.spec import layout_label
from api.spec.units import format_bytes


def _peak_from_metrics(run: Any) -> int | None:
    try:
        rows = run.metrics()
    except (MeshrunError, AttributeError):
        return None
    peaks = [r.peak_memory_bytes for r in rows if r.peak_memory_bytes]
    return max(peaks) if peaks else None


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # colour and cursor sequences


def console_link(client: Any, run_id: str) -> str:
    """The run's page in the web console of the service this client talks to."""
    return f"{client.base_url}/runs/{run_id}"


def print_summary(run: Any, console: Console | None = None) -> None:
    """The end-of-run summary: status, steps, final loss, tokens/s, MFU, peak memory, console and dashboard URLs.

    Aligned ``label  value`` lines, each printed whole (soft wrap; no table that would cut a link with "…" at 80
    columns or in a pipe)."""
    c = console or out()
    s = run.summary
    rows: list[tuple[str, str]] = [("run", _escape(f"{run.id} ({run.name})"))]
    rows.append(("status", _status(run.status) + (f"  {_escape(run.status_reason)}" if run.status_reason else "")))
    rows.append(("layout", layout_label(run.spec.layout) + (f"  world {run.plan.world_size}" if run.plan else "")))
    if s is not None:
        rows.append(("steps", f"{s.steps_done}/{run.spec.train.steps}"))
        rows.append(("final loss", _num(s.final_loss)))
        rows.append(("tokens/s (mean of all steps)", _rate(s.mean_tokens_per_s)))
        rows.append(("MFU", _pct(s.mean_mfu)))
        if s.peak_memory_bytes_per_rank:
            peak = max(s.peak_memory_bytes_per_rank.values())
            rows.append(("peak memory", f"{_gib(peak)} GiB (max over {len(s.peak_memory_bytes_per_rank)} ranks)"))
        elif (peak := _peak_from_metrics(run)) is not None:
            rows.append(("peak memory", f"{_gib(peak)} GiB (max over ranks)"))
        if s.wall_time_s is not None:
            rows.append(("wall time", f"{s.wall_time_s:.1f} s"))
    client = getattr(run, "_client", None)
    if client is not None and getattr(client, "base_url", None):
        rows.append(("console", _escape(console_link(client, run.id))))
    if run.dashboard_url:
        rows.append(("ray job", _escape(run.dashboard_url)))
    width = max(len(label) for label, _ in rows)
    for label, value in rows:
        c.print(f"[bold]{label.ljust(width)}[/]  {value}", soft_wrap=True)


def _exit_for_run(run: Any) -> int:
    v = RunStatus(run.status).value
    return {"SUCCEEDED": EXIT_OK, "FAILED": EXIT_RUN_FAILED, "CANCELLED": EXIT_CANCELLED}.get(v, EXIT_OK)


# ------------------------------------------------------------------------------------------------ runs
@command(app, "submit")
def submit(
    ctx: typer.Context,
    file: Optional[Path] = typer.Argument(None, help="Run spec (YAML/JSON)."),
    set_: list[str] = typer.Option([], "--set", help="Override a field: key.sub=value (repeatable)."),
    name: Optional[str] = typer.Option(None, help="Run name (overrides the spec's)."),
    from_sweep: Optional[str] = typer.Option(
        None, "--from-sweep", help="Use this sweep's best layout and micro-batch (base spec = the sweep's)."
    ),
    wait: bool = typer.Option(False, "--wait", "-w", help="Wait for the run to finish; exit code = outcome."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Live progress bar with --wait."),
    timeout: Optional[float] = typer.Option(None, "--timeout", help="With --wait: give up after this many seconds."),
    idempotency_key: Optional[str] = typer.Option(None, help="Re-submitting with the same key returns the same run."),
    as_json: bool = typer.Option(False, "--json", help="Print the run as JSON (only JSON on stdout)."),
) -> None:
    """Submit a run spec. With --wait, show live progress and the summary; exit 0 only if it SUCCEEDED."""
    st = _state(ctx)
    client = st.client()
    if file is None and from_sweep is None:
        _fail("give a spec FILE or --from-sweep SWEEP_ID", EXIT_USAGE)
    body: dict[str, Any] = _load_or_usage(file) if file is not None else {}
    if from_sweep is not None:
        sweep = client.sweeps.get(from_sweep)
        try:
            best = sweep.best_run_spec()
        except ValueError as e:
            _fail(str(e), EXIT_CONFLICT, param="from_sweep")
        if body:
            body["layout"] = best.layout.model_dump(mode="json")
            body.setdefault("batch", {})["micro_batch_size"] = best.batch.micro_batch_size
        else:
            body = best.model_dump(mode="json")
            body["name"] = f"{best.name}-best"[:128]
    body = _usage(lambda: apply_overrides(body, set_))
    if name:
        body["name"] = name
    run = client.runs.create(body, idempotency_key=idempotency_key)
    if not wait:
        if as_json:
            emit_json(run)
        else:
            out().print(
                f"submitted [bold]{run.id}[/] ({run.name}) {_status(run.status)}  {layout_label(run.spec.layout)}"
            )
            for w in run.plan.warnings if run.plan else []:
                err().print(f"[yellow]warning:[/] {_escape(w)}")
            out().print(f"console: {console_link(client, run.id)}")
            err().print(f"follow it with: meshrun show {run.id} | meshrun logs {run.id} --follow")
        return
    if not as_json:
        err().print(f"submitted [bold]{run.id}[/] ({run.name}) {layout_label(run.spec.layout)}")
        err().print(f"console: {console_link(client, run.id)}", soft_wrap=True)
    try:
        run = client.runs.wait(run.id, progress=err() if (progress and not as_json) else False, timeout=timeout)
    except KeyboardInterrupt:
        err().print(f"[yellow]stopped waiting; run {run.id} goes on[/] (meshrun cancel {run.id} stops it)")
        raise typer.Exit(130) from None
    if as_json:
        emit_json(run)
    else:
        print_summary(run)
    raise typer.Exit(_exit_for_run(run))


@command(app, "runs")
def runs(
    ctx: typer.Context,
    status: Optional[list[str]] = typer.Option(None, "--status", "-s", help="Filter by status (repeatable)."),
    name: Optional[str] = typer.Option(None, help="Filter by exact name."),
    sweep: Optional[str] = typer.Option(None, "--sweep", help="Runs of this sweep."),
    limit: int = typer.Option(20, min=1, max=500),
    offset: int = typer.Option(0, min=0),
    cursor: Optional[str] = typer.Option(None, help="Continue after a page (the cursor the previous page printed)."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """List runs, newest first, one page at a time."""
    page = (
        _state(ctx)
        .client()
        .runs.list(status=status or None, name=name, sweep_id=sweep, limit=limit, offset=offset, cursor=cursor)
    )
    if as_json:
        emit_json(page)
        return
    total = "?" if page.total is None else f"{page.total}{'' if page.total_exact else '+'}"
    first = page.offset + 1 if page.items else 0
    t = Table(title=f"runs {first}-{page.offset + len(page.items)} of {total}" if not cursor else "runs")
    for col in ("id", "name", "status", "layout", "steps", "loss", "tok/s", "created"):
        t.add_column(
            col, justify="right" if col in ("steps", "loss", "tok/s") else "left", no_wrap=col in ("id", "status")
        )
    for r in page.items:
        s = r.summary
        t.add_row(
            r.id,
            r.name,
            _status(r.status),
            layout_label(r.spec.layout),
            f"{s.steps_done if s else '-'}/{r.spec.train.steps}",
            _num(s.final_loss if s else None),
            _rate(s.mean_tokens_per_s if s else None),
            _ts(r.created_at, short=True),
        )
    out().print(t)
    if page.next_cursor:
        err().print(f"more: meshrun runs --limit {limit} --cursor {page.next_cursor}", soft_wrap=True)


@command(app, "show")
def show(
    ctx: typer.Context, run_id: str = typer.Argument(..., metavar="ID"), as_json: bool = typer.Option(False, "--json")
) -> None:
    """Details of one run: status, layout, plan, prediction, summary, and where the time goes (breakdown)."""
    client = _state(ctx).client()
    run = client.runs.get(run_id)
    try:
        bd = client.runs.breakdown(run_id)
    except MeshrunError as e:  # an older service without /breakdown: show the rest
        bd = None
        err().print(f"breakdown unavailable: {e}")
    if as_json:
        emit_json({**run.model_dump(mode="json"), "breakdown": bd.model_dump(mode="json") if bd else None})
        return
    c = out()
    print_summary(run, c)
    t = Table(show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold")
    t.add_column()
    m = run.spec.model
    t.add_row("model", f"{m.name}/{m.preset}" + (f"  {run.plan.model.n_params:,} params" if run.plan else ""))
    t.add_row("batch", f"global {run.spec.batch.global_batch_size}, micro {run.spec.batch.micro_batch_size}")
    t.add_row("attempts", str(run.attempts))
    if run.plan:
        pl = run.plan
        t.add_row(
            "plan",
            f"world {pl.world_size} = dp {pl.dp} (replicate {pl.dp_replicate} x shard {pl.dp_shard}) x tp {pl.tp} "
            f"x pp {pl.pp}, zero {pl.zero_stage}, {pl.microbatches_per_step} micro-batches/step, "
            f"{pl.tokens_per_step:,} tokens/step, {pl.device}, per worker {pl.resources_per_worker}",
        )
    if run.plan and run.plan.predicted:
        p = run.plan.predicted
        iv = getattr(p, "step_time_interval", None)
        t.add_row(
            "predicted",
            f"{_gib(p.memory_bytes.total)} GiB/rank, {p.step_time_s.total:.3f} s/step"
            + (f" ({iv.low_s:.3f}-{iv.high_s:.3f}, {iv.kernels})" if iv is not None else "")
            + f", {_rate(p.tokens_per_s)} tok/s"
            + (f", MFU {p.mfu:.1%}" if p.mfu else "")
            + (f", factors: {p.calibration}" if getattr(p, "calibration", None) else ""),
        )
        mem = p.memory_bytes
        t.add_row(
            "  memory/rank",
            f"params {_gib(mem.params)}, grads {_gib(mem.grads)}, optimizer {_gib(mem.optimizer)}, "
            f"activations {_gib(mem.activations)}, buffers {_gib(mem.buffers)} GiB",
        )
        st = p.step_time_s
        parts = [(k, getattr(st, k)) for k in ("compute", "tp_comm", "pp_comm", "pp_bubble", "dp_comm", "optimizer")]
        parts.append(("other", st.other))
        t.add_row("  step time", ", ".join(f"{k} {v:.3f}" for k, v in parts if v) + " s")
        if p.cost is not None and p.cost.usd_for_steps is not None:
            t.add_row("  cost", f"{_usd(p.cost.usd_for_steps)} for {p.cost.steps} steps ({p.cost.price_source} price)")
    if run.cost is not None:
        t.add_row("cost", cost_line(run.cost))
    for w in run.plan.warnings if run.plan else []:
        t.add_row("warning", f"[yellow]{_escape(w)}[/]")
    t.add_row("created", _ts(run.created_at))
    t.add_row("started", _ts(run.started_at))
    t.add_row("finished", _ts(run.finished_at))
    if run.ray_job_id:
        t.add_row("ray job id", run.ray_job_id)
    if run.started_at is not None:
        try:
            t.add_row("goodput", goodput_line(_state(ctx).client().runs.goodput(run_id)))
        except NotFoundError:
            pass  # a service from before goodput
    c.print(t)
    if bd is not None:
        print_breakdown(bd, c)


def goodput_line(g: Any) -> str:
    """``87.5% of 412 s; lost: queue 20 s, startup 18 s, ...`` (causes over half a second)."""
    head = f"{g.goodput:.1%} of {g.wall_s:.0f} s" if g.goodput is not None else "n/a"
    lost = [(k, v) for k, v in g.lost_s.model_dump().items() if v >= 0.5]
    tail = ", ".join(f"{k.replace('_', ' ')} {v:.0f} s" for k, v in lost)
    redone = f"; {g.recomputed_steps} steps redone" if g.recomputed_steps else ""
    per = []
    for a in g.attempts_detail:  # empty from a service before the split
        mine = ", ".join(f"{k.replace('_', ' ')} {v:.0f} s" for k, v in a.lost_s.model_dump().items() if v >= 0.5)
        per.append(f"#{a.attempt} {a.productive_s:.0f} s" + (f" ({mine})" if mine else ""))
    attempts = f"; per attempt: {'; '.join(per)}" if len(per) > 1 else ""
    reps = [  # replica mode: what each replica trained, and how long the run went on without it
        f"r{r.replica} {r.steps} steps" + (f", out {r.absent_s:.0f} s after {r.losses} loss(es)" if r.losses else "")
        for r in (getattr(g, "replicas", None) or [])
    ]
    replicas = f"; per replica: {'; '.join(reps)}" if reps else ""
    return head + (f"; lost: {tail}" if tail else "") + redone + attempts + replicas


@command(app, "metrics")
def metrics(
    ctx: typer.Context,
    run_id: str = typer.Argument(..., metavar="ID"),
    since_step: int = typer.Option(0, min=0, help="Only steps after this one."),
    attempt: Optional[int] = typer.Option(None, min=1, help="Rows of one attempt (default: latest per step)."),
    tail: Optional[int] = typer.Option(None, min=1, help="Show only the last N rows."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Per-step metrics of a run."""
    rows = _state(ctx).client().runs.metrics(run_id, since_step=since_step, attempt=attempt)
    if tail:
        rows = rows[-tail:]
    if as_json:
        emit_json(rows)
        return
    t = Table(title=f"metrics of {run_id}")
    for col in ("step", "attempt", "loss", "tok/s", "step s", "MFU", "peak GiB", "comm", "grad norm", "lr"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(
            str(r.step),
            str(r.attempt),
            _num(r.loss),
            _rate(r.tokens_per_s),
            _num(r.step_time_s, ".3f"),
            _pct(r.mfu),
            _gib(r.peak_memory_bytes),
            _pct(r.comm_fraction),
            _num(r.grad_norm, ".3f"),
            _num(r.lr, ".2e"),
        )
    out().print(t)


@command(app, "events")
def events(
    ctx: typer.Context, run_id: str = typer.Argument(..., metavar="ID"), as_json: bool = typer.Option(False, "--json")
) -> None:
    """State changes and other events of a run."""
    items = _state(ctx).client().runs.events(run_id)
    if as_json:
        emit_json(items)
        return
    t = Table(title=f"events of {run_id}")
    for col in ("time", "kind", "transition", "reason", "actor"):
        t.add_column(col)
    for e in items:
        tr = f"{e.from_status or ''} -> {e.to_status}" if e.to_status else ""
        t.add_row(_ts(e.time), e.kind, tr, _escape(e.reason or ""), e.actor or "")
    out().print(t)


@command(app, "checkpoints")
def checkpoints(
    ctx: typer.Context, run_id: str = typer.Argument(..., metavar="ID"), as_json: bool = typer.Option(False, "--json")
) -> None:
    """Checkpoints written by a run."""
    items = _state(ctx).client().runs.checkpoints(run_id)
    if as_json:
        emit_json(items)
        return
    t = Table(title=f"checkpoints of {run_id}")
    for col in ("attempt", "step", "size", "path", "created"):
        t.add_column(col)
    for ck in items:
        size = format_bytes(ck.size_bytes)
        t.add_row(str(ck.attempt), str(ck.step), size, ck.path, _ts(ck.created_at))
    out().print(t)


@command(app, "export")
def export(
    ctx: typer.Context,
    run_id: str = typer.Argument(..., metavar="RUN_ID"),
    out_dir: str = typer.Option(..., "--out", help="Directory to write, on the service's filesystem."),
    fmt: str = typer.Option("hf", "--format", help="hf: Hugging Face config.json + model.safetensors."),
    step: Optional[int] = typer.Option(None, "--checkpoint", min=0, help="Step of the checkpoint (default: latest)."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Export a run's checkpoint (any layout) as a Hugging Face model that transformers loads."""
    res = _state(ctx).client().runs.export(run_id, out=out_dir, format=fmt, checkpoint=step)
    if as_json:
        emit_json(res)
        return
    out().print(
        f"exported step {res.step} of {run_id} ({res.n_params:,} parameters) to {res.out}: {', '.join(res.files)}"
    )


@command(app, "logs")
def logs(
    ctx: typer.Context,
    run_id: str = typer.Argument(..., metavar="ID"),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new output until the run ends."),
    interval: float = typer.Option(1.0, min=0.1, help="Seconds between polls with --follow."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Driver and worker output of a run (from Ray)."""
    client = _state(ctx).client()
    if as_json:
        emit_json({"run_id": run_id, "logs": client.runs.logs(run_id)})
        return
    cursor: str | None = None
    plain = not sys.stdout.isatty()  # a pipe or a file gets no colour codes (Ray colours its log prefixes)

    def drain() -> None:
        # every page from the cursor on (the output written so far), then remember where it ended
        nonlocal cursor
        while True:
            page = client.runs.logs_page(run_id, cursor=cursor)
            sys.stdout.write(_ANSI.sub("", page.logs) if plain else page.logs)
            sys.stdout.flush()
            cursor = page.next_cursor or cursor
            if not page.has_more or not page.logs:
                return

    drain()
    if not follow:
        return
    try:
        while True:
            done = client.runs.get(run_id).done
            time.sleep(0 if done else interval)
            drain()
            if done:
                return
    except KeyboardInterrupt:
        return


@command(app, "cancel")
def cancel(
    ctx: typer.Context, run_id: str = typer.Argument(..., metavar="ID"), as_json: bool = typer.Option(False, "--json")
) -> None:
    """Cancel a queued or running run."""
    run = _state(ctx).client().runs.cancel(run_id)
    if as_json:
        emit_json(run)
    else:
        out().print(
            f"{run.id} {_status(run.status)}" + (f"  {_escape(run.status_reason)}" if run.status_reason else "")
        )


@command(app, "resume")
def resume(
    ctx: typer.Context,
    run_id: str = typer.Argument(..., metavar="ID"),
    layout: Optional[str] = typer.Option(None, "--layout", help='New layout, e.g. "dp=2,tp=1" (resharded).'),
    from_file: Optional[Path] = typer.Option(
        None, "--from-file", help="YAML with layout/batch/steps (or a run spec: its layout, batch, train.steps)."
    ),
    steps: Optional[int] = typer.Option(
        None, min=1, help="New total step count (the LR schedule continues from the checkpoint, no jump)."
    ),
    fresh: bool = typer.Option(
        False, "--fresh", help="The run has no checkpoint: start it again from step 0 (refused without this)."
    ),
    wait: bool = typer.Option(False, "--wait", "-w"),
    progress: bool = typer.Option(True, "--progress/--no-progress"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Resume a stopped run from its latest checkpoint, optionally on another layout."""
    client = _state(ctx).client()
    new_layout: Any = None
    batch: Any = None
    if from_file is not None:
        data = _load_or_usage(from_file)
        new_layout, batch = data.get("layout"), data.get("batch")
        steps = steps or data.get("steps") or (data.get("train") or {}).get("steps")
    if layout is not None:
        new_layout = _usage(lambda: parse_layout(layout))
    run = client.runs.resume(run_id, layout=new_layout, batch=batch, steps=steps, fresh=fresh)
    if wait:
        run = client.runs.wait(run.id, progress=err() if (progress and not as_json) else False)
    if as_json:
        emit_json(run)
    elif wait:
        print_summary(run)
    else:
        out().print(f"resumed {run.id} {_status(run.status)}  {layout_label(run.spec.layout)}")
    if wait:
        raise typer.Exit(_exit_for_run(run))

"""``meshrun sweep`` and ``meshrun sweeps list|show|wait|cancel``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer
from rich.table import Table

from api.cli._common import (
    EXIT_CANCELLED,
    EXIT_OK,
    EXIT_RUN_FAILED,
    EXIT_USAGE,
    _escape,
    _fail,
    _gib,
    _load_or_usage,
    _pct,
    _rate,
    _state,
    _ts,
    _usage,
    app,
    command,
    emit_json,
    err,
    out,
    sweeps_app,
)
from api.sdk import (
    parse_layouts,
)
from api.sdk._specs import apply_overrides
from api.spec import layout_label


# ----------------------------------------------------------------------------------------------- sweeps
def _sweep_table(sweep: Any) -> Table:
    t = Table(title=f"sweep {sweep.id} ({sweep.name}) {sweep.status}  objective {sweep.objective}")
    for col in ("trial", "run", "layout", "mb", "status", "pred tok/s", "tok/s", "MFU", "peak GiB", "reason"):
        t.add_column(col)
    best_id = sweep.best_trial.id if sweep.best_trial else None
    for tr in sweep.trials:
        mark = " *" if tr.id == best_id else ""
        t.add_row(
            f"{tr.id}{mark}",
            tr.run_id or "-",
            layout_label(tr.layout),
            str(tr.micro_batch_size),
            f"{tr.status} ({tr.phase})" if tr.phase else tr.status,
            _rate(tr.predicted_tokens_per_s),
            _rate(tr.measured_tokens_per_s),
            _pct(tr.measured_mfu),
            _gib(tr.peak_memory_bytes),
            _escape(tr.reason or ""),
        )
    return t


@command(app, "sweep")
def sweep(
    ctx: typer.Context,
    file: Path = typer.Argument(..., help="A run spec (the base) or a full sweep spec (YAML/JSON)."),
    layouts: Optional[str] = typer.Option(
        None, help='"auto" (added to the spec\'s own layouts, if it lists any) or "dp=4; dp=2,tp=2; tp=2,pp=2".'
    ),
    micro_batch_sizes: Optional[str] = typer.Option(None, help='Comma list, e.g. "1,2,4".'),
    max_trials: Optional[int] = typer.Option(None, min=1),
    steps_per_trial: Optional[int] = typer.Option(None, min=2),
    objective: Optional[str] = typer.Option(
        None, help="tokens_per_s | mfu | cost (tokens per device-second: the cheapest per token)."
    ),
    name: Optional[str] = typer.Option(None),
    set_: list[str] = typer.Option([], "--set", help="Override a field of the sweep spec: key=value."),
    wait: bool = typer.Option(False, "--wait", "-w"),
    progress: bool = typer.Option(True, "--progress/--no-progress"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Sweep layouts/micro-batches with Ray Tune and report the fastest that fits."""
    data = _load_or_usage(file)
    body: dict[str, Any] = data if "base" in data else {"name": f"{data.get('name', 'run')}-sweep"[:128], "base": data}
    search = dict(body.get("search") or {})
    if layouts is not None:
        parsed = _usage(lambda: parse_layouts(layouts))
        listed = search.get("layouts")
        if parsed == "auto" and isinstance(listed, list) and listed:
            # auto ADDS to the spec's own layouts (they are kept, tried first)
            search["add_auto"] = True
            err().print(
                f"--layouts auto: adding the planner's candidates for the live cluster to the spec's "
                f"{len(listed)} layouts"
            )
        else:
            search["layouts"] = parsed
    if micro_batch_sizes is not None:
        try:
            search["micro_batch_sizes"] = [int(x) for x in micro_batch_sizes.split(",") if x.strip()]
        except ValueError:
            _fail(f"--micro-batch-sizes must be integers like 1,2,4, got {micro_batch_sizes!r}", EXIT_USAGE)
    if search:
        body["search"] = search
    budget = dict(body.get("budget") or {})
    if max_trials is not None:
        budget["max_trials"] = max_trials
    if steps_per_trial is not None:
        budget["steps_per_trial"] = steps_per_trial
    if budget:
        body["budget"] = budget
    if objective is not None:
        body["objective"] = objective
    if name is not None:
        body["name"] = name
    body = _usage(lambda: apply_overrides(body, set_))
    client = _state(ctx).client()
    sw = client.sweeps.create(body)
    if wait:
        sw = client.sweeps.wait(sw.id, progress=err() if (progress and not as_json) else False)
    if as_json:
        emit_json(sw)
    else:
        out().print(_sweep_table(sw))
        if sw.best_trial is not None:
            out().print(
                f"best: {layout_label(sw.best_trial.layout)} micro-batch {sw.best_trial.micro_batch_size}; "
                f"run it with: meshrun submit --from-sweep {sw.id}"
            )
        elif not wait:
            err().print(f"follow it with: meshrun sweeps show {sw.id}")
    if wait:
        raise typer.Exit(
            {"SUCCEEDED": EXIT_OK, "CANCELLED": EXIT_CANCELLED}.get(str(sw.status).upper(), EXIT_RUN_FAILED)
        )


@command(sweeps_app, "list")
def sweeps_list(
    ctx: typer.Context,
    limit: int = typer.Option(20, min=1, max=1000),
    offset: int = typer.Option(0, min=0),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """List sweeps, newest first."""
    page = _state(ctx).client().sweeps.list(limit=limit, offset=offset)
    if as_json:
        emit_json(page)
        return
    t = Table(title=f"sweeps ({page.total})")
    for col in ("id", "name", "status", "trials", "best", "created"):
        t.add_column(col)
    for s in page.items:
        best = f"{layout_label(s.best_trial.layout)} mb{s.best_trial.micro_batch_size}" if s.best_trial else "-"
        t.add_row(s.id, s.name, s.status, str(len(s.trials)), best, _ts(s.created_at))
    out().print(t)


@command(sweeps_app, "show")
def sweeps_show(
    ctx: typer.Context, sweep_id: str = typer.Argument(..., metavar="ID"), as_json: bool = typer.Option(False, "--json")
) -> None:
    """Trials of a sweep (the best marked *)."""
    sw = _state(ctx).client().sweeps.get(sweep_id)
    if as_json:
        emit_json(sw)
    else:
        out().print(_sweep_table(sw))


@command(sweeps_app, "wait")
def sweeps_wait(
    ctx: typer.Context,
    sweep_id: str = typer.Argument(..., metavar="ID"),
    timeout: Optional[float] = typer.Option(None),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Wait for a sweep to finish (exit 0 if it SUCCEEDED)."""
    sw = _state(ctx).client().sweeps.wait(sweep_id, progress=False if as_json else err(), timeout=timeout)
    if as_json:
        emit_json(sw)
    else:
        out().print(_sweep_table(sw))
    raise typer.Exit({"SUCCEEDED": EXIT_OK, "CANCELLED": EXIT_CANCELLED}.get(str(sw.status).upper(), EXIT_RUN_FAILED))


@command(sweeps_app, "cancel")
def sweeps_cancel(
    ctx: typer.Context, sweep_id: str = typer.Argument(..., metavar="ID"), as_json: bool = typer.Option(False, "--json")
) -> None:
    """Cancel a sweep and its running trials."""
    sw = _state(ctx).client().sweeps.cancel(sweep_id)
    if as_json:
        emit_json(sw)
    else:
        out().print(f"{sw.id} {sw.status}")

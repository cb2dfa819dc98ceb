"""Where the time goes: ``breakdown`` (predicted vs measured step time per term, with a bar per term),
``profile`` (profile the next steps of a running run) and ``artifact`` (list or download a run's stored files)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from api.cli._common import _escape, _gib, _state, app, command, emit_json, out
from api.spec.units import format_bytes

BAR_WIDTH = 30


def _s(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1000:.1f} ms" if abs(x) < 1 else f"{x:.3f} s"


def _bar(x: float | None, top: float, char: str) -> str:
    if not x or top <= 0:
        return ""
    return char * max(1, round(BAR_WIDTH * x / top))


def _accounted(bd: Any) -> str:
    """One line: how much of the measured step the terms name (they tile it, so ~100%) and what is left."""
    total, left = bd.step_time_s.measured_s, getattr(bd, "unaccounted_s", None)
    if not total or left is None:
        return "named terms: the step is not measured yet"
    named = sum(r.measured_s or 0.0 for r in bd.terms)
    left = 0.0 if abs(left) < 1e-9 else left  # rounding: no "-0.0 ms"
    return f"named terms: {100 * named / total:.1f}% of the measured step (unaccounted {_s(left)})"


def print_breakdown(bd: Any, console: Console | None = None) -> None:
    """A table: one row per term with predicted and measured seconds, the measured share and two bars
    (predicted ░, measured █) on one scale; then the per-rank step and compute times."""
    c = console or out()
    if not bd.steps_measured and bd.step_time_s.predicted_s is None:
        c.print("breakdown: not measured yet (no measured step) and no prediction")
        return
    where = (
        f"mean of the typical half of {bd.steps_measured} steady steps ({bd.first_step}-{bd.last_step}, "
        f"{bd.warmup_steps_excluded} warm-up left out)"
        if bd.steps_measured
        else "not measured yet"
    )
    t = Table(title=f"where the time goes: {where}", title_justify="left")
    for col, just in (("term", "left"), ("predicted", "right"), ("measured", "right"), ("share", "right")):
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    t.add_column("predicted ░ / measured █")
    rows = [*bd.terms, bd.step_time_s]
    top = max([x for r in rows for x in (r.predicted_s, r.measured_s) if x] or [0.0])
    for r in rows:
        share = "-" if r.share is None else f"{100 * r.share:.0f}%"
        bars = _bar(r.predicted_s, top, "░") + "\n" + _bar(r.measured_s, top, "█")
        name = r.term.replace("_", " ") if r.term != "total" else "[bold]step (total)[/]"
        if r.measured_total_s:
            name += f" [dim](in flight {_s(r.measured_total_s)})[/]"
        t.add_row(name, _s(r.predicted_s), _s(r.measured_s), share, bars.strip("\n"))
    c.print(t)
    c.print(_accounted(bd))
    if bd.ranks and bd.steps_measured:
        rt = Table(title="per rank", title_justify="left")
        for col in ("rank", "node", "step", "compute", "vs peers", "peak GiB"):
            rt.add_column(col, justify="right" if col != "node" else "left")
        for rk in bd.ranks:
            vs = "-" if rk.compute_vs_peers is None else f"{rk.compute_vs_peers:.2f}x"
            rt.add_row(
                str(rk.rank),
                (rk.node_id or "-")[:12],
                _s(rk.step_time_s),
                _s(rk.compute_s),
                vs,
                _gib(rk.peak_memory_bytes),
            )
        c.print(rt)
    for s in bd.stragglers:
        c.print(f"[yellow]straggler[/]: {_escape(s)}")


@command(app, "breakdown")
def breakdown(
    ctx: typer.Context, run_id: str = typer.Argument(..., metavar="RUN"), as_json: bool = typer.Option(False, "--json")
) -> None:
    """Where the time goes: predicted vs measured step time per term (compute, tp/pp/dp communication, pipeline
    bubble, optimizer, data wait, other) and per rank."""
    bd = _state(ctx).client().runs.breakdown(run_id)
    if as_json:
        emit_json(bd)
        return
    print_breakdown(bd)


@command(app, "profile")
def profile(
    ctx: typer.Context,
    run_id: str = typer.Argument(..., metavar="RUN"),
    steps: int = typer.Option(3, "--steps", min=1, max=100, help="Steps to profile on every rank."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Profile the next steps of a running run (torch.profiler on every rank); the Chrome traces become run
    artifacts (meshrun artifact RUN)."""
    ack = _state(ctx).client().runs.profile(run_id, steps=steps)
    if as_json:
        emit_json(ack)
        return
    out().print(ack.message)


@command(app, "artifact")
def artifact(
    ctx: typer.Context,
    run_id: str = typer.Argument(..., metavar="RUN"),
    name: Optional[str] = typer.Argument(None, help="Artifact to download; omit to list them."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="File or directory (default: here)."),
    attempt: Optional[int] = typer.Option(None, min=1, help="Attempt that wrote it (default: the latest)."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """List a run's artifacts (profiles as Chrome-trace JSON: open them in Perfetto; stack dumps), or download one."""
    runs = _state(ctx).client().runs
    if name is None:
        items = runs.artifacts(run_id)
        if as_json:
            emit_json(items)
            return
        t = Table(title=f"artifacts of {run_id}")
        for col in ("attempt", "rank", "kind", "size", "name"):
            t.add_column(col)
        for a in items:
            rank = "-" if a.rank is None else str(a.rank)
            t.add_row(str(a.attempt), rank, a.kind, format_bytes(a.size_bytes), a.name)
        out().print(t)
        return
    path = runs.download_artifact(run_id, name, output or Path.cwd(), attempt=attempt)
    out().print(f"wrote {path} ({format_bytes(path.stat().st_size)})")

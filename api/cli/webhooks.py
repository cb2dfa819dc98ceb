"""``meshrun webhook add|list|rm|deliveries|ping``: a project's (or a run's) webhooks and their delivery log."""

from __future__ import annotations

from typing import Optional

import typer
from rich.table import Table

from api.cli._common import _escape, _state, _ts, command, emit_json, err, out, webhook_app
from api.spec import WEBHOOK_EVENTS


def _split(text: Optional[str]) -> list[str] | None:
    return [p.strip() for p in text.split(",") if p.strip()] if text else None


@command(webhook_app, "add")
def webhook_add(
    ctx: typer.Context,
    url: str = typer.Argument(..., help="Where to POST: an http:// or https:// URL."),
    events: Optional[str] = typer.Option(
        None, "--events", help=f"Comma list of {', '.join(WEBHOOK_EVENTS)} (default run.state,sweep.finished)."
    ),
    states: Optional[str] = typer.Option(None, help="Only these run states for run.state, e.g. FAILED,SUCCEEDED."),
    secret: Optional[str] = typer.Option(None, help="Your own signing secret (default: a random one, shown once)."),
    fmt: str = typer.Option("json", "--format", help='"json" or "slack" ({"text": ...}).'),
    run: Optional[str] = typer.Option(None, "--run", help="Only this run's events."),
    goodput_below: Optional[float] = typer.Option(None, help="Threshold of run.goodput_low, in (0, 1]."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Add a webhook; prints its signing secret once."""
    hook = (
        _state(ctx)
        .client()
        .webhooks.create(
            url,
            events=_split(events),
            states=_split(states),
            secret=secret,
            format=fmt,
            run_id=run,
            goodput_below=goodput_below,
        )
    )
    if as_json:
        emit_json(hook)
        return
    out().print(f"webhook {hook.id}: {_escape(hook.url)} ({', '.join(hook.events)}, {hook.format})")
    out().print(f"secret: {hook.secret}")
    err().print("the secret is shown only now: receivers check X-Meshrun-Signature with it (docs/webhooks.md)")


@command(webhook_app, "list")
def webhook_list(ctx: typer.Context, as_json: bool = typer.Option(False, "--json")) -> None:
    """List webhooks (never their secrets)."""
    hooks = _state(ctx).client().webhooks.list()
    if as_json:
        emit_json(hooks)
        return
    t = Table(title=f"webhooks ({len(hooks)})")
    for col in ("id", "project", "url", "events", "format", "run", "secret", "created"):
        t.add_column(col)
    for h in hooks:
        t.add_row(
            str(h.id),
            h.project,
            _escape(h.url),
            ", ".join(h.events),
            h.format,
            h.run_id or "-",
            f"{h.secret_prefix}…",
            _ts(h.created_at),
        )
    out().print(t)


@command(webhook_app, "rm")
def webhook_rm(ctx: typer.Context, webhook_id: int = typer.Argument(..., metavar="ID", min=1)) -> None:
    """Delete a webhook and its delivery log."""
    _state(ctx).client().webhooks.delete(webhook_id)
    out().print(f"webhook {webhook_id} deleted")


@command(webhook_app, "deliveries")
def webhook_deliveries(
    ctx: typer.Context,
    webhook_id: int = typer.Argument(..., metavar="ID", min=1),
    limit: int = typer.Option(20, min=1, max=500),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """The delivery log, newest first."""
    items = _state(ctx).client().webhooks.deliveries(webhook_id, limit=limit)
    if as_json:
        emit_json(items)
        return
    t = Table(title=f"deliveries of webhook {webhook_id}")
    for col in ("id", "event", "run/sweep", "outcome", "attempts", "HTTP", "error", "last attempt"):
        t.add_column(col)
    for d in items:
        t.add_row(
            str(d.id),
            d.event,
            d.run_id or d.sweep_id or "-",
            d.outcome,
            str(d.attempts),
            str(d.http_status or "-"),
            _escape(d.error or ""),
            _ts(d.last_attempt_at) if d.last_attempt_at else "-",
        )
    out().print(t)


@command(webhook_app, "ping")
def webhook_ping(ctx: typer.Context, webhook_id: int = typer.Argument(..., metavar="ID", min=1)) -> None:
    """Send a test event (it shows in the delivery log like any other)."""
    d = _state(ctx).client().webhooks.ping(webhook_id)
    out().print(f"ping queued as delivery {d.id}")

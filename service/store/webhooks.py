"""Webhooks and their deliveries (keyword-only store functions; the caller owns the transaction).

The service process turns stored events into deliveries (``scan_events``): run state changes, stragglers and hangs
from ``run_events`` (written by the run controller and the run drivers, in whichever process they run), a sweep's
end from ``sweep_events``, and a finished run's goodput below a webhook's threshold (``service.store.goodput``).
Each webhook keeps a cursor per event table; a new webhook starts at the newest event (no history is replayed).
A delivery is unique per (webhook, source event), so service replicas scanning the same events deliver once.
Sending is ``service.control.webhooks``' business: it claims due deliveries (``claim_due``) and records every
attempt (``record_attempt``): retries with exponential backoff, up to a bounded number of attempts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.errors import NotFound
from service.store.controller import SweepStatus
from service.store.goodput import run_goodput
from service.store.models import Run, RunEvent, Sweep, SweepEvent, Webhook, WebhookDelivery, utcnow

RUN_EVENT_KINDS = {"state": "run.state", "straggler": "run.straggler", "hang": "run.hang"}
TERMINAL_RUN = frozenset({"SUCCEEDED", "FAILED", "CANCELLED"})
SCAN_BATCH = 500
MAX_BACKOFF_S = 600.0
# PostgreSQL hands out ids before commit: a transaction holding an older id may commit after a newer one. The scan
# stays this far behind the newest event so that a cursor does not pass an event still being written.
SCAN_LAG_S = 2.0
RETRY_STATUSES = frozenset({408, 409, 425, 429})
MAX_ERROR_CHARS = 300


# ------------------------------------------------------------------------------------------------ webhooks
def _max_ids(session: Session) -> tuple[int, int]:
    return (
        int(session.scalar(select(func.max(RunEvent.id))) or 0),
        int(session.scalar(select(func.max(SweepEvent.id))) or 0),
    )


def create_webhook(
    session: Session,
    *,
    project: str,
    url: str,
    events: list[str],
    states: list[str] | None,
    payload_format: str,
    goodput_below: float | None,
    run_id: str | None,
    secret_sealed: str,
    secret_prefix: str,
    created_by: str | None,
) -> Webhook:
    if run_id is not None:
        run = session.get(Run, run_id)
        if run is None or run.project != project:
            raise NotFound(f"no run '{run_id}' in project '{project}'", param="run_id")
    run_cursor, sweep_cursor = _max_ids(session)
    hook = Webhook(
        project=project,
        url=url,
        events=list(events),
        states=list(states) if states else None,
        payload_format=payload_format,
        goodput_below=goodput_below,
        run_id=run_id,
        secret_sealed=secret_sealed,
        secret_prefix=secret_prefix,
        run_event_cursor=run_cursor,
        sweep_event_cursor=sweep_cursor,
        created_by=created_by,
    )
    session.add(hook)
    session.flush()
    return hook


def list_webhooks(session: Session, *, project: str | None) -> list[Webhook]:
    stmt = select(Webhook).order_by(Webhook.id)
    if project is not None:
        stmt = stmt.where(Webhook.project == project)
    return list(session.scalars(stmt).all())


def get_webhook(session: Session, *, webhook_id: int, project: str | None) -> Webhook:
    hook = session.get(Webhook, webhook_id)
    if hook is None or (project is not None and hook.project != project):
        raise NotFound(f"no webhook {webhook_id}; list yours with GET /v1/webhooks", param="webhook_id")
    return hook


def delete_webhook(session: Session, *, webhook_id: int, project: str | None) -> None:
    hook = get_webhook(session, webhook_id=webhook_id, project=project)
    session.execute(delete(WebhookDelivery).where(WebhookDelivery.webhook_id == hook.id))
    session.delete(hook)
    session.flush()


def list_deliveries(session: Session, *, webhook_id: int, limit: int = 100) -> list[WebhookDelivery]:
    """Newest first."""
    stmt = (
        select(WebhookDelivery)
        .where(WebhookDelivery.webhook_id == webhook_id)
        .order_by(WebhookDelivery.id.desc())
        .limit(limit)
    )
    return list(session.scalars(stmt).all())


# ------------------------------------------------------------------------------------------------ events
def add_delivery(
    session: Session,
    *,
    hook: Webhook,
    source: str,
    event: str,
    payload: dict[str, Any],
    run_id: str | None = None,
    sweep_id: str | None = None,
) -> bool:
    """Queue one delivery; False when this webhook already has one for ``source`` (another replica queued it)."""
    try:
        with session.begin_nested():
            session.add(
                WebhookDelivery(
                    webhook_id=hook.id,
                    source=source,
                    event=event,
                    payload={"event": event, "project": hook.project, **payload},
                    run_id=run_id,
                    sweep_id=sweep_id,
                    next_attempt_at=utcnow(),
                )
            )
    except IntegrityError:
        return False
    return True


def _iso(t: datetime | None) -> str | None:
    return t.isoformat() if t is not None else None


def _run_payload(ev: RunEvent, run: Run) -> dict[str, Any]:
    return {
        "time": _iso(ev.time),
        "run": {"id": run.id, "name": run.name, "status": run.status, "sweep_id": run.sweep_id},
        "from_status": ev.from_status,
        "to_status": ev.to_status,
        "reason": ev.reason,
        "event_id": ev.id,
    }


def _scan_runs(session: Session, hook: Webhook, upto: int) -> int:
    kinds = [k for k, e in RUN_EVENT_KINDS.items() if e in hook.events]
    if "run.goodput_low" in hook.events and "state" not in kinds:
        kinds.append("state")
    if not kinds:
        hook.run_event_cursor = upto
        return 0
    stmt = (
        select(RunEvent, Run)
        .join(Run, Run.id == RunEvent.run_id)
        .where(RunEvent.id > hook.run_event_cursor, RunEvent.id <= upto, RunEvent.kind.in_(kinds))
        .where(Run.project == hook.project)
        .order_by(RunEvent.id)
        .limit(SCAN_BATCH)
    )
    if hook.run_id is not None:
        stmt = stmt.where(Run.id == hook.run_id)
    rows = session.execute(stmt).all()
    n = 0
    for ev, run in rows:
        event = RUN_EVENT_KINDS[ev.kind]
        wanted = event in hook.events and not (event == "run.state" and hook.states and ev.to_status not in hook.states)
        if wanted:
            n += add_delivery(
                session,
                hook=hook,
                source=f"run_event:{ev.id}",
                event=event,
                payload=_run_payload(ev, run),
                run_id=run.id,
            )
        if "run.goodput_low" in hook.events and ev.kind == "state" and ev.to_status in TERMINAL_RUN:
            goodput = run_goodput(session, run=run).get("goodput")
            if goodput is not None and hook.goodput_below is not None and goodput < hook.goodput_below:
                payload = {**_run_payload(ev, run), "goodput": goodput, "goodput_below": hook.goodput_below}
                n += add_delivery(
                    session,
                    hook=hook,
                    source=f"goodput:{ev.id}",
                    event="run.goodput_low",
                    payload=payload,
                    run_id=run.id,
                )
    hook.run_event_cursor = rows[-1][0].id if len(rows) == SCAN_BATCH else upto
    return n


def _scan_sweeps(session: Session, hook: Webhook, upto: int) -> int:
    if "sweep.finished" not in hook.events or hook.run_id is not None:
        hook.sweep_event_cursor = upto
        return 0
    stmt = (
        select(SweepEvent, Sweep)
        .join(Sweep, Sweep.id == SweepEvent.sweep_id)
        .where(SweepEvent.id > hook.sweep_event_cursor, SweepEvent.id <= upto)
        .where(SweepEvent.trial_id.is_(None), SweepEvent.kind == "state")
        .where(SweepEvent.to_status.in_(sorted(SweepStatus.TERMINAL)), Sweep.project == hook.project)
        .order_by(SweepEvent.id)
        .limit(SCAN_BATCH)
    )
    rows = session.execute(stmt).all()
    n = 0
    for ev, sweep in rows:
        payload = {
            "time": _iso(ev.time),
            "sweep": {"id": sweep.id, "name": sweep.name, "status": sweep.status, "best_trial_id": sweep.best_trial_id},
            "from_status": ev.from_status,
            "to_status": ev.to_status,
            "reason": ev.reason,
            "event_id": ev.id,
        }
        n += add_delivery(
            session,
            hook=hook,
            source=f"sweep_event:{ev.id}",
            event="sweep.finished",
            payload=payload,
            sweep_id=sweep.id,
        )
    hook.sweep_event_cursor = rows[-1][0].id if len(rows) == SCAN_BATCH else upto
    return n


def _settled_max(session: Session, model: type[RunEvent] | type[SweepEvent]) -> int:
    stmt = select(func.max(model.id))
    if session.get_bind().dialect.name == "postgresql":
        stmt = stmt.where(model.time <= utcnow() - timedelta(seconds=SCAN_LAG_S))
    return int(session.scalar(stmt) or 0)


def scan_events(session: Session) -> int:
    """Queue a delivery for every new event each webhook wants; returns how many were queued."""
    hooks = list(session.scalars(select(Webhook).order_by(Webhook.id)).all())
    if not hooks:
        return 0
    run_upto, sweep_upto = _settled_max(session, RunEvent), _settled_max(session, SweepEvent)
    n = 0
    for hook in hooks:
        if hook.run_event_cursor < run_upto:
            n += _scan_runs(session, hook, run_upto)
        if hook.sweep_event_cursor < sweep_upto:
            n += _scan_sweeps(session, hook, sweep_upto)
    session.flush()
    return n


# ------------------------------------------------------------------------------------------------ delivery
@dataclass(frozen=True)
class Due:
    """A claimed delivery, detached from the session: what the sender needs."""

    delivery_id: int
    webhook_id: int
    event: str
    url: str
    payload_format: str
    secret_sealed: str
    payload: dict[str, Any]
    attempt: int  # the number of the attempt about to be made


def claim_due(session: Session, *, lease_s: float, limit: int = 20) -> list[Due]:
    """Pending deliveries whose time has come, each claimed for ``lease_s`` (a replica or a crashed sender that
    claimed one before lets it go when the lease ends)."""
    now = utcnow()
    rows = session.execute(
        select(WebhookDelivery, Webhook)
        .join(Webhook, Webhook.id == WebhookDelivery.webhook_id)
        .where(WebhookDelivery.outcome == "pending", WebhookDelivery.next_attempt_at <= now)
        .order_by(WebhookDelivery.next_attempt_at, WebhookDelivery.id)
        .limit(limit)
    ).all()
    out = []
    for d, hook in rows:
        claimed = session.execute(
            update(WebhookDelivery)
            .where(WebhookDelivery.id == d.id, WebhookDelivery.outcome == "pending")
            .where(WebhookDelivery.next_attempt_at <= now)
            .values(next_attempt_at=now + timedelta(seconds=lease_s))
            .execution_options(synchronize_session=False)
        )
        if claimed.rowcount == 1:  # type: ignore[attr-defined]
            out.append(
                Due(
                    d.id,
                    hook.id,
                    d.event,
                    hook.url,
                    hook.payload_format,
                    hook.secret_sealed,
                    dict(d.payload),
                    d.attempts + 1,
                )
            )
    return out


def backoff_s(attempts: int, base_s: float) -> float:
    """The wait after the ``attempts``-th failed attempt: base, 2 base, 4 base ... capped at 10 minutes."""
    return min(MAX_BACKOFF_S, base_s * 2 ** max(0, attempts - 1))


def retryable(http_status: int | None) -> bool:
    """A transport error (no status), 408/409/425/429 or a 5xx is worth another attempt; other answers are final."""
    return http_status is None or http_status in RETRY_STATUSES or http_status >= 500


def record_attempt(
    session: Session,
    *,
    delivery_id: int,
    http_status: int | None,
    error: str | None,
    max_attempts: int,
    retry_base_s: float,
) -> WebhookDelivery | None:
    d = session.get(WebhookDelivery, delivery_id)
    if d is None:  # the webhook was deleted meanwhile
        return None
    now = utcnow()
    d.attempts = (d.attempts or 0) + 1
    d.last_attempt_at = now
    d.http_status = http_status
    d.error = error[:MAX_ERROR_CHARS] if error else None
    if http_status is not None and 200 <= http_status < 300:
        d.outcome, d.delivered_at = "delivered", now
    elif d.attempts >= max_attempts or not retryable(http_status):
        d.outcome = "failed"
    else:
        d.next_attempt_at = now + timedelta(seconds=backoff_s(d.attempts, retry_base_s))
    session.flush()
    return d


# ------------------------------------------------------------------------------------------------ payloads
_ICONS = {"SUCCEEDED": ":white_check_mark:", "FAILED": ":x:", "CANCELLED": ":no_entry_sign:"}


def slack_text(payload: dict[str, Any]) -> str:
    """One line for a chat channel."""
    event = payload.get("event", "")
    reason = f": {payload['reason']}" if payload.get("reason") else ""
    if "run" in payload:
        run = payload["run"]
        who = f"run {run.get('name')} ({run.get('id')})"
        if event == "run.state":
            icon = _ICONS.get(str(payload.get("to_status")), ":arrows_counterclockwise:")
            return f"{icon} {who} {payload.get('from_status') or 'new'} -> {payload.get('to_status')}{reason}"
        if event == "run.goodput_low":
            return (
                f":hourglass: {who} ended {payload.get('to_status')} with goodput {payload.get('goodput', 0):.0%}, "
                f"below {payload.get('goodput_below', 0):.0%}"
            )
        return f":warning: {who} {event.removeprefix('run.')}{reason}"
    if "sweep" in payload:
        sweep = payload["sweep"]
        icon = _ICONS.get(str(payload.get("to_status")), "")
        what = f"sweep {sweep.get('name')} ({sweep.get('id')}) finished {payload.get('to_status')}{reason}"
        return f"{icon} {what}".strip()
    return f"meshrun {event}{reason}"


def render_body(payload: dict[str, Any], payload_format: str) -> bytes:
    """The exact bytes POSTed (and signed)."""
    data = {"text": slack_text(payload)} if payload_format == "slack" else payload
    return json.dumps(data, separators=(",", ":"), sort_keys=True, default=str).encode()

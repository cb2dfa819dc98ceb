"""The console's webhooks page: each webhook of the caller's project (never its secret) with its latest deliveries
(event, outcome, attempts, HTTP status, error). Read-only: webhooks are added with ``meshrun webhook add`` or
``POST /v1/webhooks`` (docs/webhooks.md)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response

from service.app.console.web import console_principal, page, sign_in_redirect
from service.app.routes.webhooks import webhook_public
from service.store import webhooks as store
from service.store.db import session_scope

router = APIRouter(include_in_schema=False)

DELIVERIES_SHOWN = 20


@router.get("/webhooks", response_class=HTMLResponse)
def webhooks_page(request: Request) -> Response:
    principal = console_principal(request)
    if principal is None:
        return sign_in_redirect(request)
    with session_scope(request.app.state.session_factory) as s:
        hooks = [
            (webhook_public(h), store.list_deliveries(s, webhook_id=h.id, limit=DELIVERIES_SHOWN))
            for h in store.list_webhooks(s, project=principal.scope)
        ]
        for _, rows in hooks:
            for d in rows:
                s.expunge(d)
    return page(request, "webhooks.html", principal, title="Webhooks", hooks=hooks)

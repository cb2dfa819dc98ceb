"""``/v1/webhooks``: create, list, read, delete a project's (or a run's) webhooks, send a test event, read the
delivery log. Thin: the store is ``service.store.webhooks``, secrets ``service.security.webhooks``, delivery
``service.control.webhooks`` (docs/webhooks.md). The secret is in the create answer only."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import APIRouter, Path, Query, Request, Response

from api.spec import DeliveryList, DeliveryPublic, WebhookCreate, WebhookCreated, WebhookList, WebhookPublic
from service.app.deps import PrincipalDep, SessionDep, SettingsDep
from service.app.errors import error_responses
from service.errors import Forbidden
from service.security.webhooks import display_prefix, new_secret, seal, webhook_key
from service.store import webhooks as store
from service.store.models import Webhook

router = APIRouter(prefix="/v1/webhooks", tags=["webhooks"])

WebhookId = Annotated[int, Path(ge=1, le=2**62, description="Webhook id.")]


def webhook_public(hook: Webhook) -> WebhookPublic:
    return WebhookPublic(
        id=hook.id,
        project=hook.project,
        run_id=hook.run_id,
        url=hook.url,
        events=list(hook.events),
        states=list(hook.states) if hook.states else None,
        format=hook.payload_format,
        goodput_below=hook.goodput_below,
        secret_prefix=hook.secret_prefix,
        created_by=hook.created_by,
        created_at=hook.created_at,
    )


def _wake(request: Request) -> None:
    dispatcher = getattr(request.app.state, "webhooks", None)
    if dispatcher is not None:
        dispatcher.wake()


@router.post(
    "",
    status_code=201,
    response_model=WebhookCreated,
    summary="Add a webhook",
    responses=error_responses(403, 404, 422),
)
def create_webhook(
    body: WebhookCreate, session: SessionDep, principal: PrincipalDep, settings: SettingsDep
) -> WebhookCreated:
    """A URL that gets a signed POST for each event it asks for. The answer carries the signing secret: it is
    never shown again."""
    project = body.project or principal.project
    if project != principal.project and not principal.admin:
        raise Forbidden("only admins may add webhooks to another project; leave out project", param="project")
    secret = body.secret or new_secret()
    hook = store.create_webhook(
        session,
        project=project,
        url=body.url,
        events=list(body.events),
        states=[s.value for s in body.states] if body.states else None,
        payload_format=body.format,
        goodput_below=body.goodput_below,
        run_id=body.run_id,
        secret_sealed=seal(secret, webhook_key(settings)),
        secret_prefix=display_prefix(secret),
        created_by=principal.token_name,
    )
    return WebhookCreated(**webhook_public(hook).model_dump(), secret=secret)


@router.get("", response_model=WebhookList, summary="List webhooks")
def list_webhooks(session: SessionDep, principal: PrincipalDep) -> WebhookList:
    return WebhookList(items=[webhook_public(h) for h in store.list_webhooks(session, project=principal.scope)])


@router.get("/{webhook_id}", response_model=WebhookPublic, summary="Read a webhook", responses=error_responses(404))
def get_webhook(webhook_id: WebhookId, session: SessionDep, principal: PrincipalDep) -> WebhookPublic:
    return webhook_public(store.get_webhook(session, webhook_id=webhook_id, project=principal.scope))


@router.delete("/{webhook_id}", status_code=204, summary="Delete a webhook", responses=error_responses(404))
def delete_webhook(webhook_id: WebhookId, session: SessionDep, principal: PrincipalDep) -> Response:
    """The webhook and its delivery log; deliveries still pending are dropped."""
    store.delete_webhook(session, webhook_id=webhook_id, project=principal.scope)
    return Response(status_code=204)


@router.get(
    "/{webhook_id}/deliveries",
    response_model=DeliveryList,
    summary="The delivery log",
    responses=error_responses(404),
)
def list_deliveries(
    webhook_id: WebhookId,
    session: SessionDep,
    principal: PrincipalDep,
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
) -> DeliveryList:
    """Newest first: the event, attempts made, outcome (pending, delivered, failed), the last HTTP status and
    error, and when."""
    hook = store.get_webhook(session, webhook_id=webhook_id, project=principal.scope)
    rows = store.list_deliveries(session, webhook_id=hook.id, limit=limit)
    return DeliveryList(items=[DeliveryPublic.model_validate(d) for d in rows])


@router.post(
    "/{webhook_id}/ping",
    status_code=202,
    response_model=DeliveryPublic,
    summary="Send a test event",
    responses=error_responses(404),
)
def ping_webhook(
    webhook_id: WebhookId, request: Request, session: SessionDep, principal: PrincipalDep
) -> DeliveryPublic:
    """Queue a ``ping`` event for this webhook (delivered like any other: signed, retried, logged)."""
    hook = store.get_webhook(session, webhook_id=webhook_id, project=principal.scope)
    source = f"ping:{secrets.token_hex(8)}"
    store.add_delivery(session, hook=hook, source=source, event="ping", payload={"reason": "test event"})
    session.flush()
    row = next(d for d in store.list_deliveries(session, webhook_id=hook.id, limit=5) if d.source == source)
    _wake(request)
    return DeliveryPublic.model_validate(row)

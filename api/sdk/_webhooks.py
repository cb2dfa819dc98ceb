"""``client.webhooks``: a project's (or one run's) webhooks and their delivery log (docs/webhooks.md)."""

from __future__ import annotations

import builtins
from collections.abc import Iterable
from typing import TYPE_CHECKING

from api.spec import DeliveryList, DeliveryPublic, WebhookCreated, WebhookList, WebhookPublic

from ._base import tolerant_validate

if TYPE_CHECKING:  # pragma: no cover
    from .client import Client


class Webhooks:
    def __init__(self, client: Client) -> None:
        self._client = client

    def create(
        self,
        url: str,
        *,
        events: Iterable[str] | None = None,
        states: Iterable[str] | None = None,
        secret: str | None = None,
        format: str = "json",
        run_id: str | None = None,
        goodput_below: float | None = None,
        project: str | None = None,
    ) -> WebhookCreated:
        """Add a webhook. The answer's ``secret`` (generated unless given) signs every call and is never shown
        again: keep it where the receiver can check ``X-Meshrun-Signature``."""
        body: dict[str, object] = {"url": url, "format": format}
        if events is not None:
            body["events"] = list(events)
        if states is not None:
            body["states"] = list(states)
        extra: tuple[tuple[str, object], ...] = (
            ("secret", secret),
            ("run_id", run_id),
            ("goodput_below", goodput_below),
            ("project", project),
        )
        for key, value in extra:
            if value is not None:
                body[key] = value
        return tolerant_validate(WebhookCreated, self._client.request("POST", "/v1/webhooks", json=body))

    def list(self) -> list[WebhookPublic]:
        return tolerant_validate(WebhookList, self._client.request("GET", "/v1/webhooks")).items

    def get(self, webhook_id: int) -> WebhookPublic:
        return tolerant_validate(WebhookPublic, self._client.request("GET", f"/v1/webhooks/{int(webhook_id)}"))

    def delete(self, webhook_id: int) -> None:
        self._client.request("DELETE", f"/v1/webhooks/{int(webhook_id)}")

    def deliveries(self, webhook_id: int, *, limit: int = 100) -> builtins.list[DeliveryPublic]:
        """The delivery log, newest first: event, outcome, attempts, last HTTP status and error."""
        data = self._client.request("GET", f"/v1/webhooks/{int(webhook_id)}/deliveries", params={"limit": limit})
        return tolerant_validate(DeliveryList, data).items

    def ping(self, webhook_id: int) -> DeliveryPublic:
        """Queue a test event (``ping``), delivered like any other."""
        return tolerant_validate(DeliveryPublic, self._client.request("POST", f"/v1/webhooks/{int(webhook_id)}/ping"))

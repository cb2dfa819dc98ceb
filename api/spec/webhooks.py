"""Webhooks: what a project (or one run) wants POSTed where, and the log of each delivery (docs/webhooks.md).

``WebhookCreate`` is the request (unknown fields are an error); ``WebhookPublic`` never carries the secret,
``WebhookCreated`` carries it once, in the answer to the create request.
"""

from __future__ import annotations

import ipaddress
from datetime import datetime
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, ValidationInfo, field_validator

from api.spec._base import _Public, _Spec
from api.spec.public import RunStatus

WebhookEvent = Literal["run.state", "run.straggler", "run.hang", "run.goodput_low", "sweep.finished"]
WEBHOOK_EVENTS: tuple[str, ...] = ("run.state", "run.straggler", "run.hang", "run.goodput_low", "sweep.finished")
DEFAULT_EVENTS: tuple[WebhookEvent, ...] = ("run.state", "sweep.finished")
PayloadFormat = Literal["json", "slack"]
DeliveryOutcome = Literal["pending", "delivered", "failed"]
MAX_URL_CHARS = 2048
_ID = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


def check_webhook_url(url: str) -> str:
    """An absolute http(s) URL with a host; never a link-local address (a cloud's metadata service)."""
    url = url.strip()
    if len(url) > MAX_URL_CHARS:
        raise ValueError(f"the URL is longer than {MAX_URL_CHARS} characters")
    if any(c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F for c in url):
        raise ValueError("the URL contains spaces or control characters; percent-encode them")
    parts = urlsplit(url)
    if parts.scheme.lower() not in ("http", "https"):
        raise ValueError("use an http:// or https:// URL, e.g. https://hooks.example.com/meshrun")
    try:
        host = parts.hostname
        parts.port  # noqa: B018 - raises on a port that is not a number or out of range
    except ValueError as e:
        raise ValueError(f"the URL's host or port is not valid ({e})") from None
    if not host:
        raise ValueError("the URL has no host; use e.g. https://hooks.example.com/meshrun")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    if ip is not None and (ip.is_link_local or ip.is_multicast or ip.is_unspecified):
        raise ValueError(f"{host} is a link-local, multicast or unspecified address; use the receiver's address")
    return url


class WebhookCreate(_Spec):
    url: str = Field(description="Where to POST: an http:// or https:// URL.", max_length=MAX_URL_CHARS)
    events: list[WebhookEvent] = Field(
        default_factory=lambda: list(DEFAULT_EVENTS),
        min_length=1,
        max_length=len(WEBHOOK_EVENTS),
        description="run.state (a run's status changed), run.straggler, run.hang, run.goodput_low (a run ended "
        "with goodput below goodput_below), sweep.finished.",
    )
    states: list[RunStatus] | None = Field(
        None, description="Only these run states for run.state (e.g. [FAILED, SUCCEEDED]); default every state."
    )
    secret: str | None = Field(
        None,
        min_length=16,
        max_length=256,
        pattern=r"^[\x21-\x7e]+$",
        description="The HMAC-SHA256 signing secret (16-256 printable characters); default: a random one, returned "
        "once in the answer to this request and never again.",
    )
    format: PayloadFormat = Field("json", description='"json" (meshrun\'s event object) or "slack" ({"text": ...}).')
    run_id: str | None = Field(None, pattern=_ID, description="Only this run's events (a per-run webhook).")
    goodput_below: float | None = Field(
        None, gt=0, le=1, validate_default=True, description="The goodput threshold of run.goodput_low (0-1]."
    )
    project: str | None = Field(None, pattern=_ID, description="Admins only: the project (default: the caller's).")

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return check_webhook_url(v)

    @field_validator("events")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        return list(dict.fromkeys(v))

    @field_validator("goodput_below")
    @classmethod
    def _threshold(cls, v: float | None, info: ValidationInfo) -> float | None:
        events = info.data.get("events") or []
        if v is None and "run.goodput_low" in events:
            raise ValueError("run.goodput_low needs goodput_below, the threshold in (0, 1], e.g. 0.8")
        if v is not None and "run.goodput_low" not in events:
            raise ValueError('goodput_below applies to the "run.goodput_low" event; add it to events or drop this')
        return v


class WebhookPublic(_Public):
    id: int
    project: str
    run_id: str | None = None
    url: str
    events: list[str]
    states: list[str] | None = None
    format: str = "json"
    goodput_below: float | None = None
    secret_prefix: str = Field(description="The secret's first characters, to tell secrets apart (never the secret).")
    created_by: str | None = None
    created_at: datetime


class WebhookCreated(WebhookPublic):
    secret: str = Field(description="The signing secret: shown in this answer only.")


class WebhookList(_Public):
    items: list[WebhookPublic]


class DeliveryPublic(_Public):
    id: int
    webhook_id: int
    event: str
    run_id: str | None = None
    sweep_id: str | None = None
    outcome: DeliveryOutcome | str
    attempts: int
    http_status: int | None = None
    error: str | None = None
    created_at: datetime
    next_attempt_at: datetime | None = None
    last_attempt_at: datetime | None = None
    delivered_at: datetime | None = None


class DeliveryList(_Public):
    items: list[DeliveryPublic]

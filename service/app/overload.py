"""Overload control: at most ``settings.max_concurrent_requests`` API requests touch the database at once (the
rest wait on the event loop, holding no thread and no connection); one that waits longer than
``settings.request_queue_timeout_s`` is answered 503 with ``Retry-After`` (the SDK waits and retries). With the
gate at or below the connection pool's size a request never waits for a pooled connection, so the pool cannot be
exhausted by clients and a burst is served in order instead of failing."""

from __future__ import annotations

import anyio
from starlette.types import ASGIApp, Receive, Scope, Send

from service.app.errors import error_response

RETRY_AFTER_S = 1
GATED_PREFIXES = ("/v1/", "/ui/")


class OverloadGate:
    def __init__(self, app: ASGIApp, *, slots: int, queue_timeout_s: float):
        self.app = app
        self.slots = max(1, slots)
        self.queue_timeout_s = queue_timeout_s
        self._limiter: anyio.CapacityLimiter | None = None  # made on the server's event loop

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not str(scope.get("path", "")).startswith(GATED_PREFIXES):
            await self.app(scope, receive, send)
            return
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.slots)
        limiter = self._limiter
        token = object()
        acquired = False
        with anyio.move_on_after(self.queue_timeout_s):
            await limiter.acquire_on_behalf_of(token)
            acquired = True
        if not acquired:
            await error_response(
                503,
                "overloaded",
                f"the service is busy ({self.slots} requests in progress, others waited "
                f"{self.queue_timeout_s:g} s); retry in {RETRY_AFTER_S} s",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            limiter.release_on_behalf_of(token)

"""Overload control: at most ``settings.max_concurrent_requests`` API requests touch the database at once (the
rest wait on the event loop, holding no thread and no connection); one that waits longer than
``settings.request_queue_timeout_s`` is answered 503 with ``Retry-After`` (the SDK waits and retries). With the
gate at or below the connection pool's size a request never waits for a pooled connection, so the pool cannot be
exhausted by clients and a burst is served in order instead of failing.

Reads come first. Everything but GET/HEAD/OPTIONS (submissions, plans, sweeps: the requests whose parsing,
validation and search cost CPU; cancels excepted, which cost none but wait for Ray) also goes through a narrower
lane of ``settings.max_concurrent_writes``, and a write about to start waits, up to ``settings.read_priority_ms``,
while reads are in progress. So clients that send expensive requests back to back (hostile or just busy) get fewer
of them answered per second, but cannot make the console's and the SDK's reads wait behind them: on a 2-core
machine four looping heavy requests leave the p99 of ``GET /v1/runs`` within 1.5x of idle
(``bench/bench_heavy_requests.py``), instead of 7x without the lane.

The queue bound is one deadline per request: waiting for the write lane, behind reads, for a slot and (plans) for
the planner together last at most ``request_queue_timeout_s``; then 503 with ``Retry-After``. The gate gives up at
90% of it (``ANSWER_MARGIN``): on a saturated machine the event loop reads a request and sends an answer seconds
late, and the bound is what the client sees. The deadline is left
in ``scope["state"]["queue_deadline"]`` (``anyio.current_time()`` clock) for the routes that wait further
(``service.app.routes.plans``). A request that started is served to the end (a plan search runs in a thread pool
of bounded size). A 503 says how long the service held it (``Server-Timing: queue;dur=<ms>``).
``bench/bench_overload.py`` measures it with 200 clients."""

from __future__ import annotations

import asyncio

import anyio
from starlette.types import ASGIApp, Receive, Scope, Send

from service.app.errors import error_response

RETRY_AFTER_S = 1
GATED_PREFIXES = ("/v1/", "/ui/")
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# writes that cost no CPU but may wait long (a cancel waits up to 20 s for the Ray Job to end): not in the lane,
# where they would hold back every submission behind them
LANE_EXEMPT_SUFFIXES = ("/cancel",)
DEADLINE_KEY = "queue_deadline"
ARRIVED_KEY = "queue_arrived"
ANSWER_MARGIN = 0.1  # of request_queue_timeout_s, kept for the event loop's lag on a loaded machine


def queue_deadline(scope: Scope) -> float | None:
    """The request's queue deadline (``anyio.current_time()`` clock) set by the gate, or None (not gated)."""
    state = scope.get("state") or {}
    value = state.get(DEADLINE_KEY)
    return float(value) if value is not None else None


def queue_timing(scope: Scope) -> str:
    """A ``Server-Timing`` value: how long the service held the request, from reaching the gate to now."""
    arrived = (scope.get("state") or {}).get(ARRIVED_KEY)
    waited_ms = (anyio.current_time() - float(arrived)) * 1000 if arrived is not None else 0.0
    return f'queue;dur={waited_ms:.0f};desc="queued"'


class OverloadGate:
    def __init__(
        self,
        app: ASGIApp,
        *,
        slots: int,
        queue_timeout_s: float,
        write_slots: int | None = None,
        read_priority_s: float = 0.0,
    ):
        self.app = app
        self.slots = max(1, slots)
        self.write_slots = min(self.slots, max(1, write_slots)) if write_slots else self.slots
        self.read_priority_s = max(0.0, read_priority_s)
        self.queue_timeout_s = queue_timeout_s
        # how long the gate holds a request: a little less than the bound, so that the answer reaches the client
        # within it even when a saturated event loop read the request late or sends the answer late
        self.hold_s = queue_timeout_s * (1 - ANSWER_MARGIN)
        # made on the server's event loop
        self._limiter: anyio.CapacityLimiter | None = None
        self._writes: anyio.CapacityLimiter | None = None
        self._reads = 0  # reads in progress (waiting for a slot or being served)
        self._no_reads: asyncio.Event | None = None  # set while no read is in progress

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not str(scope.get("path", "")).startswith(GATED_PREFIXES):
            await self.app(scope, receive, send)
            return
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.slots)
            self._writes = anyio.CapacityLimiter(self.write_slots)
        now = anyio.current_time()
        state = scope.setdefault("state", {})
        state[DEADLINE_KEY], state[ARRIVED_KEY] = now + self.hold_s, now
        if scope.get("method", "GET") in READ_METHODS:
            await self._read(scope, receive, send)
        elif str(scope.get("path", "")).rstrip("/").endswith(LANE_EXEMPT_SUFFIXES):
            await self._gated(self._limiter, scope, receive, send)
        else:
            await self._write(scope, receive, send)

    async def _read(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._reads += 1
        if self._no_reads is None or self._no_reads.is_set():
            self._no_reads = asyncio.Event()
        try:
            await self._gated(self._limiter, scope, receive, send)
        finally:
            self._reads -= 1
            if self._reads == 0:
                self._no_reads.set()

    async def _write(self, scope: Scope, receive: Receive, send: Send) -> None:
        lane = self._writes
        assert lane is not None
        token = object()
        if not await self._acquire(lane, token, scope, receive, send):
            return
        try:
            if self._reads and self._no_reads is not None and self.read_priority_s > 0:
                # reads in progress go first; bounded, so a stream of reads cannot starve writes
                left = queue_deadline(scope)
                wait = self.read_priority_s if left is None else min(self.read_priority_s, left - anyio.current_time())
                with anyio.move_on_after(max(0.0, wait)):
                    await self._no_reads.wait()
            await self._gated(self._limiter, scope, receive, send)
        finally:
            lane.release_on_behalf_of(token)

    async def _gated(self, limiter: anyio.CapacityLimiter | None, scope: Scope, receive: Receive, send: Send) -> None:
        assert limiter is not None
        token = object()
        if not await self._acquire(limiter, token, scope, receive, send):
            return
        try:
            await self.app(scope, receive, send)
        finally:
            limiter.release_on_behalf_of(token)

    async def _acquire(
        self, limiter: anyio.CapacityLimiter, token: object, scope: Scope, receive: Receive, send: Send
    ) -> bool:
        """Wait for a slot of ``limiter``; False (after answering 503) when none came by the request's deadline."""
        deadline = queue_deadline(scope)
        if deadline is None:
            deadline = anyio.current_time() + self.hold_s
        with anyio.CancelScope(deadline=deadline):
            await limiter.acquire_on_behalf_of(token)
            return True
        await error_response(
            503,
            "overloaded",
            f"the service is busy ({limiter.total_tokens:g} requests of this kind in progress, others waited "
            f"{self.queue_timeout_s:g} s); retry in {RETRY_AFTER_S} s",
            # what the service measured: from the request reaching the gate to this answer (a client that sees
            # far more waited on its own side or in the network)
            headers={"Retry-After": str(RETRY_AFTER_S), "Server-Timing": queue_timing(scope)},
        )(scope, receive, send)
        return False

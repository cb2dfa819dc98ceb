"""POST /v1/plans: score one layout or rank layouts for a model on a cluster. Thin: the logic is in
``service.planner``.

A search runs off the event loop in a thread pool of its own, ``limiter.slots`` threads (so searches never take the
threads that reads use), at most ``limiter.slots`` at a time: a request waits for the planner until its queue
deadline (``service.app.overload``: ``request_queue_timeout_s`` from its arrival, time spent in the gate included)
and is then answered 503 with ``Retry-After``, never queued without bound. Oversized searches are refused by the
planner itself before they cost CPU (422 naming the field to pin). The response's ``calibration`` says which
factors came from measured runs of this cluster, and when (``service.store.calibrations.calibration_for``).

``cluster.device == "live"`` plans for the service's Ray cluster, described by ``cluster_from_live`` (a callable
returning the live ``ClusterSpec``; tests set it) or else by the runtime's ``planning_cluster()`` when the app
runs one. Request fields that are set (bandwidths, peak, memory) override what it reports.
With neither (or no cluster yet) the request is refused (422, ``cluster.device``).

Errors are raised as ``api.spec.validation.SpecError`` (a ValueError with ``.param``); the app maps them to 422
with the body ``{"error": {"code", "message", "param"}}``.
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import anyio
from fastapi import APIRouter, Request, Response
from sqlalchemy.orm import Session, sessionmaker

from api.spec import ClusterSpec, PlanRequest, PlanResponse
from api.spec.validation import SpecError, SpecIssue
from service import planner
from service.app.deps import RuntimeDep, SessionFactoryDep
from service.app.errors import error_responses
from service.app.overload import queue_deadline, queue_timing
from service.control.runtime import Runtime
from service.errors import Unavailable
from service.security.paths import decide_path
from service.store.calibrations import calibration_for

router = APIRouter(tags=["plans"])

# Overrides the runtime's live cluster when set (tests): returns a ClusterSpec (device, gpus_per_node, nodes).
cluster_from_live: Callable[[], ClusterSpec] | None = None

RETRY_AFTER_S = 1


class PlannerLimiter:
    """At most ``slots`` searches at once, run in a pool of ``slots`` threads; ``try_acquire`` never waits,
    ``acquire_by`` waits on the event loop (holding no thread) until a deadline."""

    POLL_S = 0.02

    def __init__(self, slots: int):
        self.slots = max(1, slots)
        self._sem = threading.BoundedSemaphore(self.slots)
        self.pool = ThreadPoolExecutor(self.slots, thread_name_prefix="planner")

    def try_acquire(self) -> bool:
        return self._sem.acquire(blocking=False)

    async def acquire_by(self, deadline: float) -> bool:
        """A slot before ``deadline`` (``anyio.current_time()`` clock)? False when none came."""
        while not self.try_acquire():
            if anyio.current_time() >= deadline:
                return False
            await anyio.sleep(self.POLL_S)
        return True

    def release(self) -> None:
        self._sem.release()


limiter = PlannerLimiter(max(2, (os.cpu_count() or 2) // 2))


def _live_cluster(runtime: Runtime | None) -> ClusterSpec | None:
    if cluster_from_live is not None:
        return cluster_from_live()
    return runtime.planning_cluster() if runtime is not None else None


def _resolve_cluster(requested: ClusterSpec, runtime: Runtime | None) -> ClusterSpec:
    if requested.device.strip().lower() != "live":
        return requested
    live = _live_cluster(runtime)
    if live is None:
        raise SpecError(
            [
                SpecIssue(
                    "cluster.device",
                    "device 'live' needs the service's Ray cluster, which is not "
                    "connected (or has no nodes yet); name a device type such as 'H100' instead",
                    "live_cluster_unavailable",
                )
            ]
        )
    overrides = {
        k: v for k, v in requested.model_dump(exclude={"device", "gpus_per_node", "nodes"}).items() if v is not None
    }
    return live.model_copy(update=overrides) if overrides else live


def _unencodable(x: object, where: str = "") -> str | None:
    """The field of the first string that is not valid Unicode (a lone surrogate), or None."""
    if isinstance(x, str):
        try:
            x.encode("utf-8")
        except UnicodeEncodeError:
            return where or "body"
    elif isinstance(x, dict):
        for k, v in x.items():
            bad = _unencodable(k, where) or _unencodable(v, f"{where}.{k}" if where else str(k))
            if bad:
                return bad
    elif isinstance(x, list | tuple):
        for i, v in enumerate(x):
            bad = _unencodable(v, f"{where}.{i}" if where else str(i))
            if bad:
                return bad
    return None


def _plan(
    req: PlanRequest,
    runtime: Runtime | None,
    factory: sessionmaker[Session] | None,
    prices: dict[str, float] | None = None,
) -> PlanResponse:
    """The blocking part (cluster lookup, calibration lookup, search): runs in a worker thread. ``prices``: the
    settings' ``device_prices`` (a request's ``cluster.price_per_device_hour`` comes first)."""
    cluster = _resolve_cluster(req.cluster, runtime)
    if cluster is not req.cluster:
        req = req.model_copy(update={"cluster": cluster})
    # a cluster that sweeps or runs have measured is planned with the fitted factors (None: the planner's defaults)
    factors, calibration = calibration_for(factory, cluster)
    return planner.search(req, factors=factors, calibration=calibration, prices=prices)


def _plan_json(
    req: PlanRequest, runtime: Runtime | None, factory: sessionmaker[Session] | None, prices: dict[str, float]
) -> bytes:
    return _plan(req, runtime, factory, prices).model_dump_json(by_alias=True).encode()  # as FastAPI would


@router.post("/v1/plans", response_model=PlanResponse, summary="Plan a layout", responses=error_responses(422, 503))
async def create_plan(req: PlanRequest, request: Request, runtime: RuntimeDep, factory: SessionFactoryDep) -> Response:
    """With ``layout``: that layout scored (one candidate; 422 if the model cannot run it). Without: the
    ``top_k`` fastest feasible layouts (``rank_by: cost``: the cheapest per token, on parts of the cluster too),
    with rejected ones and why; every feasible one with its cost. 503 with ``Retry-After`` when the planner stayed
    busy with other searches until the request's queue deadline."""
    bad = _unencodable(req.model_dump())
    if bad:
        raise SpecError(
            [SpecIssue(bad, f"{bad} is not valid Unicode (a lone surrogate); fix the text", "invalid_value")]
        )
    if req.model.path is not None:  # a Hugging Face directory: the same path policy as a submission
        settings = request.app.state.settings
        path = decide_path(req.model.path, param="model.path", settings=settings, restricted=settings.auth_enabled)
        req = req.model_copy(update={"model": req.model.model_copy(update={"path": path})})
    deadline = queue_deadline(request.scope)
    if deadline is None:
        deadline = anyio.current_time() + request.app.state.settings.request_queue_timeout_s
    if not await limiter.acquire_by(deadline):
        raise Unavailable(
            f"the planner stayed busy with {limiter.slots} searches until this request's queue limit; retry in "
            f"{RETRY_AFTER_S} s",
            code="planner_busy",
            headers={"Retry-After": str(RETRY_AFTER_S), "Server-Timing": queue_timing(request.scope)},
        )
    try:  # serialized in the pool too: a long answer encoded on the event loop would stall every other request
        body = await asyncio.get_running_loop().run_in_executor(
            limiter.pool, functools.partial(_plan_json, req, runtime, factory, request.app.state.settings.device_prices)
        )
        return Response(body, media_type="application/json")
    finally:
        limiter.release()

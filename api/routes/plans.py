"""POST /v1/plans: score one layout or rank layouts for a model on a cluster. Thin: the logic is in
``service.planner``.

``cluster.device == "live"`` plans for the service's Ray cluster, described by ``cluster_from_live`` (a callable
returning the live ``ClusterSpec``; the Ray backend may set it) or else by ``app.state.runtime.planning_cluster()``
when the app runs a runtime. Request fields that are set (bandwidths, peak, memory) override what it reports.
With neither (or no cluster yet) the request is refused (422, ``cluster.device``).

Errors are raised as ``api.validation.SpecError`` (a ValueError with ``.param``); the app maps them to 422
with the body ``{"error": {"code", "message", "param"}}``.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Request

from api.schemas import ClusterSpec, PlanRequest, PlanResponse
from api.validation import SpecError, SpecIssue
from service import planner

router = APIRouter(tags=["plans"])

# Set by the Ray backend: returns a ClusterSpec describing the live cluster (device, gpus_per_node, nodes).
cluster_from_live: Callable[[], ClusterSpec] | None = None


def _live_cluster(request: Request) -> ClusterSpec | None:
    if cluster_from_live is not None:
        return cluster_from_live()
    runtime = getattr(request.app.state, "runtime", None)
    planning_cluster = getattr(runtime, "planning_cluster", None)
    return planning_cluster() if planning_cluster is not None else None


def _resolve_cluster(requested: ClusterSpec, request: Request) -> ClusterSpec:
    if requested.device.strip().lower() != "live":
        return requested
    live = _live_cluster(request)
    if live is None:
        raise SpecError([SpecIssue("cluster.device", "device 'live' needs the service's Ray cluster, which is not "
                                   "connected (or has no nodes yet); name a device type such as 'H100' instead",
                                   "live_cluster_unavailable")])
    overrides = {k: v for k, v in requested.model_dump(exclude={"device", "gpus_per_node", "nodes"}).items()
                 if v is not None}
    return live.model_copy(update=overrides) if overrides else live


@router.post("/v1/plans", response_model=PlanResponse, summary="Plan a layout")
def create_plan(req: PlanRequest, request: Request) -> PlanResponse:
    """With ``layout``: that layout scored (one candidate; 422 if the model cannot run it). Without: the
    ``top_k`` fastest feasible layouts, with rejected ones and why."""
    from service.calibration import factors_for

    cluster = _resolve_cluster(req.cluster, request)
    if cluster is not req.cluster:
        req = req.model_copy(update={"cluster": cluster})
    # a cluster that a sweep has measured is planned with the fitted factors (None: the planner's defaults)
    factors = factors_for(getattr(request.app.state, "session_factory", None), cluster)
    return planner.search(req, factors=factors)

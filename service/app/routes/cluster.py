"""GET /v1/cluster: the Ray cluster the service runs on (nodes, CPUs/GPUs total and free, dashboard URL)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from api.spec import ClusterPublic
from service.app.deps import PrincipalDep, RuntimeDep
from service.app.errors import ApiError

router = APIRouter(tags=["cluster"])


@router.get("/v1/cluster", response_model=ClusterPublic, summary="The Ray cluster")
async def get_cluster(request: Request, runtime: RuntimeDep, principal: PrincipalDep) -> ClusterPublic:
    """Nodes with their CPUs/GPUs/memory, totals and what is free now, and the Ray dashboard URL (through this
    service when the caller may use its dashboard proxy)."""
    if runtime is None:
        raise ApiError(
            503,
            "this API process runs no Ray runtime; query the service that runs the scheduler",
            code="runtime_unavailable",
        )
    try:
        cluster = await run_in_threadpool(runtime.cluster)
    except Exception as e:
        raise ApiError(503, f"the Ray cluster is not reachable: {e}", code="runtime_unavailable") from e
    from service.app.links import ray_proxy_allowed, ray_proxy_url

    if ray_proxy_allowed(request, principal):
        cluster = cluster.model_copy(update={"dashboard_url": ray_proxy_url(request)})
    return cluster

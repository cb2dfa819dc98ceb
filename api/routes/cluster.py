"""GET /v1/cluster: the Ray cluster the service runs on (nodes, CPUs/GPUs total and free, dashboard URL)."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from api.deps import RuntimeDep
from api.errors import ApiError
from api.schemas import ClusterPublic

router = APIRouter(tags=["cluster"])


@router.get("/v1/cluster", response_model=ClusterPublic, summary="The Ray cluster")
async def get_cluster(runtime: RuntimeDep) -> ClusterPublic:
    """Nodes with their CPUs/GPUs/memory, totals and what is free now, and the Ray dashboard URL."""
    if runtime is None:
        raise ApiError(503, "this API process runs no Ray runtime; query the service that runs the scheduler",
                       code="runtime_unavailable")
    try:
        return await run_in_threadpool(runtime.cluster)
    except Exception as e:  # noqa: BLE001 - Ray unreachable
        raise ApiError(503, f"the Ray cluster is not reachable: {e}", code="runtime_unavailable") from e

"""POST /v1/plans through FastAPI's TestClient on a tiny app (the real app maps SpecError the same way)."""

from __future__ import annotations

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient

from api.routes import plans
from api.routes.plans import router
from api.schemas import ClusterSpec, PlanResponse
from api.validation import SpecError


@pytest.fixture()
def client():
    app = FastAPI()
    app.include_router(router)

    @app.exception_handler(SpecError)
    async def _spec_error(_: Request, exc: SpecError) -> JSONResponse:
        return JSONResponse(status_code=422, content={"error": {"code": exc.code, "message": str(exc),
                                                                "param": exc.param}})

    with TestClient(app) as c:
        yield c


def body(**over):
    b = {"model": {"name": "gpt", "preset": "7b"}, "cluster": {"device": "H100", "nodes": 1},
         "global_batch_size": 64, "top_k": 4}
    b.update(over)
    return b


def test_ranks_layouts(client):
    r = client.post("/v1/plans", json=body())
    assert r.status_code == 200, r.text
    resp = PlanResponse.model_validate(r.json())
    assert 1 <= len(resp.candidates) <= 4
    tps = [c.tokens_per_s for c in resp.candidates]
    assert tps == sorted(tps, reverse=True) and all(c.feasible for c in resp.candidates)
    assert resp.model.n_params > 6e9 and resp.cluster["device"] == "H100"
    assert resp.evaluated >= len(resp.candidates)


def test_scores_one_layout(client):
    layout = {"dp": 4, "tp": 2, "zero_stage": 2}
    r = client.post("/v1/plans", json=body(layout=layout, micro_batch_size=2))
    assert r.status_code == 200, r.text
    cands = r.json()["candidates"]
    assert len(cands) == 1
    assert cands[0]["layout"]["tp"] == 2 and cands[0]["micro_batch_size"] == 2
    assert set(cands[0]["memory_bytes"]) >= {"params", "grads", "optimizer", "activations", "buffers", "total"}


def test_invalid_layout_is_422_naming_the_field(client):
    r = client.post("/v1/plans", json=body(layout={"dp": 1, "tp": 3}))
    assert r.status_code == 422
    err = r.json()["error"]
    assert err["param"] == "layout.tp" and "tp in" in err["message"]


def test_unknown_device_is_422(client):
    r = client.post("/v1/plans", json=body(cluster={"device": "quantum-9000"}))
    assert r.status_code == 422
    assert r.json()["error"]["param"] == "cluster.device"
    assert "H100" in r.json()["error"]["message"]


def test_live_without_hook_is_422(client, monkeypatch):
    monkeypatch.setattr(plans, "cluster_from_live", None)
    r = client.post("/v1/plans", json=body(cluster={"device": "live"}))
    assert r.status_code == 422
    assert r.json()["error"]["param"] == "cluster.device"


def test_live_with_hook_plans_for_the_live_cluster(client, monkeypatch):
    monkeypatch.setattr(plans, "cluster_from_live", lambda: ClusterSpec(device="A100-40GB", gpus_per_node=4, nodes=2))
    r = client.post("/v1/plans", json=body(cluster={"device": "live", "inter_node_bandwidth_bytes_per_s": 1e10}))
    assert r.status_code == 200, r.text
    info = r.json()["cluster"]
    assert info["device"] == "A100-40GB" and info["world_size"] == 8
    assert info["inter_node_bandwidth_bytes_per_s"] == 1e10


def test_malformed_request_is_422(client):
    r = client.post("/v1/plans", json=body(bogus=1))
    assert r.status_code == 422


def test_live_falls_back_to_the_apps_runtime(client, monkeypatch):
    monkeypatch.setattr(plans, "cluster_from_live", None)

    class FakeRuntime:
        def planning_cluster(self):
            return ClusterSpec(device="cpu", gpus_per_node=2, nodes=1, peak_flops_per_s=5e10, memory_bytes=4 << 30)

    client.app.state.runtime = FakeRuntime()
    r = client.post("/v1/plans", json=body(model={"name": "gpt", "preset": "tiny"}, global_batch_size=8,
                                            cluster={"device": "live"}))
    assert r.status_code == 200, r.text
    assert r.json()["cluster"]["device"] == "cpu" and r.json()["cluster"]["world_size"] == 2
    assert r.json()["candidates"]

"""POST /v1/plans through FastAPI's TestClient on the app (no Ray runtime; SpecError -> 422 with the error body)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from fastapi.testclient import TestClient

from api.spec import ClusterSpec, PlanResponse
from service.app.routes import plans
from service.planner import Factors
from service.store.calibrations import cluster_key, forget_cached_factors, store_calibration


@pytest.fixture()
def client(tmp_path):
    from service.app.server import create_app
    from service.settings import Settings

    app = create_app(
        Settings(
            start_scheduler=False, data_dir=tmp_path, database_url=f"sqlite:///{tmp_path}/p.db", rate_limit_per_minute=0
        )
    )
    with TestClient(app) as c:
        yield c


def body(**over):
    b = {
        "model": {"name": "gpt", "preset": "7b"},
        "cluster": {"device": "H100", "nodes": 1},
        "global_batch_size": 64,
        "top_k": 4,
    }
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

        def stop(self):  # the app's lifespan stops its runtime
            pass

    client.app.state.runtime = FakeRuntime()
    r = client.post(
        "/v1/plans", json=body(model={"name": "gpt", "preset": "tiny"}, global_batch_size=8, cluster={"device": "live"})
    )
    assert r.status_code == 200, r.text
    assert r.json()["cluster"]["device"] == "cpu" and r.json()["cluster"]["world_size"] == 2
    assert r.json()["candidates"]


def test_the_response_says_where_the_factors_came_from(client):
    cluster = ClusterSpec(device="H100", nodes=1)
    r = client.post("/v1/plans", json=body())
    assert r.json()["calibration"]["source"] == "default" and r.json()["calibration"]["measured"] == []
    with client.app.state.session_factory() as s:
        store_calibration(
            s,
            cluster_key=cluster_key(cluster),
            factors=Factors(tp_latency_scale=3.0),
            error_before=0.4,
            error_after=0.1,
            sweep_id=None,
            measured=["tp_latency_scale"],
            observations=5,
        )
        s.commit()
    forget_cached_factors()
    try:
        got = client.post("/v1/plans", json=body()).json()
    finally:
        forget_cached_factors()
    cal = got["calibration"]
    assert cal["source"] == "measured" and cal["measured"] == ["tp_latency_scale"] and cal["observations"] == 5
    assert cal["measured_at"] and cal["error_after"] == 0.1
    assert got["cluster"]["factors"]["tp_latency_scale"] == 3.0


def test_an_absurd_search_is_a_422_naming_the_field(client):
    big = {
        "model": {
            "name": "gpt",
            "preset": None,
            "n_layers": 1008,
            "d_model": 10080,
            "n_heads": 720,
            "vocab_size": 50400,
            "seq_len": 2048,
        },
        "cluster": {"device": "H100", "gpus_per_node": 720, "nodes": 154},
        "global_batch_size": 110880,
    }
    r = client.post("/v1/plans", json=big)
    assert r.status_code == 422
    err = r.json()["error"]
    assert err["param"] == "micro_batch_size" and err["code"] == "search_too_large"
    assert "pin micro_batch_size" in err["message"]
    r = client.post("/v1/plans", json=body(cluster={"device": "H100", "nodes": 100_000}))
    assert r.status_code == 422 and r.json()["error"]["param"] == "cluster.nodes"


def test_a_busy_planner_makes_a_plan_wait_then_answers_503_with_retry_after_at_its_queue_limit(tmp_path, monkeypatch):
    from service.app.server import create_app
    from service.settings import Settings

    limiter = plans.PlannerLimiter(1)
    monkeypatch.setattr(plans, "limiter", limiter)
    settings = Settings(
        start_scheduler=False,
        data_dir=tmp_path,
        database_url=f"sqlite:///{tmp_path}/q.db",
        rate_limit_per_minute=0,
        request_queue_timeout_s=1.5,
    )
    with TestClient(create_app(settings)) as c:
        assert limiter.try_acquire()  # another search holds the only slot
        threading.Timer(0.5, limiter.release).start()  # ... and ends within the queue limit: this one waits for it
        assert c.post("/v1/plans", json=body()).status_code == 200

        assert limiter.try_acquire()  # now it holds the slot past the queue limit
        try:
            t0 = time.monotonic()
            r = c.post("/v1/plans", json=body())
            waited = time.monotonic() - t0
            assert r.status_code == 503
            assert r.headers["Retry-After"] == "1" and r.json()["error"]["code"] == "planner_busy"
            assert 1.3 <= waited < 10  # it waited for its queue limit (less the answer margin), not for ever
        finally:
            limiter.release()
        assert c.post("/v1/plans", json=body()).status_code == 200  # the slot is free again


def test_searches_run_off_the_event_loop(client, monkeypatch):
    seen = {}
    real = plans.planner.search

    def spy(req, **kw):
        try:  # inside the event loop's thread there is a running loop; in a threadpool worker there is none
            asyncio.get_running_loop()
            seen["on_loop"] = True
        except RuntimeError:
            seen["on_loop"] = False
        return real(req, **kw)

    monkeypatch.setattr(plans.planner, "search", spy)
    assert client.post("/v1/plans", json=body()).status_code == 200
    assert seen == {"on_loop": False}


def test_eager_attention_and_kernels_through_the_route(client):
    """POST /v1/plans with model.attention 'eager': the scores' 5 a s^2 b bytes per layer appear in the activations
    (L=2, a=4, s=128, b=2); the answer names its attention, kernel profile, interval and calibration."""
    model = {"name": "gpt", "preset": None, "n_layers": 2, "d_model": 64, "n_heads": 4, "vocab_size": 256,
             "seq_len": 128}  # fmt: skip
    out = {}
    for attention in ("flash", "eager"):
        r = client.post(
            "/v1/plans",
            json=body(
                model={**model, "attention": attention},
                cluster={"device": "H100", "gpus_per_node": 1},
                global_batch_size=2,
                layout={"dp": 1},
                micro_batch_size=2,
                activation_checkpointing="none",
            ),
        )
        assert r.status_code == 200, r.text
        out[attention] = r.json()
    assert out["eager"]["model"]["attention"] == "eager"
    (flash,), (eager,) = out["flash"]["candidates"], out["eager"]["candidates"]
    assert eager["attention"] == "eager" and flash["attention"] == "flash"
    assert eager["memory_bytes"]["activations"] - flash["memory_bytes"]["activations"] == 2 * 5 * 4 * 128**2 * 2
    assert eager["step_time_s"]["compute"] > flash["step_time_s"]["compute"]
    iv = eager["step_time_interval"]
    assert iv["low_s"] < eager["step_time_s"]["total"] < iv["high_s"] and iv["kernels"] == "megatron"
    assert out["eager"]["cluster"]["kernels"] == "megatron" and out["eager"]["calibration"]["used"] == "defaults"
    r = client.post("/v1/plans", json=body(cluster={"device": "H100", "kernels": "eager"}))
    assert r.status_code == 200 and r.json()["cluster"]["kernels"] == "eager"
    assert r.json()["candidates"][0]["step_time_interval"]["kernels"] == "eager"
    bad = client.post("/v1/plans", json=body(model={"name": "gpt", "preset": "tiny", "attention": "sdpa"}))
    assert bad.status_code == 422

"""Cost over HTTP: POST /v1/plans prices every candidate (hand-computed here from its predicted step time), ranks by
time or by cost, refuses bad prices with a 422 naming the field; GET /v1/runs/{id} (and the console's run page)
shows what a finished run cost from its stored attempts."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import update

from api.spec import RunSpec, build_plan
from service import store
from service.planner.prices import DEFAULT_PRICES
from service.store.db import session_scope
from service.store.models import RunAttempt

T0 = datetime(2026, 1, 1, tzinfo=UTC)
PRICE = "cluster.price_per_device_hour"


def body(**over):
    b = {
        "model": {"name": "gpt", "preset": "125m"},
        "cluster": {"device": "H100", "nodes": 1, "gpus_per_node": 8},
        "global_batch_size": 64,
        "top_k": 5,
    }
    b.update(over)
    return b


def plan(client, **over) -> dict:
    r = client.post("/v1/plans", json=body(**over))
    assert r.status_code == 200, r.text
    return r.json()


def test_every_candidate_is_priced_as_computed_by_hand(client) -> None:
    resp = plan(client, cluster={"device": "H100", "nodes": 1, "gpus_per_node": 8, "price_per_device_hour": 2.0},
                steps=1000)  # fmt: skip
    tokens_per_step = 64 * resp["model"]["seq_len"]
    assert resp["candidates"]
    for c in resp["candidates"]:
        t = c["step_time_s"]["total"]
        cost = c["cost"]
        assert cost["devices"] == 8 and cost["price_per_device_hour"] == 2.0 and cost["price_source"] == "request"
        assert cost["device_hours_per_step"] == pytest.approx(8 * t / 3600)
        assert cost["usd_per_step"] == pytest.approx(8 * t / 3600 * 2.0)
        assert cost["usd_per_billion_tokens"] == pytest.approx(8 * t / 3600 * 2.0 * 1e9 / tokens_per_step)
        assert cost["steps"] == 1000
        assert cost["device_hours_for_steps"] == pytest.approx(8 * t / 3600 * 1000)
        assert cost["usd_for_steps"] == pytest.approx(8 * t / 3600 * 2.0 * 1000)
    # one layout scored: the same arithmetic on its 4 devices; no steps, no run total
    one = plan(client, layout={"dp": 4}, micro_batch_size=4, cluster={"device": "H100", "price_per_device_hour": 1.0})
    (c,) = one["candidates"]
    assert c["cost"]["devices"] == 4
    assert c["cost"]["usd_per_step"] == pytest.approx(4 * c["step_time_s"]["total"] / 3600)
    assert c["cost"]["steps"] is None and c["cost"]["usd_for_steps"] is None


def test_where_the_price_comes_from(make_client) -> None:
    client = make_client(device_prices={"h100-sxm": 1.5})  # an alias of H100

    def cost(**cluster):
        return plan(client, cluster=cluster, layout={"dp": 2}, micro_batch_size=4)["candidates"][0]["cost"]

    settings = cost(device="H100")
    assert settings["price_per_device_hour"] == 1.5 and settings["price_source"] == "settings"
    assert cost(device="H100", price_per_device_hour=2.25)["price_source"] == "request"  # the request comes first
    a100 = cost(device="A100-80GB")
    assert a100["price_per_device_hour"] == DEFAULT_PRICES["A100-80GB"] and a100["price_source"] == "default"
    free = cost(device="L4")  # not in the table: no money figures
    assert free["price_source"] == "none" and free["price_per_device_hour"] is None
    assert free["usd_per_step"] is None and free["usd_per_billion_tokens"] is None and free["usd_for_steps"] is None
    assert free["device_hours_per_step"] > 0
    zero = cost(device="L4", price_per_device_hour=0)
    assert zero["usd_per_step"] == 0 and zero["price_source"] == "request"  # 0 is a price (owned devices)


def test_rank_by_time_or_by_cost(client) -> None:
    by_time = plan(client, rank_by="time")["candidates"]
    by_cost = plan(client, rank_by="cost")["candidates"]
    tps = [c["tokens_per_s"] for c in by_time]
    assert tps == sorted(tps, reverse=True) and {c["cost"]["devices"] for c in by_time} == {8}
    per_b = [c["cost"]["usd_per_billion_tokens"] for c in by_cost]
    assert per_b == sorted(per_b)
    # a small model is cheaper per token on fewer GPUs (no communication): the cost ranking uses part of the node
    assert by_cost[0]["cost"]["devices"] < 8
    assert per_b[0] < by_time[0]["cost"]["usd_per_billion_tokens"]
    assert by_cost[0]["tokens_per_s"] < by_time[0]["tokens_per_s"]
    r = client.post("/v1/plans", json=body(rank_by="money"))
    assert r.status_code == 422 and r.json()["error"]["param"] == "rank_by"


@pytest.mark.parametrize("bad", [-1, 1e300, "cheap", True])
def test_a_bad_price_is_a_422_naming_the_field(client, bad) -> None:
    r = client.post("/v1/plans", json=body(cluster={"device": "H100", "price_per_device_hour": bad}))
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] == PRICE
    spec = {"name": "c", "cluster": {"price_per_device_hour": bad}}
    r = client.post("/v1/runs", json=spec)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] == PRICE


def test_a_non_finite_price_is_a_422(client) -> None:
    raw = json.dumps(body()).replace('"nodes": 1', '"price_per_device_hour": NaN, "nodes": 1')
    r = client.post("/v1/plans", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] == PRICE


def test_a_finished_run_shows_what_it_cost(client) -> None:
    spec = RunSpec.model_validate(
        {"name": "c", "layout": {"dp": 4}, "batch": {"global_batch_size": 8}, "cluster": {"price_per_device_hour": 3}}
    )
    with session_scope(client.app.state.session_factory) as s:
        run, _ = store.create_run(
            s, spec=spec.model_dump(mode="json"), plan=build_plan(spec).model_dump(mode="json"), name="c"
        )
        rid = run.id
        store.transition(s, run_id=rid, to="STARTING", reason="admitted")
        store.transition(s, run_id=rid, to="RUNNING", reason="driver")
        store.start_attempt(s, run_id=rid, cause="start")
        store.start_attempt(s, run_id=rid, cause="restart")
        store.end_run(s, run_id=rid, to="SUCCEEDED", reason="done")
        for n, (start, end) in {1: (0, 1800), 2: (2000, 2000 + 5400)}.items():  # 30 min, then 90 min
            s.execute(
                update(RunAttempt)
                .where(RunAttempt.run_id == rid, RunAttempt.attempt == n)
                .values(started_at=T0 + timedelta(seconds=start), finished_at=T0 + timedelta(seconds=end))
            )
    cost = client.get(f"/v1/runs/{rid}").json()["cost"]
    assert cost["devices"] == 4 and cost["attempts_wall_s"] == pytest.approx(7200)
    assert cost["device_hours"] == pytest.approx(8.0)  # 4 devices x 2 h
    assert cost["usd"] == pytest.approx(24.0) and cost["price_source"] == "request"
    page = client.get(f"/runs/{rid}")
    assert page.status_code == 200
    card = page.text.split('id="cost"', 1)[1].split("</div>", 1)[0]
    assert "8.00 device-hours" in card and "$24.00" in card


def test_a_run_without_a_known_price_costs_device_hours_only(client) -> None:
    spec = RunSpec.model_validate({"name": "c", "layout": {"dp": 2}, "batch": {"global_batch_size": 8}})
    with session_scope(client.app.state.session_factory) as s:
        run, _ = store.create_run(
            s, spec=spec.model_dump(mode="json"), plan=build_plan(spec).model_dump(mode="json"), name="c"
        )
        rid = run.id
        store.transition(s, run_id=rid, to="STARTING", reason="admitted")
        store.transition(s, run_id=rid, to="RUNNING", reason="driver")
        store.start_attempt(s, run_id=rid, cause="start")
        store.end_run(s, run_id=rid, to="FAILED", reason="boom")
        s.execute(
            update(RunAttempt)
            .where(RunAttempt.run_id == rid)
            .values(started_at=T0, finished_at=T0 + timedelta(seconds=900))
        )
    cost = client.get(f"/v1/runs/{rid}").json()["cost"]
    assert cost["device_hours"] == pytest.approx(0.5) and cost["usd"] is None and cost["price_source"] == "none"


def test_a_submission_is_priced_with_the_settings_and_its_run_costs_that(make_client) -> None:
    from tests.sweeps.conftest import FakeRuntime, tiny_base

    client = make_client(device_prices={"cpu": 0.5})
    app = client.app
    app.state.runtime = FakeRuntime(app.state.session_factory, app.state.settings)  # a 6-CPU "cluster"
    r = client.post("/v1/runs", json=tiny_base(name="priced", layout={"dp": 2}, train={"steps": 40}))
    assert r.status_code == 201, r.text
    run = r.json()
    pred = run["plan"]["predicted"]
    assert pred["cost"]["price_per_device_hour"] == 0.5 and pred["cost"]["price_source"] == "settings"
    assert pred["cost"]["usd_for_steps"] == pytest.approx(2 * pred["step_time_s"]["total"] / 3600 * 0.5 * 40)
    # a run is priced as meshrun's own loop, says which calibration it used (none here) and how far to trust it
    assert pred["calibration"] == "defaults" and pred["step_time_interval"]["kernels"] == "eager"
    with session_scope(app.state.session_factory) as s:
        store.transition(s, run_id=run["id"], to="STARTING", reason="admitted")
        store.transition(s, run_id=run["id"], to="RUNNING", reason="driver")
        store.start_attempt(s, run_id=run["id"], cause="start")
        store.end_run(s, run_id=run["id"], to="CANCELLED", reason="stop")
        s.execute(
            update(RunAttempt)
            .where(RunAttempt.run_id == run["id"])
            .values(started_at=T0, finished_at=T0 + timedelta(seconds=3600))
        )
    cost = client.get(f"/v1/runs/{run['id']}").json()["cost"]
    assert cost["device_hours"] == pytest.approx(2.0) and cost["usd"] == pytest.approx(1.0)
    assert cost["price_source"] == "settings"  # the price its prediction used at submission

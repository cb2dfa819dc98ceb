"""service/app/observability.py: /metrics content, route-template labels, DB collector, JSON logs with run ids."""

from __future__ import annotations

import io
import json
import logging

import pytest
from fastapi import FastAPI, HTTPException
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from service.app import observability as obs
from service import store
from service.store.db import make_engine, make_sessionmaker, session_scope
from service.store.models import Base


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _find(samples, name: str, **labels: str) -> float | None:
    for (n, lab), v in samples.items():
        if n == name and all(dict(lab).get(k) == val for k, val in labels.items()):
            return v
    return None


@pytest.fixture(scope="module")
def pg_url():
    from tests.service.pg import postgres_database

    with postgres_database("meshrun_test_obs") as url:
        yield url


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'obs.db'}"
    return request.getfixturevalue("pg_url")


@pytest.fixture
def app_and_factory(db_url):
    engine = make_engine(db_url)
    Base.metadata.drop_all(engine)
    Base.metadata.create_all(engine)
    factory = make_sessionmaker(engine)
    app = FastAPI()

    @app.get("/v1/runs/{run_id}")
    def get_run(run_id: str) -> dict:
        if run_id == "missing":
            raise HTTPException(404, "no such run")
        return {"id": run_id}

    @app.get("/boom")
    def boom() -> dict:
        raise RuntimeError("boom")

    obs.instrument_app(app, None)
    app.state.session_factory = factory  # set after instrument_app, as a lifespan would
    yield app, factory
    engine.dispose()


def test_metrics_endpoint_counts_requests_by_route_template_and_status(app_and_factory):
    app, _ = app_and_factory
    client = TestClient(app, raise_server_exceptions=False)
    assert client.get("/v1/runs/run-a").status_code == 200
    assert client.get("/v1/runs/run-b").status_code == 200
    assert client.get("/v1/runs/missing").status_code == 404
    assert client.get("/boom").status_code == 500
    assert client.get("/nope/123").status_code == 404
    resp = client.get("/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    s = _samples(resp.text)
    assert _find(s, obs.HTTP_REQUESTS, route="/v1/runs/{run_id}", status="200", method="GET") == 2
    assert _find(s, obs.HTTP_REQUESTS, route="/v1/runs/{run_id}", status="404") == 1
    assert _find(s, obs.HTTP_REQUESTS, route=obs.UNMATCHED_ROUTE, status="404") == 1
    assert _find(s, obs.HTTP_ERRORS, route="/boom", status="500") == 1
    assert _find(s, obs.HTTP_ERRORS, route="/v1/runs/{run_id}") is None  # 404 is not a server error
    assert _find(s, obs.HTTP_LATENCY + "_count", route="/v1/runs/{run_id}") == 3
    # raw paths never become labels (bounded cardinality), scrapes are not counted
    assert not any("run-a" in dict(lab).get("route", "") for (_, lab) in s)
    assert _find(s, obs.HTTP_REQUESTS, route="/metrics") is None


def test_runs_by_status_queue_length_and_per_run_training_series(app_and_factory):
    app, factory = app_and_factory
    with session_scope(factory) as session:
        ids = []
        for i in range(3):
            run, _ = store.create_run(session, spec={"name": f"r{i}"}, plan=None, name=f"r{i}")
            ids.append(run.id)
    with session_scope(factory) as session:
        store.transition(session, run_id=ids[0], to="STARTING")
        store.transition(session, run_id=ids[0], to="RUNNING")
        store.add_metrics(session, run_id=ids[0], attempt=1, rows=[
            {"step": 1, "loss": 5.0, "tokens_per_s": 100.0, "mfu": 0.1},
            {"step": 2, "loss": 4.5, "tokens_per_s": 120.0, "mfu": 0.12, "step_time_s": 0.5,
             "peak_memory_bytes": 1234}])
    s = _samples(TestClient(app).get("/metrics").text)
    assert _find(s, obs.RUNS, status="QUEUED") == 2
    assert _find(s, obs.RUNS, status="RUNNING") == 1
    assert _find(s, obs.RUNS, status="FAILED") == 0
    assert _find(s, obs.QUEUE_LENGTH) == 2
    assert _find(s, obs.DB_UP) == 1
    assert _find(s, obs.DB_PING_LATENCY) is not None
    loss_name = obs.RUN_METRICS["loss"][0]
    assert _find(s, loss_name, run_id=ids[0], run_name="r0", status="RUNNING") == 4.5  # latest step
    assert _find(s, obs.RUN_METRICS["step"][0], run_id=ids[0]) == 2
    assert _find(s, obs.RUN_METRICS["peak_memory_bytes"][0], run_id=ids[0]) == 1234
    assert _find(s, loss_name, run_id=ids[1]) is None  # queued runs have no training series
    # a finished run keeps its series for a while (labelled with its final status)
    with session_scope(factory) as session:
        store.transition(session, run_id=ids[0], to="SUCCEEDED")
    s2 = _samples(TestClient(app).get("/metrics").text)
    assert _find(s2, loss_name, run_id=ids[0], status="SUCCEEDED") == 4.5
    assert _find(s2, obs.RUNS, status="RUNNING") == 0 and _find(s2, obs.RUNS, status="SUCCEEDED") == 1
    # the SQLAlchemy timing events saw the scrape's own SELECTs
    assert (_find(s, obs.DB_QUERY_LATENCY + "_count", operation="SELECT") or 0) >= 1


def test_scrape_survives_a_broken_database(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path / 'empty.db'}")  # no tables
    app = FastAPI()
    obs.instrument_app(app, None)
    app.state.session_factory = make_sessionmaker(engine)
    resp = TestClient(app).get("/metrics")
    assert resp.status_code == 200
    assert _find(_samples(resp.text), obs.DB_UP) == 0


def test_instrument_app_twice_and_many_apps_do_not_clash():
    a, b = FastAPI(), FastAPI()
    reg = obs.instrument_app(a, None)
    assert obs.instrument_app(a, None) is reg
    assert obs.instrument_app(b, None) is not reg
    assert TestClient(b).get("/metrics").status_code == 200


class _S:
    def __init__(self, log_json: bool, log_level: str = "INFO") -> None:
        self.log_json, self.log_level = log_json, log_level


def test_json_logs_carry_run_ids_from_extras_and_context():
    buf = io.StringIO()
    handler = obs.configure_logging(_S(True), stream=buf)
    try:
        log = logging.getLogger("meshrun.test")
        log.info("admitted %s", "x", extra={"run_id": "run-1", "attempt": 2})
        with obs.run_context("run-2"):
            log.warning("in context")
        log.info("no run")
        try:
            raise ValueError("bad")
        except ValueError:
            log.exception("failed")
        lines = [json.loads(line) for line in buf.getvalue().splitlines()]
    finally:
        logging.getLogger().removeHandler(handler)
    assert lines[0]["message"] == "admitted x" and lines[0]["run_id"] == "run-1" and lines[0]["attempt"] == 2
    assert lines[0]["level"] == "INFO" and lines[0]["logger"] == "meshrun.test" and "ts" in lines[0]
    assert lines[1]["run_id"] == "run-2"
    assert "run_id" not in lines[2]
    assert "ValueError: bad" in lines[3]["exception"]


def test_text_logs_and_reconfigure_replaces_handler():
    buf1, buf2 = io.StringIO(), io.StringIO()
    obs.configure_logging(_S(False), stream=buf1)
    h2 = obs.configure_logging(_S(False, "WARNING"), stream=buf2)
    try:
        log = logging.getLogger("meshrun.test2")
        log.info("hidden")
        with obs.run_context("run-9"):
            log.warning("shown")
        assert buf1.getvalue() == ""
        assert "[run run-9]" in buf2.getvalue() and "shown" in buf2.getvalue() and "hidden" not in buf2.getvalue()
        assert sum(1 for h in logging.getLogger().handlers if h.get_name() == "meshrun") == 1
    finally:
        logging.getLogger().removeHandler(h2)
        logging.getLogger().setLevel(logging.WARNING)


def test_bad_log_level_names_the_setting():
    with pytest.raises(ValueError, match="MESHRUN_LOG_LEVEL"):
        obs.configure_logging(_S(False, "LOUD"), stream=io.StringIO())


# --------------------------------------------------------------------------------------- /metrics scrape auth
def test_compose_prometheus_sends_the_metrics_token_meshrun_expects():
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[2]
    services = yaml.safe_load((root / "docker-compose.yml").read_text())["services"]
    prom = yaml.safe_load((root / "deploy" / "prometheus" / "prometheus.yml").read_text())
    job = next(j for j in prom["scrape_configs"] if j["job_name"] == "meshrun")
    assert services["meshrun"]["environment"]["MESHRUN_AUTH"] == "on"  # so /metrics needs a token
    creds = job["authorization"]["credentials_file"]
    assert job["authorization"].get("type", "Bearer") == "Bearer"
    # the same variable reaches meshrun (Settings.metrics_token) and the file Prometheus reads
    token_ref = "${MESHRUN_METRICS_TOKEN:-}"
    assert services["meshrun"]["environment"]["MESHRUN_METRICS_TOKEN"] == token_ref
    assert services["prometheus"]["environment"]["MESHRUN_METRICS_TOKEN"] == token_ref
    entry = " ".join(services["prometheus"]["entrypoint"])
    assert f"> {creds}" in entry and "$$MESHRUN_METRICS_TOKEN" in entry and "exec /bin/prometheus" in entry
    data_mount = next(v for v in services["prometheus"]["volumes"] if v.startswith("prometheus-data:"))
    assert creds.startswith(data_mount.split(":")[1] + "/")  # written where the container may write


def test_instrumented_app_requires_a_scrape_token_with_auth_on(tmp_path):
    from service.settings import Settings

    app = FastAPI()
    obs.instrument_app(app, Settings(data_dir=tmp_path, auth="on", metrics_token="tok-" + "x" * 20))
    client = TestClient(app)
    r = client.get("/metrics")
    assert r.status_code == 401 and set(r.json()["error"]) == {"code", "message", "param"}
    assert client.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.get("/metrics", headers={"Authorization": "Bearer tok-" + "x" * 20}).status_code == 200
    assert Settings(data_dir=tmp_path, metrics_token="").metrics_token is None

"""One definition of a metric row (``api.spec.metrics.MetricRow``): the store's columns, the store's write path, the
API, the Prometheus exporter, the Ray gauges and the SDK's DataFrame all agree with it."""

from __future__ import annotations

import datetime as dt

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import BigInteger, DateTime, Float, Integer

from api.spec.metrics import GAUGES, KEY_FIELDS, MEASUREMENTS, METRIC_ROW_FIELDS, UNITS, MetricRow
from service import store
from service.app import observability as obs
from service.store.db import make_engine, make_sessionmaker, session_scope
from service.store.models import Base, Metric
from workers import ray_metrics

# a value for every measured field, of the field's type
VALUES = {n: (12345 if METRIC_ROW_FIELDS[n].integer else 0.25 + i) for i, n in enumerate(MEASUREMENTS)}


def test_every_field_has_a_unit_and_a_meaning():
    for name, f in METRIC_ROW_FIELDS.items():
        assert f.unit and f.description, name
    assert UNITS["tokens_per_s"] == "tokens/s" and UNITS["step_time_s"] == "s" and UNITS["peak_memory_bytes"] == "bytes"
    assert KEY_FIELDS == ("step", "attempt") and "time" not in MEASUREMENTS
    # the units also reach the OpenAPI schema (json_schema_extra)
    props = MetricRow.model_json_schema()["properties"]
    assert props["tokens_per_s"]["unit"] == "tokens/s"


def test_the_store_has_one_column_per_field_of_the_right_type():
    cols = {c.name: c for c in Metric.__table__.columns}
    columns = {n for n, f in METRIC_ROW_FIELDS.items() if f.column}
    assert set(cols) - {"id", "run_id", "extra"} == columns
    # structured fields (per-rank lists, the breakdown) live in the row's extra JSON
    assert {"breakdown", "breakdown_per_rank"} <= set(METRIC_ROW_FIELDS) - columns
    for name, f in METRIC_ROW_FIELDS.items():
        if not f.column:
            continue
        col_type = cols[name].type
        if name == "time":
            assert isinstance(col_type, DateTime)
        elif f.integer:
            assert isinstance(col_type, (Integer, BigInteger)), name
        else:
            assert isinstance(col_type, Float), name
        assert cols[name].nullable == (name in MEASUREMENTS), name
    assert store.METRIC_FIELDS == MEASUREMENTS


@pytest.fixture
def factory(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path / 'm.db'}")
    Base.metadata.create_all(engine)
    yield make_sessionmaker(engine)
    engine.dispose()


def _run_with_one_full_row(factory) -> str:
    with session_scope(factory) as s:
        run, _ = store.create_run(s, spec={"name": "m"}, plan=None, name="m")
        store.transition(s, run_id=run.id, to="STARTING")
        store.transition(s, run_id=run.id, to="RUNNING")
        row = {"step": 3, "time": 1_700_000_000.0, "a_new_key": 7, **VALUES}
        assert store.add_metrics(s, run_id=run.id, attempt=2, rows=[row]) == 1
        return run.id


def test_a_worker_row_round_trips_through_the_store_and_the_api_model(factory):
    run_id = _run_with_one_full_row(factory)
    with session_scope(factory) as s:
        (m,) = store.list_metrics(s, run_id=run_id)
        api_row = MetricRow.model_validate(m)
        assert m.extra == {"a_new_key": 7}  # an undeclared key is kept, apart from the columns
    assert api_row.step == 3 and api_row.attempt == 2
    assert api_row.time is not None and api_row.time.replace(tzinfo=dt.UTC).timestamp() == 1_700_000_000.0
    for name, value in VALUES.items():
        assert getattr(api_row, name) == value, name


def test_the_exporter_and_the_ray_gauges_cover_every_gauge_field(factory):
    assert set(obs.RUN_METRICS) == set(GAUGES) == set(ray_metrics.GAUGES)
    for field, gauge in GAUGES.items():
        assert obs.RUN_METRICS[field][0] == "meshrun_run_" + gauge
        assert ray_metrics.PROMETHEUS_NAMES[field] == "ray_meshrun_train_" + gauge

    run_id = _run_with_one_full_row(factory)
    app = FastAPI()
    obs.instrument_app(app, None)
    app.state.session_factory = factory
    samples = {
        s.name: s.value
        for fam in text_string_to_metric_families(TestClient(app).get("/metrics").text)
        for s in fam.samples
        if s.labels.get("run_id") == run_id
    }
    for field, (name, _help) in obs.RUN_METRICS.items():
        expected = 3 if field == "step" else VALUES[field]
        assert samples[name] == pytest.approx(expected), field


def test_the_sdk_dataframe_has_one_column_per_field():
    pytest.importorskip("pandas")
    from api.sdk.resources import metric_rows_frame

    df = metric_rows_frame([MetricRow(step=1, loss=2.0), MetricRow(step=2, tokens_per_s=5.0)])
    assert list(df.index) == [1, 2] and set(df.columns) == set(METRIC_ROW_FIELDS) - {"step"}

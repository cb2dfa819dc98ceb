"""Fixtures for API tests through HTTP: a TestClient on a fresh app, on SQLite and on PostgreSQL.

``db_url`` is parametrized: ``sqlite`` (a file under tmp_path) and ``postgresql`` (a database created for this
test session at 127.0.0.1:5432 and dropped afterwards; tables are emptied between tests). ``make_client(**kw)``
builds ``create_app(Settings(start_scheduler=False, data_dir=tmp_path, database_url=db_url, **kw))`` and enters
its lifespan (migrations run).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import inspect, text

from service.app.server import create_app
from service.store.db import make_engine
from service.store.models import Base
from service.settings import Settings
from tests.service.pg import postgres_database


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    with postgres_database("meshrun_test_api") as url:
        yield url


def _truncate(url: str) -> None:
    """Empty every table; a database whose tables do not exist yet (first test, before migrations) is fine.
    Any other error (server down, lock timeout, a renamed table) fails the test."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            existing = set(inspect(conn).get_table_names())
        tables = [t.name for t in Base.metadata.sorted_tables if t.name in existing]
        if tables:
            with engine.begin() as conn:
                conn.execute(text(f"TRUNCATE {', '.join(tables)} RESTART IDENTITY CASCADE"))
    finally:
        engine.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request, tmp_path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'meshrun.db'}"
        return
    url = request.getfixturevalue("pg_url")
    _truncate(url)
    yield url
    _truncate(url)


@pytest.fixture
def make_client(db_url, tmp_path) -> Iterator[Callable[..., TestClient]]:
    with ExitStack() as stack:
        def make(*, raise_server_exceptions: bool = True, **overrides) -> TestClient:
            kw = dict(start_scheduler=False, data_dir=tmp_path, database_url=db_url, rate_limit_per_minute=0)
            kw.update(overrides)
            app = create_app(Settings(**kw))
            return stack.enter_context(TestClient(app, raise_server_exceptions=raise_server_exceptions))
        yield make


@pytest.fixture
def client(make_client) -> TestClient:
    return make_client()

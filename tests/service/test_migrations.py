"""Alembic migrations on SQLite and PostgreSQL: up from empty, down to base, up again; no drift from the ORM."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from service.store import migrate
from service.store.db import make_engine
from service.store.models import Base
from tests.service.pg import postgres_database

TABLES = {"runs", "run_attempts", "metrics", "run_events", "checkpoints", "sweeps", "trials", "calibrations",
          "run_stats", "api_tokens", "console_sessions", "sweep_events", "artifacts", "webhooks",
          "webhook_deliveries"}


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'm.db'}"
        return
    with postgres_database("meshrun_test_migr") as url:
        yield url


def _tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def _drift(url: str) -> list:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True, "compare_server_default": True})
            return compare_metadata(ctx, Base.metadata)
    finally:
        engine.dispose()


def test_upgrade_downgrade_upgrade_without_drift(db_url):
    assert migrate.current(db_url) is None
    migrate.upgrade(db_url)
    assert migrate.current(db_url) == migrate.head()
    assert _tables(db_url) == TABLES
    assert _drift(db_url) == []

    migrate.downgrade(db_url, "base")
    assert migrate.current(db_url) is None
    assert _tables(db_url) == set()

    migrate.upgrade(db_url)
    migrate.upgrade(db_url)  # idempotent: a second service start changes nothing
    assert migrate.current(db_url) == migrate.head()
    assert _drift(db_url) == []


def test_every_orm_table_has_a_migration():
    assert set(Base.metadata.tables) == TABLES

"""A throw-away PostgreSQL database per test session (the server at 127.0.0.1:5432 is shared by several people).

``pg_database(prefix)`` creates ``<prefix>_<pid>_<random>`` with an autocommit psycopg connection and drops it
afterwards. ``postgres_database(prefix)`` is the one way fixtures get a database: it FAILS with a clear reason when
the server is not reachable (the test command needs PostgreSQL; a suite that skipped every PostgreSQL test would pass
without testing the deployment's database).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager

PG_ADMIN_URL = os.environ.get("MESHRUN_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def _dsn(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def pg_available() -> str | None:
    """None if PostgreSQL answers, else why not."""
    try:
        import psycopg
        with psycopg.connect(_dsn(PG_ADMIN_URL), connect_timeout=3, autocommit=True) as conn:
            conn.execute("SELECT 1")
        return None
    except Exception as e:  # noqa: BLE001
        return f"PostgreSQL at {PG_ADMIN_URL} not reachable: {e}"


@contextmanager
def pg_database(prefix: str) -> Iterator[str]:
    """Create a fresh database, yield its SQLAlchemy URL, drop it (terminating leftover connections)."""
    import psycopg
    name = f"{prefix}_{os.getpid()}_{secrets.token_hex(3)}"
    base, _, _ = PG_ADMIN_URL.rpartition("/")
    with psycopg.connect(_dsn(PG_ADMIN_URL), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"{base}/{name}"
    finally:
        with psycopg.connect(_dsn(PG_ADMIN_URL), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def fail_without_pg() -> None:
    """Fail the calling test/fixture, saying why and what to do, when PostgreSQL is not reachable."""
    import pytest

    why = pg_available()
    if why is not None:
        pytest.fail(f"{why}: the suite needs PostgreSQL at 127.0.0.1:5432 (database `test`, trust auth; "
                    "MESHRUN_TEST_PG_URL names another)", pytrace=False)


@contextmanager
def postgres_database(prefix: str) -> Iterator[str]:
    """For fixtures: ``fail_without_pg()`` then ``pg_database(prefix)``."""
    fail_without_pg()
    with pg_database(prefix) as url:
        yield url

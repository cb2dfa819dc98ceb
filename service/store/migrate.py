"""Database migrations (Alembic, revisions in ``migrations/``), callable from code.

    upgrade(url)             # empty or older database -> newest schema; the service calls it on start
    downgrade(url, "base")   # back down (tests, rollbacks)
    current(url)             # revision the database is at (None = never migrated)

The ini file and the scripts ship inside the ``migrations`` package, so this works from a wheel as well as from
a checkout. On PostgreSQL an advisory lock serialises concurrent upgrades (several API replicas starting at once).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, text

from service.meta import PROJECT_ROOT
from service.store.db import make_engine, redact_url

log = logging.getLogger(__name__)

MIGRATIONS_DIR = PROJECT_ROOT / "migrations"
_PG_LOCK_KEY = 0x6D657368  # "mesh": advisory lock id held while migrating


def alembic_config(url: str | None = None, *, connection: Connection | None = None) -> Config:
    """An Alembic Config pointing at meshrun's scripts; the URL/connection travel as attributes (no ini edit,
    no %-escaping of passwords)."""
    cfg = Config(str(MIGRATIONS_DIR / "alembic.ini"))
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    if url is not None:
        cfg.attributes["url"] = url
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def head() -> str:
    """The newest revision in migrations/."""
    rev = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert rev is not None
    return rev


@contextmanager
def _connection(url: str) -> Iterator[Connection]:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            if conn.dialect.name == "postgresql":
                conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": _PG_LOCK_KEY})
                conn.commit()
            try:
                yield conn
            finally:
                if conn.dialect.name == "postgresql":
                    conn.rollback()
                    conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": _PG_LOCK_KEY})
                    conn.commit()
    finally:
        engine.dispose()


def upgrade(url: str, rev: str = "head") -> None:
    """Migrate the database at ``url`` up to ``rev`` (default: newest). Idempotent."""
    with _connection(url) as conn:
        command.upgrade(alembic_config(url, connection=conn), rev)
        conn.commit()
    log.debug("database %s upgraded to %s", redact_url(url), rev)


def downgrade(url: str, rev: str) -> None:
    """Migrate the database at ``url`` down to ``rev`` ("base" = empty)."""
    with _connection(url) as conn:
        command.downgrade(alembic_config(url, connection=conn), rev)
        conn.commit()


def current(url: str) -> str | None:
    """The revision the database is at, or None if it was never migrated."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()

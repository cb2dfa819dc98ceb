"""Alembic environment. The database URL comes from the caller (``config.attributes["url"]`` or an open
``config.attributes["connection"]``, set by service.store.migrate), else ``sqlalchemy.url`` in the ini, else Settings."""

from __future__ import annotations

from alembic import context
from sqlalchemy.engine import Connection

from service.store.models import Base

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    url = config.attributes.get("url") or config.get_main_option("sqlalchemy.url")
    if not url:
        from service.settings import Settings
        url = Settings().database_url
    return url


def _configure(**kw) -> None:
    context.configure(target_metadata=target_metadata, compare_type=True, compare_server_default=True,
                      render_as_batch=True,  # SQLite cannot ALTER most things: batch mode recreates tables
                      **kw)


def run_migrations_offline() -> None:
    _configure(url=_url(), literal_binds=True, dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()


def _run(connection: Connection) -> None:
    _configure(connection=connection)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    from service.store.db import make_engine
    engine = make_engine(_url())
    try:
        with engine.connect() as conn:
            _run(conn)
            conn.commit()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()

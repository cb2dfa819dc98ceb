"""Database engine and sessions. SQLite (WAL, busy timeout, foreign keys) by default; PostgreSQL by URL."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

SQLITE_BUSY_TIMEOUT_MS = 30_000


def make_engine(
    url: str, *, echo: bool = False, pool_size: int = 10, max_overflow: int = 20, pool_timeout_s: float = 30.0
) -> Engine:
    """The engine of ``url``; the pool is bounded (``pool_size`` + ``max_overflow`` connections, a checkout waits
    at most ``pool_timeout_s`` and then raises ``sqlalchemy.exc.TimeoutError``, which the API answers 503)."""
    pool = {"pool_size": pool_size, "max_overflow": max_overflow, "pool_timeout": pool_timeout_s}
    if url.startswith("sqlite"):
        path = url.split(":///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            url,
            echo=echo,
            connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000},
            **pool,
        )

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record):
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()

        return engine
    return create_engine(url, echo=echo, pool_pre_ping=True, **pool)


def redact_url(url: str) -> str:
    """``url`` for logs: the password hidden (``***``); never raises (a log line must not fail)."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return "<database>"


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(bind=engine, expire_on_commit=False)


_SHARED: dict[str, sessionmaker[Session]] = {}
_SHARED_LOCK = threading.Lock()


def shared_sessionmaker(url: str) -> sessionmaker[Session]:
    """One engine and sessionmaker per database URL per process (for code that gets only the URL, e.g. objects
    Ray pickles into other processes)."""
    with _SHARED_LOCK:
        if url not in _SHARED:
            _SHARED[url] = make_sessionmaker(make_engine(url))
        return _SHARED[url]


@contextmanager
def session_scope(factory: sessionmaker[Session]) -> Iterator[Session]:
    """A transaction: commit on success, roll back on error."""
    session = factory()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()

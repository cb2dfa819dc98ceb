"""/healthz tells the truth about writes (issue 34): a database that answers reads but refuses commits is
``db: unwritable`` and a full checkpoint storage is ``storage: full``, both 503 with Retry-After; it recovers."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine

from service.app.routes import health
from service.app.server import create_app
from service.settings import Settings
from service.store.db import make_sessionmaker


@pytest.fixture(autouse=True)
def fresh_probes(monkeypatch):
    monkeypatch.setattr(health, "PROBE_INTERVAL_S", 0.0)


def _client(tmp_path, **kw) -> TestClient:
    s = Settings(start_scheduler=False, data_dir=tmp_path, database_url=f"sqlite:///{tmp_path / 'h.db'}",
                 rate_limit_per_minute=0, **kw)
    return TestClient(create_app(s))


def test_read_only_database_is_db_unwritable(tmp_path):
    with _client(tmp_path) as c:
        ok = c.get("/healthz")
        assert ok.status_code == 200 and ok.json()["db"] == "ok", ok.text
        # the same database file, opened read-only (what a read-only mount or a revoked permission gives)
        ro = create_engine(f"sqlite:///file:{tmp_path / 'h.db'}?mode=ro&uri=true")
        writable = c.app.state.session_factory
        c.app.state.session_factory = make_sessionmaker(ro)
        try:
            r = c.get("/healthz")
            assert r.status_code == 503, r.text
            body = r.json()
            assert body["db"] == "unwritable" and body["status"] == "degraded"
            assert "cannot be written" in body["reason"] and r.headers["Retry-After"]
        finally:
            c.app.state.session_factory = writable
            ro.dispose()
        assert c.get("/healthz").status_code == 200




def test_full_checkpoint_storage_is_storage_full(tmp_path, tiny_tmpfs):
    with _client(tmp_path, checkpoint_root=tiny_tmpfs / "ckpt") as c:
        assert c.get("/healthz").json()["storage"] == "ok"
        filler = tiny_tmpfs / "filler"
        with open(filler, "wb") as f:
            try:
                while True:
                    f.write(b"x" * 65536)
                    f.flush()
            except OSError:
                pass
        r = c.get("/healthz")
        assert r.status_code == 503, r.text
        body = r.json()
        assert body["storage"] == "full" and "no space left" in body["reason"] and r.headers["Retry-After"]
        filler.unlink()
        back = c.get("/healthz")
        assert back.status_code == 200 and back.json()["storage"] == "ok", back.text
        assert list((tiny_tmpfs / "ckpt").iterdir()) == []  # the probe leaves nothing behind

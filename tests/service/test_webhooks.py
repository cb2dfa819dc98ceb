"""Webhook logic on real database rows (SQLite file): which events become deliveries (state filter, straggler, hang,
goodput below a threshold, a sweep's end, another project's run), sealed secrets, signatures, backoff bounds."""

from __future__ import annotations

import json

import pytest

from service import store
from service.security import webhooks as sec
from service.settings import Settings
from service.store import webhooks as wh
from service.store.db import make_engine, make_sessionmaker, session_scope
from service.store.models import Base, Sweep, SweepEvent, WebhookDelivery


@pytest.fixture
def factory(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path / 'w.db'}")
    Base.metadata.create_all(engine)
    yield make_sessionmaker(engine)
    engine.dispose()


def _hook(s, *, events, project="p", states=None, goodput_below=None, run_id=None):
    return wh.create_webhook(
        s, project=project, url="https://e.x/h", events=events, states=states, payload_format="json",
        goodput_below=goodput_below, run_id=run_id, secret_sealed="v1:x", secret_prefix="mwh_", created_by="t",
    )


def _deliveries(s, hook_id):
    return [(d.event, d.payload.get("to_status")) for d in reversed(wh.list_deliveries(s, webhook_id=hook_id))]


def test_events_become_deliveries_once(factory):
    with session_scope(factory) as s:
        old, _ = store.create_run(s, spec={}, plan=None, project="p", name="old")
    with session_scope(factory) as s:  # a new webhook does not replay history
        states = _hook(s, events=["run.state"], states=["FAILED", "SUCCEEDED"]).id
        every = _hook(s, events=["run.state", "run.straggler", "run.hang"]).id
        low = _hook(s, events=["run.goodput_low"], goodput_below=0.5).id
        sweeps = _hook(s, events=["sweep.finished"]).id
        other = _hook(s, events=["run.state"], project="q").id
    with session_scope(factory) as s:
        run, _ = store.create_run(s, spec={}, plan=None, project="p", name="r")
        rid = run.id
    with session_scope(factory) as s:
        store.transition(s, run_id=rid, to="STARTING", reason="placed")
        store.add_event(s, run_id=rid, kind="straggler", reason="rank 1 is a straggler")
        store.add_event(s, run_id=rid, kind="hang", reason="attempt 1: no step for 60 s")
        store.add_event(s, run_id=rid, kind="checkpoint", reason="not wanted")
        store.transition(s, run_id=rid, to="FAILED", reason="worker died")
        s.add(Sweep(id="sweep-1", name="sw", project="p", spec={}, status="SUCCEEDED"))
        s.flush()
        s.add(SweepEvent(sweep_id="sweep-1", kind="state", from_status="RUNNING", to_status="SUCCEEDED"))
    for _ in range(2):  # a second scan (another replica, a restart) adds nothing
        with session_scope(factory) as s:
            wh.scan_events(s)
    with session_scope(factory) as s:
        assert _deliveries(s, states) == [("run.state", "FAILED")]
        assert _deliveries(s, every) == [("run.state", "QUEUED"), ("run.state", "STARTING"), ("run.straggler", None),
                                         ("run.hang", None), ("run.state", "FAILED")]
        (d,) = wh.list_deliveries(s, webhook_id=low)  # no step ran: goodput 0 < 0.5
        assert d.event == "run.goodput_low" and d.payload["goodput"] == 0.0 and d.payload["run"]["id"] == rid
        assert _deliveries(s, sweeps) == [("sweep.finished", "SUCCEEDED")]
        assert _deliveries(s, other) == []
        assert old.id not in {d.run_id for d in s.query(WebhookDelivery)}


def test_claim_and_attempts_retry_then_give_up(factory):
    with session_scope(factory) as s:
        hook = _hook(s, events=["run.state"])
        assert wh.add_delivery(s, hook=hook, source="x", event="ping", payload={})
        assert not wh.add_delivery(s, hook=hook, source="x", event="ping", payload={})  # unique per source
    with session_scope(factory) as s:
        (due,) = wh.claim_due(s, lease_s=60)
        assert due.attempt == 1
    with session_scope(factory) as s:
        assert wh.claim_due(s, lease_s=60) == []  # claimed: nobody else sends it meanwhile
        d = wh.record_attempt(s, delivery_id=due.delivery_id, http_status=503, error="HTTP 503", max_attempts=2,
                              retry_base_s=0.0001)
        assert d is not None and d.outcome == "pending" and d.attempts == 1
    with session_scope(factory) as s:
        d = wh.record_attempt(s, delivery_id=due.delivery_id, http_status=None, error="ConnectError", max_attempts=2,
                              retry_base_s=0.0001)
        assert d is not None and d.outcome == "failed" and d.attempts == 2 and d.error == "ConnectError"


def test_backoff_and_retry_policy():
    assert [wh.backoff_s(n, 2.0) for n in (1, 2, 3, 4)] == [2.0, 4.0, 8.0, 16.0]
    assert wh.backoff_s(40, 2.0) == wh.MAX_BACKOFF_S
    assert wh.retryable(None) and wh.retryable(500) and wh.retryable(429) and wh.retryable(408)
    assert not wh.retryable(400) and not wh.retryable(404) and not wh.retryable(410)


def test_sealed_secrets_and_signatures(tmp_path):
    key = sec.webhook_key(Settings(data_dir=tmp_path))
    path = tmp_path / "secrets" / "webhook.key"
    assert path.stat().st_mode & 0o777 == 0o600 and sec.webhook_key(Settings(data_dir=tmp_path)) == key
    secret = sec.new_secret()
    sealed = sec.seal(secret, key)
    assert secret not in sealed and sec.seal(secret, key) != sealed and sec.unseal(sealed, key) == secret
    with pytest.raises(sec.SealError):
        sec.unseal(sealed, b"k" * 32)
    tampered = sealed[:-6] + ("A" if sealed[-6] != "A" else "B") + sealed[-5:]
    with pytest.raises(sec.SealError):
        sec.unseal(tampered, key)
    assert sec.webhook_key(Settings(data_dir=tmp_path, webhook_key="shared")) != key
    body = json.dumps({"event": "run.state"}).encode()
    sig = sec.sign(secret, 1700000000, body)
    assert sig.startswith("sha256=") and len(sig) == 7 + 64
    assert sec.verify(secret, 1700000000, body, sig)
    assert not sec.verify(secret, 1700000001, body, sig) and not sec.verify(secret, 1700000000, body + b" ", sig)


def test_slack_payloads():
    run = {"event": "run.state", "run": {"id": "run-1", "name": "n"}, "from_status": "RUNNING",
           "to_status": "FAILED", "reason": "oom"}
    assert json.loads(wh.render_body(run, "slack")) == {"text": ":x: run n (run-1) RUNNING -> FAILED: oom"}
    assert json.loads(wh.render_body(run, "json")) == run
    low = {**run, "event": "run.goodput_low", "to_status": "SUCCEEDED", "goodput": 0.42, "goodput_below": 0.8}
    assert "42%" in wh.slack_text(low) and "80%" in wh.slack_text(low)
    sweep = {"event": "sweep.finished", "sweep": {"id": "sweep-1", "name": "s"}, "to_status": "SUCCEEDED"}
    assert wh.slack_text(sweep).endswith("sweep s (sweep-1) finished SUCCEEDED")

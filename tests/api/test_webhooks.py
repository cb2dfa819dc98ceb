"""Webhooks through the REST API, delivered by the service's dispatcher to a real HTTP receiver: signed calls,
a retry after a 500 with both attempts in the delivery log, a dead receiver that never slows the request path,
secrets never returned, 422 naming the field."""

from __future__ import annotations

import socket
import time

import pytest
from sqlalchemy import text

from tests.webhook_receiver import receiver

SPEC = {"name": "wh", "layout": {"dp": 2}, "batch": {"global_batch_size": 8, "micro_batch_size": 2}}
FAST = dict(webhook_poll_s=0.05, webhook_retry_base_s=0.05, webhook_timeout_s=2.0)


def _error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def _deliveries(client, hook_id: int, until, timeout_s: float = 20.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        items = client.get(f"/v1/webhooks/{hook_id}/deliveries").json()["items"]
        if until(items):
            return items
        assert time.monotonic() < deadline, items
        time.sleep(0.05)


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_state_changes_are_signed_and_a_500_is_retried(make_client):
    client = make_client(**FAST)
    with receiver() as rec:
        rec.answers = [500]  # the first call fails, its retry succeeds
        r = client.post("/v1/webhooks", json={"url": rec.url, "events": ["run.state"]})
        assert r.status_code == 201, r.text
        hook = r.json()
        secret = hook["secret"]
        assert secret.startswith("mwh_") and hook["secret_prefix"] == secret[:8]
        run = client.post("/v1/runs", json=SPEC).json()
        calls = rec.wait_for(lambda c: len(c) >= 2)
        assert all(c.signed_with(secret) for c in calls)
        assert not calls[0].signed_with(secret + "x")
        assert [c.json["run"]["id"] for c in calls] == [run["id"], run["id"]]
        assert calls[1].json == calls[0].json and calls[1].body == calls[0].body  # the retry sends the same event
        assert calls[1].json["event"] == "run.state" and calls[1].json["to_status"] == "QUEUED"
        assert [c.headers["X-Meshrun-Attempt"] for c in calls] == ["1", "2"]
        items = _deliveries(client, hook["id"], lambda it: it and it[0]["outcome"] == "delivered")
        assert len(items) == 1
        d = items[0]
        assert d["attempts"] == 2 and d["http_status"] == 200 and d["run_id"] == run["id"] and d["error"] is None
        assert d["delivered_at"] and d["last_attempt_at"] and d["created_at"]

        # the console shows the webhook and its delivery log, never the secret, under the strict CSP
        page = client.get("/webhooks")
        assert page.status_code == 200 and rec.url in page.text and run["id"] in page.text, page.text[:500]
        assert "delivered" in page.text and secret not in page.text and hook["secret_prefix"] in page.text
        assert "'unsafe-inline'" not in page.headers["content-security-policy"].split(
            "script-src")[1].split(";")[0]

        # a cancel is one more state change: QUEUED -> CANCELLED
        assert client.post(f"/v1/runs/{run['id']}/cancel").status_code == 200
        calls = rec.wait_for(lambda c: any(x.json["to_status"] == "CANCELLED" for x in c))
        last = [c for c in calls if c.json["to_status"] == "CANCELLED"][0]
        assert last.json["from_status"] == "QUEUED" and last.signed_with(secret)


def test_secret_is_sealed_and_never_returned(make_client):
    client = make_client(**FAST)
    r = client.post("/v1/webhooks", json={"url": "https://hooks.example.com/x", "secret": "my-own-secret-1234"})
    assert r.status_code == 201 and r.json()["secret"] == "my-own-secret-1234"
    hid = r.json()["id"]
    for body in (client.get("/v1/webhooks").text, client.get(f"/v1/webhooks/{hid}").text):
        assert "my-own-secret-1234" not in body and "my-own-s" in body  # the display prefix only
    with client.app.state.session_factory() as s:
        row = s.execute(text("SELECT * FROM webhooks")).mappings().one()
    assert "my-own-secret" not in str(dict(row)) and row["secret_sealed"].startswith("v1:")
    assert client.delete(f"/v1/webhooks/{hid}").status_code == 204
    _error(client.get(f"/v1/webhooks/{hid}"), 404)


def test_dead_receiver_does_not_block_requests(make_client):
    client = make_client(webhook_poll_s=0.05, webhook_retry_base_s=0.05, webhook_max_attempts=3)
    hook = client.post("/v1/webhooks", json={"url": f"http://127.0.0.1:{_closed_port()}/down"}).json()
    for _ in range(3):
        assert client.post("/v1/runs", json=SPEC).status_code == 201
    items = _deliveries(client, hook["id"], lambda it: len(it) == 3 and all(d["outcome"] == "failed" for d in it))
    assert all(d["attempts"] == 3 and d["http_status"] is None and "Connect" in d["error"] for d in items), items


def test_receiver_that_never_answers_holds_no_request(make_client):
    """A receiver that accepts the connection and never answers: requests go on while its delivery is in flight;
    the attempt ends at the per-attempt timeout and is logged."""
    client = make_client(webhook_poll_s=0.05, webhook_timeout_s=0.5, webhook_max_attempts=1)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        hook = client.post("/v1/webhooks", json={"url": f"http://127.0.0.1:{silent.getsockname()[1]}/slow"}).json()
        first = client.post("/v1/runs", json=SPEC)
        assert first.status_code == 201
        for _ in range(3):  # served while the first delivery waits on the silent receiver
            assert client.post("/v1/runs", json=SPEC).status_code == 201
            assert client.get(f"/v1/runs/{first.json()['id']}").status_code == 200
        items = _deliveries(client, hook["id"], lambda it: len(it) == 4 and all(d["outcome"] == "failed" for d in it))
    assert all(d["attempts"] == 1 and "Timeout" in d["error"] for d in items), items


def test_slack_format_and_state_filter(make_client):
    client = make_client(**FAST)
    with receiver() as rec:
        body = {"url": rec.url, "format": "slack", "states": ["CANCELLED"]}
        hook = client.post("/v1/webhooks", json=body).json()
        run = client.post("/v1/runs", json=SPEC).json()
        client.post(f"/v1/runs/{run['id']}/cancel")
        calls = rec.wait_for(lambda c: len(c) >= 1)
        time.sleep(0.3)  # the QUEUED event (filtered out) would have arrived by now
        assert len(rec.calls) == 1
        assert set(calls[0].json) == {"text"} and run["id"] in calls[0].json["text"]
        assert "QUEUED -> CANCELLED" in calls[0].json["text"] and calls[0].signed_with(hook["secret"])


def test_ping_and_run_scoped_webhook(make_client):
    client = make_client(**FAST)
    with receiver() as rec:
        mine = client.post("/v1/runs", json=SPEC).json()
        hook = client.post("/v1/webhooks", json={"url": rec.url, "run_id": mine["id"]}).json()
        assert hook["run_id"] == mine["id"]
        other = client.post("/v1/runs", json=SPEC).json()
        client.post(f"/v1/runs/{other['id']}/cancel")
        client.post(f"/v1/runs/{mine['id']}/cancel")
        calls = rec.wait_for(lambda c: len(c) >= 1)
        assert client.post(f"/v1/webhooks/{hook['id']}/ping").status_code == 202
        calls = rec.wait_for(lambda c: any(x.json["event"] == "ping" for x in c))
        runs = {c.json["run"]["id"] for c in calls if "run" in c.json}
        assert runs == {mine["id"]}


@pytest.mark.parametrize(
    "body, param",
    [
        ({"url": "ftp://example.com/x"}, "url"),
        ({"url": "javascript:alert(1)"}, "url"),
        ({"url": "http://169.254.169.254/latest"}, "url"),
        ({"url": "https://example.com/x", "events": ["run.exploded"]}, "events"),
        ({"url": "https://example.com/x", "events": []}, "events"),
        ({"url": "https://example.com/x", "secret": "short"}, "secret"),
        ({"url": "https://example.com/x", "format": "xml"}, "format"),
        ({"url": "https://example.com/x", "events": ["run.goodput_low"]}, "goodput_below"),
        ({"url": "https://example.com/x", "goodput_below": 2}, "goodput_below"),
        ({"url": "https://example.com/x", "states": ["DONE"]}, "states"),
        ({"url": "https://example.com/x", "colour": "red"}, "colour"),
    ],
)
def test_bad_webhooks_are_422_naming_the_field(client, body, param):
    err = _error(client.post("/v1/webhooks", json=body), 422)
    assert err["param"] is not None and err["param"].split(".")[0] == param, err


def test_unknown_run_and_webhook_are_404(client):
    r = client.post("/v1/webhooks", json={"url": "https://e.x/h", "run_id": "nope"})
    assert _error(r, 404)["param"] == "run_id"
    _error(client.get("/v1/webhooks/999/deliveries"), 404)
    _error(client.delete("/v1/webhooks/999"), 404)


def test_webhooks_belong_to_their_project(make_client):
    from service.security import tokens as auth

    client = make_client(auth="on", webhooks=False)
    with client.app.state.session_factory.begin() as s:
        a = {"Authorization": f"Bearer {auth.create_token(s, 'proj-a', 'alice')}"}
        b = {"Authorization": f"Bearer {auth.create_token(s, 'proj-b', 'bob')}"}
    _error(client.post("/v1/webhooks", json={"url": "https://e.x/h"}), 401)
    hook = client.post("/v1/webhooks", json={"url": "https://e.x/h"}, headers=a).json()
    assert hook["project"] == "proj-a" and hook["created_by"] == "alice"
    assert client.get("/v1/webhooks", headers=b).json()["items"] == []
    for method, path in (("get", ""), ("get", "/deliveries"), ("post", "/ping"), ("delete", "")):
        _error(client.request(method.upper(), f"/v1/webhooks/{hook['id']}{path}", headers=b), 404)
    body = {"url": "https://e.x/h", "project": "proj-b"}
    assert _error(client.post("/v1/webhooks", json=body, headers=a), 403)["param"] == "project"
    assert [h["id"] for h in client.get("/v1/webhooks", headers=a).json()["items"]] == [hook["id"]]

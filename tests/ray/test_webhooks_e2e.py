"""Webhooks end to end on the session's live service and Ray cluster: a tiny run that succeeds and one that fails at
run time (its data file does not exist) each produce a signed state-change call to a real HTTP receiver, sent by
the service process while the runs' own drivers wrote the state changes."""

from __future__ import annotations

import httpx

from tests.ray.helpers import submit, tiny_spec, wait_for
from tests.webhook_receiver import receiver


def test_a_run_that_succeeds_and_one_that_fails_are_signed_calls(live_service):
    url = live_service.url
    with receiver() as rec:
        body = {"url": rec.url, "events": ["run.state"], "states": ["RUNNING", "SUCCEEDED", "FAILED"]}
        r = httpx.post(f"{url}/v1/webhooks", json=body, timeout=30)
        assert r.status_code == 201, r.text
        hook = r.json()
        try:
            ok = submit(url, tiny_spec("e2e-webhook-ok", steps=3))
            bad = submit(url, tiny_spec("e2e-webhook-fails", steps=3,
                                        data={"source": "text", "path": "/nonexistent/meshrun-webhook.txt"}))
            wait_for(url, ok["id"], {"SUCCEEDED"}, timeout_s=240)
            wait_for(url, bad["id"], {"FAILED"}, timeout_s=240)

            def ended(calls) -> dict[str, dict]:
                return {c.json["run"]["id"]: c for c in calls
                        if c.json.get("to_status") in ("SUCCEEDED", "FAILED") and c.json["run"]["id"] in
                        (ok["id"], bad["id"])}

            calls = rec.wait_for(lambda c: len(ended(c)) == 2, timeout_s=60)
            last = ended(calls)
            assert last[ok["id"]].json["to_status"] == "SUCCEEDED" and last[ok["id"]].json["from_status"] == "RUNNING"
            assert last[bad["id"]].json["to_status"] == "FAILED"
            assert "meshrun-webhook.txt" in last[bad["id"]].json["reason"]
            assert all(c.signed_with(hook["secret"]) for c in calls)
            assert all(c.headers["X-Meshrun-Event"] == "run.state" for c in calls)
            # the successful run's RUNNING call came first; nothing outside the wanted states was sent
            mine = [c.json for c in calls if c.json["run"]["id"] == ok["id"]]
            assert [m["to_status"] for m in mine] == ["RUNNING", "SUCCEEDED"]
            log = httpx.get(f"{url}/v1/webhooks/{hook['id']}/deliveries", timeout=30).json()["items"]
            ours = [d for d in log if d["run_id"] in (ok["id"], bad["id"]) and d["outcome"] == "delivered"]
            assert len(ours) >= 3 and all(d["attempts"] == 1 and d["http_status"] == 200 for d in ours)
        finally:
            httpx.delete(f"{url}/v1/webhooks/{hook['id']}", timeout=30)

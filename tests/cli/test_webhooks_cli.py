"""``meshrun webhook add|list|deliveries|ping|rm`` and ``client.webhooks`` against the live API server, with a real
HTTP receiver: a run that succeeds and one that fails (played through the store by ``FakeWorker``) each produce a
signed state-change call to their run's webhook."""

from __future__ import annotations

import json

from api.client import Client
from tests.cli.test_cli import cli, no_traceback, uname
from tests.sdk.conftest import FakeWorker
from tests.webhook_receiver import receiver

SPEC = {"model": {"name": "gpt", "preset": "tiny"}, "layout": {"dp": 1},
        "batch": {"global_batch_size": 2, "micro_batch_size": 2}, "train": {"steps": 3}}


def test_webhook_commands_and_signed_terminal_states(api_server):
    with receiver() as rec, Client(api_server.url, max_retries=0, timeout=10) as client:
        ok = client.runs.create({**SPEC, "name": uname("wh-ok")})
        bad = client.runs.create({**SPEC, "name": uname("wh-bad")})
        r = cli(api_server.url, "webhook", "add", rec.url, "--run", ok.id, "--states", "SUCCEEDED,FAILED", "--json")
        assert r.exit_code == 0, r.output
        hook_ok = json.loads(r.output)
        hook_bad = client.webhooks.create(rec.url, run_id=bad.id, states=["SUCCEEDED", "FAILED"], format="json")
        secrets = {ok.id: hook_ok["secret"], bad.id: hook_bad.secret}
        workers = [FakeWorker(api_server, ok.id, steps=2).start(),
                   FakeWorker(api_server, bad.id, steps=2, fail_at=1).start()]
        for w in workers:
            w.join()
        calls = rec.wait_for(lambda c: len(c) >= 2)
        got = {c.json["run"]["id"]: c for c in calls}
        assert {rid: c.json["to_status"] for rid, c in got.items()} == {ok.id: "SUCCEEDED", bad.id: "FAILED"}
        assert all(c.signed_with(secrets[rid]) for rid, c in got.items())
        assert not got[ok.id].signed_with(secrets[bad.id])
        assert "worker 1 died" in got[bad.id].json["reason"]

        r = cli(api_server.url, "webhook", "list")
        assert r.exit_code == 0 and str(hook_bad.id) in r.output and hook_bad.secret not in r.output, r.output
        client.webhooks.ping(hook_bad.id)
        rec.wait_for(lambda c: any(x.json["event"] == "ping" for x in c))
        assert {d.event for d in client.webhooks.deliveries(hook_bad.id)} == {"run.state", "ping"}
        r = cli(api_server.url, "webhook", "deliveries", str(hook_ok["id"]))
        assert r.exit_code == 0 and "run.state" in r.output and "delivered" in r.output, r.output
        assert cli(api_server.url, "webhook", "rm", str(hook_ok["id"])).exit_code == 0
        client.webhooks.delete(hook_bad.id)
        assert [h.id for h in client.webhooks.list() if h.id in (hook_ok["id"], hook_bad.id)] == []
        r = cli(api_server.url, "webhook", "add", "ftp://nope")
        assert r.exit_code == 4 and "url" in r.output, r.output
        no_traceback(r)

"""CLI commands whose server side needs the Ray runtime, against a scripted service (httpx.MockTransport):
``logs --follow`` streams until the run ends; ``cluster`` renders nodes; ``demo --url`` uses a running service."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import httpx
import pytest
from typer.testing import CliRunner

import api.cli  # noqa: F401  (registers the commands)
from api.cli import _common as cli_mod
from api import client as sdk
from api.spec import RunSpec

NOW = datetime(2026, 1, 1, tzinfo=timezone.utc).isoformat()
runner = CliRunner(env={"COLUMNS": "200"})


def run_body(status: str, **over):
    body = {"id": "run-1", "name": "r", "project": "default", "status": status,
            "spec": RunSpec(train={"steps": 3}).model_dump(mode="json"), "created_at": NOW, "updated_at": NOW}
    body.update(over)
    return body


@pytest.fixture()
def use_handler(monkeypatch):
    def install(handler):
        monkeypatch.setattr(cli_mod.State, "client",
                            lambda self: sdk.Client("http://fake", transport=httpx.MockTransport(handler)))
        monkeypatch.setattr("time.sleep", lambda s: None)

    return install


def test_logs_follow_prints_each_line_once_until_the_run_ends(use_handler):
    chunks = ["step 1\n", "step 1\nstep 2\n", "step 1\nstep 2\nstep 3\n\x1b[36m(RayTrainWorker pid=7)\x1b[0m done\n"]
    state = {"logs": 0, "gets": 0}

    def handler(req):
        if req.url.path.endswith("/logs"):  # pages like the service: from the cursor's offset, next_cursor at the end
            text = chunks[min(state["logs"], len(chunks) - 1)]
            state["logs"] += 1
            cursor = req.url.params.get("cursor")
            start = int(cursor[1:]) if cursor else 0
            return httpx.Response(200, json={"run_id": "run-1", "logs": text[start:], "offset": start,
                                             "total_chars": len(text), "has_more": False,
                                             "next_cursor": f"c{len(text)}"})
        state["gets"] += 1
        return httpx.Response(200, json=run_body("RUNNING" if state["gets"] < 3 else "SUCCEEDED"))

    use_handler(handler)
    r = runner.invoke(cli_mod.app, ["logs", "run-1", "--follow"])
    assert r.exit_code == 0, r.output
    assert r.stdout == "step 1\nstep 2\nstep 3\n(RayTrainWorker pid=7) done\n"  # not a terminal: no colour codes


def test_cluster_table_and_json(use_handler):
    cl = {"address": "10.0.0.1:6380", "dashboard_url": "http://10.0.0.1:8265", "cpus_total": 16, "cpus_free": 12,
          "gpus_total": 0, "gpus_free": 0,
          "nodes": [{"node_id": "abcdef0123456789", "alive": True, "address": "10.0.0.1", "cpus": 16, "gpus": 0,
                     "memory_bytes": 64 * 2**30}]}
    use_handler(lambda req: httpx.Response(200, json=cl))
    r = runner.invoke(cli_mod.app, ["cluster"])
    assert r.exit_code == 0, r.output
    assert "abcdef012345" in r.stdout and "12/16" in r.stdout and "http://10.0.0.1:8265" in r.stdout
    r = runner.invoke(cli_mod.app, ["cluster", "--json"])
    assert json.loads(r.stdout)["cpus_free"] == 12


def test_demo_against_a_running_service_prints_summary_and_dashboard(monkeypatch):
    submitted = []
    gets = {"n": 0}
    summary = {"steps_done": 3, "final_loss": 2.5, "mean_tokens_per_s": 1234.0, "mean_mfu": 0.02,
               "peak_memory_bytes_per_rank": {"0": 2**30, "1": 2**29}, "wall_time_s": 9.5}

    def handler(req):
        if req.url.path == "/healthz":
            return httpx.Response(200, json={"status": "ok"})
        if req.url.path == "/v1/cluster":
            return httpx.Response(200, json={"dashboard_url": "http://127.0.0.1:8265"})
        if req.method == "POST":
            submitted.append(json.loads(req.content))
            return httpx.Response(201, json=run_body("QUEUED", spec=submitted[-1]))
        if req.url.path.endswith("/metrics"):
            return httpx.Response(200, json={"run_id": "run-1", "items": [{"step": 3, "loss": 2.5}]})
        gets["n"] += 1
        done = gets["n"] > 1
        return httpx.Response(200, json=run_body("SUCCEEDED" if done else "RUNNING", spec=submitted[-1],
                                                 summary=summary if done else None))

    real_client = cli_mod.Client
    monkeypatch.setattr(cli_mod, "Client", lambda *a, **k: real_client("http://fake",
                                                                       transport=httpx.MockTransport(handler)))
    monkeypatch.setattr("api.sdk.resources.time.sleep", lambda s: None)
    r = runner.invoke(cli_mod.app, ["--url", "http://fake", "demo", "--set", "train.steps=3"])
    assert r.exit_code == 0, r.output
    assert submitted[0]["name"] == cli_mod.DEMO_SPEC["name"] and submitted[0]["train"]["steps"] == 3
    for words in ("SUCCEEDED", "final loss", "2.5000", "1,234", "2.0%", "1.00 GiB", "http://127.0.0.1:8265"):
        assert words in r.stdout, (words, r.stdout)


def test_resume_layout_and_from_file_bodies(use_handler, tmp_path):
    sent = []

    def handler(req):
        sent.append(json.loads(req.content) if req.content else None)
        return httpx.Response(200, json=run_body("QUEUED"))

    use_handler(handler)
    r = runner.invoke(cli_mod.app, ["resume", "run-1", "--layout", "dp=1,tp=2", "--steps", "30", "--json"])
    assert r.exit_code == 0, r.output
    assert sent[-1] == {"layout": {"dp": 1, "tp": 2}, "steps": 30}
    f = tmp_path / "spec.yaml"  # a full run spec: its layout, batch and train.steps are used
    f.write_text("name: x\nlayout: {dp: 2, zero_stage: 3}\nbatch: {global_batch_size: 32}\ntrain: {steps: 50}\n")
    r = runner.invoke(cli_mod.app, ["resume", "run-1", "--from-file", str(f)])
    assert r.exit_code == 0, r.output
    assert sent[-1] == {"layout": {"dp": 2, "zero_stage": 3}, "batch": {"global_batch_size": 32}, "steps": 50}

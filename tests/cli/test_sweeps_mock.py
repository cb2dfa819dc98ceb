"""Sweeps through the SDK and the CLI against a scripted service (httpx.MockTransport): the sweeps API is
SweepCreate -> SweepPublic, GET/cancel by id; `submit --from-sweep` submits the best trial's layout."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

import api.cli  # noqa: F401  (registers the commands)
from api.cli import _common as cli_mod
from api import client as sdk
from api.spec import RunSpec, SweepCreate

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
NOW = datetime(2026, 1, 1, tzinfo=timezone.utc).isoformat()


class FakeSweepService:
    def __init__(self) -> None:
        self.polls = 0
        self.created: dict | None = None
        self.submitted: list[dict] = []

    def sweep(self) -> dict:
        spec = SweepCreate.model_validate(self.created).model_dump(mode="json")
        done = self.polls >= 2
        trials = [
            {"id": 1, "run_id": "run-t1", "layout": {"dp": 2}, "micro_batch_size": 2, "status": "SUCCEEDED",
             "measured_tokens_per_s": 1000.0},
            {"id": 2, "run_id": "run-t2", "layout": {"tp": 2}, "micro_batch_size": 4,
             "status": "SUCCEEDED" if done else "RUNNING", "measured_tokens_per_s": 1500.0 if done else None},
        ]
        return {"id": "sweep-1", "name": spec["name"], "project": "default",
                "status": "SUCCEEDED" if done else "RUNNING", "objective": "tokens_per_s", "spec": spec,
                "trials": trials, "best_trial": trials[1] if done else trials[0], "created_at": NOW,
                "updated_at": NOW, "future_field": 1}

    def handler(self, req: httpx.Request) -> httpx.Response:
        if req.method == "POST" and req.url.path == "/v1/sweeps":
            self.created = json.loads(req.content)
            return httpx.Response(201, json=self.sweep())
        if req.method == "GET" and req.url.path == "/v1/sweeps/sweep-1":
            self.polls += 1
            return httpx.Response(200, json=self.sweep())
        if req.method == "GET" and req.url.path == "/v1/sweeps":
            return httpx.Response(200, json={"items": [self.sweep()], "total": 1, "limit": 50, "offset": 0})
        if req.method == "POST" and req.url.path == "/v1/runs":
            body = json.loads(req.content)
            self.submitted.append(body)
            spec = RunSpec.model_validate(body).model_dump(mode="json")
            return httpx.Response(201, json={"id": "run-best", "name": spec["name"], "project": "default",
                                             "status": "QUEUED", "spec": spec, "created_at": NOW,
                                             "updated_at": NOW})
        return httpx.Response(404, json={"error": {"code": "not_found", "message": f"no {req.url.path}",
                                                   "param": None}})


@pytest.fixture()
def fake(monkeypatch):
    svc = FakeSweepService()

    def client(self):
        return sdk.Client("http://fake", transport=httpx.MockTransport(svc.handler))

    monkeypatch.setattr(cli_mod.State, "client", client)
    return svc


def test_sdk_sweep_wait_and_best_spec(fake):
    c = sdk.Client("http://fake", transport=httpx.MockTransport(fake.handler))
    sw = c.sweeps.create(EXAMPLES / "sweep.yaml", overrides=["budget.max_trials=2"])
    assert fake.created["budget"]["max_trials"] == 2 and not sw.done
    sw.wait(poll_interval_s=0.001)
    assert sw.done and sw.best_trial.layout.tp == 2
    best = sw.best_run_spec()
    assert best.layout.tp == 2 and best.batch.micro_batch_size == 4 and best.model.preset == "tiny"


def test_cli_sweep_from_run_spec_with_layouts_and_wait(fake):
    r = CliRunner(env={"COLUMNS": "200"}).invoke(cli_mod.app, [
        "sweep", str(EXAMPLES / "dp.yaml"), "--layouts", "dp=2; tp=2,sp=true", "--micro-batch-sizes", "2,4",
        "--max-trials", "4", "--wait", "--no-progress"])
    assert r.exit_code == 0, r.output
    assert fake.created["base"]["name"] == "gpt-dp2"
    assert fake.created["search"] == {"layouts": [{"dp": 2}, {"tp": 2, "sequence_parallel": True}],
                                      "micro_batch_sizes": [2, 4]}
    assert fake.created["budget"] == {"max_trials": 4}
    assert "submit --from-sweep sweep-1" in r.stdout and "dp1 tp2" in r.stdout


def test_cli_submit_from_sweep_uses_best_layout(fake):
    fake.created = SweepCreate.model_validate(
        __import__("yaml").safe_load((EXAMPLES / "sweep.yaml").read_text())).model_dump(mode="json")
    fake.polls = 5
    r = CliRunner().invoke(cli_mod.app, ["submit", "--from-sweep", "sweep-1", "--json"])
    assert r.exit_code == 0, r.output
    sent = fake.submitted[-1]
    assert sent["layout"]["tp"] == 2 and sent["batch"]["micro_batch_size"] == 4
    assert sent["name"] == "gpt-sweep-base-best"
    assert json.loads(r.stdout)["id"] == "run-best"


def test_cli_sweeps_list_and_show_json(fake):
    fake.created = SweepCreate.model_validate(
        __import__("yaml").safe_load((EXAMPLES / "sweep.yaml").read_text())).model_dump(mode="json")
    r = CliRunner().invoke(cli_mod.app, ["sweeps", "list", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["items"][0]["id"] == "sweep-1"
    r = CliRunner().invoke(cli_mod.app, ["sweeps", "show", "sweep-1", "--json"])
    assert r.exit_code == 0 and len(json.loads(r.stdout)["trials"]) == 2
    r = CliRunner().invoke(cli_mod.app, ["sweeps", "show", "sweep-404"])
    assert r.exit_code == 3


def test_cli_layouts_auto_adds_to_the_specs_layouts_and_says_so(fake):
    r = CliRunner(env={"COLUMNS": "200"}).invoke(cli_mod.app, [
        "sweep", str(EXAMPLES / "sweep.yaml"), "--layouts", "auto", "--max-trials", "3", "--no-progress"])
    assert r.exit_code == 0, r.output
    assert fake.created["search"]["add_auto"] is True and len(fake.created["search"]["layouts"]) == 3
    assert "adding the planner's candidates" in r.output


def test_sweep_progress_counts_skipped_trials_apart():
    from rich.console import Console

    from api.sdk._progress import SweepProgress

    svc = FakeSweepService()
    svc.created = SweepCreate.model_validate(
        __import__("yaml").safe_load((EXAMPLES / "sweep.yaml").read_text())).model_dump(mode="json")
    sweep = sdk.Client("http://fake", transport=httpx.MockTransport(svc.handler)).sweeps.get("sweep-1")
    sweep.trials[0].status = "SKIPPED"  # one skipped, one running: 0 of 1 done
    sweep.trials[1].phase = "warm-up 1/2"
    console = Console(record=True, width=250)
    view = SweepProgress(console)
    view.update(sweep)
    view.close()
    text = console.export_text()
    assert "0/1" in text and "(1 skipped)" in text
    assert f"trial {sweep.trials[1].id} " in text and " warm-up 1/2" in text, text


def test_run_progress_shows_the_startup_phase_then_labelled_tokens_per_s():
    from types import SimpleNamespace as NS

    from rich.console import Console

    from api.sdk._progress import RunProgress

    console = Console(record=True, width=250)
    view = RunProgress(console)
    run = NS(name="r", id="run-1", status="STARTING", spec=NS(train=NS(steps=4)),
             status_reason="placing 8 workers of 1 CPU (Ray Train) [+3.2 s since queued]")
    view.update(run, [])
    assert view._progress.tasks[0].fields["status"] == f"STARTING: {run.status_reason}"
    running = NS(**{**vars(run), "status": "RUNNING"})
    view.update(running, [NS(step=1, loss=5.0, tokens_per_s=100.0), NS(step=2, loss=4.0, tokens_per_s=300.0)])
    view.close()
    text = console.export_text()
    assert "tok/s now 300 mean 200" in text and "2/4" in text

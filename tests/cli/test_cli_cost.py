"""``meshrun plan`` prices its candidates and ranks by time or cost; ``meshrun show`` says what a finished run cost
(against the live API server; runs played by FakeWorker, no Ray)."""

from __future__ import annotations

import json

import pytest

from tests.cli.test_cli import EXAMPLES, cli, uname
from tests.sdk.conftest import FakeWorker

PLAN = ("plan", "--model", "gpt", "--preset", "125m", "--device", "H100", "--gpus-per-node", "8",
        "--global-batch-size", "64", "--micro-batch-size", "4", "--top-k", "3")  # fmt: skip


def test_plan_prints_costs_and_ranks_by_cost(api_server):
    r = cli(api_server.url, *PLAN, "--price", "2", "--steps", "1000")
    assert r.exit_code == 0, r.output
    for words in ("$/step", "$/1B tok", "$ run", "$2.00 per device-hour (request)", "run = 1000 steps"):
        assert words in r.stdout, words
    by_time = json.loads(cli(api_server.url, *PLAN, "--json").stdout)["candidates"]
    by_cost = json.loads(cli(api_server.url, *PLAN, "--rank-by", "cost", "--json").stdout)["candidates"]
    assert by_time[0]["cost"]["price_source"] == "default"  # H100 is in the dated table
    assert by_cost[0]["cost"]["usd_per_billion_tokens"] < by_time[0]["cost"]["usd_per_billion_tokens"]
    r = cli(api_server.url, *PLAN, "--device", "L4")  # no price known: device-hours only
    assert r.exit_code == 0, r.output
    assert "dev-h/step" in r.stdout and "no price known" in r.stdout
    r = cli(api_server.url, *PLAN, "--rank-by", "money")
    assert r.exit_code != 0 and "rank_by" in r.output


def test_show_says_what_a_finished_run_cost(api_server):
    r = cli(api_server.url, "submit", str(EXAMPLES / "dp.yaml"), "--name", uname("cost"), "--set", "train.steps=3",
            "--set", "cluster.price_per_device_hour=4", "--json")  # fmt: skip
    assert r.exit_code == 0, r.output
    run_id = json.loads(r.stdout)["id"]
    FakeWorker(api_server, run_id, steps=3).start().join()
    r = cli(api_server.url, "show", run_id)
    assert r.exit_code == 0, r.output
    assert "device-hours (2 devices x" in r.stdout and "/device-hour (request)" in r.stdout
    cost = json.loads(cli(api_server.url, "show", run_id, "--json").stdout)["cost"]
    assert cost["devices"] == 2 and cost["attempts_wall_s"] > 0
    assert cost["usd"] == pytest.approx(cost["device_hours"] * 4)

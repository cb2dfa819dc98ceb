"""``meshrun validate``: offline it checks the spec alone and says which checks it could not run; with
``--cluster live`` it runs a submission's checks on the service (``POST /v1/runs/validate``), so a 7B model on a CPU
cluster is refused by validate exactly as ``submit`` refuses it, with the memory breakdown said once."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from api.cli import app

runner = CliRunner(env={"COLUMNS": "200"})
SEVEN_B_ON_CPU = """name: gpt-7b-on-cpu
model: {name: gpt, preset: 7b}
layout: {dp: 2}
batch: {global_batch_size: 8, micro_batch_size: 1}
resources: {device: cpu, cpus_per_worker: 1}
train: {steps: 5}
"""
TINY = """name: tiny-dp2
model: {name: gpt, preset: tiny}
layout: {dp: 2}
batch: {global_batch_size: 8, micro_batch_size: 2}
resources: {device: cpu, cpus_per_worker: 1}
train: {steps: 5}
"""


@pytest.fixture
def specs(tmp_path: Path) -> tuple[Path, Path]:
    big, tiny = tmp_path / "7b.yaml", tmp_path / "tiny.yaml"
    big.write_text(SEVEN_B_ON_CPU)
    tiny.write_text(TINY)
    return big, tiny


def test_offline_says_which_checks_it_could_not_run(specs) -> None:
    big, _ = specs
    r = runner.invoke(app, ["validate", str(big)])
    assert r.exit_code == 0, r.output
    assert "valid (offline)" in r.stdout
    assert "not checked:" in r.stderr and "memory fit" in r.stderr and "--cluster live" in r.stderr


def test_unknown_cluster_is_a_usage_error(specs) -> None:
    r = runner.invoke(app, ["validate", str(specs[1]), "--cluster", "h100"])
    assert r.exit_code == 2 and '"live"' in r.stderr


def test_live_on_a_service_without_ray_says_what_it_could_not_check(api_server, specs) -> None:
    _, tiny = specs
    r = runner.invoke(app, ["--url", api_server.url, "validate", str(tiny), "--cluster", "live"])
    assert r.exit_code == 0, r.output
    assert f"valid (on {api_server.url})" in r.stdout
    assert "not checked: memory fit: this service runs no Ray runtime" in r.stderr, r.stderr
    # the endpoint refuses what submit refuses (here: a spec error), with the same 422 body
    bad = {"name": "x", "model": {"name": "gpt", "preset": "tiny"}, "layout": {"dp": 0}}
    for path in ("/v1/runs/validate", "/v1/runs"):
        resp = httpx.post(f"{api_server.url}{path}", json=bad, timeout=30)
        assert resp.status_code == 422 and resp.json()["error"]["param"].startswith("layout"), resp.text


@pytest.mark.ray
def test_live_refuses_what_submit_refuses_with_the_breakdown_once(ray_service_url, specs) -> None:
    big, tiny = specs
    r = runner.invoke(app, ["--url", ray_service_url, "validate", str(big), "--cluster", "live"])
    assert r.exit_code == 4, r.output
    refused = r.stderr
    assert "layout predicted not to fit in device memory: out of memory" in refused
    assert "best feasible alternative" in refused or "no feasible layout found" in refused, refused
    assert refused.count("params ") == 1 and refused.count("optimizer ") == 1, refused  # the breakdown once
    r = runner.invoke(app, ["--url", ray_service_url, "submit", str(big)])
    assert r.exit_code == 4 and r.stderr == refused, (r.stderr, refused)  # submit says the very same
    assert runner.invoke(app, ["validate", str(big)]).exit_code == 0  # offline cannot know (and says so)

    r = runner.invoke(app, ["--url", ray_service_url, "validate", str(tiny), "--cluster", "live"])
    assert r.exit_code == 0, r.output
    assert "predicted" in r.stdout and "not checked" not in r.stderr
    runs = httpx.get(f"{ray_service_url}/v1/runs", params={"name": "tiny-dp2"}, timeout=30).json()["items"]
    assert runs == []  # validating stores nothing

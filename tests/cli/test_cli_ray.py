"""The CLI on the Ray-backed live service: submit --wait on a tiny run exits 0 with the summary; a run that
fails exits 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[2]


def meshrun(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "api.cli", "--url", url, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=900, env={**os.environ, "COLUMNS": "200"})


def test_submit_wait_tiny_run_exits_0_with_summary(ray_service_url):
    name = f"cli-ok-{uuid.uuid4().hex[:8]}"
    p = meshrun(ray_service_url, "submit", "examples/dp.yaml", "--name", name, "--set", "train.steps=5",
                "--set", "batch.global_batch_size=8", "--wait", "--timeout", "600")
    assert p.returncode == 0, p.stdout + p.stderr
    for words in ("SUCCEEDED", "final loss", "tokens/s", "MFU", "5/5"):
        assert words in p.stdout, (words, p.stdout)
    p = meshrun(ray_service_url, "runs", "--name", name, "--json")
    run_id = json.loads(p.stdout)["items"][0]["id"]
    p = meshrun(ray_service_url, "metrics", run_id, "--json")
    assert [m["step"] for m in json.loads(p.stdout)] == [1, 2, 3, 4, 5]
    p = meshrun(ray_service_url, "logs", run_id)
    assert p.returncode == 0
    p = meshrun(ray_service_url, "cluster", "--json")
    assert p.returncode == 0 and json.loads(p.stdout)["cpus_total"] > 0


def test_failing_run_exits_1(ray_service_url, tmp_path):
    spec = {"name": f"cli-fail-{uuid.uuid4().hex[:8]}",
            "model": {"name": "custom", "preset": None, "entrypoint": "meshrun_no_such_module:build"},
            "train": {"steps": 3}}
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump(spec))
    p = meshrun(ray_service_url, "submit", str(f), "--wait", "--timeout", "600", "--no-progress")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "FAILED" in p.stdout

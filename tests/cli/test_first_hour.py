"""The first hour, as a new user has it: ``meshrun serve`` with no configuration at all (SQLite, its own Ray head
with the default CPU slot sizing, the default scheduler interval), then the README's Python snippet (which runs
``examples/gpt-3d-demo.yaml``, 8 workers) and ``meshrun sweep examples/sweep.yaml --layouts auto --max-trials 3
--wait``, driven through the SDK and the CLI on this 2-core machine.

One service for the module: ``python -m api.cli serve`` as a subprocess whose environment holds no ``MESHRUN_*``
setting but its data directory and free ports (the default ports when they are free: other sessions may hold
them). Only the number of training steps is lowered, through the public overrides (``overrides=`` in the SDK,
``--steps-per-trial`` in the CLI); the specs and layouts are the examples' own.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.cluster.head import MIN_LOCAL_CPU_SLOTS, free_port
from tests.chaos.conftest import OwnedService
from tests.conftest import ROOT

pytestmark = [pytest.mark.ray, pytest.mark.slow]

SNIPPET_STEPS = 3
TRIAL_STEPS = 4  # the example's budget.warmup_steps is 2: two measured steps per trial


@pytest.fixture(scope="module")
def default_service() -> Iterator[OwnedService]:
    data_dir = Path(f"/tmp/mr_first_{secrets.token_hex(3)}")  # short: Ray's unix sockets live under it
    data_dir.mkdir()
    port = free_port(None)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "MESHRUN_"))}
    env.update(
        PYTHONPATH=str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""),
        RAY_USAGE_STATS_ENABLED="0",
        MESHRUN_DATA_DIR=str(data_dir),
        MESHRUN_PORT=str(port),
        # the defaults when free (6389, 8265, 8090); other test sessions and services may hold them
        MESHRUN_RAY_GCS_PORT=str(free_port(6389)),
        MESHRUN_RAY_DASHBOARD_PORT=str(free_port(8265)),
        MESHRUN_RAY_METRICS_EXPORT_PORT=str(free_port(8090)),
    )
    svc = OwnedService(data_dir=data_dir, env=env, url=f"http://127.0.0.1:{port}")
    try:
        svc.start()
        yield svc
    finally:
        svc.stop()
        rec = svc.head()
        if rec is not None:
            from service.cluster import ownership

            ownership.stop_recorded(rec, timeout_s=10)
        shutil.rmtree(data_dir, ignore_errors=True)


def meshrun(url: str, *args: str, timeout_s: float = 600) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "MESHRUN_"))}
    return subprocess.run(
        [sys.executable, "-m", "api.cli", "--url", url, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**env, "COLUMNS": "200"},
    )


def readme_snippet() -> str:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    code = next(b for b in blocks if "examples/gpt-3d-demo.yaml" in b)
    return code


def test_serve_defaults_size_the_slots_so_every_example_fits(default_service: OwnedService) -> None:
    p = meshrun(default_service.url, "cluster", "--json")
    assert p.returncode == 0, p.stdout + p.stderr
    assert json.loads(p.stdout)["cpus_total"] == max(os.cpu_count() or 1, MIN_LOCAL_CPU_SLOTS)


def test_readme_snippet_runs_gpt_3d_demo(default_service: OwnedService, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's Python snippet as written (the service's URL, and fewer steps through ``overrides=``)."""
    code = readme_snippet()
    create = 'client.runs.create("examples/gpt-3d-demo.yaml")'
    assert create in code and 'Client("http://127.0.0.1:8000")' in code, code
    code = code.replace(
        create, f'client.runs.create("examples/gpt-3d-demo.yaml", overrides=["train.steps={SNIPPET_STEPS}"])'
    )
    code = code.replace('Client("http://127.0.0.1:8000")', f'Client("{default_service.url}")')
    monkeypatch.chdir(ROOT)  # the snippet names the example by its path in the repository
    scope: dict = {}
    exec(compile(code, "README.md snippet", "exec"), scope)
    run = scope["run"]
    assert str(run.status) in ("SUCCEEDED", "RunStatus.SUCCEEDED"), (run.status, run.status_reason)
    assert (run.spec.layout.dp, run.spec.layout.tp, run.spec.layout.pp) == (2, 2, 2)
    assert run.spec.name == "gpt-3d-demo"
    df = scope["df"]
    assert list(df.index) == list(range(1, SNIPPET_STEPS + 1))
    assert scope["plans"].candidates, "the snippet's plan request found no layout"
    # the run's page as the CLI shows it
    p = meshrun(default_service.url, "show", run.id)
    assert p.returncode == 0 and "SUCCEEDED" in p.stdout, p.stdout + p.stderr


def test_sweep_layouts_auto_finishes(default_service: OwnedService) -> None:
    url = default_service.url
    p = meshrun(
        url,
        "sweep",
        "examples/sweep.yaml",
        "--layouts",
        "auto",
        "--max-trials",
        "3",
        "--steps-per-trial",
        str(TRIAL_STEPS),
        "--wait",
        "--no-progress",
        "--json",
    )
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    sweep = json.loads(p.stdout)
    assert sweep["status"] == "SUCCEEDED", sweep["status_reason"]
    trials = sweep["trials"]
    ran = [t for t in trials if t["status"] != "SKIPPED"]
    assert 1 <= len(ran) <= 3, [(t["layout"], t["status"], t["reason"]) for t in trials]
    assert all(t["status"] == "SUCCEEDED" for t in ran), [(t["layout"], t["status"], t["reason"]) for t in ran]
    assert all(t["reason"] for t in trials if t["status"] == "SKIPPED"), trials
    assert sweep["best_trial"] is not None and sweep["best_trial"]["measured_tokens_per_s"] > 0
    # auto adds to the spec's own layouts: the three listed ones are among the trials (run or skipped)
    listed = [{"dp": 2}, {"dp": 2, "zero_stage": 3}, {"tp": 2}]
    for want in listed:
        assert any(all(t["layout"][k] == v for k, v in want.items()) for t in trials), (want, trials)
    # every slot the trials held is free again once the sweep is over
    total = max(os.cpu_count() or 1, MIN_LOCAL_CPU_SLOTS)
    deadline = time.monotonic() + 120
    while True:
        cl = json.loads(meshrun(url, "cluster", "--json").stdout)
        if cl["cpus_free"] == total or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert cl["cpus_free"] == total, cl

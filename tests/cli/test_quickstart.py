"""examples/quickstart.py runs, as a user runs it, against the live Ray-backed service (MESHRUN_URL), and every run it
submits is stored and succeeds. An SDK change that breaks the example fails here.

It also carries the SDK's lifecycle checks on those runs (progress, metrics, summary, events, checkpoints, logs, a
cancel then a resume on another layout), so the suite pays for these Ray runs once.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pytest

from api import client as sdk

TIMEOUT_S = 1800  # six Ray runs and a sweep, on a loaded 2-core machine
pytestmark = [pytest.mark.ray, pytest.mark.timeout(TIMEOUT_S)]

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Output:
    stdout: str


def _ts(t: datetime) -> float:
    return (t if t.tzinfo else t.replace(tzinfo=UTC)).timestamp()


@pytest.fixture(scope="module")
def quickstart(ray_service_url: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Output, float]:
    env = {**os.environ, "MESHRUN_URL": ray_service_url, "COLUMNS": "160", "PYTHONUNBUFFERED": "1"}
    env.pop("MESHRUN_TOKEN", None)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    log = tmp_path_factory.mktemp("quickstart") / "out.log"
    started = time.time()
    with open(log, "w") as fh:  # a file, not a pipe: what it printed so far is there when it times out
        proc = subprocess.Popen([sys.executable, str(ROOT / "examples" / "quickstart.py")], cwd=ROOT, env=env,
                                stdout=fh, stderr=subprocess.STDOUT, text=True)
        try:
            rc = proc.wait(timeout=TIMEOUT_S - 60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            pytest.fail(f"quickstart.py did not finish in {TIMEOUT_S - 60} s; it printed:\n{log.read_text()[-6000:]}")
    out = Output(log.read_text())
    assert rc == 0, f"quickstart.py exited {rc}:\n{out.stdout[-8000:]}"
    return out, started


@pytest.fixture()
def rclient(ray_service_url: str):
    with sdk.Client(ray_service_url, timeout=30) as c:
        yield c


def test_the_quickstart_runs_and_its_data_parallel_run_succeeds(quickstart, rclient) -> None:
    p, _ = quickstart
    out = p.stdout
    assert "rejected:" in out and "(field layout.tp)" in out  # the refused spec names its field
    m = re.search(r"^(\S+) [A-Z]+ 2$", out, re.M)  # print(run.id, run.status.value, run.plan.world_size)
    assert m, out[-4000:]
    run = rclient.runs.get(m.group(1))
    assert run.status == sdk.RunStatus.SUCCEEDED, run.status_reason
    assert run.spec.name == "gpt-dp2" and run.spec.train.steps == 20
    assert "20/20" in out  # the progress line reached the end
    rows = run.metrics()
    assert [r.step for r in rows] == list(range(1, 21))
    assert all(r.loss is not None and r.tokens_per_s and r.tokens_per_s > 0 for r in rows)
    assert run.summary is not None and run.summary.steps_done == 20
    assert run.summary.final_loss == pytest.approx(rows[-1].loss)
    assert [e.to_status for e in run.events() if e.kind == "state"][-1] == "SUCCEEDED"
    assert isinstance(run.logs(), str)


def test_the_quickstart_sweep_finishes_with_a_best_trial(quickstart, rclient) -> None:
    _, started = quickstart
    sweeps = [s for s in rclient.sweeps.list(limit=20).items
              if s.name == "tiny-layouts" and _ts(s.created_at) >= started - 5]
    assert len(sweeps) == 1, [(s.id, s.name, s.created_at) for s in sweeps]
    sweep = sweeps[0]
    assert sweep.status == "SUCCEEDED", (sweep.status, sweep.status_reason)
    assert len(sweep.trials) == 6  # 3 layouts x 2 micro-batch sizes; budget.max_trials=3 of them run
    ran = [t for t in sweep.trials if t.run_id is not None]
    assert 1 <= len(ran) <= 3, sweep.trials
    assert sweep.best_trial is not None and sweep.best_trial.run_id in {t.run_id for t in ran}
    assert sweep.best_trial.measured_tokens_per_s and sweep.best_trial.measured_tokens_per_s > 0
    best = [r for r in rclient.runs.list(name="gpt-sweep-base", limit=20).items
            if _ts(r.created_at) >= started - 5 and r.sweep_id is None]
    assert best and best[0].status == sdk.RunStatus.SUCCEEDED, best
    assert best[0].spec.layout == sweep.best_trial.layout


def test_the_quickstart_run_is_cancelled_then_resumed_on_another_layout(quickstart, rclient) -> None:
    p, _ = quickstart
    m = re.search(r"^(\S+) SUCCEEDED attempts: (\d+) summary:", p.stdout, re.M)
    assert m, p.stdout[-4000:]
    final = rclient.runs.get(m.group(1))
    assert final.status == sdk.RunStatus.SUCCEEDED, final.status_reason
    assert final.spec.name == "gpt-zero3" and final.spec.layout.tp == 2 and final.spec.layout.dp == 1
    assert final.attempts == int(m.group(2)) >= 2
    states = [e.to_status for e in final.events() if e.kind == "state"]
    assert "CANCELLED" in states and states[-1] == "SUCCEEDED"
    with pytest.raises(sdk.ConflictError):  # a finished run cannot be cancelled again
        rclient.runs.cancel(final.id)
    end = final.spec.train.steps
    resumed_rows = final.metrics(attempt=final.attempts)
    start = resumed_rows[0].step - 1  # the checkpoint it resumed from
    assert start >= 5 and start % 5 == 0 and end == start + 10
    assert [r.step for r in resumed_rows] == list(range(start + 1, end + 1))
    rows = final.metrics()
    assert [r.step for r in rows][:end] == list(range(1, end + 1))
    assert {r.attempt for r in rows if start < r.step <= end} == {final.attempts}  # replayed by the resume
    assert end in {c.step for c in final.checkpoints()}  # every 5 steps: the last step is one
    assert final.summary is not None and final.summary.steps_done == end

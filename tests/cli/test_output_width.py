"""CLI output without a terminal (piped, as in CI logs and ``| tee``) and at 80 columns: links and ids are printed
whole (never cut with "…", so the Ray job link can be copied), the live progress becomes plain lines, and no ANSI
colour codes reach the pipe. The CLI runs as a subprocess against a live API server; FakeWorker plays the run."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

from tests.sdk.conftest import play_when_submitted

ROOT = Path(__file__).resolve().parents[2]
LONG_JOB_LINK = "http://127.0.0.1:8265/#/jobs/raysubmit_" + "Wq8dZtX3mNbJ5kLs" * 3


def piped(url: str, *args: str, columns: int = 80) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE", "MESHRUN_URL")}
    env.update(COLUMNS=str(columns), PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "api.cli", "--url", url, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        stdin=subprocess.DEVNULL,
    )


def test_submit_wait_piped_at_80_columns_prints_whole_lines_without_colour(api_server) -> None:
    name = f"a-run-with-a-rather-long-descriptive-name-{uuid.uuid4().hex[:10]}"
    play_when_submitted(api_server, name, steps=20)
    r = piped(api_server.url, "submit", "examples/dp.yaml", "--name", name, "--set", "train.steps=20", "--wait")
    assert r.returncode == 0, r.stdout + r.stderr
    both = r.stdout + r.stderr
    assert "…" not in both and "\x1b[" not in both, both
    run_id = r.stderr.split("submitted ", 1)[1].split()[0]
    # the progress as plain lines: the run's name and id whole, its status changes, and the last step
    assert f"{name} ({run_id}): SUCCEEDED" in r.stderr, r.stderr
    assert f"{run_id} step 20/20  loss 0.2500" in r.stderr, r.stderr
    # the summary: the run and its console link whole, on one line each
    assert f"{run_id} ({name})" in r.stdout
    assert f"console                       {api_server.url}/runs/{run_id}\n" in r.stdout, r.stdout

    from service import store

    with api_server.session() as s:
        store.get_run(s, run_id=run_id).dashboard_url = LONG_JOB_LINK
    for columns in (80, 40):
        r = piped(api_server.url, "show", run_id, columns=columns)
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"ray job                       {LONG_JOB_LINK}\n" in r.stdout, r.stdout
        assert "…" not in r.stdout and "\x1b[" not in r.stdout


def test_error_message_is_one_line_at_80_columns(api_server) -> None:
    missing = "run-" + "x" * 59
    r = piped(api_server.url, "show", missing)
    assert r.returncode == 3, r.stdout + r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) <= 2 and missing in lines[0] and len(lines[0]) > 80, r.stderr  # message (+ field), unbroken

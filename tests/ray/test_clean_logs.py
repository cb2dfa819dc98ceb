"""A successful run's logs look successful: its driver output (the Ray Job's log, what ``meshrun logs`` shows) and its
workers' own Ray log files hold no ERROR line, no traceback, no "preemption notice" (the worker group's normal
shutdown after SUCCEEDED is not a preemption) and no ANSI colour codes. One run of each layout kind the session's
6-CPU cluster holds: dp2 (the shared reference run), tp2, pp2 with the 1F1B schedule, the 3-D dp2 x tp2 x pp2 (eight
workers at half a CPU each; its run is test_runs.py's) and a sweep trial."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest

from tests.ray.helpers import ray_job, submit, tiny_spec, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.slow]

BAD = re.compile(r"\bERROR\b|Traceback|preemption notice|\x1b\[")
RAY_TRANSIENT = "it's safe to ignore this error"  # Ray Train's own warning on a loaded machine (see below)


def without_ray_transient_warnings(lines: list[str]) -> list[str]:
    """Drop Ray Train's "Failed to send resource request ... safe to ignore" warning and its traceback (its
    TrainController's 5 s call to Ray's autoscaling coordinator, on a loaded 2-core machine: Ray's code and
    Ray's words, not meshrun's); every other line stays."""
    out: list[str] = []
    skipping: str | None = None
    for line in lines:
        if RAY_TRANSIENT in line:
            # "(TrainController pid=N)" in the driver's log; nothing in the controller's own log file
            skipping = line.split(")", 1)[0] + ")" if line.startswith("(") else ""
            continue
        if skipping is not None and line.startswith(skipping):  # its traceback, up to the exception line
            if "GetTimeoutError" in line:
                skipping = None
            continue
        skipping = None
        out.append(line)
    return out


LAYOUTS = {  # dp2 and the 3-D layout: the runs of tests/ray/test_runs.py are checked (no run of their own here)
    "tp2": {"tp": 2},
    "pp2-1f1b": {"pp": 2, "layout": {"dp": 1, "tp": 1, "pp": 2, "pp_schedule": "1f1b"}},
}


def test_the_dp2_reference_run_logs_no_error_traceback_or_preemption(live_service, ray_cluster, reference_dp2_run):
    done, _ = reference_dp2_run
    assert_clean_logs(live_service, ray_cluster, done["id"], done["ray_job_id"])


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_a_successful_run_logs_no_error_traceback_or_preemption(live_service, ray_cluster, kind) -> None:
    url = live_service.url
    over = dict(LAYOUTS[kind])
    layout = over.pop("layout", None)
    spec = tiny_spec(f"clean-logs-{kind}", steps=6, **over)
    if layout is not None:
        spec["layout"] = layout
    run = submit(url, spec)
    done = wait_for(url, run["id"], {"SUCCEEDED"}, timeout_s=400)
    assert_clean_logs(live_service, ray_cluster, run["id"], done["ray_job_id"])


def test_a_successful_sweep_trial_logs_no_error_traceback_or_preemption(live_service, ray_cluster) -> None:
    url = live_service.url
    base = tiny_spec("clean-logs-trial", steps=100)
    base.pop("layout")
    body = {
        "name": "clean-logs-sweep",
        "base": base,
        "search": {"layouts": [{"dp": 2}], "micro_batch_sizes": [2]},
        "objective": "tokens_per_s",
        "budget": {"max_trials": 1, "steps_per_trial": 6, "warmup_steps": 2, "max_concurrent_trials": 1},
        "early_stopping": False,
    }
    r = httpx.post(f"{url}/v1/sweeps", json=body, timeout=60)
    assert r.status_code == 201, r.text
    sweep = r.json()
    deadline = time.monotonic() + 600
    while sweep["status"] not in {"SUCCEEDED", "FAILED", "CANCELLED"}:
        assert time.monotonic() < deadline, f"sweep still {sweep['status']}"
        time.sleep(2)
        sweep = httpx.get(f"{url}/v1/sweeps/{sweep['id']}", timeout=30).json()
    assert sweep["status"] == "SUCCEEDED", sweep
    trial = sweep["trials"][0]
    assert trial["status"] == "SUCCEEDED" and trial["run_id"], trial
    assert_clean_logs(live_service, ray_cluster, trial["run_id"], sweep["ray_job_id"])


def assert_clean_logs(live_service, ray_cluster, run_id: str, ray_job_id: str) -> None:
    """The run's driver output and its Ray Job's worker log files: no ERROR, traceback, preemption notice or ANSI."""
    url = live_service.url
    # the worker group is shut down after the run ended: give its processes time to get (and log) their SIGTERM
    time.sleep(8)
    driver = httpx.get(f"{url}/v1/runs/{run_id}/logs", timeout=30).json()["logs"]
    assert driver.strip(), f"no driver log for {run_id}"
    lines = without_ray_transient_warnings(driver.splitlines())
    bad = [i for i, line in enumerate(lines) if BAD.search(line)]
    assert not bad, "\n".join(lines[max(0, bad[0] - 5) : bad[0] + 40])

    job = ray_job(live_service, ray_job_id, until={"SUCCEEDED", "FAILED", "STOPPED"})
    logs_dir = Path(ray_cluster.head.temp_dir) / "session_latest" / "logs"
    files = {p.name: p.read_text(errors="replace") for p in logs_dir.glob(f"worker-*-{job.job_id}-*.*")}
    assert files, f"no worker logs of job {job.job_id} under {logs_dir}"
    bad = [
        f"{name}: {line}"
        for name, text in files.items()
        for line in without_ray_transient_warnings(text.splitlines())
        if BAD.search(line)
    ]
    assert not bad, "\n".join(bad[:20])

"""HTTP helpers for the end-to-end tests on the live service."""

from __future__ import annotations

import time
from typing import Any

import httpx

TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}


def tiny_spec(name: str, *, dp: int = 1, tp: int = 1, pp: int = 1, steps: int = 8, **over: Any) -> dict[str, Any]:
    """A tiny GPT spec (fast on 2 CPU cores)."""
    spec: dict[str, Any] = {
        "name": name,
        "model": {"name": "gpt", "preset": "tiny"},
        "data": {"source": "synthetic"},
        "layout": {"dp": dp, "tp": tp, "pp": pp},
        "batch": {"global_batch_size": 4 * dp * max(pp, 1), "micro_batch_size": 2 if pp == 1 else 1},
        "train": {"steps": steps, "seed": 0},
        "optimizer": {"lr": 3e-3, "warmup_steps": 0, "schedule": "constant"},
        "resources": {"device": "cpu", "cpus_per_worker": 1},
    }
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(spec.get(k), dict):
            spec[k] = {**spec[k], **v}
        else:
            spec[k] = v
    return spec


def submit(url: str, spec: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{url}/v1/runs", json=spec, timeout=60)
    assert r.status_code in (200, 201, 202), r.text
    return r.json()


def get_run(url: str, run_id: str) -> dict[str, Any]:
    r = httpx.get(f"{url}/v1/runs/{run_id}", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def wait_for(url: str, run_id: str, statuses: set[str], *, timeout_s: float = 180) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    run = get_run(url, run_id)
    while run["status"] not in statuses:
        if run["status"] in TERMINAL and not (statuses & TERMINAL and run["status"] in statuses):
            raise AssertionError(f"run {run_id} ended {run['status']} ({run.get('status_reason')}) while "
                                 f"waiting for {statuses}; events: {events(url, run_id)}")
        if time.monotonic() > deadline:
            raise AssertionError(f"run {run_id} still {run['status']} ({run.get('status_reason')}) after "
                                 f"{timeout_s}s; events: {events(url, run_id)}")
        time.sleep(0.5)
        run = get_run(url, run_id)
    return run


def metrics(url: str, run_id: str, attempt: int | None = None) -> list[dict[str, Any]]:
    """The run's metric rows (of one ``attempt``: replaced steps included)."""
    params = {"attempt": attempt, "limit": 1000} if attempt is not None else None
    r = httpx.get(f"{url}/v1/runs/{run_id}/metrics", params=params, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["items"]


def events(url: str, run_id: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{url}/v1/runs/{run_id}/events", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["items"]


def wait_for_step(url: str, run_id: str, step: int, *, timeout_s: float = 180) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while True:
        rows = metrics(url, run_id)
        if rows and rows[-1]["step"] >= step:
            return rows
        run = get_run(url, run_id)
        if run["status"] in TERMINAL:
            raise AssertionError(f"run ended {run['status']} ({run.get('status_reason')}) before step {step}")
        if time.monotonic() > deadline:
            raise AssertionError(f"run {run_id} did not reach step {step} in {timeout_s}s ({run['status']})")
        time.sleep(0.5)


def status_of(job: Any) -> str:
    return str(getattr(job.status, "value", job.status))


def ray_job(svc: Any, job_id: str, *, until: set[str] | None = None, timeout_s: float = 60) -> Any:
    """The job from Ray's own job list (``list_jobs``), optionally once its status is in ``until``."""
    deadline = time.monotonic() + timeout_s
    while True:
        jobs = {j.submission_id: j for j in svc.runtime.jobs.list()}
        job = jobs.get(job_id)
        assert job is not None, f"Ray Job {job_id} is not in Ray's job list: {sorted(jobs)}"
        if until is None or status_of(job) in until or time.monotonic() > deadline:
            return job
        time.sleep(0.5)

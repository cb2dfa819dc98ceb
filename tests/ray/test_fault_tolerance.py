"""Issue 7 on Ray: a worker SIGKILLed mid-run -> Ray Train restarts the group from the latest checkpoint as a new
attempt; the run succeeds with every step exactly once and the uninterrupted run's final loss."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest
import ray  # noqa: F401 - ray vendors psutil

from tests.ray.conftest import FT_STEPS, ft_spec
from tests.ray.helpers import events, metrics, submit, wait_for, wait_for_step
from tests.ray.test_runs import worker_pids

pytestmark = pytest.mark.ray


def test_worker_killed_mid_run_recovers_from_checkpoint(live_service, reference_dp2_run):
    url = live_service.url
    ref, ref_rows = reference_dp2_run
    # paced (0.3 s more per step on rank 0; the math is unchanged) so that the kill lands mid-run: unpaced, the 30
    # tiny steps end before a SIGKILL sent once step 12 is visible through the API
    run = submit(url, ft_spec("e2e-ft-kill", resources={"device": "cpu", "cpus_per_worker": 1, "max_failures": 1},
                              faults={"slow_rank": {"rank": 0, "delay_s": 0.3}}))
    wait_for_step(url, run["id"], 12, timeout_s=300)
    pids = worker_pids(url, run["id"])
    os.kill(pids[1], signal.SIGKILL)

    done = wait_for(url, run["id"], {"SUCCEEDED"}, timeout_s=400)
    assert done["attempts"] == 2
    ev = events(url, run["id"])
    attempts = [e["reason"] for e in ev if e["kind"] == "attempt"]
    assert len(attempts) == 2 and attempts[1].startswith("attempt 2: restart after failure"), attempts
    rows = metrics(url, run["id"])
    assert [r["step"] for r in rows] == list(range(1, FT_STEPS + 1))  # every step exactly once
    assert rows[-1]["attempt"] == 2 and rows[0]["attempt"] == 1
    # replayed steps after the resume came from attempt 2; they start right after a checkpoint step
    first_replayed = min(r["step"] for r in rows if r["attempt"] == 2)
    # ... the latest checkpoint attempt 1 recorded before it died
    a1 = [int(e["reason"].split()[3]) for e in ev if e["kind"] == "checkpoint" and e["reason"].endswith("_a1")]
    assert (first_replayed - 1) % 5 == 0 and first_replayed - 1 == max(a1), (first_replayed, a1)
    assert done["summary"]["final_loss"] == pytest.approx(ref["summary"]["final_loss"], rel=1e-5)
    assert rows[-1]["loss"] == pytest.approx(ref_rows[-1]["loss"], rel=1e-5)
    cks = httpx.get(f"{url}/v1/runs/{run['id']}/checkpoints", timeout=30).json()["items"]
    assert [c["step"] for c in cks] == [25, 30]  # keep: 2 (pruned checkpoints are not listed)


def test_cancelled_run_resumes_from_checkpoint_with_a_new_layout(live_service, reference_dp2_run):
    """A dp2 checkpoint resumed as tp2 through REST. (Resharding to one process is checked on the engine itself:
    tests/workers/test_checkpoint.py, fsdp dp2 to dp2 x tp2 and to one process; a second Ray run here cost 30 s.)"""
    layout = {"dp": 1, "tp": 2}
    url = live_service.url
    ref, ref_rows = reference_dp2_run
    # rank 0 slowed by 50 ms a step: the cancel below lands within the 30 steps of the reference run it compares to
    # (a warm start ran 35 tiny steps between two polls of the checkpoints); the delay changes no loss
    run = submit(url, ft_spec(f"e2e-resume-{'-'.join(f'{k}{v}' for k, v in layout.items())}",
                              train={"steps": 2000, "seed": 1, "deterministic": True},
                              faults={"slow_rank": {"rank": 0, "delay_s": 0.05}}))
    deadline = time.monotonic() + 300
    ck_url = f"{url}/v1/runs/{run['id']}/checkpoints"
    while not any(c["step"] >= 10 for c in httpx.get(ck_url, timeout=30).json()["items"]):
        assert time.monotonic() < deadline, "no checkpoint of step >= 10 recorded"
        time.sleep(0.5)
    assert httpx.post(f"{url}/v1/runs/{run['id']}/cancel", timeout=60).json()["status"] == "CANCELLED"
    cks = httpx.get(f"{url}/v1/runs/{run['id']}/checkpoints", timeout=30).json()["items"]
    last = max(c["step"] for c in cks)
    assert 10 <= last < len(ref_rows), (last, len(ref_rows))
    ran = metrics(url, run["id"])[-1]["step"]
    steps = ran + 3  # the resumed attempt replaces every step after the checkpoint
    r = httpx.post(f"{url}/v1/runs/{run['id']}/resume", json={"layout": layout, "steps": steps}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["status"] in ("QUEUED", "STARTING", "RUNNING")
    done = wait_for(url, run["id"], {"SUCCEEDED"}, timeout_s=300)
    assert done["plan"]["world_size"] == layout.get("dp", 1) * layout.get("tp", 1)
    rows = metrics(url, run["id"])
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    resumed = [r for r in rows if r["step"] > last]
    assert all(r["attempt"] == 2 for r in resumed)
    # the first resumed step's loss is the loss the uninterrupted run had at that step (resharded checkpoint)
    assert resumed[0]["loss"] == pytest.approx(ref_rows[last]["loss"], rel=1e-3)


def test_a_restart_resumes_from_the_in_memory_copy_when_storage_is_unreadable(live_service, reference_dp2_run):
    """``checkpoint.memory_copy`` (issue 33): every rank's checkpoint files are also kept by the run's channel (outside
    the worker group). The storage copies of every listed checkpoint are cut to zero bytes before a worker is
    SIGKILLed: the restarted group resumes from memory (a ``checkpoint_restored`` event), never reads storage, and
    trains the uninterrupted run's losses; from storage the attempt could not have loaded at all."""
    url = live_service.url
    _, ref_rows = reference_dp2_run
    run = submit(url, ft_spec("e2e-memory-copy",
                              checkpoint={"every_steps": 5, "keep": 2, "memory_copy": True},
                              resources={"device": "cpu", "cpus_per_worker": 1, "max_failures": 1},
                              faults={"slow_rank": {"rank": 0, "delay_s": 0.6}}))  # 3 s between checkpoints
    ck_url = f"{url}/v1/runs/{run['id']}/checkpoints"
    deadline = time.monotonic() + 300
    while True:
        cks = httpx.get(ck_url, timeout=30).json()["items"]
        if any(c["step"] >= 10 for c in cks):
            break
        assert time.monotonic() < deadline, "no checkpoint of step >= 10 recorded"
        time.sleep(0.2)
    cut = {}
    for c in cks:
        files = [p for p in Path(c["path"]).rglob("*") if p.is_file()]
        assert files, c
        for p in files:
            p.write_bytes(b"")
        cut[c["step"]] = len(files)
    os.kill(worker_pids(url, run["id"])[1], signal.SIGKILL)

    done = wait_for(url, run["id"], {"SUCCEEDED", "FAILED"}, timeout_s=400)
    assert done["status"] == "SUCCEEDED", done.get("status_reason")
    assert done["attempts"] == 2
    restored = [e["reason"] for e in events(url, run["id"]) if e["kind"] == "checkpoint_restored"]
    assert len(restored) == 1 and restored[0].startswith("attempt 2 resumes from the in-memory copy"), restored
    step = int(restored[0].split("checkpoint of step ")[1].split()[0])
    assert step in cut, (step, cut)  # a checkpoint whose storage files were emptied
    rows = metrics(url, run["id"])
    assert [r["step"] for r in rows] == list(range(1, FT_STEPS + 1))  # every step once
    assert min(r["step"] for r in rows if r["attempt"] == 2) == step + 1
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in ref_rows], rel=1e-5)

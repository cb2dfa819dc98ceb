"""A full disk, end to end (issue 34, "Health and disk"): a run whose checkpoint storage is full fails its save with
ENOSPC on a real Ray cluster; /healthz says ``storage: full``; the driver waits, telling the run's events why; once
space returns the run is requeued by its failure policy, resumes and SUCCEEDS, and no partial checkpoint is left or
listed. The checkpoint root is a real tmpfs (root needed, as in CI), the service and its database are elsewhere."""

from __future__ import annotations

import errno
import time

import httpx
import pytest

from tests.conftest import mounted_tmpfs, start_live_service, stop_live_service
from tests.ray.helpers import events, submit, tiny_spec, wait_for

pytestmark = pytest.mark.ray


@pytest.fixture
def ckpt_disk(tmp_path):
    """A real 72 MiB tmpfs: the driver counts space as back at 64 MiB free (service.runs.disk_full)."""
    with mounted_tmpfs(tmp_path / "ckfs", "72m") as mnt:
        yield mnt


def _fill(mnt):
    filler = mnt / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
        except OSError as e:
            assert e.errno == errno.ENOSPC
        try:  # the last few KiB
            while True:
                f.write(b"\0" * 512)
        except OSError as e:
            assert e.errno == errno.ENOSPC
    return filler


def _until(what, check, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} within {timeout_s:.0f} s"
        time.sleep(1)


def test_a_run_on_a_full_disk_resumes_when_space_returns(ray_cluster, tmp_path, ckpt_disk):
    svc = start_live_service(ray_cluster=ray_cluster, data_dir=tmp_path / "data", checkpoint_root=ckpt_disk / "ck")
    try:
        url = svc.url
        (ckpt_disk / "ck").mkdir()
        filler = _fill(ckpt_disk)
        health = httpx.get(f"{url}/healthz", timeout=30)
        assert health.status_code == 503 and health.json().get("storage") == "full", health.text

        spec = tiny_spec("disk-full", steps=4, checkpoint={"every_steps": 2}, resources={"max_failures": 1})
        run = submit(url, spec)
        rid = run["id"]
        waiting = _until("the driver says it waits for space",
                         lambda: [e for e in events(url, rid) if e["kind"] == "disk_full_wait"], 300)
        assert "MiB free" in waiting[0]["reason"] and str(ckpt_disk / "ck") in waiting[0]["reason"]
        assert httpx.get(f"{url}/v1/runs/{rid}", timeout=30).json()["status"] not in ("FAILED", "SUCCEEDED")

        filler.unlink()  # space returns
        done = wait_for(url, rid, {"SUCCEEDED"}, timeout_s=300)
        kinds = [e["kind"] for e in events(url, rid)]
        assert kinds.count("disk_full") == 1, kinds  # one retry, counted against max_failures=1
        # the failed attempt (Ray Train may have restarted its workers once inside it, by the same failure policy),
        # then the resumed one
        assert done["attempts"] >= 2, (done, kinds)
        listed = httpx.get(f"{url}/v1/runs/{rid}/checkpoints", timeout=30).json()["items"]
        assert listed and max(c["step"] for c in listed) == 4
        leftovers = [p for p in (ckpt_disk / "ck").rglob("*") if p.name.endswith(".partial")]
        assert leftovers == [], leftovers
        assert httpx.get(f"{url}/healthz", timeout=30).status_code == 200
    finally:
        stop_live_service(svc)

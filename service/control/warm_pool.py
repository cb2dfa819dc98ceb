"""The service's side of its warm pool (``MESHRUN_WARM_WORKERS``): keeps one ``service.cluster.warm_host`` Ray Job
running on the service's cluster (started with the runtime, started again when it ended: a restarted head, a crash),
reuses one a previous service process left running, and stops it when the service stops."""

from __future__ import annotations

import logging
import time

from service.cluster.env import job_runtime_env, python_command, warm_pool_name
from service.cluster.jobs import JobsBackend
from service.settings import Settings

logger = logging.getLogger(__name__)

CHECK_EVERY_S = 30.0  # how often the runtime's tick looks at the pool's job


class WarmHost:
    def __init__(self, settings: Settings, jobs: JobsBackend, *, gcs_address: str | None, dashboard_url: str | None):
        self.settings, self.jobs = settings, jobs
        self.gcs_address, self.dashboard_url = gcs_address, dashboard_url
        self.name = warm_pool_name(settings)
        self.job_id: str | None = None
        self.checked_at = 0.0

    def ensure(self, *, force: bool = False) -> None:
        """Start the pool's job unless it runs (at most every CHECK_EVERY_S unless ``force``); failures are logged."""
        if self.name is None or (not force and time.monotonic() - self.checked_at < CHECK_EVERY_S):
            return
        self.checked_at = time.monotonic()
        try:
            if self.job_id and not self.jobs.state(self.job_id).terminal:
                return
            self.job_id = self._running() or self._submit()
        except Exception:
            logger.exception("warm pool %s: could not start its Ray Job (runs start cold meanwhile)", self.name)
            self.jobs.reset()

    def _running(self) -> str | None:
        for job in self.jobs.list():
            meta = job.metadata or {}
            if meta.get("meshrun") == "warm" and meta.get("pool") == self.name and str(job.status) in (
                "PENDING", "RUNNING", "JobStatus.PENDING", "JobStatus.RUNNING",
            ):  # fmt: skip
                return job.submission_id
        return None

    def _submit(self) -> str:
        assert self.name is not None
        sid = f"{self.name}-{int(time.time() * 1000)}"
        s = self.settings
        self.jobs.submit(
            entrypoint=f"{python_command()} -m service.cluster.warm_host --name {self.name} "
            f"--workers {s.warm_workers} --max-idle {s.warm_max_idle_groups} --idle-s {s.warm_idle_s:g}",
            submission_id=sid,
            metadata={"meshrun": "warm", "pool": self.name, "job_name": "meshrun warm worker pool"},
            runtime_env=job_runtime_env(s, job_id=sid, gcs_address=self.gcs_address, dashboard_url=self.dashboard_url),
        )
        logger.info("warm pool %s: Ray Job %s started (%d workers)", self.name, sid, s.warm_workers)
        return sid

    def stop(self) -> None:
        if self.job_id is None:
            return
        try:
            self.jobs.stop(self.job_id)
        except Exception:
            logger.exception("warm pool %s: stopping Ray Job %s failed", self.name, self.job_id)
        self.job_id = None

"""Ray-side plumbing shared by the service and the run driver.

- ``JobsBackend``: one Ray Job per run through the dashboard's Jobs API (submit, status, stop, logs, list).
- ``RunChannel``: a small Ray actor per run (created by the driver, ``num_cpus=0``). Workers send it per-step
  metric rows fire-and-forget (``.remote()`` without ``ray.get``), rank 0 registers each worker-group start
  (an attempt) and the rank -> node map, the Train callback sends checkpoints and worker errors. The driver
  drains it every ~0.5 s into the run database. This keeps ``ray.train.report`` (a ~2 s barrier) out of the
  per-step path.

Light on purpose: the channel actor's process imports this module (no Ray Train, no Jobs client at import time), so
a run's channel is up in the time a Python process takes to import Ray. Ray Train's ``ChannelCallback`` is in
``service.runs.trainer``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import ray
from ray.actor import ActorHandle

if TYPE_CHECKING:
    from ray.job_submission import JobDetails, JobSubmissionClient

logger = logging.getLogger(__name__)

SUBMISSION_PREFIX = "meshrun-"
MAX_REASON_CHARS = 4000


def submission_id(run_id: str, n: int) -> str:
    """The Ray Job submission id of the ``n``-th submission (1-based) of a run."""
    return f"{SUBMISSION_PREFIX}{run_id}-{n}"


def submission_number(job_id: str | None) -> int:
    if not job_id or not job_id.startswith(SUBMISSION_PREFIX):
        return 0
    try:
        return int(job_id.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return 0


def trim(text: str, limit: int = MAX_REASON_CHARS) -> str:
    """Keep the head and the tail of a long message (the tail usually holds the actual error)."""
    text = text.strip()
    if len(text) <= limit:
        return text
    head = limit // 4
    return text[:head] + "\n...\n" + text[-(limit - head - 5) :]


# ----------------------------------------------------------------------------------------------- channel
class RunChannel:
    """Buffer between the workers / Train controller and the driver (which owns the database writes)."""

    def __init__(self, run_id: str, first_attempt: int):
        self.run_id = run_id
        self.attempt = first_attempt - 1
        self.events: list[dict[str, Any]] = []
        self.worker_errors: list[str] = []
        self.last_error: str | None = None
        self.stop_requested = False
        self.preempt_reason: str | None = None
        self.ranks: dict[int, dict[str, Any]] = {}
        self.states: dict[int, dict[str, Any]] = {}  # rank -> latest "where am I" snapshot of the current attempt
        self.profile_steps = 0  # a profile request not yet handed to rank 0
        self.hang_text: str | None = None  # the driver's diagnosis of the current attempt's hang
        self.copies: dict[int, dict[int, dict[str, bytes]]] = {}  # step -> rank -> its checkpoint files (memory_copy)
        self.copy_world: dict[int, int] = {}  # step -> the ranks that make its copy complete

    def begin_attempt(self, info: dict[str, Any]) -> int:
        """Rank 0 calls this once per worker-group start; returns the attempt number: the next one, or the one
        ``info["attempt"]`` names (a warm job's, numbered by its driver so that no worker waits for this call)."""
        self.attempt = int(info["attempt"]) if info.get("attempt") is not None else self.attempt + 1
        cause = info.get("cause") or (f"restart after failure: {self.last_error}" if self.last_error else "start")
        self.ranks = {int(r["rank"]): r for r in info.get("ranks", [])}
        self.states, self.hang_text = {}, None
        self.events.append(
            {
                "type": "attempt",
                "attempt": self.attempt,
                "cause": cause,
                "ranks": info.get("ranks", []),
                "time": time.time(),
            }
        )
        self.last_error = None
        return self.attempt

    def metrics(self, attempt: int, rows: list[dict[str, Any]]) -> None:
        self.events.append({"type": "metrics", "attempt": attempt, "rows": rows})

    def checkpoint(self, info: dict[str, Any]) -> None:
        self.events.append({"type": "checkpoint", "attempt": self.attempt, **info})

    def worker_error(self, text: str) -> None:
        self.last_error = self.hang_text or text  # a diagnosed hang explains the workers' error better
        self.worker_errors.append(text)
        self.events.append({"type": "worker_error", "attempt": self.attempt, "text": text})

    def event(self, kind: str, reason: str) -> None:
        """A run event from the workers' side (an async_ps worker lost and replaced, ...)."""
        self.events.append({"type": "event", "attempt": self.attempt, "kind": kind, "reason": reason})

    def done(self, summary: dict[str, Any]) -> None:
        self.events.append({"type": "done", "attempt": self.attempt, "summary": summary})

    def drain(self) -> list[dict[str, Any]]:
        out, self.events = self.events, []
        return out

    def info(self) -> dict[str, Any]:
        return {
            "attempt": self.attempt,
            "ranks": list(self.ranks.values()),
            "worker_errors": self.worker_errors,
            "last_error": self.last_error,
        }

    # checkpoint.memory_copy (``workers.memory_copy``): the newest complete checkpoint's files, outside the workers
    def keep_copy(self, step: int, rank: int, world: int, files: dict[str, bytes]) -> None:
        """Rank ``rank``'s files of the checkpoint of ``step``; once every rank's are in, older copies go."""
        self.copies.setdefault(step, {})[rank] = files
        self.copy_world[step] = world
        if len(self.copies[step]) == world:
            for old in [s for s in self.copies if s < step]:
                self.copies.pop(old)
                self.copy_world.pop(old, None)

    def copy_of(self, step: int) -> dict[int, dict[str, bytes]] | None:
        """Every rank's files of the checkpoint of ``step``, or None when some rank's are missing."""
        got = self.copies.get(step)
        return got if got is not None and len(got) == self.copy_world.get(step) else None

    def request_stop(self) -> None:
        self.stop_requested = True

    def request_preempt(self, reason: str) -> None:
        """The service wants the workers back: checkpoint at the next report, then stop (the run is re-queued)."""
        self.preempt_reason = reason

    def should_stop(self) -> bool:
        return self.stop_requested

    # diagnostics (``workers.ray_worker.channel_hooks``): heartbeats, artifacts, control of rank 0
    def rank_state(self, attempt: int, snapshot: dict[str, Any]) -> None:
        if attempt == self.attempt:
            self.states[int(snapshot.get("rank", -1))] = snapshot

    def rank_states(self) -> dict[str, Any]:
        return {"attempt": self.attempt, "states": list(self.states.values()), "ranks": list(self.ranks.values())}

    def hang(self, text: str) -> None:
        """The driver diagnosed a hang of the current attempt (and is about to end it)."""
        self.hang_text = self.last_error = text

    def artifact(self, attempt: int, rank: int | None, name: str, text: str) -> None:
        self.events.append({"type": "artifact", "attempt": attempt, "rank": rank, "name": name, "text": text})

    def request_profile(self, steps: int) -> None:
        self.profile_steps = max(self.profile_steps, int(steps))

    def control(self) -> dict[str, Any]:
        """Rank 0 polls this at every report: stop, a preemption with its reason (checkpoint, then stop), or profile
        the next k steps (handed out once)."""
        steps, self.profile_steps = self.profile_steps, 0
        return {"stop": self.stop_requested, "preempt": self.preempt_reason, "profile_steps": steps}


RunChannelActor = ray.remote(num_cpus=0, max_restarts=0)(RunChannel)


def channel_name(run_id: str) -> str:
    return f"meshrun-channel-{run_id}"


def open_channel(run_id: str, first_attempt: int) -> ActorHandle:
    """The run's channel actor (named after the run; the existing one when it runs already)."""
    handle = RunChannelActor.options(name=channel_name(run_id), get_if_exists=True).remote(run_id, first_attempt)
    return cast(ActorHandle, handle)


def format_worker_exceptions(worker_exceptions: Mapping[int, BaseException]) -> str:
    parts = []
    for rank in sorted(worker_exceptions):
        e = worker_exceptions[rank]
        cause = getattr(e, "cause", None) or e
        parts.append(f"rank {rank}: {type(cause).__name__}: {_short(cause)}")
    return "; ".join(parts)


def _short(e: BaseException, limit: int = 1500) -> str:
    text = str(e).strip()
    # RayTaskError strings carry a full traceback: keep its last non-empty lines (the exception itself)
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if len(lines) > 6:
        text = "\n".join(lines[-6:])
    return text[-limit:]


# -------------------------------------------------------------------------------------------------- jobs
@dataclass
class JobState:
    status: str  # PENDING RUNNING STOPPED SUCCEEDED FAILED, or MISSING
    message: str | None = None
    metadata: dict[str, str] | None = None

    @property
    def terminal(self) -> bool:
        return self.status in ("STOPPED", "SUCCEEDED", "FAILED", "MISSING")


class JobsBackend:
    """Thin wrapper over ``JobSubmissionClient`` (created lazily, re-created after errors)."""

    def __init__(self, dashboard_url: str):
        self.dashboard_url = dashboard_url
        self._client: JobSubmissionClient | None = None

    @property
    def client(self) -> JobSubmissionClient:
        if self._client is None:
            from ray.job_submission import JobSubmissionClient  # the service only: not in the channel's process

            self._client = JobSubmissionClient(self.dashboard_url)
        return self._client

    def reset(self) -> None:
        self._client = None

    def submit(
        self,
        *,
        entrypoint: str,
        submission_id: str,
        metadata: dict[str, str],
        runtime_env: dict[str, Any] | None = None,
    ) -> str:
        return self.client.submit_job(
            entrypoint=entrypoint, submission_id=submission_id, metadata=metadata, runtime_env=runtime_env or {}
        )

    def state(self, job_id: str) -> JobState:
        try:
            info = self.client.get_job_info(job_id)
        except RuntimeError as e:
            if "does not exist" in str(e) or "404" in str(e) or "not found" in str(e).lower():
                return JobState(status="MISSING", message=f"Ray Job {job_id} does not exist")
            raise
        return JobState(
            status=str(getattr(info.status, "value", info.status)), message=info.message, metadata=info.metadata
        )

    def stop(self, job_id: str) -> bool:
        try:
            return bool(self.client.stop_job(job_id))
        except RuntimeError as e:
            if "does not exist" in str(e):
                return False
            raise

    def logs(self, job_id: str) -> str:
        return self.client.get_job_logs(job_id)

    def list(self) -> list[JobDetails]:
        return self.client.list_jobs()

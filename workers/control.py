"""Polling the run channel's ``control()`` (``service.cluster.jobs.RunChannel``) without waiting for it: rank 0 of a
Ray Train or warm worker group at each report, and the replica-mode driver (``workers.replica_driver``) for a
preemption request. Imports ray only (no Ray Train, no torch)."""

from __future__ import annotations

import logging
from typing import Any, cast

import ray

logger = logging.getLogger(__name__)


class ControlPoll:
    """Rank 0's ``control()`` poll of the run channel, kept out of the step loop: each call returns the answer to the
    previous poll if it has come (None while it is out, or when the channel failed to answer) and sends the next one;
    a request (stop, preemption, profile) is seen one report later, and no report waits for the channel (it may
    still be starting when a warm job begins, or be busy). ``stop_if_gone``: a channel that died (its driver was
    killed) answers stop, for a warm worker that would otherwise train an orphaned job to its end."""

    def __init__(self, channel: Any, *, stop_if_gone: bool = False) -> None:
        self.channel = channel
        self.stop_if_gone = stop_if_gone
        self.pending: Any = None

    def __call__(self) -> dict[str, Any] | None:
        out: dict[str, Any] | None = None
        if self.pending is not None:
            ready, _ = ray.wait([self.pending], timeout=0)
            if not ready:
                return None  # still out: no second poll piles up behind it
            try:
                out = cast(dict[str, Any], ray.get(self.pending))
            except ray.exceptions.ActorDiedError:
                if self.stop_if_gone:
                    logger.warning("the run's channel is gone (its driver ended): this job stops")
                    return {"stop": True}
                logger.warning("the run's channel is gone")
            except Exception as e:  # a slow or lost channel must not stop training
                logger.warning("run channel control poll failed: %s", e)
        self.pending = self.channel.control.remote()
        return out

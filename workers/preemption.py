"""Preemption notices: a SIGTERM (what a spot or preemptible node's processes get before it is reclaimed, and what a
node drain sends) makes the run checkpoint at its next report boundary and stop cleanly, within a grace period.

- ``NOTICE`` is this process's notice. ``install()`` puts ``NOTICE.handler`` on SIGTERM (the main thread only: Python
  signal handlers live there; a Ray Train worker installs it through its actor's ``__ray_call__``, which runs on
  the actor's main thread, see ``workers.ray_worker``). The handler only records the notice and arms a watchdog.
- The training loop (``workers.loop``) adds ``vote()`` to the stop vote it already combines across ranks at every
  report (one ``all_gather`` about every ``spec.metrics.report_every_s`` seconds, never per step): a vote of
  ``PREEMPT_VOTE`` on any rank makes every rank stop after the same step and save an emergency checkpoint of it,
  so the resumed run recomputes no step. The summary says ``preempted`` and which ranks got the notice.
- The watchdog ends the process ``grace_s`` seconds after the notice (``MESHRUN_PREEMPTION_GRACE_S``, default 30)
  if it has not finished by then: a rank stuck in a collective must not hold a node that is going away.
- ``finish()``: the training loop is over (done or failed). A SIGTERM from then on is the worker's normal shutdown
  (Ray ending the worker group after the run), not a notice: it goes to the handler that was there before
  ``install()`` (Ray's, which exits the worker), with no "preemption notice" and no watchdog.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from types import FrameType
from typing import Any

log = logging.getLogger(__name__)

GRACE_ENV = "MESHRUN_PREEMPTION_GRACE_S"
DEFAULT_GRACE_S = 30.0
STOP_VOTE = 1  # a user's stop (cancel, sweep early stop)
PREEMPT_VOTE = 2  # a preemption notice: checkpoint, then stop


def grace_s_from_env() -> float:
    try:
        return max(0.0, float(os.environ.get(GRACE_ENV, DEFAULT_GRACE_S)))
    except ValueError:
        log.warning("%s is not a number of seconds; using %s", GRACE_ENV, DEFAULT_GRACE_S)
        return DEFAULT_GRACE_S


class PreemptionNotice:
    """The preemption notice of one process (see the module docstring)."""

    def __init__(self, grace_s: float | None = None, *, exit_fn=os._exit):
        self.grace_s = grace_s_from_env() if grace_s is None else grace_s
        self.received_at: float | None = None
        self.cause: str | None = None
        self._exit = exit_fn
        self._watchdog: threading.Timer | None = None
        self._lock = threading.Lock()
        self.finished = False  # the loop is over: SIGTERM is a normal shutdown (``finish``)
        self.previous_handler: Any = None  # SIGTERM's handler before ``install``

    @property
    def requested(self) -> bool:
        return self.received_at is not None

    def vote(self) -> int:
        return PREEMPT_VOTE if self.requested else 0

    def trigger(self, cause: str = "SIGTERM") -> None:
        """Record a notice (the first one counts) and arm the watchdog."""
        with self._lock:
            if self.received_at is not None:
                return
            self.received_at, self.cause = time.time(), cause
            if self.grace_s > 0:
                self._watchdog = threading.Timer(self.grace_s, self._expire)
                self._watchdog.daemon = True
                self._watchdog.start()
        log.warning("preemption notice (%s): checkpointing at the next report, %.0f s grace", cause, self.grace_s)

    def handler(self, signum: int, frame: FrameType | None) -> None:
        if self.finished:
            self._pass_on(signum, frame)
            return
        self.trigger(signal.Signals(signum).name)

    def _pass_on(self, signum: int, frame: FrameType | None) -> None:
        """The signal's meaning before ``install`` (Ray's handler exits the worker; the default ends the process)."""
        previous = self.previous_handler
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def finish(self) -> None:
        """The training loop is over: no forced exit, and a later SIGTERM is no preemption notice."""
        self.disarm()
        self.finished = True

    def disarm(self) -> None:
        """The process finished its work in time: no forced exit."""
        with self._lock:
            if self._watchdog is not None:
                self._watchdog.cancel()
                self._watchdog = None

    def reset(self) -> None:
        self.disarm()
        self.received_at, self.cause, self.finished = None, None, False

    def _expire(self) -> None:
        log.error("preemption grace period of %.0f s is over; exiting", self.grace_s)
        self._exit(128 + signal.SIGTERM)


NOTICE = PreemptionNotice()


def install(notice: PreemptionNotice = NOTICE) -> bool:
    """Handle SIGTERM with ``notice`` in this process; False (nothing changed) off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return False
    notice.grace_s = grace_s_from_env()
    previous = signal.signal(signal.SIGTERM, notice.handler)
    if previous != notice.handler:  # installed again (a later attempt in the same process): keep the original
        notice.previous_handler = previous
    return True


def install_on_actor_main_thread(_actor_instance: object = None) -> bool:
    """For ``actor.__ray_call__.remote(install_on_actor_main_thread)``: runs on a Ray actor's main thread."""
    return install(NOTICE)

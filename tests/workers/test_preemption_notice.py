"""The worker's SIGTERM handler (``workers.preemption``), with real signals to this process: a SIGTERM during the
training loop is a preemption notice; once the loop finished (``finish``) it is the worker's normal shutdown, handed
to the handler that was there before (Ray's), with no "preemption notice" logged and no watchdog."""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest

from workers.preemption import PREEMPT_VOTE, PreemptionNotice, install


@pytest.fixture
def sigterm_restored():
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


def _sigterm() -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)  # the handler runs on the main thread at the next bytecode boundary


def test_sigterm_during_the_loop_is_a_notice(sigterm_restored, caplog) -> None:
    earlier: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: earlier.append(signum))
    notice = PreemptionNotice(grace_s=0, exit_fn=lambda code: None)
    assert install(notice)
    with caplog.at_level(logging.WARNING, logger="workers.preemption"):
        _sigterm()
    assert notice.requested and notice.vote() == PREEMPT_VOTE and earlier == []
    assert "preemption notice (SIGTERM)" in caplog.text


def test_sigterm_after_the_loop_finished_is_the_normal_shutdown(sigterm_restored, caplog) -> None:
    earlier: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: earlier.append(signum))  # Ray's handler stands in here
    exits: list[int] = []
    notice = PreemptionNotice(grace_s=0.1, exit_fn=exits.append)
    assert install(notice)
    notice.finish()
    with caplog.at_level(logging.INFO, logger="workers.preemption"):
        _sigterm()
    time.sleep(0.2)
    assert earlier == [signal.SIGTERM]  # passed on
    assert not notice.requested and notice.vote() == 0 and exits == []
    assert "preemption" not in caplog.text
    notice.reset()  # the next attempt in this process: a SIGTERM is a notice again
    assert install(notice)
    _sigterm()
    assert notice.requested and earlier == [signal.SIGTERM]

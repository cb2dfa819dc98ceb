"""One hang rule (``api.spec.run.hang_limit_s``) for the group-mode watch and replica mode's driver."""

from __future__ import annotations

from api.spec.run import hang_limit_s
from service.runs.watch import HangWatch


def test_the_spec_timeout_wins_else_300_s_or_20_slowest_steps() -> None:
    assert hang_limit_s(3, 100.0) == 3.0
    assert hang_limit_s(None, 0.0) == 300.0
    assert hang_limit_s(None, 10.0) == 300.0
    assert hang_limit_s(None, 30.0) == 600.0


def test_the_group_watch_uses_it() -> None:
    w = HangWatch(timeout_s=None)
    w.step_time(40.0)
    assert w.effective_timeout_s() == 800.0
    w.states(1, [{"steps_done": 1, "phase": "train"}], now=0.0)
    assert not w.hung(now=799.0) and w.hung(now=801.0)
    assert HangWatch(timeout_s=5).effective_timeout_s() == 5.0

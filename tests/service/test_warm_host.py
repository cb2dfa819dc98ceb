"""The warm pool's host loop (``service.cluster.warm_host.host_pool``): it keeps reaping while the pool answers and
ends its process once the pool is gone, so that a driver orphaned by a dead Ray head does not live on (a fake pool
and a fake ``ray.get`` here; the real case is tests/chaos/test_owned_head.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from ray.exceptions import ActorDiedError, GetTimeoutError

from service.cluster import warm_host


class _Left(Exception):
    """``os._exit`` in the test: the host left."""


class _StillThere(BaseException):  # not an Exception: ``host_pool`` must not take it for an unanswered reap
    """The host reaped past the test's outcomes: it did not leave when it should have."""


@dataclass
class _Host:
    """The pool's n-th ``reap.remote()`` returns ref n; ``ray.get(n)`` raises ``outcomes[n - 1]`` unless it is None
    (an answer), and ``_StillThere`` past the last outcome."""

    outcomes: list[BaseException | None]
    reaps: int = 0
    exit_codes: list[int] = field(default_factory=list)

    def remote(self) -> int:  # pool.reap.remote
        self.reaps += 1
        return self.reaps

    def get(self, ref: int, timeout: float) -> None:
        if ref > len(self.outcomes):
            raise _StillThere(f"reap {ref} after {self.outcomes}")
        outcome = self.outcomes[ref - 1]
        if outcome is not None:
            raise outcome

    def exit(self, code: int) -> None:
        self.exit_codes.append(code)
        raise _Left


def _host(monkeypatch: pytest.MonkeyPatch, outcomes: list[BaseException | None]) -> _Host:
    host = _Host(outcomes)
    monkeypatch.setattr(warm_host.ray, "get", host.get)
    monkeypatch.setattr(warm_host.os, "_exit", host.exit)
    pool = type("Pool", (), {"reap": host})()
    with pytest.raises(_Left):
        warm_host.host_pool(pool, "meshrun-warm-pool-test", every_s=0, retry_s=0)
    return host


def test_a_dead_pool_ends_the_host_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    host = _host(monkeypatch, [None, None, ActorDiedError()])
    assert host.reaps == 3 and host.exit_codes == [1]


def test_unanswered_reaps_end_the_host_only_when_they_come_in_a_row(monkeypatch: pytest.MonkeyPatch) -> None:
    slow = GetTimeoutError("reap took 60 s")
    host = _host(monkeypatch, [slow, slow, None, slow, slow, slow])
    assert host.reaps == 6 and host.exit_codes == [1]  # two misses, an answer, then three misses in a row

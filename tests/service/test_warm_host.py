"""The warm pool's host loop (``service.cluster.warm_host.host_pool``): it keeps reaping while the pool answers and
ends its process once the pool is gone, so that a driver orphaned by a dead Ray head does not live on (a fake pool
here; the real case is tests/chaos/test_owned_head.py)."""

from __future__ import annotations

import pytest
from ray.exceptions import ActorDiedError, GetTimeoutError

from service.cluster import warm_host


class _Reap:
    def __init__(self) -> None:
        self.calls = 0

    def remote(self) -> int:
        self.calls += 1
        return self.calls


class _Pool:
    def __init__(self) -> None:
        self.reap = _Reap()  # its n-th ``reap.remote()`` is ref n, which ``ray.get`` answers with the n-th outcome


class _Left(Exception):
    pass


@pytest.fixture
def fake_ray(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    exits: dict[str, int] = {}

    def get(ref: int, timeout: float) -> None:
        outcome = pool_outcomes[ref - 1] if ref <= len(pool_outcomes) else None
        if outcome is not None:
            raise outcome

    def leave(code: int) -> None:
        exits["code"] = code
        raise _Left

    pool_outcomes: list[BaseException | None] = []
    monkeypatch.setattr(warm_host.ray, "get", get)
    monkeypatch.setattr(warm_host.os, "_exit", leave)
    monkeypatch.setattr(warm_host.time, "sleep", lambda s: None)
    exits["outcomes"] = pool_outcomes  # type: ignore[assignment]
    return exits


def _run(fake_ray: dict, outcomes: list[BaseException | None]) -> _Pool:
    fake_ray["outcomes"].extend(outcomes)
    pool = _Pool()
    with pytest.raises(_Left):
        warm_host.host_pool(pool, "meshrun-warm-pool-test", every_s=0, retry_s=0)
    return pool


def test_a_dead_pool_ends_the_host_at_once(fake_ray) -> None:
    pool = _run(fake_ray, [None, None, ActorDiedError()])
    assert pool.reap.calls == 3 and fake_ray["code"] == 1


def test_unanswered_reaps_end_the_host_only_when_they_come_in_a_row(fake_ray) -> None:
    slow = GetTimeoutError("reap took 60 s")
    pool = _run(fake_ray, [slow, slow, None, slow, slow, slow])
    assert pool.reap.calls == 6 and fake_ray["code"] == 1  # two misses, an answer, then three misses in a row

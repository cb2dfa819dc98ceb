"""The warm pool's idle limit (``WarmPool.expire``, ``MESHRUN_WARM_IDLE_S``) on the pool's own bookkeeping: which idle
groups go, which stay. The groups' workers are plain objects here (``_kill`` is recorded, not sent to Ray); the end
to end test is tests/ray/test_warm_runs.py."""

from __future__ import annotations

from typing import Any

from service.cluster.warm import WarmPool

STANDING = (("node-a", "node-a"), 1)
OTHER = (("node-a",), 1)


def _pool(idle_s: float | None, groups: dict[int, tuple[Any, bool, float]]) -> Any:
    cls = WarmPool.__ray_metadata__.modified_class  # the actor's own class, without Ray
    pool = cls(max_idle=4, idle_s=idle_s)
    pool.standing = STANDING
    pool.groups = {gid: {"key": key, "workers": [], "busy": busy, "jobs": 1, "used": used, "owner": None}
                   for gid, (key, busy, used) in groups.items()}
    pool.killed = []
    pool._kill = lambda gid: (pool.killed.append(gid), pool.groups.pop(gid))
    return pool


def test_idle_groups_past_the_limit_go_except_the_newest_standing_one() -> None:
    pool = _pool(60, {
        1: (STANDING, False, 0.0),     # standing shape, idle longest, but the newest idle one of its shape is #4
        2: (OTHER, False, 30.0),       # idle 70 s: goes
        3: (OTHER, True, 0.0),         # busy: stays, however old
        4: (STANDING, False, 50.0),    # the newest idle standing group: stays
        5: (OTHER, False, 80.0),       # idle 20 s: stays
    })
    assert sorted(pool.expire(now=100.0)) == [1, 2]
    assert sorted(pool.groups) == [3, 4, 5]


def test_the_only_standing_group_stays_however_long_it_is_idle() -> None:
    pool = _pool(60, {1: (STANDING, False, 0.0)})
    assert pool.expire(now=10_000.0) == [] and list(pool.groups) == [1]


def test_without_a_limit_nothing_expires() -> None:
    pool = _pool(None, {1: (OTHER, False, 0.0)})
    assert pool.expire(now=10_000.0) == [] and pool.killed == []

"""A sweep's own warm pool (``budget.warm_workers``): named per sweep, started by the sweep driver in its Ray Job
(so it ends with the job); the groups and ``warm_fit`` are ``service.cluster.warm``'s."""

from __future__ import annotations

from typing import Any

import ray

from service.cluster.warm import WarmPool, usable, warm_fit

__all__ = ["pool_name", "start_pool", "sweep_pool", "usable", "warm_fit"]


def pool_name(sweep_id: str) -> str:
    return f"meshrun-warm-{sweep_id}"


def start_pool(sweep_id: str) -> Any:
    """The sweep's pool (the sweep driver calls this once, before its Tuner)."""
    return WarmPool.options(name=pool_name(sweep_id), get_if_exists=True).remote()  # type: ignore[attr-defined]


def sweep_pool(sweep_id: str) -> Any:
    """The pool ``start_pool`` made, from a trial's process."""
    return ray.get_actor(pool_name(sweep_id))

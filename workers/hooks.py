"""The callbacks of one training process (``workers.loop.train``'s keyword arguments, as one typed value). The Ray
worker builds them from the run's channel (``workers.ray_worker.channel_hooks``); runs and sweep trials get the
same ones. No torch here: the service imports the Ray worker module."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Hooks:
    """The callbacks of one training process (each optional; see ``workers.loop``'s docstring)."""

    sink: Callable[[dict[str, Any]], None] | None = None  # per-step rows (global rank 0)
    on_checkpoint: Callable[[int, str], None] | None = None  # after every rank saved step's checkpoint
    stop: Callable[[], bool] | None = None  # True: stop after the current step (polled at reports)
    control: Callable[[], dict[str, Any] | None] | None = None  # {"stop", "preempt", "profile_steps"} at reports
    on_state: Callable[[dict[str, Any]], None] | None = None  # the rank's "where am I" snapshot, every few seconds
    on_profile: Callable[[int, int, list[str]], None] | None = None  # profile files of steps first..last

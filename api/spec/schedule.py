"""The learning-rate schedule as a pure function (shared by the workers and the service's resume).

``lr_factor(step, ...)``: the LR multiplier of 0-based optimizer ``step``: linear warm-up to 1, then cosine or
linear decay to ``min_lr_ratio`` at ``total_steps`` (or constant). ``anchor = (k, f)`` continues a schedule whose
horizon changed on resume at step ``k``: from ``k`` on, the decay starts at ``f`` (what the old schedule gave at
``k``) and reaches ``min_lr_ratio`` at the new ``total_steps``, so the LR never jumps (``resume_anchor``).
"""

from __future__ import annotations

import math


def _shape(schedule: str, progress: float) -> float:
    """1 -> 0 over progress 0 -> 1."""
    progress = min(1.0, max(0.0, progress))
    if schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_factor(
    step: int,
    *,
    warmup_steps: int,
    total_steps: int,
    schedule: str,
    min_lr_ratio: float,
    anchor: tuple[int, float] | None = None,
) -> float:
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if anchor is not None and step >= anchor[0]:
        k, f = anchor
        return min_lr_ratio + (f - min_lr_ratio) * _shape(schedule, (step - k) / max(1, total_steps - k))
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * _shape(schedule, progress)


def resume_anchor(
    step: int,
    *,
    old_total_steps: int,
    new_total_steps: int,
    warmup_steps: int,
    schedule: str,
    min_lr_ratio: float,
    old_anchor: tuple[int, float] | None = None,
) -> tuple[int, float] | None:
    """The anchor that keeps the LR continuous when a run resumed at 0-based optimizer ``step`` (its checkpoint's
    step) gets a new horizon; None when nothing changes (same horizon, constant schedule, still warming up)."""
    if new_total_steps == old_total_steps or schedule == "constant" or step < warmup_steps:
        return old_anchor
    f = lr_factor(
        step,
        warmup_steps=warmup_steps,
        total_steps=old_total_steps,
        schedule=schedule,
        min_lr_ratio=min_lr_ratio,
        anchor=old_anchor,
    )
    return (step, f)

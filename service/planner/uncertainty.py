"""How far to trust a predicted step time: an interval around it, from the residuals of the planner on the
measurements behind its kernel profile, widened when the model is far from those measurements.

For a step time ``t`` predicted for a model of ``n`` parameters on ``w`` devices the interval is

    [t (1 - below), t (1 + above)]
    below = min(MAX_HALF_WIDTH, max(FLOOR, over) * (1 + distance))
    above = min(MAX_HALF_WIDTH, max(FLOOR, under) * (1 + distance))
    distance = max(0, log10(n / n_max), log10(n_min / n)) + max(0, log10(w / w_max), log10(w_min / w)) / 2

With ``r = measured / predicted - 1`` the residuals of the data behind the prediction (``BASES``), ``over`` is the
80th percentile of ``-r`` over the runs the planner over-predicted (r < 0) and ``under`` the 80th percentile of ``r``
over those it under-predicted (r >= 0): each side holds four in five of its runs, so the interval holds four in five
of all of them, asymmetric where the planner is biased. ``n_min..n_max``, ``w_min..w_max`` are the parameter and
device ranges of that data.
``FLOOR`` keeps a side from vanishing where the data has no residual of that sign. A CPU has no measured basis (a
calibration measures it): ``CPU_HALF_WIDTH`` each way.

Bases (``tests/service/test_planner_uncertainty.py`` re-derives the percentiles from the data, so they cannot drift
from the model; ``bench/bench_planner_published.py`` prints the coverage). A run belongs to the basis of the profile
it is priced with (``kernels`` in ``tests/service/data/published_runs.json``):
- ``megatron`` on GPUs: the published Megatron-LM / Megatron-DeepSpeed runs (Narayanan et al. SC21, Korthikanti et
  al. 2022, BigScience tr11: 38 runs, 1.7B-1T parameters, 8-3072 A100s).
- ``eager`` on GPUs: meshrun's own rows (``tests/service/data/h100_measured.json``: 29 whole training steps of
  meshrun-shaped GPTs of 125M-2.7B parameters on one H100, micro-batches 1-8, with and without full recompute) and
  MosaicML llm-foundry's MPT tables (148 runs, 125M-70B on 8-128 A100s / H100s: PyTorch modules under Composer with
  ``torch.autocast``, FSDP and gradient clipping, no fused Megatron kernels; ``service.planner.profiles``): 177 runs.
  Until 2026-11-28 llm-foundry's rows were priced ``megatron`` and pooled there (0.073 / 0.300 over 186 runs): their
  systematic -15 % bias (every H100 row too fast, by up to 45 %) then set the whole profile's upper side past the cap,
  and the interval covered 74 % of the bench's runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_HALF_WIDTH = 0.25  # wider than +-25 % says nothing a user can plan with: the cap
FLOOR = 0.03  # least width of a side (run-to-run noise of a measured step: a few percent)
CPU_HALF_WIDTH = 0.20  # assumed: CPU runs depend on the host's load and cores (a calibration measures them)


@dataclass(frozen=True)
class Basis:
    """The data behind one kernel profile's predictions: its residual percentiles and the ranges it covers."""

    name: str
    over: float  # 80th percentile of -r over the over-predicted runs (r = measured / predicted - 1 < 0)
    under: float  # 80th percentile of r over the under-predicted runs (r >= 0)
    n_runs: int
    params: tuple[float, float]  # (min, max) model parameters
    world: tuple[int, int]  # (min, max) devices


BASES: dict[str, Basis] = {
    "megatron": Basis("published Megatron runs", 0.051, 0.181, 38, (1.7e9, 1.01e12), (8, 3072)),
    "eager": Basis("meshrun's H100 loop and llm-foundry's runs", 0.092, 0.225, 177, (1.6e8, 6.5e10), (1, 128)),
}


def distance(basis: Basis, n_params: float, world: int) -> float:
    """How far (decades of parameters, half-decades of devices) a prediction lies outside its basis' data."""
    lo, hi = basis.params
    n = max(n_params, 1.0)
    d = max(0.0, math.log10(n / hi), math.log10(lo / n))
    wlo, whi = basis.world
    w = max(world, 1)
    return d + max(0.0, math.log10(w / whi), math.log10(wlo / w)) / 2


def bounds(profile: str, *, is_cpu: bool, n_params: float, world: int) -> tuple[float, float, str]:
    """(below, above: the interval's relative extent each way; what it rests on)."""
    if is_cpu:
        return CPU_HALF_WIDTH, CPU_HALF_WIDTH, "assumed for a CPU (no measured basis; a calibration measures it)"
    b = BASES[profile]
    d = distance(b, n_params, world)
    below = min(MAX_HALF_WIDTH, max(FLOOR, b.over) * (1 + d))
    above = min(MAX_HALF_WIDTH, max(FLOOR, b.under) * (1 + d))
    where = f"{b.name}: 80th percentiles of {b.n_runs} runs' residuals each way"
    if d > 0:
        where += f", widened x{1 + d:.2f} outside their sizes"
    if MAX_HALF_WIDTH in (below, above):
        where += f", capped at {MAX_HALF_WIDTH:.0%}"
    return below, above, where


def overlaps(a_low: float, a_high: float, b_low: float, b_high: float) -> bool:
    """Whether two intervals share a point."""
    return a_low <= b_high and b_low <= a_high

"""Guards that keep a calibration from poisoning later plans. Pure Python.

A calibration (``service.store.calibrations.fit_factors``) moves the planner's per-term factors until its
predictions match measured runs. Fitted freely, a handful of noisy trials can be matched by absurd factors (three
trials on a loaded two-core machine once gave ``optimizer_scale`` 33, ``dp_latency_scale`` 147, ``launch_scale``
0, and every later plan of that cluster used them). So:

1. **No more free factors than the data supports** (``max_free_factors``): ``n - 1`` for ``n`` measured values
   (a trial's throughput is one value, each measured term of a run's breakdown one more), at least one. The fit
   keeps the factors that move the predictions most (``service.store.calibrations.fit_factors``).
2. **Physical bounds** (``PHYSICAL_BOUNDS``): each factor stays where the hardware can be, see the table's comments.
3. **Held-out check** (``held_out_errors``): with two or more trials, each trial is predicted by a fit to the
   others (leave-one-out); a calibration whose held-out error is not below the defaults' error on the same trials is
   rejected: stored for the record with ``_rejected`` and the reason, never used by a plan
   (``service.store.calibrations.latest_calibration`` skips it).
4. **Machine load** (``machine_load``): the host's 1, 5 and 15 minute load averages and its CPU count, stored with
   the calibration (measurements on a loaded host say little about an idle one).
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Callable, Sequence
from typing import Any, Protocol

# factor -> (lower bound, upper bound, additive: starts from 0 / may be 0). Multipliers of the device table's figures.
PHYSICAL_BOUNDS: dict[str, tuple[float, float, bool]] = {
    # achieved GEMM/attention rate x the table's: the table's large-shape efficiency is 0.72-0.80 of peak on GPUs,
    # so 1.35 reaches the peak; a CPU's measured peak may be off by more: down to 0.1
    "compute_efficiency": (0.1, 1.35, False),
    # achieved memory bandwidth x a large copy's (kernels do not beat a copy by more than noise)
    "memory_efficiency": (0.1, 1.25, False),
    # host time per launch and fixed device time per kernel: 12 us x 0.1-10 on a GPU (1.2-120 us)
    "launch_scale": (0.1, 10.0, False),
    # host bookkeeping of recomputation, x the profile's (0: none; 10: ten times)
    "recompute_scale": (0.0, 10.0, True),
    # collectives: achieved bus bandwidth x the table's (nccl-tests reach 0.8-1.0 of it), latency x 0-20
    "tp_bandwidth_efficiency": (0.02, 1.5, False),
    "tp_latency_scale": (0.0, 20.0, True),
    "pp_bandwidth_efficiency": (0.02, 1.5, False),
    "pp_latency_scale": (0.0, 20.0, True),
    "dp_bandwidth_efficiency": (0.02, 1.5, False),
    "dp_latency_scale": (0.0, 20.0, True),
    "dp_overlap_fraction": (0.0, 1.0, True),
    # the bubble is schedule arithmetic: only its stalls move it
    "bubble_scale": (0.5, 2.0, False),
    # the optimizer step is memory-bound: 1/4 to 4 times the profile's bytes
    "optimizer_scale": (0.25, 4.0, False),
    # fixed host seconds per step (logging, data, Python): at most one second
    "step_overhead_s": (0.0, 1.0, True),
}


class Measured(Protocol):
    @property
    def measured_tokens_per_s(self) -> float | None: ...

    def terms(self) -> dict[str, float]: ...


def measured_values(observations: Sequence[Measured]) -> int:
    """How many measured values the observations hold: one per throughput, one per measured term."""
    n = 0
    for o in observations:
        n += 1 if (o.measured_tokens_per_s and o.measured_tokens_per_s > 0) else 0
        n += len(o.terms())
    return n


def max_free_factors(observations: Sequence[Measured]) -> int:
    """The most factors a fit may move: one fewer than the measured values, at least one."""
    return max(1, measured_values(observations) - 1)


def held_out_errors(
    n: int, predict_held_out: Callable[[int], float | None], default_error: Callable[[int], float | None]
) -> tuple[float, float, int] | None:
    """(mean held-out error of the fits, mean error of the defaults, trials compared) over leave-one-out
    folds ``0..n-1``: ``predict_held_out(i)`` is the relative error on trial ``i`` of a fit to the others,
    ``default_error(i)`` the defaults' error on it (None: not comparable). None with fewer than two trials."""
    if n < 2:
        return None
    fitted, defaults = [], []
    for i in range(n):
        e_fit, e_def = predict_held_out(i), default_error(i)
        if e_fit is None or e_def is None or not (math.isfinite(e_fit) and math.isfinite(e_def)):
            continue
        fitted.append(e_fit)
        defaults.append(e_def)
    if not fitted:
        return None
    return statistics.fmean(fitted), statistics.fmean(defaults), len(fitted)


def rejection(held_out: tuple[float, float, int] | None) -> str | None:
    """Why a calibration is rejected (its held-out error is not below the defaults'), or None."""
    if held_out is None:
        return None
    fitted, defaults, n = held_out
    if fitted >= defaults:
        return (
            f"held-out error {fitted:.1%} is not below the defaults' {defaults:.1%} over {n} trials "
            "(leave-one-out): the fit does not predict trials it has not seen"
        )
    return None


def machine_load() -> dict[str, Any]:
    """The host's load averages (1, 5, 15 minutes) and CPU count, or {} where the OS has none."""
    try:
        one, five, fifteen = os.getloadavg()
    except (OSError, AttributeError):
        return {}
    return {"load_avg": [round(one, 2), round(five, 2), round(fifteen, 2)], "cpus": os.cpu_count()}

"""Layout planner: predicts memory per rank and step time of a parallelism layout from the model's kernels and
their shapes, the collectives and the pipeline schedule, and searches for the fastest layout that fits. Pure
Python (standard library, pydantic and ``api.spec``). Every function takes ``factors=`` (per-term calibration
factors fitted to measured runs). How a layout is priced: ``service.planner.core``; kernels:
``service.planner.kernels`` and ``service.planner.compute``; collectives: ``service.planner.comm``; schedules:
``service.planner.pipeline``; the device table and its sources: ``service.planner.devices``.
"""

from service.planner.devices import DEVICES, Device, device_names, lookup_device, resolve_device
from service.planner.factors import DEFAULT_FACTORS, TERM_FACTORS, Factors, default_factors
from service.planner.search import (
    MAX_SEARCH,
    MICRO_BATCH_SIZES,
    RECOMPUTE_ORDER,
    best_alternative,
    divisors,
    evaluate,
    predict_run,
    search,
    search_size,
)

__all__ = [
    "DEFAULT_FACTORS",
    "DEVICES",
    "MAX_SEARCH",
    "MICRO_BATCH_SIZES",
    "RECOMPUTE_ORDER",
    "TERM_FACTORS",
    "Device",
    "Factors",
    "best_alternative",
    "default_factors",
    "device_names",
    "divisors",
    "evaluate",
    "lookup_device",
    "predict_run",
    "resolve_device",
    "search",
    "search_size",
]

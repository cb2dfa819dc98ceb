"""Layout planner: predicts memory per rank and step time of a parallelism layout and searches for the
fastest layout that fits. Pure Python (no torch, no ray); every function takes ``factors=`` (efficiency
factors a calibration step can fit). See ``service.planner.core`` for how a layout is priced.
"""

from service.planner.core import (MICRO_BATCH_SIZES, RECOMPUTE_ORDER, best_alternative, evaluate, predict_run,
                                  search)
from service.planner.devices import DEVICES, Device, device_names, lookup_device, resolve_device
from service.planner.factors import DEFAULT_FACTORS, Factors, default_factors

__all__ = [
    "DEFAULT_FACTORS", "DEVICES", "MICRO_BATCH_SIZES", "RECOMPUTE_ORDER", "Device", "Factors", "best_alternative",
    "default_factors", "device_names", "evaluate", "lookup_device", "predict_run", "resolve_device", "search",
]

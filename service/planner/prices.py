"""What a layout costs: device-hours from the predicted step time, and US dollars where a price per device-hour is
known. Pure Python.

The price of a device-hour comes from, first to last: the request (``ClusterSpec.price_per_device_hour``, a run
spec's ``cluster.price_per_device_hour``), the service's settings (``MESHRUN_DEVICE_PRICES``, a JSON mapping of
device name to US dollars per device-hour, aliases resolved like the device table's), the dated default table
below, or none (then every money figure is null, never 0: an unknown price is not a free device).

The default table holds public on-demand list prices of single GPUs on GPU clouds (not hyperscalers, whose 8-GPU
machines cost several times more per GPU: AWS p5.48xlarge, 8 x H100, $98.32/h on demand in us-east-1, about
$12.29 per GPU-hour, deploybase.ai "AWS vs Google Cloud", March 2026). Prices move by the month and by provider:
set your own in ``MESHRUN_DEVICE_PRICES`` or per request.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from api.spec import Candidate, CandidateCost
from api.spec.validation import SpecError
from service.planner.devices import lookup_device

# device -> US dollars per device-hour, on demand
DEFAULT_PRICES: dict[str, float] = {
    # pricegpu.pages.dev, "H100 vs A100 Cloud Pricing" (early 2026): typical on-demand $1.49-2.49 per hour for
    # an A100 80GB SXM and $2.49-3.99 for an H100 SXM (Lambda, CoreWeave, RunPod, ...): the midpoints.
    "A100-80GB": 1.99,
    "H100": 3.24,
    # Spheron on-demand prices as of 2026-03-17 (spheron.network/blog/nvidia-h200-vs-b200-vs-gb200).
    "H200": 4.54,
    "B200": 6.03,
}
PRICES_AS_OF = "2026-03"  # the newest source above


def canonical_device(name: str) -> str | None:
    """The device table's name for ``name`` (aliases resolved), or None for a device it does not know."""
    try:
        return lookup_device(name).name
    except SpecError:
        return None


def resolve_price(
    device: str, requested: float | None, overrides: Mapping[str, float] | None = None
) -> tuple[float | None, str]:
    """(US dollars per device-hour, where it came from: ``request`` | ``settings`` | ``default`` | ``none``)."""
    if requested is not None:
        return float(requested), "request"
    name = canonical_device(device)
    for key, price in (overrides or {}).items():
        if key == device or canonical_device(key) == (name or device):
            return float(price), "settings"
    if name is not None and name in DEFAULT_PRICES:
        return DEFAULT_PRICES[name], "default"
    return None, "none"


def candidate_cost(
    devices: int,
    step_time_s: float,
    tokens_per_step: int,
    *,
    price: float | None,
    source: str,
    steps: int | None = None,
) -> CandidateCost:
    """Cost of one predicted step on ``devices`` devices, of a billion tokens and of ``steps`` steps."""
    ok = step_time_s > 0 and math.isfinite(step_time_s)
    dh_step = devices * step_time_s / 3600.0 if ok else 0.0
    per_b = dh_step * 1e9 / tokens_per_step if ok and tokens_per_step > 0 else None
    priced = price is not None and ok
    return CandidateCost(
        devices=devices,
        price_per_device_hour=price,
        price_source=source,
        device_hours_per_step=dh_step,
        usd_per_step=dh_step * price if priced and price is not None else None,
        usd_per_billion_tokens=per_b * price if priced and price is not None and per_b is not None else None,
        steps=steps,
        device_hours_for_steps=dh_step * steps if steps and ok else None,
        usd_for_steps=dh_step * steps * price if steps and priced and price is not None else None,
    )


def with_cost(
    cand: Candidate, *, tokens_per_step: int, price: float | None, source: str, steps: int | None = None
) -> Candidate:
    """``cand`` with its ``cost`` (none for a layout that does not fit: it has no step time to price)."""
    if not cand.feasible or cand.step_time_s.total <= 0:
        return cand
    cost = candidate_cost(
        cand.layout.world_size, cand.step_time_s.total, tokens_per_step, price=price, source=source, steps=steps
    )
    return cand.model_copy(update={"cost": cost})

"""Published (and meshrun-measured) training runs as planner fixtures: ``data/published_runs.json``, written by
``data/make_published_runs.py`` from the tables it transcribes (each source says where its figures come from, what
was measured and under which settings).

``predict(run)`` prices a run with the planner exactly as a user would describe it (model sizes, device, nodes,
layout, micro-batch, global batch, precision, checkpointing, ``model.attention`` eager for the runs without flash
attention, ``cluster.kernels`` eager for meshrun's own runs and llm-foundry's, megatron for the rest); ``report()``
gives the step-time error per source and the ranking quality within each group of runs that differ only in layout /
micro-batch.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from api.spec import ClusterSpec, Layout, ModelSpec
from api.spec.validation import resolve_model
from service.planner import Factors, default_factors, evaluate, resolve_device

DATA = Path(__file__).resolve().parent / "data" / "published_runs.json"


@lru_cache(maxsize=1)
def load() -> dict[str, Any]:
    return json.loads(DATA.read_text())


def runs(source: str | None = None) -> list[dict[str, Any]]:
    return [r for r in load()["runs"] if source is None or r["source"] == source]


def sources() -> dict[str, dict[str, str]]:
    return load()["sources"]


def kernels(run: dict[str, Any]) -> str:
    """The kernel profile a fixture run is priced with: its ``kernels`` (llm-foundry's rows: eager), else eager for
    meshrun's own runs and megatron for the rest."""
    return run.get("kernels") or ("eager" if run["source"].startswith("meshrun") else "megatron")


def predict(run: dict[str, Any], *, factors: Factors | None = None):
    """The planner's Candidate for a fixture run."""
    cluster = ClusterSpec(**{**run["cluster"], "kernels": kernels(run)})
    attention = "flash" if run.get("flash_attention", True) else "eager"
    cfg = resolve_model(ModelSpec(name="gpt", preset=None, attention=attention, **run["model"]))
    if factors is None:
        factors = default_factors(is_cpu=resolve_device(cluster).is_cpu)
    return evaluate(
        cfg,
        cluster,
        layout=Layout(**run["layout"]),
        micro_batch_size=run["micro_batch_size"],
        global_batch_size=run["global_batch_size"],
        precision=run["precision"],
        activation_checkpointing=run["activation_checkpointing"],
        factors=factors,
        validate=False,
    )


@dataclass
class Row:
    run: dict[str, Any]
    predicted_s: float
    measured_s: float
    low_s: float = 0.0  # the prediction's interval (``service.planner.uncertainty``)
    high_s: float = math.inf

    @property
    def covered(self) -> bool:
        return self.low_s <= self.measured_s <= self.high_s

    @property
    def error(self) -> float:
        """Signed relative error of the step time (predicted / measured - 1)."""
        return self.predicted_s / self.measured_s - 1


def rows(source: str | None = None, *, factors: Factors | None = None) -> list[Row]:
    out = []
    for r in runs(source):
        cand = predict(r, factors=factors)
        iv = cand.step_time_interval
        lo, hi = (iv.low_s, iv.high_s) if iv is not None else (0.0, math.inf)
        out.append(Row(r, cand.step_time_s.total, r["step_time_s"], lo, hi))
    return out


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        for pos, i in enumerate(order):
            r[i] = float(pos)
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return cov / var if var else float("nan")


@dataclass
class GroupRank:
    group: str
    n: int
    spearman: float
    regret: float  # measured time per sample of the predicted best / the measured best - 1


def ranking(rs: list[Row]) -> list[GroupRank]:
    """Per group of 3+ runs (same model and cluster, other layout or micro-batch): Spearman of predicted vs
    measured time per sample, and the regret of the planner's pick."""
    groups: dict[str, list[Row]] = defaultdict(list)
    for r in rs:
        if r.run.get("group"):
            groups[r.run["group"]].append(r)
    out = []
    for g, members in sorted(groups.items()):
        if len(members) < 3:
            continue
        pred = [m.predicted_s / m.run["global_batch_size"] for m in members]
        meas = [m.measured_s / m.run["global_batch_size"] for m in members]
        pick = min(range(len(members)), key=lambda i: pred[i])
        out.append(GroupRank(g, len(members), spearman(pred, meas), meas[pick] / min(meas) - 1))
    return out


def summary(rs: list[Row]) -> dict[str, float]:
    errs = [abs(r.error) for r in rs]
    return {
        "n": len(rs),
        "mape": statistics.fmean(errs),
        "max": max(errs),
        "bias": statistics.fmean(r.error for r in rs),
        "covered": statistics.fmean(1.0 if r.covered else 0.0 for r in rs),
        "widest": max(max(1 - r.low_s / r.predicted_s, r.high_s / r.predicted_s - 1) for r in rs),
    }

"""Fit the planner's efficiency factors (``service.planner.Factors``) to what a sweep measured. Pure Python.

A sweep measures tokens/s of several layouts of one model on one cluster. The planner predicts the same numbers
from catalogue figures and ``Factors`` (achieved GEMM fraction of peak, effective bandwidth per tier, overlap
of data-parallel communication, fixed latencies and host overheads). ``fit_factors`` searches the factors that
minimise the planner's squared log error of tokens/s (least squares on log step time) on those measurements: a
deterministic coordinate search on a multiplicative grid (each factor in turn is scaled by 1/4 ... 4, shrinking the
steps when nothing improves), accepting a move only when the error drops. The reported error is the mean relative
error of tokens/s; should the log fit not lower it, the search minimises it directly, so the error after is never
above the error before.
Factors that change no prediction of the measured layouts (e.g. inter-node bandwidth on one node) keep their
value. A few hundred planner evaluations per factor and round: milliseconds to a second.

Calibrations are stored per cluster key (``cluster_key``: device type, nodes x devices per node, and the CPU
model on CPU clusters) in the ``calibrations`` table; ``latest_factors(session, key)`` returns the newest one,
which later plans for that cluster should pass as ``factors=`` (see ``factors_for``).
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from api.schemas import ClusterSpec, Layout, ModelConfig
from service.models import Calibration
from service.planner import Factors, default_factors, evaluate, resolve_device

log = logging.getLogger(__name__)

# factor -> (lower bound, upper bound, additive: starts from 0 / may be 0)
FIT_BOUNDS: dict[str, tuple[float, float, bool]] = {
    "gemm_fraction": (1e-3, 1.0, False),
    "intra_bandwidth_fraction": (1e-3, 1.0, False),
    "inter_bandwidth_fraction": (1e-3, 1.0, False),
    "dp_overlap_fraction": (0.0, 1.0, True),
    "intra_latency_s": (0.0, 0.1, True),
    "inter_latency_s": (0.0, 0.1, True),
    "layer_overhead_s": (0.0, 1.0, True),
    "step_overhead_s": (0.0, 10.0, True),
}
SCALES = (0.25, 0.5, 1 / 1.5, 1 / 1.2, 1.2, 1.5, 2.0, 4.0)
ZERO_SEEDS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.1)
MAX_ROUNDS = 60
MIN_ERROR = 1e-3     # good enough: 0.1 % mean relative error
MIN_GAIN = 2e-3      # a round improving the error by less than 0.2 % (relative) refines the steps / stops
MAX_EVALUATIONS = 5000  # planner evaluations per fit (~0.3 ms each)
FACTORS_CACHE_S = 5.0


# ------------------------------------------------------------------------------------------------ keys
@lru_cache(maxsize=1)
def _local_cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def cluster_key(cluster: ClusterSpec, *, cpu_model: str | None = None) -> str:
    """Key of a cluster's calibrations: ``H100/2x8`` or ``cpu/1x6/<CPU model>``. The CPU model is the one of the
    machine computing the key (the service's; the embedded cluster runs there) unless given."""
    key = f"{cluster.device.strip()}/{cluster.nodes}x{cluster.gpus_per_node}"
    if cluster.device.strip().lower() == "cpu":
        model = cpu_model if cpu_model is not None else _local_cpu_model()
        if model:
            key += f"/{model}"
    return key[:256]


# --------------------------------------------------------------------------------------------- storage
def latest_calibration(session: Session, cluster_key: str) -> Calibration | None:
    return session.scalar(select(Calibration).where(Calibration.cluster_key == cluster_key)
                          .order_by(Calibration.created_at.desc(), Calibration.id.desc()).limit(1))


def latest_factors(session: Session, cluster_key: str) -> Factors | None:
    """The newest calibrated factors for this cluster key, or None (then the planner uses its defaults)."""
    cal = latest_calibration(session, cluster_key)
    if cal is None:
        return None
    try:
        return Factors.from_dict(cal.factors)
    except (TypeError, ValueError):
        log.warning("calibration %s for %s has unusable factors; ignoring it", cal.id, cluster_key)
        return None


_cache: dict[str, tuple[float, Factors | None]] = {}
_cache_lock = threading.Lock()


def factors_for(session_factory: Any, cluster: ClusterSpec | None) -> Factors | None:
    """``latest_factors`` for a planning cluster, with its own short session and a few seconds of caching (for
    the submission/plan paths). None when there is no cluster or no calibration, or the lookup fails."""
    if cluster is None or session_factory is None:
        return None
    key = cluster_key(cluster)
    now = time.monotonic()
    with _cache_lock:
        hit = _cache.get(key)
        if hit is not None and now - hit[0] < FACTORS_CACHE_S:
            return hit[1]
    try:
        with session_factory() as session:
            factors = latest_factors(session, key)
    except Exception:  # noqa: BLE001 - planning without calibration is still planning
        log.exception("reading the calibration of %s failed", key)
        return None
    with _cache_lock:
        _cache[key] = (now, factors)
    return factors


def forget_cached_factors() -> None:
    with _cache_lock:
        _cache.clear()


def store_calibration(session: Session, *, cluster_key: str, factors: Factors, error_before: float | None,
                      error_after: float | None, sweep_id: str | None) -> Calibration:
    cal = Calibration(cluster_key=cluster_key, factors=factors.to_dict(), error_before=error_before,
                      error_after=error_after, sweep_id=sweep_id)
    session.add(cal)
    session.flush()
    forget_cached_factors()
    return cal


# ---------------------------------------------------------------------------------------- observations
@dataclass(frozen=True)
class Observation:
    """One measured layout: what the planner needs to predict it, and what was measured."""

    model: ModelConfig
    layout: Layout
    micro_batch_size: int
    global_batch_size: int
    measured_tokens_per_s: float
    precision: str = "fp32"
    activation_checkpointing: str = "none"
    label: str = ""


def predict_tokens_per_s(obs: Observation, cluster: ClusterSpec, factors: Factors) -> float:
    cand = evaluate(obs.model, cluster, layout=obs.layout, micro_batch_size=obs.micro_batch_size,
                    global_batch_size=obs.global_batch_size, precision=obs.precision,
                    activation_checkpointing=obs.activation_checkpointing, factors=factors, validate=False)
    return float(cand.tokens_per_s)


def mean_relative_error(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """mean |predicted - measured| / measured."""
    pairs = [(p, m) for p, m in zip(predicted, measured) if m and m > 0]
    if not pairs:
        return float("nan")
    return statistics.fmean(abs(p - m) / m for p, m in pairs)


def mean_squared_log_error(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """mean (log(predicted / measured))^2; a prediction <= 0 counts as a factor-1000 miss."""
    pairs = [(p, m) for p, m in zip(predicted, measured) if m and m > 0]
    if not pairs:
        return float("nan")
    return statistics.fmean(math.log(p / m) ** 2 if p > 0 else math.log(1e3) ** 2 for p, m in pairs)


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Spearman rank correlation (average ranks for ties); None with fewer than 2 points or no variance."""
    if len(xs) != len(ys) or len(xs) < 2:
        return None

    def ranks(v: Sequence[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2 + 1
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return cov / var if var else None


# ------------------------------------------------------------------------------------------------- fit
@dataclass
class FitResult:
    factors: Factors
    factors_before: Factors
    error_before: float
    error_after: float
    rank_correlation_before: float | None
    rank_correlation_after: float | None
    predicted_before: list[float] = field(default_factory=list)
    predicted_after: list[float] = field(default_factory=list)
    measured: list[float] = field(default_factory=list)
    fitted: list[str] = field(default_factory=list)
    evaluations: int = 0
    elapsed_s: float = 0.0

    def to_json(self, labels: Sequence[str] = ()) -> dict[str, Any]:
        changed = {k: v for k, v in self.factors.to_dict().items() if self.factors_before.to_dict().get(k) != v}
        out: dict[str, Any] = {
            "factors": self.factors.to_dict(), "factors_before": self.factors_before.to_dict(),
            "changed": changed, "fitted": self.fitted,
            "error_before": _finite(self.error_before), "error_after": _finite(self.error_after),
            "rank_correlation_before": self.rank_correlation_before,
            "rank_correlation": self.rank_correlation_after,
            "trials_used": len(self.measured), "evaluations": self.evaluations, "elapsed_s": self.elapsed_s,
        }
        if labels:
            out["points"] = [{"trial": lab, "measured_tokens_per_s": m, "predicted_before": pb, "predicted_after": pa}
                             for lab, m, pb, pa in zip(labels, self.measured, self.predicted_before,
                                                       self.predicted_after)]
        return out


def _finite(x: float) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def fit_factors(observations: Sequence[Observation], cluster: ClusterSpec, *, start: Factors | None = None,
                params: Iterable[str] | None = None, max_rounds: int = MAX_ROUNDS,
                max_evaluations: int = MAX_EVALUATIONS) -> FitResult:
    """Coordinate search for the factors that best predict the measured tokens/s: least squares on the log of
    throughput (= log step time), then checked on the mean relative error (the reported error).

    ``start``: the factors the predictions were made with (default: the planner's defaults for the device).
    ``params``: which factors to fit (default: all in ``FIT_BOUNDS``); those no measured layout depends on are
    left alone. The result's error after is <= the error before (moves are accepted only when they improve).
    """
    t0 = time.perf_counter()
    obs = [o for o in observations if o.measured_tokens_per_s and o.measured_tokens_per_s > 0]
    if start is None:
        start = default_factors(is_cpu=resolve_device(cluster).is_cpu)
    measured = [o.measured_tokens_per_s for o in obs]
    n_eval = 0

    def preds(f: Factors) -> list[float]:
        nonlocal n_eval
        n_eval += len(obs)
        return [predict_tokens_per_s(o, cluster, f) for o in obs]

    def loss(p: list[float]) -> float:
        return mean_relative_error(p, measured)

    before = preds(start)
    err_before = loss(before) if obs else float("nan")
    if not obs:
        return FitResult(start, start, err_before, err_before, None, None, [], [], [], [], 0,
                         time.perf_counter() - t0)

    names = [p for p in (params if params is not None else FIT_BOUNDS) if p in FIT_BOUNDS]
    # sensitivity: only factors that move some prediction
    active = []
    for name in names:
        lo, hi, additive = FIT_BOUNDS[name]
        cur = getattr(start, name)
        probe = min(hi, max(lo, cur * 2 if cur > 0 else (ZERO_SEEDS[2] if additive else lo)))
        if probe == cur:
            probe = max(lo, cur / 2)
        try:
            if preds(replace(start, **{name: probe})) != before:
                active.append(name)
        except ValueError:
            continue

    def search(loss_fn, budget: int) -> tuple[Factors, list[float], float]:
        best_f, best_p = start, before
        best_err = loss_fn(before)
        scales = list(SCALES)
        spent0 = n_eval
        for _round in range(max_rounds):
            if n_eval - spent0 >= budget:
                break
            improved = False
            round_start = best_err
            for name in active:
                lo, hi, additive = FIT_BOUNDS[name]
                cur = getattr(best_f, name)
                tries = {min(hi, max(lo, cur * sc)) for sc in scales} if cur > 0 else set()
                if additive:
                    tries |= {0.0} | ({min(hi, z) for z in ZERO_SEEDS} if cur == 0 else set())
                tries.discard(cur)
                for v in sorted(tries):
                    try:
                        f = replace(best_f, **{name: v})
                    except ValueError:
                        continue
                    p = preds(f)
                    e = loss_fn(p)
                    if e < best_err - 1e-12:
                        best_f, best_p, best_err, improved = f, p, e, True
            if best_err < MIN_ERROR ** 2:
                break
            if not improved or round_start - best_err < MIN_GAIN * round_start:
                if scales[-1] <= 1.05:
                    break
                scales = [sc ** 0.5 for sc in scales]  # finer steps around the optimum
        return best_f, best_p, best_err

    # least squares on log throughput (= log step time): symmetric in over/under-prediction, keeps the ranking
    best_f, best_p, _ = search(lambda p: mean_squared_log_error(p, measured), max_evaluations)
    best_err = loss(best_p)
    if best_err > err_before:  # rare: then minimise the reported error itself (never worse than before)
        best_f, best_p, best_err = search(loss, max_evaluations // 2)
    return FitResult(best_f, start, err_before, best_err, spearman(before, measured), spearman(best_p, measured),
                     before, best_p, measured, active, n_eval, time.perf_counter() - t0)

"""Fit the planner's per-term calibration factors (``service.planner.Factors``) to measured runs. Pure Python.

The planner predicts a step time as a sum of terms (compute, tp_comm, pp_comm, pp_bubble, dp_comm, optimizer,
other) from the device table and the model's kernels; each term has its own factors (``service.planner.TERM_FACTORS``:
compute efficiency, TP/PP/DP bandwidth and latency, bubble, ...). An ``Observation`` is one measured layout: its
whole-step throughput (``measured_tokens_per_s``, what a sweep trial measures), and/or its measured seconds per term
(``measured_terms_s``, named like ``api.spec.StepTimeBreakdown``, what a run's measured breakdown gives). Per-term
observations pin each term's factors separately; throughput alone fits them jointly.

``fit_factors`` minimises the squared log error of throughput plus, for per-term observations, of each measured
term: a deterministic coordinate search on a multiplicative grid (each factor in turn is scaled by 1/4 ... 4,
shrinking the steps when nothing improves), accepting a move only when the error drops. The reported error is the
mean relative error of tokens/s; should the log fit not lower it, the search minimises it directly, so the error after
is never above the error before. Factors that change no prediction of the observations (e.g. inter-node bandwidth on
one node) keep their value. A few hundred planner evaluations per factor and round: milliseconds to a second.

Calibrations are stored per cluster key (``cluster_key``: device type, nodes x devices per node, and the CPU
model on CPU clusters) in the ``calibrations`` table with the names of the factors the fit moved (``measured``);
``latest_factors(session, key)`` returns the newest factors, ``calibration_for`` the factors and where they came from
(``api.spec.PlanCalibration``, which ``POST /v1/plans`` returns).
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, cast

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from api.spec import Candidate, ClusterSpec, Layout, ModelConfig, PlanCalibration
from service.planner import TERM_FACTORS, Factors, default_factors, evaluate, resolve_device
from service.store.calibration_guards import (
    PHYSICAL_BOUNDS,
    held_out_errors,
    machine_load,
    max_free_factors,
    rejection,
)
from service.store.models import Calibration

log = logging.getLogger(__name__)

FIT_BOUNDS = PHYSICAL_BOUNDS  # factor -> (lower, upper, additive); physical, documented in calibration_guards
TERMS = tuple(TERM_FACTORS)
SCALES = (0.25, 0.5, 1 / 1.5, 1 / 1.2, 1.2, 1.5, 2.0, 4.0)
ZERO_SEEDS = (1e-4, 1e-3, 1e-2, 0.1, 1.0)
MAX_ROUNDS = 60
MIN_ERROR = 1e-3  # good enough: 0.1 % mean relative error
MIN_GAIN = 2e-3  # a round improving the error by less than 0.2 % (relative) refines the steps / stops
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
    """The newest calibration of the cluster that was not rejected (``calibration_guards``: rejected fits are
    kept for the record, never used)."""
    rows = session.scalars(
        select(Calibration)
        .where(Calibration.cluster_key == cluster_key)
        .order_by(Calibration.created_at.desc(), Calibration.id.desc())
        .limit(50)
    )
    return next((c for c in rows if not (c.factors or {}).get("_rejected")), None)


META_PREFIX = "_"  # keys of the stored factor JSON that describe the fit rather than a factor


def _values(stored: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in stored.items() if not k.startswith(META_PREFIX)}


def latest_factors(session: Session, cluster_key: str) -> Factors | None:
    """The newest calibrated factors for this cluster key, or None (then the planner uses its defaults)."""
    cal = latest_calibration(session, cluster_key)
    if cal is None:
        return None
    try:
        return Factors.from_dict(_values(cal.factors))
    except (TypeError, ValueError):
        log.warning("calibration %s for %s has unusable factors; ignoring it", cal.id, cluster_key)
        return None


def calibration_info(cal: Calibration | None, cluster_key: str | None) -> PlanCalibration:
    """Where a calibration's factors came from (``api.spec.PlanCalibration``); 'default' without one."""
    if cal is None:
        return PlanCalibration(source="default", cluster_key=cluster_key)
    stored = cal.factors or {}
    measured = stored.get("_measured")
    if measured is None:  # rows of the earlier format: every factor that differs from the defaults
        defaults = Factors().to_dict()
        measured = sorted(k for k, v in _values(stored).items() if defaults.get(k) != v)
    return PlanCalibration(
        source="measured",
        cluster_key=cluster_key,
        calibration_id=cal.id,
        measured_at=cal.created_at,
        measured=list(measured),
        observations=stored.get("_observations"),
        sweep_id=cal.sweep_id,
        error_before=cal.error_before,
        error_after=cal.error_after,
        defaults=[k for k in FIT_BOUNDS if k not in measured],
        held_out_error=(stored.get("_held_out") or {}).get("fitted"),
        load_avg=(stored.get("_load") or {}).get("load_avg"),
    )


_cache: dict[str, tuple[float, Factors | None, PlanCalibration]] = {}
_cache_lock = threading.Lock()


def calibration_for(
    session_factory: sessionmaker[Session] | None, cluster: ClusterSpec | None
) -> tuple[Factors | None, PlanCalibration]:
    """(latest calibrated factors or None, where they came from) for a planning cluster, with its own short session
    and a few seconds of caching (for the submission/plan paths). (None, default) when there is no cluster or no
    calibration, or the lookup fails."""
    if cluster is None or session_factory is None:
        return None, PlanCalibration()
    key = cluster_key(cluster)
    now = time.monotonic()
    with _cache_lock:
        hit = _cache.get(key)
        if hit is not None and now - hit[0] < FACTORS_CACHE_S:
            return hit[1], hit[2]
    try:
        with session_factory() as session:
            cal = latest_calibration(session, key)
            factors = latest_factors(session, key) if cal is not None else None
            info = calibration_info(cal if factors is not None else None, key)
    except Exception:
        log.exception("reading the calibration of %s failed", key)
        return None, PlanCalibration(cluster_key=key)
    with _cache_lock:
        _cache[key] = (now, factors, info)
    return factors, info


def factors_for(session_factory: sessionmaker[Session] | None, cluster: ClusterSpec | None) -> Factors | None:
    """``latest_factors`` for a planning cluster (cached; None without a cluster or a calibration)."""
    return calibration_for(session_factory, cluster)[0]


def forget_cached_factors() -> None:
    with _cache_lock:
        _cache.clear()


def store_calibration(
    session: Session,
    *,
    cluster_key: str,
    factors: Factors,
    error_before: float | None,
    error_after: float | None,
    sweep_id: str | None,
    measured: Sequence[str] | None = None,
    observations: int | None = None,
    meta: Mapping[str, Any] | None = None,
) -> Calibration:
    """Store a calibration: the factor values, and (under ``_``-keys) which factors the fit moved
    (``measured``), from how many observations, and ``meta`` (``_rejected``, ``_held_out``, ``_load``)."""
    stored: dict[str, Any] = factors.to_dict()
    if measured is not None:
        stored["_measured"] = list(measured)
    if observations is not None:
        stored["_observations"] = observations
    for k, v in (meta or {}).items():
        stored[META_PREFIX + k.lstrip(META_PREFIX)] = v
    cal = Calibration(
        cluster_key=cluster_key,
        factors=stored,
        error_before=error_before,
        error_after=error_after,
        sweep_id=sweep_id,
    )
    session.add(cal)
    session.flush()
    forget_cached_factors()
    return cal


# ---------------------------------------------------------------------------------------- observations
@dataclass(frozen=True)
class Observation:
    """One measured layout: what the planner needs to predict it, and what was measured. ``measured_tokens_per_s``
    is the whole step's throughput (None or 0: not measured); ``measured_terms_s`` maps step-time terms
    (``api.spec.StepTimeBreakdown`` names: compute, tp_comm, pp_comm, pp_bubble, dp_comm, optimizer, other) to
    measured seconds per step."""

    model: ModelConfig
    layout: Layout
    micro_batch_size: int
    global_batch_size: int
    measured_tokens_per_s: float | None = None
    precision: str = "fp32"
    activation_checkpointing: str = "none"
    label: str = ""
    measured_terms_s: Mapping[str, float] | None = None

    def terms(self) -> dict[str, float]:
        """The measured terms the fit uses (known names, positive seconds)."""
        return {k: float(v) for k, v in (self.measured_terms_s or {}).items() if k in TERMS and v and v > 0}


def predict(obs: Observation, cluster: ClusterSpec, factors: Factors) -> Candidate:
    """The planner's prediction of an observation: a meshrun run, priced with its own loop (``kernels`` eager)
    unless the cluster names a profile."""
    if cluster.kernels is None:
        cluster = cluster.model_copy(update={"kernels": "eager"})
    return evaluate(
        obs.model,
        cluster,
        layout=obs.layout,
        micro_batch_size=obs.micro_batch_size,
        global_batch_size=obs.global_batch_size,
        precision=obs.precision,
        activation_checkpointing=obs.activation_checkpointing,
        factors=factors,
        validate=False,
    )


def predict_tokens_per_s(obs: Observation, cluster: ClusterSpec, factors: Factors) -> float:
    return float(predict(obs, cluster, factors).tokens_per_s)


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
    term_error_before: dict[str, float] = field(default_factory=dict)
    term_error_after: dict[str, float] = field(default_factory=dict)

    def to_json(self, labels: Sequence[str] = ()) -> dict[str, Any]:
        changed = {k: v for k, v in self.factors.to_dict().items() if self.factors_before.to_dict().get(k) != v}
        out: dict[str, Any] = {
            "factors": self.factors.to_dict(),
            "factors_before": self.factors_before.to_dict(),
            "changed": changed,
            "fitted": self.fitted,
            "error_before": _finite(self.error_before),
            "error_after": _finite(self.error_after),
            "term_error_before": self.term_error_before,
            "term_error_after": self.term_error_after,
            "rank_correlation_before": self.rank_correlation_before,
            "rank_correlation": self.rank_correlation_after,
            "trials_used": len(self.measured),
            "evaluations": self.evaluations,
            "elapsed_s": self.elapsed_s,
        }
        if labels:
            out["points"] = [
                {"trial": lab, "measured_tokens_per_s": m, "predicted_before": pb, "predicted_after": pa}
                for lab, m, pb, pa in zip(labels, self.measured, self.predicted_before, self.predicted_after)
            ]
        return out


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


class _Preds:
    """Predictions of every observation under one set of factors: tokens/s and the terms that were measured."""

    def __init__(self, obs: Sequence[Observation], cands: Sequence[Candidate]):
        self.tps = [float(c.tokens_per_s) for c in cands]
        self.terms = [{k: float(getattr(c.step_time_s, k)) for k in o.terms()} for o, c in zip(obs, cands)]

    def key(self) -> tuple:
        return (tuple(self.tps), tuple(tuple(sorted(t.items())) for t in self.terms))


def _with(f: Factors, name: str, value: float) -> Factors:
    return replace(f, **cast(dict[str, Any], {name: value}))


def _log_sq(p: float, m: float) -> float:
    return math.log(p / m) ** 2 if p > 0 else math.log(1e3) ** 2


def _term_errors(obs: Sequence[Observation], preds: _Preds) -> dict[str, float]:
    """Mean relative error per measured term."""
    errs: dict[str, list[float]] = {}
    for o, pt in zip(obs, preds.terms):
        for k, m in o.terms().items():
            errs.setdefault(k, []).append(abs(pt.get(k, 0.0) - m) / m)
    return {k: statistics.fmean(v) for k, v in errs.items()}


def fit_factors(
    observations: Sequence[Observation],
    cluster: ClusterSpec,
    *,
    start: Factors | None = None,
    params: Iterable[str] | None = None,
    max_rounds: int = MAX_ROUNDS,
    max_evaluations: int = MAX_EVALUATIONS,
    max_free: int | None = None,
) -> FitResult:
    """Coordinate search for the factors that best predict the observations: least squares on the log of
    throughput (= log step time) and of each measured term, then checked on the mean relative error of tokens/s
    (the reported error; with per-term observations only, the mean relative error of the terms).

    ``start``: the factors the predictions were made with (default: the planner's defaults for the device).
    ``params``: which factors to fit (default: all in ``FIT_BOUNDS``); those no observation depends on are
    left alone. The result's error after is <= the error before (moves are accepted only when they improve).
    ``max_free``: the most factors to move (default ``calibration_guards.max_free_factors``: one fewer than the
    measured values); the ones that move the predictions most are kept. Every factor stays in ``FIT_BOUNDS``
    (a start outside them is clamped first).
    """
    t0 = time.perf_counter()
    obs = [o for o in observations if (o.measured_tokens_per_s and o.measured_tokens_per_s > 0) or o.terms()]
    if start is None:
        start = default_factors(is_cpu=resolve_device(cluster).is_cpu)
    for name, (lo, hi, _) in FIT_BOUNDS.items():  # an earlier, unguarded calibration: into physical bounds
        start = _with(start, name, min(hi, max(lo, getattr(start, name))))
    with_tps = [i for i, o in enumerate(obs) if o.measured_tokens_per_s and o.measured_tokens_per_s > 0]
    measured = [float(obs[i].measured_tokens_per_s or 0.0) for i in with_tps]
    n_eval = 0

    def preds(f: Factors) -> _Preds:
        nonlocal n_eval
        n_eval += len(obs)
        return _Preds(obs, [predict(o, cluster, f) for o in obs])

    def reported(p: _Preds) -> float:
        if with_tps:
            return mean_relative_error([p.tps[i] for i in with_tps], measured)
        errs = _term_errors(obs, p)
        return statistics.fmean(errs.values()) if errs else float("nan")

    def log_loss(p: _Preds) -> float:
        total = 0.0
        for i, o in enumerate(obs):
            if o.measured_tokens_per_s and o.measured_tokens_per_s > 0:
                total += _log_sq(p.tps[i], o.measured_tokens_per_s)
            terms = o.terms()
            if terms:
                total += statistics.fmean(_log_sq(p.terms[i].get(k, 0.0), m) for k, m in terms.items())
        return total / len(obs)

    if not obs:
        nan = float("nan")
        return FitResult(start, start, nan, nan, None, None, [], [], [], [], 0, time.perf_counter() - t0)
    before = preds(start)
    err_before = reported(before)

    names = [p for p in (params if params is not None else FIT_BOUNDS) if p in FIT_BOUNDS]
    # sensitivity: only factors that move some prediction
    active: list[str] = []
    moves: dict[str, float] = {}
    for name in names:
        lo, hi, additive = FIT_BOUNDS[name]
        cur = getattr(start, name)
        probe = min(hi, max(lo, cur * 2 if cur > 0 else (ZERO_SEEDS[2] if additive else lo)))
        if probe == cur:
            probe = max(lo, cur / 2)
        try:
            moved = preds(_with(start, name, probe))
        except ValueError:
            continue
        if moved.key() != before.key():
            active.append(name)
            moves[name] = abs(log_loss(moved) - log_loss(before)) + sum(
                abs(math.log(a / b)) for a, b in zip(moved.tps, before.tps) if a > 0 and b > 0
            )
    free = max_free if max_free is not None else max_free_factors(obs)
    if len(active) > free:  # no more free factors than the data supports: the most influential ones
        keep = set(sorted(active, key=lambda n: -moves[n])[:free])
        active = [n for n in active if n in keep]

    def search(loss_fn, budget: int) -> tuple[Factors, _Preds, float]:
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
                        f = _with(best_f, name, v)
                    except ValueError:
                        continue
                    p = preds(f)
                    e = loss_fn(p)
                    if e < best_err - 1e-12:
                        best_f, best_p, best_err, improved = f, p, e, True
            if best_err < MIN_ERROR**2:
                break
            if not improved or round_start - best_err < MIN_GAIN * round_start:
                if scales[-1] <= 1.05:
                    break
                scales = [sc**0.5 for sc in scales]  # finer steps around the optimum
        return best_f, best_p, best_err

    # least squares on log throughput / log term times: symmetric in over/under-prediction, keeps the ranking
    best_f, best_p, _ = search(log_loss, max_evaluations)
    best_err = reported(best_p)
    if best_err > err_before:  # rare: then minimise the reported error itself (never worse than before)
        best_f, best_p, best_err = search(reported, max_evaluations // 2)
    tps_before = [before.tps[i] for i in with_tps]
    tps_after = [best_p.tps[i] for i in with_tps]
    return FitResult(
        best_f,
        start,
        err_before,
        best_err,
        spearman(tps_before, measured),
        spearman(tps_after, measured),
        tps_before,
        tps_after,
        measured,
        [n for n in active if getattr(best_f, n) != getattr(start, n)] or active,
        n_eval,
        time.perf_counter() - t0,
        _term_errors(obs, before),
        _term_errors(obs, best_p),
    )


def calibrate(
    session: Session,
    *,
    cluster: ClusterSpec,
    observations: Sequence[Observation],
    start: Factors | None = None,
    sweep_id: str | None = None,
) -> tuple[FitResult, Calibration | None]:
    """Fit the factors to ``observations`` (throughput and/or per-term seconds) and store them for the cluster, so
    that later plans for it use them. Nothing is stored without usable observations (the Calibration is None)."""
    if start is None:
        start = latest_factors(session, cluster_key(cluster)) or default_factors(is_cpu=resolve_device(cluster).is_cpu)
    fit = fit_factors(observations, cluster, start=start)
    used = [o for o in observations if (o.measured_tokens_per_s and o.measured_tokens_per_s > 0) or o.terms()]
    if not used:
        return fit, None
    cal = store_calibration(
        session,
        cluster_key=cluster_key(cluster),
        factors=fit.factors,
        error_before=_finite(fit.error_before),
        error_after=_finite(fit.error_after),
        sweep_id=sweep_id,
        measured=fit.fitted,
        observations=len(used),
        meta=guard(used, cluster, fit),
    )
    return fit, cal


def guard(observations: Sequence[Observation], cluster: ClusterSpec, fit: FitResult) -> dict[str, Any]:
    """What ``calibration_guards`` says of a fit: its leave-one-out check over the throughput observations
    (``held_out``: each trial predicted by a fit to the others, against the start factors' error on it), the
    reason it is rejected (``rejected``, absent when accepted) and the host's load (``load``)."""
    tps = [o for o in observations if o.measured_tokens_per_s and o.measured_tokens_per_s > 0]
    start = fit.factors_before

    def err(o: Observation, f: Factors) -> float:
        m = float(o.measured_tokens_per_s or 0.0)
        return abs(predict_tokens_per_s(o, cluster, f) - m) / m

    def held_out(i: int) -> float:
        rest = tps[:i] + tps[i + 1 :]
        return err(tps[i], fit_factors(rest, cluster, start=start, max_evaluations=MAX_EVALUATIONS // 4).factors)

    checked = held_out_errors(len(tps), held_out, lambda i: err(tps[i], start))
    meta: dict[str, Any] = {"load": machine_load()}
    if checked is not None:
        meta["held_out"] = {"fitted": checked[0], "defaults": checked[1], "trials": checked[2]}
    why = rejection(checked)
    if why:
        meta["rejected"] = why
        log.warning("calibration for %s rejected: %s", cluster_key(cluster), why)
    return meta

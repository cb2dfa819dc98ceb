"""Calibration: fitting the planner's factors to measurements generated from known factors lowers its error."""

from __future__ import annotations

import math

import pytest
from sqlalchemy.orm import Session

from api.spec import ClusterSpec, Layout, ModelSpec
from api.spec.validation import resolve_model
from service.planner import Factors
from service.planner.factors import CPU_FACTORS
from service.store.calibrations import (
    Observation,
    calibration_for,
    cluster_key,
    factors_for,
    fit_factors,
    latest_factors,
    mean_relative_error,
    predict,
    predict_tokens_per_s,
    spearman,
    store_calibration,
)
from service.store.db import make_engine, make_sessionmaker
from service.store.models import Base

CLUSTER = ClusterSpec(device="cpu", gpus_per_node=6, nodes=1, peak_flops_per_s=20e9, memory_bytes=2 << 30)
TRUE = Factors(
    compute_efficiency=0.35,
    launch_scale=6.0,
    tp_latency_scale=8.0,
    dp_bandwidth_efficiency=0.3,
    pp_latency_scale=5.0,
    dp_overlap_fraction=0.1,
    step_overhead_s=0.03,
    flash_attention=False,
)
LAYOUTS = [
    (Layout(dp=2), 1),
    (Layout(dp=2), 2),
    (Layout(tp=2), 1),
    (Layout(tp=2), 2),
    (Layout(pp=2), 1),
    (Layout(pp=2), 2),
    (Layout(dp=2, tp=2), 1),
    (Layout(dp=2, tp=2), 2),
    (Layout(dp=4), 1),
]


def synthetic(factors: Factors, *, noise: float = 0.0) -> list[Observation]:
    cfg = resolve_model(ModelSpec(name="gpt", preset="tiny"))
    out = []
    for i, (lay, mb) in enumerate(LAYOUTS):
        probe = Observation(cfg, lay, mb, 8, 1.0)
        wobble = 1 + noise * math.sin(7.0 * i)  # deterministic "measurement noise"
        out.append(Observation(cfg, lay, mb, 8, predict_tokens_per_s(probe, CLUSTER, factors) * wobble, label=str(i)))
    return out


def test_fit_recovers_known_factors_and_lowers_the_error():
    obs = synthetic(TRUE)
    fit = fit_factors(obs, CLUSTER, start=CPU_FACTORS)
    assert fit.error_before > 0.5  # the defaults are far off
    assert fit.error_after < 0.05 and fit.error_after < fit.error_before / 10
    assert fit.rank_correlation_after >= fit.rank_correlation_before
    assert fit.rank_correlation_after > 0.9
    assert "compute_efficiency" in fit.fitted
    assert fit.elapsed_s < 10
    preds = [predict_tokens_per_s(o, CLUSTER, fit.factors) for o in obs]
    assert mean_relative_error(preds, [o.measured_tokens_per_s for o in obs]) == pytest.approx(fit.error_after)


def test_fit_with_noise_still_improves_and_never_gets_worse():
    obs = synthetic(TRUE, noise=0.15)
    fit = fit_factors(obs, CLUSTER, start=CPU_FACTORS)
    assert fit.error_after < fit.error_before
    assert fit.error_after < 0.2
    # starting at the truth, a fit cannot make it worse
    again = fit_factors(obs, CLUSTER, start=TRUE)
    assert again.error_after <= again.error_before


def test_factors_no_measurement_depends_on_are_left_alone():
    obs = [o for o in synthetic(TRUE) if o.layout.tp == 1 and o.layout.pp == 1 and o.layout.dp == 2]
    fit = fit_factors(obs, CLUSTER, start=CPU_FACTORS)
    for name in ("tp_latency_scale", "tp_bandwidth_efficiency", "pp_latency_scale", "bubble_scale"):
        assert name not in fit.fitted
        assert getattr(fit.factors, name) == getattr(CPU_FACTORS, name)
    assert fit.error_after < fit.error_before


def test_per_term_observations_fit_each_term_and_lower_its_error():
    """Measured seconds per term (what a run's measured breakdown gives) pin the factors of that term."""
    cfg = resolve_model(ModelSpec(name="gpt", preset="tiny"))
    obs = []
    for i, (lay, mb) in enumerate(LAYOUTS):
        probe = Observation(cfg, lay, mb, 8)
        truth = predict(probe, CLUSTER, TRUE).step_time_s
        terms = {
            k: getattr(truth, k)
            for k in ("compute", "tp_comm", "pp_comm", "pp_bubble", "dp_comm")
            if getattr(truth, k) > 0
        }
        obs.append(Observation(cfg, lay, mb, 8, measured_terms_s=terms, label=str(i)))
    fit = fit_factors(obs, CLUSTER, start=CPU_FACTORS)
    assert fit.measured == []  # no throughput given: the terms alone
    for term, before in fit.term_error_before.items():
        assert fit.term_error_after[term] <= before, term
    assert fit.term_error_after["compute"] < 0.1 and fit.term_error_after["tp_comm"] < 0.15
    assert {"compute_efficiency", "tp_latency_scale"} <= set(fit.fitted)
    # throughput and terms together
    both = [
        Observation(
            o.model,
            o.layout,
            o.micro_batch_size,
            8,
            predict_tokens_per_s(o, CLUSTER, TRUE),
            measured_terms_s=o.measured_terms_s,
        )
        for o in obs
    ]
    fit2 = fit_factors(both, CLUSTER, start=CPU_FACTORS)
    assert fit2.error_after < 0.1 < fit2.error_before


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(4.5 / math.sqrt(22.5))  # tied ranks averaged
    assert spearman([1], [1]) is None and spearman([1, 1], [2, 3]) is None


def test_cluster_key_and_latest_factors(tmp_path):
    assert cluster_key(ClusterSpec(device="H100", gpus_per_node=8, nodes=2)) == "H100/2x8"
    assert cluster_key(CLUSTER, cpu_model="Xeon X").startswith("cpu/1x6/Xeon X")
    engine = make_engine(f"sqlite:///{tmp_path}/c.db")
    Base.metadata.create_all(engine)
    factory = make_sessionmaker(engine)
    key = cluster_key(CLUSTER)
    with Session(engine) as s:
        assert latest_factors(s, key) is None
        store_calibration(s, cluster_key=key, factors=CPU_FACTORS, error_before=1.0, error_after=0.5, sweep_id=None)
        store_calibration(s, cluster_key=key, factors=TRUE, error_before=0.5, error_after=0.1, sweep_id=None)
        store_calibration(
            s, cluster_key="H100/1x8", factors=CPU_FACTORS, error_before=None, error_after=None, sweep_id=None
        )
        s.commit()
        assert latest_factors(s, key) == TRUE
    assert factors_for(factory, CLUSTER) == TRUE
    assert factors_for(factory, None) is None
    factors, info = calibration_for(factory, CLUSTER)
    assert factors == TRUE and info.source == "measured" and info.error_after == 0.1
    assert "compute_efficiency" in info.measured and info.measured_at is not None  # earlier rows: what differs
    with Session(engine) as s:
        store_calibration(
            s,
            cluster_key=key,
            factors=TRUE,
            error_before=0.3,
            error_after=0.05,
            sweep_id=None,
            measured=["launch_scale"],
            observations=4,
        )
        s.commit()
    factors, info = calibration_for(factory, CLUSTER)
    assert factors == TRUE and info.measured == ["launch_scale"] and info.observations == 4


def test_calibrate_stores_per_term_fits_that_plans_then_use(tmp_path):
    from service.store.calibrations import calibrate

    engine = make_engine(f"sqlite:///{tmp_path}/c.db")
    Base.metadata.create_all(engine)
    cfg = resolve_model(ModelSpec(name="gpt", preset="tiny"))
    obs = []
    for lay, mb in LAYOUTS:
        truth = predict(Observation(cfg, lay, mb, 8), CLUSTER, TRUE).step_time_s
        obs.append(Observation(cfg, lay, mb, 8, measured_terms_s={"compute": truth.compute, "tp_comm": truth.tp_comm}))
    with Session(engine) as s:
        fit, cal = calibrate(s, cluster=CLUSTER, observations=obs)
        s.commit()
        assert cal is not None and fit.term_error_after["compute"] < fit.term_error_before["compute"]
        assert cal.factors["_observations"] == len(obs) and "compute_efficiency" in cal.factors["_measured"]
        none_fit, none_cal = calibrate(s, cluster=CLUSTER, observations=[Observation(cfg, Layout(dp=2), 1, 8)])
        assert none_cal is None
    factors, info = calibration_for(make_sessionmaker(engine), CLUSTER)
    assert info.source == "measured" and factors == fit.factors

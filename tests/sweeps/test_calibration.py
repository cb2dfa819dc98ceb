"""Calibration: fitting the planner's factors to measurements generated from known factors lowers its error."""

from __future__ import annotations

import math

import pytest
from sqlalchemy.orm import Session

from api.schemas import ClusterSpec, Layout, ModelSpec
from api.validation import resolve_model
from service.calibration import (Observation, cluster_key, factors_for, fit_factors, latest_factors,
                                 mean_relative_error, predict_tokens_per_s, spearman, store_calibration)
from service.db import make_engine, make_sessionmaker
from service.models import Base
from service.planner import Factors
from service.planner.factors import CPU_FACTORS

CLUSTER = ClusterSpec(device="cpu", gpus_per_node=6, nodes=1, peak_flops_per_s=20e9, memory_bytes=2 << 30)
TRUE = Factors(gemm_fraction=0.25, intra_bandwidth_fraction=0.1, dp_overlap_fraction=0.1, intra_latency_s=1e-3,
               layer_overhead_s=4e-3, step_overhead_s=0.03, flash_attention=False, memory_overhead_fraction=0.1)
LAYOUTS = [(Layout(dp=2), 1), (Layout(dp=2), 2), (Layout(tp=2), 1), (Layout(tp=2), 2), (Layout(pp=2), 1),
           (Layout(pp=2), 2), (Layout(dp=2, tp=2), 1), (Layout(dp=2, tp=2), 2), (Layout(dp=4), 1)]


def synthetic(factors: Factors, *, noise: float = 0.0) -> list[Observation]:
    cfg = resolve_model(ModelSpec(name="gpt", preset="tiny"))
    out = []
    for i, (lay, mb) in enumerate(LAYOUTS):
        probe = Observation(cfg, lay, mb, 8, 1.0)
        wobble = 1 + noise * math.sin(7.0 * i)  # deterministic "measurement noise"
        out.append(Observation(cfg, lay, mb, 8, predict_tokens_per_s(probe, CLUSTER, factors) * wobble,
                               label=str(i)))
    return out


def test_fit_recovers_known_factors_and_lowers_the_error():
    obs = synthetic(TRUE)
    fit = fit_factors(obs, CLUSTER, start=CPU_FACTORS)
    assert fit.error_before > 0.5  # the defaults are far off
    assert fit.error_after < 0.05 and fit.error_after < fit.error_before / 10
    assert fit.rank_correlation_after >= fit.rank_correlation_before
    assert fit.rank_correlation_after > 0.9
    assert "gemm_fraction" in fit.fitted
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
    assert "inter_bandwidth_fraction" not in fit.fitted
    assert fit.factors.inter_bandwidth_fraction == CPU_FACTORS.inter_bandwidth_fraction
    assert fit.error_after < fit.error_before


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
        store_calibration(s, cluster_key="H100/1x8", factors=CPU_FACTORS, error_before=None, error_after=None,
                          sweep_id=None)
        s.commit()
        assert latest_factors(s, key) == TRUE
    assert factors_for(factory, CLUSTER) == TRUE
    assert factors_for(factory, None) is None

"""Calibration guards (issue 32): free factors <= measured values - 1, physical bounds, leave-one-out rejection
(rejected fits are stored and never used), machine load, and the plan naming its calibration."""

from __future__ import annotations

import math

import pytest
from sqlalchemy.orm import Session

from api.spec import Layout, ModelSpec
from api.spec.validation import resolve_model
from service.planner.factors import CPU_FACTORS
from service.store.calibration_guards import (
    PHYSICAL_BOUNDS,
    held_out_errors,
    machine_load,
    max_free_factors,
    measured_values,
    rejection,
)
from service.store.calibrations import (
    Observation,
    calibrate,
    calibration_for,
    cluster_key,
    fit_factors,
    latest_calibration,
    store_calibration,
)
from service.store.db import make_engine, make_sessionmaker
from service.store.models import Base
from tests.sweeps.test_calibration import CLUSTER, TRUE, synthetic

CFG = resolve_model(ModelSpec(name="gpt", preset="tiny"))


def test_free_factors_are_one_fewer_than_the_measured_values():
    three = synthetic(TRUE)[:3]
    assert measured_values(three) == 3 and max_free_factors(three) == 2
    terms = [Observation(CFG, Layout(dp=2), 1, 8, measured_terms_s={"compute": 1.0, "dp_comm": 0.2, "other": 0.1})]
    assert measured_values(terms) == 3 and max_free_factors(terms) == 2
    both = [Observation(CFG, Layout(dp=2), 1, 8, 100.0, measured_terms_s={"compute": 1.0})]
    assert measured_values(both) == 2 and max_free_factors(both) == 1
    assert max_free_factors(three[:1]) == 1  # one trial: still one factor (a single scale)
    fit = fit_factors(three, CLUSTER, start=CPU_FACTORS)
    moved = [k for k in PHYSICAL_BOUNDS if getattr(fit.factors, k) != getattr(CPU_FACTORS, k)]
    assert len(moved) <= 2 and len(fit.fitted) <= 2
    assert len(fit_factors(synthetic(TRUE), CLUSTER, start=CPU_FACTORS).fitted) <= 8


def test_a_fit_to_absurd_trials_stays_within_physical_bounds():
    """Trials measured 100x slower than any physics (a loaded machine): every factor stays in its bounds."""
    slow = [
        Observation(o.model, o.layout, o.micro_batch_size, 8, o.measured_tokens_per_s / 100) for o in synthetic(TRUE)
    ]
    fit = fit_factors(slow, CLUSTER, start=CPU_FACTORS)
    for name, (lo, hi, _) in PHYSICAL_BOUNDS.items():
        assert lo <= getattr(fit.factors, name) <= hi, name
    assert fit.factors.optimizer_scale <= 4 and fit.factors.dp_latency_scale <= 20 and fit.factors.launch_scale >= 0.1
    # an earlier, unguarded calibration as the start is clamped into the bounds first
    wild = CPU_FACTORS.__class__(**{**CPU_FACTORS.to_dict(), "optimizer_scale": 33.0, "dp_latency_scale": 147.0})
    again = fit_factors(synthetic(TRUE)[:2], CLUSTER, start=wild)
    assert again.factors.optimizer_scale <= 4 and again.factors.dp_latency_scale <= 20


def test_held_out_errors_and_rejection_by_hand():
    fits, defaults = [0.10, 0.30, 0.20], [0.25, 0.25, 0.25]
    got = held_out_errors(3, lambda i: fits[i], lambda i: defaults[i])
    assert got == pytest.approx((0.2, 0.25, 3))
    assert rejection(got) is None  # 20 % held out against the defaults' 25 %: kept
    same = held_out_errors(3, lambda i: fits[i], lambda i: fits[i])
    assert "not below the defaults' 20.0%" in rejection(same)  # no gain: rejected
    assert held_out_errors(1, lambda i: 0.0, lambda i: 1.0) is None and rejection(None) is None
    assert held_out_errors(2, lambda i: None if i else 0.1, lambda i: 0.3) == pytest.approx((0.1, 0.3, 1))
    load = machine_load()
    assert len(load["load_avg"]) == 3 and load["cpus"] >= 1


def _db(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path}/g.db")
    Base.metadata.create_all(engine)
    return engine


def test_a_fit_that_does_not_beat_the_defaults_held_out_is_stored_rejected_and_never_used(tmp_path):
    engine = _db(tmp_path)
    key = cluster_key(CLUSTER)
    # trials the defaults predict exactly, each with its own unexplainable wobble: no fit predicts a held-out one
    exact = synthetic(CPU_FACTORS)[:4]
    noisy = [
        Observation(o.model, o.layout, o.micro_batch_size, 8, o.measured_tokens_per_s * (1 + 0.3 * math.sin(3.0 * i)))
        for i, o in enumerate(exact)
    ]
    with Session(engine) as s:
        good_fit, good = calibrate(s, cluster=CLUSTER, observations=synthetic(TRUE), start=CPU_FACTORS)
        s.commit()
        assert good is not None and "_rejected" not in good.factors
        assert good.factors["_held_out"]["fitted"] < good.factors["_held_out"]["defaults"]
        assert good.factors["_held_out"]["trials"] == 9 and len(good.factors["_load"]["load_avg"]) == 3
        bad_fit, bad = calibrate(s, cluster=CLUSTER, observations=noisy, start=CPU_FACTORS)
        s.commit()
        assert bad is not None and bad.id > good.id
        assert bad.factors["_held_out"]["fitted"] >= bad.factors["_held_out"]["defaults"]
        assert "leave-one-out" in bad.factors["_rejected"]
        assert latest_calibration(s, key).id == good.id  # the rejected one is kept out of plans
    factors, info = calibration_for(make_sessionmaker(engine), CLUSTER)
    assert factors == good_fit.factors and info.calibration_id == good.id and info.used == f"calibration {good.id}"
    assert info.held_out_error == pytest.approx(good.factors["_held_out"]["fitted"])
    assert set(info.defaults) == set(PHYSICAL_BOUNDS) - set(info.measured) and info.load_avg is not None


def test_only_rejected_calibrations_mean_defaults(tmp_path):
    engine = _db(tmp_path)
    with Session(engine) as s:
        store_calibration(
            s, cluster_key=cluster_key(CLUSTER), factors=TRUE, error_before=0.5, error_after=0.1, sweep_id=None,
            meta={"rejected": "held-out error 40% is not below the defaults' 20%"},
        )  # fmt: skip
        s.commit()
    factors, info = calibration_for(make_sessionmaker(engine), CLUSTER)
    assert factors is None and info.source == "default" and info.used == "defaults"

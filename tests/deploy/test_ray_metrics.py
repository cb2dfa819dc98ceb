"""workers/ray_metrics.py: cheap import, tags, never raises into training."""

from __future__ import annotations

import logging
import subprocess
import sys
import types

import pytest

from workers import ray_metrics as rm


def test_import_does_not_import_ray_or_torch():
    code = "import sys, workers.ray_metrics; print(sorted(m for m in ('ray', 'torch') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


class _FakeGauge:
    points: list = []

    def __init__(self, name, description="", tag_keys=()):
        self.name, self.tag_keys = name, tag_keys

    def set(self, value, tags=None):
        assert set(tags) == set(self.tag_keys)
        _FakeGauge.points.append((self.name, value, dict(tags)))


@pytest.fixture
def fake_ray(monkeypatch):
    ray = types.ModuleType("ray")
    ray.is_initialized = lambda: True
    util = types.ModuleType("ray.util")
    metrics = types.ModuleType("ray.util.metrics")
    metrics.Gauge = _FakeGauge
    monkeypatch.setitem(sys.modules, "ray", ray)
    monkeypatch.setitem(sys.modules, "ray.util", util)
    monkeypatch.setitem(sys.modules, "ray.util.metrics", metrics)
    monkeypatch.setattr(rm, "_gauges", None)
    _FakeGauge.points = []
    yield
    rm._gauges = None


def test_publish_sets_one_gauge_per_finite_field_tagged_by_run(fake_ray):
    pub = rm.RunMetricsPublisher("run-1", "tiny", 3)
    pub.publish({"step": 7, "loss": 2.5, "tokens_per_s": 1000.0, "mfu": float("nan"), "lr": None,
                 "peak_memory_bytes": 10, "unknown": 1.0, "grad_norm": "n/a"})
    got = {name: (v, tags) for name, v, tags in _FakeGauge.points}
    assert set(got) == {"meshrun_train_step", "meshrun_train_loss", "meshrun_train_tokens_per_second",
                        "meshrun_train_peak_memory_bytes"}
    assert got["meshrun_train_loss"] == (2.5, {"run_id": "run-1", "run_name": "tiny", "rank": "3"})
    assert pub.published == 1 and pub.enabled


def test_per_rank_peak_memory_is_published_once_per_rank(fake_ray):
    pub = rm.RunMetricsPublisher("run-4", "tiny", 0)
    pub.publish({"step": 3, "peak_memory_bytes": 30, "peak_memory_bytes_per_rank": [10, 30, 20]})
    mem = {tags["rank"]: v for name, v, tags in _FakeGauge.points if name == "meshrun_train_peak_memory_bytes"}
    assert mem == {"0": 10.0, "1": 30.0, "2": 20.0}  # not the aggregate under rank 0
    steps = [(v, tags["rank"]) for name, v, tags in _FakeGauge.points if name == "meshrun_train_step"]
    assert steps == [(3.0, "0")]


def test_a_failing_gauge_is_logged_once_and_never_raises(fake_ray, monkeypatch, caplog):
    def broken(self, value, tags=None):
        raise RuntimeError("metrics agent gone")

    monkeypatch.setattr(_FakeGauge, "set", broken)
    pub = rm.RunMetricsPublisher("run-2", "tiny", 0)
    with caplog.at_level(logging.WARNING, logger=rm.__name__):
        for step in range(5):
            pub.publish({"step": step, "loss": 1.0})
    warnings = [r for r in caplog.records if "metrics agent gone" in r.getMessage()]
    assert len(warnings) == 1 and "run-2" in warnings[0].getMessage()
    assert not pub.enabled and pub.published == 0


def test_without_ray_publish_is_a_silent_no_op(monkeypatch):
    monkeypatch.delitem(sys.modules, "ray", raising=False)
    pub = rm.RunMetricsPublisher("run-3", "tiny", 0)
    pub.publish({"step": 1, "loss": 1.0})
    assert not pub.enabled and pub.published == 0
    assert "ray" not in sys.modules  # publish did not import ray


def test_prometheus_names_carry_rays_prefix():
    assert rm.PROMETHEUS_NAMES["tokens_per_s"] == "ray_meshrun_train_tokens_per_second"
    assert all(name.startswith("ray_meshrun_train_") for name in rm.PROMETHEUS_NAMES.values())

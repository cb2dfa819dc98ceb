"""Local SGD / DiLoCo (``layout.sync``) in the worker loop: tiny GPT, fp32, gloo, one spawned world.

- DiLoCo with H = 1 and an outer SGD with lr 1 and no momentum, over an inner SGD, equals synchronous data
  parallelism (the mean of the replicas' SGD steps is the SGD step of the mean gradient);
- DiLoCo with H = 8 (Nesterov outer) learns, and the bytes it sends across groups per step are 1/8 of
  synchronous DP's (measured: DDP's gradient buckets vs the averagings' buffers);
- local SGD with tp 2 inside each replica learns and reports the replicas' divergence before each sync.
"""

from __future__ import annotations

import pytest

from tests.workers.dist_utils import run_world, tiny_spec

pytestmark = pytest.mark.slow

FP32_TOL = 1e-5
SGD = {
    "optimizer": {
        "name": "sgd",
        "lr": 0.3,
        "momentum": 0.9,
        "grad_clip": None,
        "warmup_steps": 0,
        "schedule": "constant",
        "weight_decay": 0.0,
    }
}
H1 = {"sync": "diloco", "sync_every_steps": 1, "outer_optimizer": {"name": "sgd", "lr": 1.0, "momentum": 0.0}}


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    specs = {
        "sync_sgd": tiny_spec(dp=2, **SGD),
        "diloco_h1_sgd": tiny_spec(dp=2, layout=H1, **SGD),
        "sync_adamw": tiny_spec(dp=2, steps=4),
        "diloco_h8": tiny_spec(dp=2, steps=8, layout={"sync": "diloco", "sync_every_steps": 8}),
        "local_sgd_tp2": tiny_spec(dp=2, tp=2, steps=4, layout={"sync": "local_sgd", "sync_every_steps": 2}),
    }
    out = run_world(2, [s for k, s in specs.items() if k != "local_sgd_tp2"])
    out += run_world(4, [specs["local_sgd_tp2"]])
    return dict(zip(specs, out))


def test_diloco_h1_outer_sgd_lr1_equals_synchronous_training(results) -> None:
    a, b = results["sync_sgd"]["losses"], results["diloco_h1_sgd"]["losses"]
    assert len(a) == len(b) == 4
    assert max(abs(x - y) for x, y in zip(a, b)) < FP32_TOL
    assert a[-1] < a[0]


def test_diloco_h8_learns_and_sends_one_eighth_of_sync_dp_bytes(results) -> None:
    d, s = results["diloco_h8"], results["sync_adamw"]
    assert d["losses"][-1] < d["losses"][0]
    sync_bytes = sum(r["cross_group_bytes"] for r in s["rows"]) / len(s["rows"])
    dil_bytes = sum(r["cross_group_bytes"] for r in d["rows"]) / len(d["rows"])
    assert sync_bytes > 0
    assert dil_bytes / sync_bytes == pytest.approx(1 / 8, rel=0.02)
    synced = [r["step"] for r in d["rows"] if r.get("replica_divergence") is not None]
    assert synced == [8]
    assert all(r["cross_group_bytes"] == 0 for r in d["rows"] if r["step"] not in synced)


def test_local_sgd_with_tp_inside_each_replica(results) -> None:
    r = results["local_sgd_tp2"]
    assert r["losses"][-1] < r["losses"][0]
    div = [row["replica_divergence"] for row in r["rows"] if row.get("replica_divergence") is not None]
    assert len(div) == 2 and all(0 < v < 1 for v in div)

"""The planner prices layout.sync: local SGD / DiLoCo send 1/H of synchronous DP's averaging traffic, the
parameter servers move pushes and pulls over the network tier (hidden under compute when staleness is allowed),
and a synchronous layout whose data-parallel traffic dominates over a slow link is told which mode pays off."""

from __future__ import annotations

import pytest

from api.spec import ClusterSpec, Layout, ModelSpec
from api.spec.validation import resolve_model
from service.planner import evaluate

CFG = resolve_model(
    ModelSpec(name="gpt", preset=None, n_layers=24, d_model=2048, n_heads=16, vocab_size=32000, seq_len=2048)
)
SLOW = ClusterSpec(device="H100", gpus_per_node=8, nodes=4, inter_node_bandwidth_bytes_per_s=1.25e9)  # 10 Gb/s
FAST = ClusterSpec(device="H100", gpus_per_node=8, nodes=4)


def _eval(cluster: ClusterSpec, precision: str = "bf16", validate: bool = True, **layout):
    return evaluate(CFG, cluster, layout=Layout(**layout), micro_batch_size=4, global_batch_size=256,
                    precision=precision, validate=validate)


def test_periodic_averaging_costs_one_hth_of_the_replicas_all_reduce() -> None:
    base = dict(dp=4, tp=8)
    h1 = _eval(SLOW, **base, sync="local_sgd", sync_every_steps=1).step_time_s.dp_comm
    h8 = _eval(SLOW, **base, sync="local_sgd", sync_every_steps=8).step_time_s.dp_comm
    assert h8 == pytest.approx(h1 / 8, rel=1e-6)
    assert h8 < _eval(SLOW, **base).step_time_s.dp_comm / 4


def test_parameter_servers_are_priced_on_the_network_and_hidden_by_staleness() -> None:
    base = dict(dp=32, sync="async_ps", precision="fp32")
    s0 = _eval(SLOW, **base, max_staleness=0).step_time_s
    s4 = _eval(SLOW, **base, max_staleness=4).step_time_s
    assert s0.dp_comm == pytest.approx(s0.dp_comm_total) and s0.dp_comm > 0
    assert s4.dp_comm_total == pytest.approx(s0.dp_comm_total) and s4.dp_comm < s0.dp_comm
    # (several servers need optimizer.grad_clip null, which the layout planner does not see)
    more = _eval(SLOW, **base, max_staleness=0, ps_shards=8, validate=False).step_time_s
    assert more.dp_comm < s0.dp_comm  # more servers share the workers' traffic
    assert _eval(FAST, **base, max_staleness=0).step_time_s.dp_comm < s0.dp_comm  # a faster network tier


def test_a_sync_layout_on_a_slow_link_is_told_when_the_modes_pay_off() -> None:
    slow = _eval(SLOW, dp=32, tp=1, zero_stage=0)
    assert "layout.sync diloco" in slow.reason
    fast_small = _eval(ClusterSpec(device="H100", gpus_per_node=8, nodes=1), dp=8, tp=1, zero_stage=0)
    assert "layout.sync" not in fast_small.reason

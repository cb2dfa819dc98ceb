"""model.attention, kernel profiles and step-time intervals (issue 32), with hand-derived numbers."""

from __future__ import annotations

import math
import statistics

import pytest

from api.spec import ClusterSpec, Layout, ModelSpec, PlanRequest
from api.spec.validation import resolve_model
from service.planner import DEVICES, evaluate, search
from service.planner import uncertainty as U
from service.planner.compute import Env, optimizer_time
from service.planner.factors import Factors
from service.planner.kernels import attention_time, gemm_time
from service.planner.profiles import EAGER, MEGATRON, PROFILES
from service.planner.search import ties

H100 = DEVICES["H100"]
SMALL = dict(name="gpt", preset=None, n_layers=2, d_model=64, n_heads=4, vocab_size=256, seq_len=128)


def _one(attention: str = "flash", kernels: str | None = None, **kw):
    cfg = resolve_model(ModelSpec(**SMALL, attention=attention))
    cluster = ClusterSpec(device="H100", gpus_per_node=1, kernels=kernels)
    args = dict(layout=Layout(), micro_batch_size=2, global_batch_size=2, precision="bf16") | kw
    return evaluate(cfg, cluster, **args)


def test_eager_attention_keeps_the_scores_for_backward():
    """Korthikanti: unfused attention keeps 5 bytes per score (softmax 2, dropout mask 1, dropout output 2), so a
    layer holds 5 a s^2 b more bytes than with flash; meshrun's eager loop (no dropout) keeps the probabilities,
    2 bytes. Here L=2, a=4, s=128, b=2."""
    flash = _one("flash").memory_bytes.activations
    assert _one("eager").memory_bytes.activations - flash == 2 * 5 * 4 * 128**2 * 2 == 1_310_720
    eager_loop = _one("eager", "eager").memory_bytes.activations - _one("flash", "eager").memory_bytes.activations
    assert eager_loop == 2 * 2 * 4 * 128**2 * 2 == 524_288
    # selective recompute drops the scores again (the attention core is recomputed)
    sel = dict(activation_checkpointing="selective")
    assert _one("eager", **sel).memory_bytes.activations == _one("flash", **sel).memory_bytes.activations
    assert _one("eager").attention == "eager" and _one().attention == "flash"


def test_unfused_attention_time_is_two_batched_gemms_and_a_memory_bound_softmax():
    bh, s, d = 8, 1024, 64
    kw = dict(peak=989e12, elem_bytes=2, batch=bh)
    gemms = gemm_time(H100, s, s, d, **kw) + gemm_time(H100, s, d, s, **kw)
    scores = bh * s * s * 2  # 16 MiB of bf16 scores
    assert scores == 16_777_216
    for passes, (f_pass, b_pass) in ((MEGATRON.softmax_passes, (4.5, 5.5)), (EAGER.softmax_passes, (4, 5))):
        assert passes == (f_pass, b_pass)
        fwd, bwd = attention_time(
            H100, batch_heads=bh, s=s, d=d, peak=989e12, flash=False, act_bytes=2, softmax_passes=passes
        )
        assert fwd == pytest.approx(gemms + 2.4e-6 + scores * f_pass / 2.93e12, rel=1e-12)
        assert bwd == pytest.approx(2 * gemms + 2 * 2.4e-6 + scores * b_pass / 2.93e12, rel=1e-12)
    # the fused (megatron) forward softmax: 4.5 passes of 16 MiB at 2.93 TB/s = 25.8 us, plus 2.4 us fixed
    assert 2.4e-6 + scores * 4.5 / 2.93e12 == pytest.approx(28.17e-6, rel=1e-3)


def test_eager_attention_is_slower_and_recomputes_more_than_flash():
    flash, eager = _one("flash").step_time_s, _one("eager").step_time_s
    assert eager.compute > flash.compute
    cfg = resolve_model(ModelSpec(name="gpt", preset="1.3b", seq_len=2048, attention="eager"))
    kw = dict(layout=Layout(), micro_batch_size=4, global_batch_size=4, precision="bf16")
    cl = ClusterSpec(device="H100", gpus_per_node=1)
    none = evaluate(cfg, cl, activation_checkpointing="none", **kw).step_time_s.total
    sel = evaluate(cfg, cl, activation_checkpointing="selective", **kw).step_time_s.total
    flash_cfg = cfg.model_copy(update={"attention": "flash"})
    sel_flash = evaluate(flash_cfg, cl, activation_checkpointing="selective", **kw).step_time_s.total
    none_flash = evaluate(flash_cfg, cl, activation_checkpointing="none", **kw).step_time_s.total
    assert sel > none and sel_flash == none_flash  # flash recomputes the scores in its backward anyway


def test_the_eager_profile_adds_meshruns_optimizer_bytes_and_host_time():
    env = {p: Env(H100, Factors(), 989e12, 2, 8, PROFILES[p]) for p in ("megatron", "eager")}
    diff = optimizer_time(env["eager"], 1e9) - optimizer_time(env["megatron"], 1e9)
    # (40 - 20) launches x 2.4 us + 1e9 params x (48 - 36) bytes / 2.93 TB/s
    assert diff == pytest.approx(20 * 2.4e-6 + 12e9 / 2.93e12, rel=1e-12)
    # host time per step and per micro-batch: 2 ms + 4 micro-batches x 0.3 ms
    other = _one(kernels="eager", global_batch_size=8).step_time_s.other
    assert other == pytest.approx(2e-3 + 4 * 0.3e-3) and _one(global_batch_size=8).step_time_s.other == 0.0
    assert _one(kernels="eager").step_time_s.total > _one(kernels="megatron").step_time_s.total


def test_intervals_rest_on_their_basis_and_widen_outside_it():
    t = _one(kernels="eager")  # 2-layer model: far below the eager basis' 160M parameters (meshrun's 125m, counted)
    n = 2 * (4 * 64 * 64 + 4 * 64 + 2 * 64 * 256 + 256 + 64 + 4 * 64) + (256 * 64 + 128 * 64) + (256 * 64 + 2 * 64)
    d = math.log10(1.6e8 / n)
    assert U.distance(U.BASES["eager"], n, 1) == pytest.approx(d)
    iv = t.step_time_interval
    assert iv.kernels == "eager" and iv.below == iv.above == U.MAX_HALF_WIDTH  # widened x(1 + d) past the cap
    assert iv.low_s == pytest.approx(t.step_time_s.total * 0.75) and iv.high_s == pytest.approx(
        t.step_time_s.total * 1.25
    )
    cfg = resolve_model(ModelSpec(name="gpt", preset="125m", seq_len=2048))
    one = ClusterSpec(device="H100", gpus_per_node=1, kernels="eager")
    c = evaluate(cfg, one, layout=Layout(), micro_batch_size=1, global_batch_size=1, precision="bf16")
    assert (c.step_time_interval.below, c.step_time_interval.above) == (0.092, 0.225)  # inside the data
    assert c.step_time_interval.low_s == pytest.approx(c.step_time_s.total * 0.908)
    # megatron on one GPU: below the published Megatron runs' 1.7B parameters and half a decade of devices below 8
    b, a, _ = U.bounds("megatron", is_cpu=False, n_params=1.4e9, world=1)
    w = 1 + math.log10(1.7e9 / 1.4e9) + math.log10(8) / 2  # 1.536
    assert b == pytest.approx(0.051 * w) and a == U.MAX_HALF_WIDTH  # 0.078 below; above 0.181 x 1.536 is capped
    b, a, _ = U.bounds("megatron", is_cpu=False, n_params=1.4e9, world=4)
    w = 1 + math.log10(1.7e9 / 1.4e9) + math.log10(8 / 4) / 2  # 1.235
    assert b == pytest.approx(0.051 * w) and a == pytest.approx(0.181 * w)  # 0.063 / 0.224: under the cap
    assert U.bounds("megatron", is_cpu=False, n_params=1.25e8, world=1)[1] == U.MAX_HALF_WIDTH  # 0.181 x 2.58
    assert U.bounds("eager", is_cpu=True, n_params=1e6, world=4)[:2] == (0.2, 0.2)


def test_the_bases_percentiles_are_those_of_the_data():
    """The interval's percentiles are re-derived from the planner's residuals on its basis, so they cannot drift;
    in-sample each side holds four in five of its runs."""
    from tests.service import published as P

    rows = P.rows()
    for name, basis in U.BASES.items():
        rs = [r for r in rows if P.kernels(r.run) == name]
        res = [r.measured_s / r.predicted_s - 1 for r in rs]
        over = statistics.quantiles([-x for x in res if x < 0], n=10, method="inclusive")[7]
        under = statistics.quantiles([x for x in res if x >= 0], n=10, method="inclusive")[7]
        assert len(rs) == basis.n_runs
        assert (over, under) == pytest.approx((basis.over, basis.under), abs=0.005), name


def test_ties_are_the_candidates_whose_interval_reaches_the_best():
    req = PlanRequest(
        model=ModelSpec(name="gpt", preset="1.3b"), cluster=ClusterSpec(device="H100"), global_batch_size=64, top_k=8
    )
    resp = search(req)
    cands = resp.candidates
    assert resp.within_uncertainty and resp.within_uncertainty[0] == 0 and resp.cluster["kernels"] == "megatron"
    hi0 = cands[0].step_time_interval.high_s
    for i, c in enumerate(cands):
        assert (i in resp.within_uncertainty) == (c.step_time_interval.low_s <= hi0)
    # by hand: three candidates at 1.0, 1.1 and 1.3 s, each -10 % / +10 %: the second reaches the first, not the third
    base = cands[0]
    made = []
    for t in (1.0, 1.1, 1.3):
        iv = base.step_time_interval.model_copy(
            update={"low_s": 0.9 * t, "high_s": 1.1 * t, "below": 0.1, "above": 0.1}
        )
        made.append(base.model_copy(update={"step_time_interval": iv}))
    assert ties(made) == [0, 1]
    assert ties(made[:1]) == [] and ties([made[0], made[2]]) == []

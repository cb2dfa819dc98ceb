"""Compute and tensor-parallel communication of one transformer layer, the embedding and the output head, per
micro-batch, from the model's actual kernels and their shapes. Pure Python; seconds.

One GPT layer (pre-LayerNorm, Megatron layout under tensor parallelism ``t``), ``m = b s`` tokens:

=====================  ==============================  =====================================================
kernel                 forward shape / bytes           backward
=====================  ==============================  =====================================================
QKV projection         GEMM (m, 3h/t, h)               input grad (m, h, 3h/t) + weight grad (3h/t, h, m)
attention core         flash, causal: 2 b a/t s^2 d     2.5x the FLOPs (``service.planner.kernels``)
output projection      GEMM (m, h, h/t)                (m, h/t, h) + (h, h/t, m)
MLP up / down          GEMM (m, f/t, h), (m, h, f/t)   likewise
2 LayerNorms           2 x 2 m' h bytes (at 60 %)      3 m' h bytes each
2 residual adds        2 x 3 m' h bytes                2 x 2 m' h bytes
GELU                   2 m f/t bytes                   3 m f/t bytes
=====================  ==============================  =====================================================

(bytes x the activation size; ``m' = m/t`` with sequence parallelism, else ``m``: LayerNorm, residual and dropout
regions are replicated over the tensor-parallel group unless sequence parallelism shards them.) Every kernel pays
the device's fixed per-kernel time, and the host must launch it: ``LAUNCHES_FWD``/``LAUNCHES_BWD`` kernels per
layer at ``kernel_launch_s`` each (``service.planner.core`` takes the larger of host and device time on GPUs, their
sum on CPUs, which run eagerly).

Tensor parallel communication per layer and micro-batch (Korthikanti et al. 2022): forward 2 all-reduces of
``m h`` activations (after the attention and MLP row-parallel GEMMs), backward 2 more; with sequence parallelism
each all-reduce becomes an all-gather + reduce-scatter pair of the same total bytes. Full recomputation repeats the
forward's (Narayanan et al. 2021: 6 instead of 4 per layer).

Recompute: ``full`` runs each layer's forward again in backward; ``selective`` (Korthikanti) recomputes the
attention core only: free with flash attention (its backward recomputes the scores anyway), one more unfused
attention forward without.

The last stage adds the final LayerNorm, the logits GEMM (m, V/t, h) with its two backward GEMMs and a fp32
cross-entropy over ``m V/t`` logits (three passes forward, two backward; vocab-parallel: three small all-reduces
of ``m`` floats); the first stage the embedding lookup (and, vocab-parallel, one all-reduce of ``m h``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from api.spec import ModelConfig
from api.spec.presets import gpt_param_count
from service.planner import comm
from service.planner.devices import Device
from service.planner.factors import Factors
from service.planner.kernels import NORM_BANDWIDTH_FRACTION, attention_time, gemm_time, memory_time
from service.planner.profiles import MEGATRON, KernelProfile

# the fused (megatron) profile's figures, kept under their earlier names (``service.planner.profiles`` documents them)
LAUNCHES_FWD = MEGATRON.launches_fwd  # kernels a layer's forward launches (GEMMs, attention, norms, residuals, ...)
LAUNCHES_BWD = MEGATRON.launches_bwd  # and its backward (input and weight gradients, bias and norm gradients)
OPTIMIZER_BYTES_PER_PARAM = MEGATRON.optimizer_bytes_per_param  # fused Adam: fp32 states read+write, grad read
OPTIMIZER_LAUNCHES = MEGATRON.optimizer_launches


@dataclass(frozen=True)
class Shape:
    """A model's sizes and per-part parameter counts."""

    family: str
    L: int
    h: int
    a: int
    V: int
    s: int
    f: int
    block_params: float
    embed_params: float
    head_params: float
    flash: bool = True  # model.attention 'flash' (fused kernels, no s^2 scores kept) or 'eager' (False)

    @classmethod
    def of(cls, cfg: ModelConfig) -> Shape:
        L, h, a, V, s, f = cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.vocab_size, cfg.seq_len, cfg.d_ff
        rope = cfg.name == "hf" and cfg.args.get("arch") == "llama"  # a Hugging Face Llama: no position table
        if rope:
            f = f * 3 // 2  # SwiGLU's three h x f GEMMs priced as a GELU MLP of width 1.5 f
        if cfg.name == "mlp":
            block: float = 2 * h + h * f + f + f * h + h
            embed, head = V * h, V * h + 2 * h
        else:  # GPT shaped (custom models are priced as a GPT of their sizes)
            block = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h
            embed, head = V * h + (0 if rope else s * h), V * h + 2 * h
            n = cfg.n_params or gpt_param_count(n_layers=L, d_model=h, vocab_size=V, seq_len=s, d_ff=f)
            if n != L * block + embed + head and n > embed + head:  # a user model with its own count
                block = (n - embed - head) / L
        flash = cfg.attention != "eager"
        return cls(cfg.name, L, h, a, V, s, f, float(block), float(embed), float(head), flash)

    @property
    def attention(self) -> bool:
        return self.family != "mlp"

    def layer_fwd_flops_per_token(self) -> float:
        """GEMM FLOPs of one layer's forward per token (attention scores at the full ``s^2``, as MFU counts)."""
        h, f = self.h, self.f
        if not self.attention:
            return 4.0 * h * f
        return 2.0 * (4 * h * h + 2 * h * f) + 4.0 * self.s * h

    def model_flops_per_token(self) -> float:
        """Forward + backward GEMM FLOPs per token, no recompute (MFU's numerator): ``72 L s h^2 (1 + s/(6h) +
        V/(12 h L))`` per sequence for a GPT with f = 4h (Korthikanti eq. 7)."""
        return 3 * (self.L * self.layer_fwd_flops_per_token() + 2.0 * self.h * self.V)


class Cost(NamedTuple):
    """Per micro-batch costs of a part of the model on one rank. Device seconds (before host-launch bounds)."""

    fwd: float = 0.0
    bwd_input: float = 0.0  # input-gradient kernels of the backward pass
    bwd_weight: float = 0.0  # weight-gradient kernels (zero-bubble schedules move these)
    recompute: float = 0.0
    tp_fwd: float = 0.0
    tp_bwd: float = 0.0
    tp_recompute: float = 0.0
    launches_fwd: float = 0.0
    launches_bwd: float = 0.0
    launches_recompute: float = 0.0


@dataclass(frozen=True)
class Env:
    """What the per-kernel costs depend on besides the layout: device, precision, factors, node size."""

    dev: Device
    fac: Factors
    peak: float
    act_bytes: int
    gpus_per_node: int
    prof: KernelProfile = MEGATRON

    def flash(self, sh: Shape) -> bool:
        """Fused (flash) attention: the model asks for it and the stack has it (``Factors.flash_attention``)."""
        return sh.flash and self.fac.flash_attention

    def gemm(self, m: float, n: float, k: float) -> tuple[float, float, float]:
        """(forward, input-gradient, weight-gradient) seconds of a linear layer ``(m x k) @ (k x n)``."""
        kw = dict(
            peak=self.peak,
            elem_bytes=self.act_bytes,
            compute_scale=self.fac.compute_efficiency,
            fixed_scale=self.fac.launch_scale,
        )
        return (
            gemm_time(self.dev, m, n, k, **kw),
            gemm_time(self.dev, m, k, n, **kw),
            gemm_time(self.dev, n, k, m, **kw),
        )

    def mem(self, nbytes: float) -> float:
        return memory_time(self.dev, nbytes, memory_scale=self.fac.memory_efficiency, fixed_scale=self.fac.launch_scale)

    def tp_link(self, t: int) -> comm.Link:
        g = comm.group(stride=1, size=t, gpus_per_node=self.gpus_per_node)
        return comm.link(
            self.dev,
            g,
            bandwidth_efficiency=self.fac.tp_bandwidth_efficiency,
            latency_scale=self.fac.tp_latency_scale,
        )


def layer_cost(env: Env, sh: Shape, *, mb: int, t: int, sp: bool, recompute: str) -> Cost:
    """One transformer (or MLP) block, one micro-batch, on one rank of a ``t``-way tensor-parallel group."""
    e = env.act_bytes
    h, f, s = sh.h, sh.f, sh.s
    m = mb * s
    mr = m / t if sp else m  # tokens of the replicated (or sequence-sharded) regions
    fwd = bwd_in = bwd_w = 0.0
    if sh.attention:
        gemms = [(m, 3 * h / t, h), (m, h, h / t), (m, f / t, h), (m, h, f / t)]
    else:
        gemms = [(m, f, h), (m, h, f)]
    for mm, nn, kk in gemms:
        a, b, c = env.gemm(mm, nn, kk)
        fwd += a
        bwd_in += b
        bwd_w += c
    attn_f = attn_b = 0.0
    if sh.attention:
        attn_f, attn_b = attention_time(
            env.dev,
            batch_heads=mb * sh.a / t,
            s=s,
            d=h / sh.a,
            peak=env.peak,
            flash=env.flash(sh),
            act_bytes=e,
            compute_scale=env.fac.compute_efficiency,
            memory_scale=env.fac.memory_efficiency,
            fixed_scale=env.fac.launch_scale,
            softmax_passes=env.prof.softmax_passes,
        )
        fwd += attn_f
        bwd_in += attn_b
    norms = 2 if sh.attention else 1
    residuals = 2 if sh.attention else 1
    sb = 4 if env.prof.fp32_stream else e  # bytes of a residual-stream element
    fwd += norms * env.mem(2 * mr * h * sb / NORM_BANDWIDTH_FRACTION)
    fwd += residuals * env.mem(mr * h * (2 * sb + e)) + env.mem(2 * m * f / t * e)
    bwd_in += norms * env.mem(3 * mr * h * sb / NORM_BANDWIDTH_FRACTION)
    bwd_in += residuals * env.mem(2 * mr * h * sb) + env.mem(3 * m * f / t * e)
    if sb != e:  # each norm's fp32 output cast to the GEMM's 16-bit input, and its gradient back
        fwd += norms * env.mem(mr * h * (sb + e))
        bwd_in += norms * env.mem(mr * h * (sb + e))
    if sh.attention:  # head split / merge copies
        fwd += env.mem(2 * m * h / t * e)
        bwd_in += env.mem(2 * m * h / t * e)
    cast_f, cast_b = env.prof.weight_cast_bytes
    if e == 2 and cast_f + cast_b > 0:  # autocast over fp32 weights: one cast per weight, fwd and bwd
        fwd += 6 * env.mem(cast_f * sh.block_params / t / 6)
        bwd_w += 6 * env.mem(cast_b * sh.block_params / t / 6)

    tp_f = tp_b = 0.0
    if t > 1:
        ln = env.tp_link(t)
        n = m * h * e
        one = 2 * comm.all_gather(n, t, ln) if sp else comm.all_reduce(n, t, ln)
        tp_f = tp_b = 2 * one
    prof = env.prof
    lf, lb = prof.launches_fwd, prof.launches_bwd
    if sh.attention and not env.flash(sh):
        lf += prof.eager_attention_launches[0]
        lb += prof.eager_attention_launches[1]
    rec = tp_rec = launches_rec = 0.0
    if recompute == "full":
        rec, tp_rec, launches_rec = fwd, tp_f, lf
    elif recompute == "selective" and sh.attention and not env.flash(sh):
        rec, launches_rec = attn_f, 1 + prof.eager_attention_launches[0]
    scale = 1.0 if sh.attention else 0.5
    return Cost(fwd, bwd_in, bwd_w, rec, tp_f, tp_b, tp_rec, lf * scale, lb * scale, launches_rec * scale)


def head_cost(env: Env, sh: Shape, *, mb: int, t: int, sp: bool) -> Cost:
    """Final LayerNorm, logits GEMM and the fp32 cross-entropy (the last stage), one micro-batch."""
    e = env.act_bytes
    m = mb * sh.s
    mr = m / t if sp else m
    a, b, c = env.gemm(m, sh.V / t, sh.h)
    logits = m * sh.V / t
    lf, lb = env.prof.loss_bytes
    sb = 4 if env.prof.fp32_stream else e
    fwd = a + env.mem(2 * mr * sh.h * sb / NORM_BANDWIDTH_FRACTION) + 3 * env.mem(logits * lf / 3)
    bwd_in = b + env.mem(3 * mr * sh.h * sb / NORM_BANDWIDTH_FRACTION) + 2 * env.mem(logits * lb * (4 + e) / 12)
    tp = 0.0
    if t > 1:
        ln = env.tp_link(t)
        tp = 3 * comm.all_reduce(m * 4, t, ln)  # vocab-parallel cross-entropy: max, sum of exp, target logit
        if sp:
            tp += comm.all_gather(m * sh.h * e, t, ln)
    return Cost(fwd, bwd_in, c, 0.0, tp, tp / 3 if sp else 0.0, 0.0, 8, 10, 0)


def embed_cost(env: Env, sh: Shape, *, mb: int, t: int, sp: bool) -> Cost:
    """Token (+ position) embedding lookup (the first stage), one micro-batch."""
    e = env.act_bytes
    m = mb * sh.s
    fwd = env.mem(2 * m * sh.h * e) + env.mem(3 * m * sh.h * e)
    bwd = env.mem(2 * m * sh.h * 4)
    tp = 0.0
    if t > 1:  # vocab-parallel embedding: partial lookups summed (reduce-scattered with sequence parallelism)
        ln = env.tp_link(t)
        tp = comm.all_gather(m * sh.h * e, t, ln) if sp else comm.all_reduce(m * sh.h * e, t, ln)
    return Cost(fwd, 0.0, bwd, 0.0, tp, 0.0, 0.0, 3, 3, 0)


def optimizer_time(env: Env, local_params: float) -> float:
    """The optimizer step over the rank's parameter shard: memory-bound (the profile's
    ``optimizer_bytes_per_param``; 36 fused, 48 with meshrun's gradient clipping) plus its launches."""
    if local_params <= 0:
        return 0.0
    prof = env.prof
    return prof.optimizer_launches * env.dev.kernel_fixed_s * env.fac.launch_scale + env.mem(
        local_params * prof.optimizer_bytes_per_param
    )

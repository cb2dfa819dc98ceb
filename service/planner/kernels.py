"""Time of single kernels on a device: GEMMs (a roofline with a shape-dependent efficiency curve), flash attention,
and memory-bound kernels (bytes / achieved bandwidth). Pure arithmetic; seconds of device time.

GEMM ``(m x k) @ (k x n)`` (``m`` rows of the output, ``n`` columns, ``k`` the reduction):

    t = fixed + max(2 m n k / (peak * eff), bytes / bandwidth)
    eff = matmul_efficiency * k / (k + k_half) * waves(m, n)

``waves``: the output is cut into ``tile x tile`` tiles spread over the device's multiprocessors; the last wave of
tiles leaves SMs idle (wave quantisation) and a partly filled tile wastes its padding (tile quantisation), after
NVIDIA's "Matrix Multiplication Background" guide. Fewer tiles than SMs are split along ``k`` (split-K), which
recovers part of the idle SMs. ``k / (k + k_half)`` is the prologue/epilogue cost of a short reduction. The curve's
constants for H100 were fitted to measured GEMMs (``service.planner.devices``, [meas-h100]),
and other GPUs use the same form with their own SM count and large-shape efficiency (mean |error| 7.6 %).

Attention (flash/SDPA, causal): forward FLOPs ``2 * 2 * b * heads * s^2 * d / 2`` (the causal half of QK^T and
PV), at ``attention_efficiency * s / (s + 700) * (d / (d + 64)) / (128 / 192)`` of peak (measured on H100: 0.49
at s=2048, d=128; 0.32 at d=64), backward 2.5x the forward FLOPs at 0.7 of the forward rate (FlashAttention-2's
backward recomputes the scores). Without flash kernels: two batched GEMMs and a memory-bound softmax over
``s^2`` scores per head.
"""

from __future__ import annotations

import math

from service.planner.devices import Device

ATTN_S_HALF = 700.0
ATTN_D_HALF = 64.0
ATTN_BWD_FLOPS = 2.5
ATTN_BWD_RATE = 0.7
NORM_BANDWIDTH_FRACTION = 0.6  # LayerNorm kernels reach ~60 % of a copy's bandwidth (measured on H100)


def gemm_time(
    dev: Device,
    m: float,
    n: float,
    k: float,
    *,
    peak: float,
    elem_bytes: float = 2,
    compute_scale: float = 1.0,
    fixed_scale: float = 1.0,
    batch: float = 1,
) -> float:
    """Seconds of one ``(m x k) @ (k x n)`` GEMM (``batch`` of them in one batched kernel). ``compute_scale``
    multiplies the achieved rate (calibration), ``fixed_scale`` the fixed per-kernel time."""
    if m <= 0 or n <= 0 or k <= 0 or batch <= 0:
        return 0.0
    eff = dev.matmul_efficiency * k / (k + dev.matmul_k_half) * wave_efficiency(dev, m, n, k, batch=batch)
    rate = peak * eff * compute_scale
    flops_t = 2.0 * batch * m * n * k / rate if rate > 0 else math.inf
    bytes_t = batch * elem_bytes * (m * k + k * n + m * n) / dev.memory_bandwidth_bytes_per_s
    return dev.kernel_fixed_s * fixed_scale + max(flops_t, bytes_t)


def wave_efficiency(dev: Device, m: float, n: float, k: float, *, batch: float = 1) -> float:
    """Useful fraction of the SM-time a GEMM occupies: tile padding x the idle SMs of the last wave. The work
    units are output tiles split along ``k`` in slices of 512 (split-K / stream-K, which cuBLAS uses to fill the
    SMs when there are few tiles and a long reduction). 1.0 on a CPU (``sms == 0``)."""
    if dev.sms <= 0:
        return 1.0
    T = dev.matmul_tile
    tm, tn = math.ceil(m / T), math.ceil(n / T)
    tile_eff = (m * n) / (tm * tn * T * T)
    units = tm * tn * batch * max(1, math.floor(k / 512))
    waves = units / dev.sms
    return tile_eff * waves / math.ceil(waves)


def attention_efficiency(dev: Device, s: int, d: float) -> float:
    return dev.attention_efficiency * s / (s + ATTN_S_HALF) * (d / (d + ATTN_D_HALF)) / (128 / 192)


def attention_time(
    dev: Device,
    *,
    batch_heads: float,
    s: int,
    d: float,
    peak: float,
    flash: bool,
    act_bytes: int,
    compute_scale: float = 1.0,
    memory_scale: float = 1.0,
    fixed_scale: float = 1.0,
    softmax_passes: tuple[float, float] = (3, 6),
) -> tuple[float, float]:
    """(forward, backward) seconds of causal self-attention over ``batch_heads`` (b x heads) sequences of length
    ``s`` with head dim ``d``. ``softmax_passes``: (forward, backward) passes over the 16-bit scores of the unfused
    path (the kernel profile's, ``service.planner.profiles``)."""
    if batch_heads <= 0:
        return 0.0, 0.0
    fwd_flops = 2.0 * batch_heads * s * s * d  # causal half of 4 b h s^2 d
    if flash:
        rate = peak * attention_efficiency(dev, s, d) * compute_scale
        if not rate > 0:  # degenerate overrides (an efficiency of 1e-300): no finite time
            return math.inf, math.inf
        fwd = dev.kernel_fixed_s * fixed_scale + fwd_flops / rate
        bwd = dev.kernel_fixed_s * fixed_scale + ATTN_BWD_FLOPS * fwd_flops / (rate * ATTN_BWD_RATE)
        return fwd, bwd
    # unfused: scores = QK^T (full s x s per head, batched), softmax (memory-bound), PV
    kw = dict(peak=peak, elem_bytes=act_bytes, compute_scale=compute_scale, fixed_scale=fixed_scale, batch=batch_heads)
    qk = gemm_time(dev, s, s, d, **kw)
    pv = gemm_time(dev, s, d, s, **kw)
    scores = batch_heads * s * s * act_bytes
    mkw = dict(memory_scale=memory_scale, fixed_scale=fixed_scale)
    soft_f = memory_time(dev, scores * softmax_passes[0], **mkw)
    soft_b = memory_time(dev, scores * softmax_passes[1], **mkw) + dev.kernel_fixed_s * fixed_scale  # two kernels
    return qk + pv + soft_f, 2 * (qk + pv) + soft_b


def memory_time(dev: Device, nbytes: float, *, memory_scale: float = 1.0, fixed_scale: float = 1.0) -> float:
    """Seconds of a memory-bound kernel moving ``nbytes`` (read + written)."""
    if nbytes <= 0:
        return 0.0
    return dev.kernel_fixed_s * fixed_scale + nbytes / (dev.memory_bandwidth_bytes_per_s * memory_scale)

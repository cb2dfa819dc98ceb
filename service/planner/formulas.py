"""Published formulas the planner stands on (Narayanan et al. SC21, Korthikanti et al. 2022, ZeRO). Pure arithmetic.

Symbols: s sequence length, b micro-batch size, h hidden size, a attention heads, L layers, V vocabulary,
t tensor-parallel degree, p pipeline stages, m micro-batches per step, v virtual stages per rank.
"""

from __future__ import annotations

Recompute = str  # "none" | "selective" | "full"


# ------------------------------------------------------------------------------------------ model size
def megatron_param_count(*, n_layers: int, d_model: int, vocab_size: int, seq_len: int, **_: object) -> float:
    """Narayanan et al. (SC21): ``Psi = 12 L h^2 (1 + 13/(12h) + (V + s)/(12 L h))`` (tied head)."""
    L, h, V, s = n_layers, d_model, vocab_size, seq_len
    return 12 * L * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * L * h))


def megatron_model_flops(
    *, global_batch_size: int, n_layers: int, d_model: int, vocab_size: int, seq_len: int, full_recompute: bool = False
) -> float:
    """Model FLOPs per step, GEMMs only (Korthikanti eq. 7 / Narayanan eq. 3 with full recomputation):
    ``72 B L s h^2 (1 + s/(6h) + V/(12 h L))``; with full recompute ``96 B s L h^2 (1 + s/(6h) + V/(16 L h))``.
    """
    B, L, h, V, s = global_batch_size, n_layers, d_model, vocab_size, seq_len
    if full_recompute:
        return 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    return 72 * B * L * s * h * h * (1 + s / (6 * h) + V / (12 * h * L))


# ------------------------------------------------------------------------------------ model states
def state_bytes_per_param(precision: str) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes per parameter with Adam (ZeRO paper): mixed precision 2 + 2 + 12
    (16-bit params and grads; fp32 master, momentum, variance), pure fp32 4 + 4 + 8."""
    return (4, 4, 8) if precision == "fp32" else (2, 2, 12)


def model_state_bytes(
    n_params: float,
    *,
    zero_stage: int,
    shard_degree: int,
    precision: str = "bf16",
) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes per rank for ``n_params`` parameters held by the rank's model
    replica (after tensor/pipeline division), ZeRO-sharded over ``shard_degree`` data-parallel ranks.

    ZeRO-1: optimizer / d; ZeRO-2: + grads / d; ZeRO-3 (FSDP full shard): + params / d.
    With mixed precision on d ranks: 16 Psi, 4 Psi + 12 Psi/d, 2 Psi + 14 Psi/d, 16 Psi/d.
    """
    pb, gb, ob = state_bytes_per_param(precision)
    d = max(1, shard_degree)
    params, grads, opt = n_params * pb, n_params * gb, n_params * ob
    if zero_stage >= 1:
        opt /= d
    if zero_stage >= 2:
        grads /= d
    if zero_stage >= 3:
        params /= d
    return params, grads, opt


# ----------------------------------------------------------------------------------------- activations
def activation_bytes_per_layer(
    *,
    seq_len: int,
    micro_batch_size: int,
    d_model: int,
    n_heads: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: Recompute = "none",
    flash_attention: bool = False,
    act_bytes: int = 2,
    score_bytes: float = 5,
) -> float:
    """Activation bytes one transformer layer keeps for backward (Korthikanti et al. 2022, table 2).

    16-bit: no parallelism ``sbh(34 + 5as/h)``; TP ``sbh(10 + 24/t + 5as/(ht))``; TP+SP
    ``sbh(34/t + 5as/(ht))``; selective recompute drops the ``5as/h`` (softmax) term; full recompute keeps
    the layer input only, ``2sbh`` (``2sbh/t`` with sequence parallelism, whose input is sharded).
    ``flash_attention`` drops the softmax term too (fused kernels do not store it). fp32 activations
    (``act_bytes=4``) count twice. ``score_bytes``: bytes kept per attention score, Korthikanti's 5 (softmax output
    2, dropout mask 1, dropout output 2); 2 without dropout (the probabilities only: meshrun's eager attention).
    """
    s, b, h, a, t = seq_len, micro_batch_size, d_model, n_heads, tp
    sbh = s * b * h
    scale = act_bytes / 2
    if recompute == "full":
        return scale * 2 * sbh / (t if sequence_parallel else 1)
    softmax = 0.0 if (recompute == "selective" or flash_attention) else score_bytes * a * s / (h * t)
    if sequence_parallel:
        per = 34 / t
    else:
        per = 10 + 24 / t
    return scale * sbh * (per + softmax)


def mlp_block_activation_bytes(
    *, seq_len: int, micro_batch_size: int, d_model: int, d_ff: int, recompute: Recompute = "none", act_bytes: int = 2
) -> float:
    """Activation bytes of one residual MLP block (the ``mlp`` family): LayerNorm input and output (2 sbh),
    up-projection output and GELU output (2 sbf) and the down-projection input (counted in those), in
    ``act_bytes`` each; full recompute keeps the block input only."""
    s, b, h, f = seq_len, micro_batch_size, d_model, d_ff
    if recompute == "full":
        return act_bytes * s * b * h
    return act_bytes * (2 * s * b * h + 2 * s * b * f)


def pipeline_inflight_factor(*, schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Micro-batches' worth of a rank's layers that the first stage holds at its peak.

    1F1B: ``min(p, m)`` micro-batches of its ``L/p`` layers (= L layers' worth when m >= p); GPipe: all m;
    interleaved 1F1B (Megatron) with v chunks: ``p (1 + (p - 1)/(p v))`` -- the warm-up holds
    ``v p + p - 1`` chunk-micro-batches of ``L/(p v)`` layers. (Korthikanti writes the factor as
    ``1 + (p-1)/(p m)`` with m their *interleaving* stages, i.e. our v.) ZB-V keeps the 1F1B peak
    (Qi et al. 2024); interleaved zero-bubble is counted like interleaved 1F1B.
    """
    p, m, v = pp, microbatches, virtual_stages
    if p <= 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    base = float(min(p, m))
    if schedule in ("interleaved_1f1b", "interleaved_zero_bubble") and v > 1:
        return base * (1 + (p - 1) / (p * v))
    return base


def bubble_fraction(*, pp: int, microbatches: int, virtual_stages: int = 1, schedule: str = "1f1b") -> float:
    """Pipeline bubble as a fraction of the ideal (bubble-free) step: ``(p - 1)/m`` for GPipe and 1F1B,
    ``(p - 1)/(v m)`` interleaved (Narayanan et al.). Zero-bubble schedules split the weight-gradient pass
    out to fill idle slots; we count a third of the interleaved bubble for them (ZB-H1, Qi et al. 2023).
    """
    p, m, v = pp, microbatches, max(1, virtual_stages)
    if p <= 1:
        return 0.0
    frac = (p - 1) / m
    if schedule in ("interleaved_1f1b", "interleaved_zero_bubble", "zbv"):
        frac /= v
    if schedule in ("interleaved_zero_bubble", "zbv"):
        frac /= 3
    return frac


# ----------------------------------------------------------------------------------------- collectives
def allreduce_wire_bytes(n_bytes: float, ranks: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce of ``n_bytes``: ``2 n (N - 1)/N``."""
    return 0.0 if ranks <= 1 else 2 * n_bytes * (ranks - 1) / ranks


def allgather_wire_bytes(n_bytes: float, ranks: int) -> float:
    """All-gather (or reduce-scatter) of a ``n_bytes`` full tensor: ``n (N - 1)/N`` per rank."""
    return 0.0 if ranks <= 1 else n_bytes * (ranks - 1) / ranks


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def group_within_node(*, stride: int, size: int, gpus_per_node: int) -> bool:
    """Whether every group of ``size`` ranks spaced ``stride`` apart (consecutive ranks fill a node) sits on
    one node: its span ``stride * size`` must fit in and tile the node."""
    if size <= 1:
        return True
    span = stride * size
    return span <= gpus_per_node and gpus_per_node % span == 0

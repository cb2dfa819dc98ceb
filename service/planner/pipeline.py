"""Pipeline schedules: the step time of ``m`` micro-batches over ``p`` stages from each stage's actual forward and
backward time (uneven stages included: the first holds the embedding, the last the output head and the loss).

With ``X_i = F_i + B_i`` a rank's forward + backward time per micro-batch (``B`` includes recomputation and the
weight-gradient part ``W``):

- GPipe and 1F1B: the first micro-batch passes every stage once (fill and drain), the others follow at the pace of
  the slowest stage: ``T = sum_i X_i + (m - 1) max_i X_i``. For equal stages that is ``(m + p - 1) X``, the
  ``(p - 1)/m`` bubble of Narayanan et al.; it holds for ``m < p`` too (1F1B then never reaches its steady state).
- Interleaved 1F1B with ``v`` model chunks per rank: fill and drain pass chunk-sized pieces,
  ``T = sum_i X_i / v + (m - 1/v) max_i X_i`` (bubble ``(p - 1)/(v m)`` for equal stages).
- Zero-bubble (Qi et al. 2024) splits the backward into input gradients ``B - W`` and weight gradients ``W``, which
  fill the idle slots: ZB-H1 leaves ``(p - 1)(F + B - 2W)`` (interleaved: divided by ``v``); ZB-V with two chunks
  per rank in a V leaves ``(p - 1) max(0, F + B - 3W) / 2``, i.e. none when F = B - W = W.
Every stage boundary also costs its point-to-point transfers on the fill/drain path.
"""

from __future__ import annotations

from collections.abc import Sequence


def pipeline_step(
    fwd: Sequence[float],
    bwd: Sequence[float],
    wgrad: Sequence[float],
    *,
    microbatches: int,
    schedule: str,
    virtual_stages: int = 1,
    p2p_s: float = 0.0,
) -> tuple[float, float, int]:
    """(step time of the pipeline, bubble = step time - the busiest rank's work, index of the busiest rank)."""
    p, m = len(fwd), max(1, microbatches)
    x = [f + b for f, b in zip(fwd, bwd)]
    b_rank = max(range(p), key=lambda i: x[i])
    xmax = x[b_rank]
    busy = m * xmax
    if p <= 1:
        return busy, 0.0, 0
    v = max(1, virtual_stages)
    fill = 2 * (p - 1) * p2p_s
    if schedule == "zbv":
        idle = max(max(0.0, f + b - 3 * w) for f, b, w in zip(fwd, bwd, wgrad)) / 2
        total = busy + (p - 1) * idle + fill
    elif schedule == "interleaved_zero_bubble":
        idle = max(max(0.0, f + b - 2 * w) for f, b, w in zip(fwd, bwd, wgrad)) / v
        total = busy + (p - 1) * idle + fill
    elif schedule == "interleaved_1f1b" and v > 1:
        total = sum(x) / v + (m - 1 / v) * xmax + fill
    else:  # gpipe, 1f1b
        total = sum(x) + (m - 1) * xmax + fill
    return total, max(0.0, total - busy), b_rank

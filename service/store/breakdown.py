"""A run's measured step-time breakdown against its plan's prediction (``GET /v1/runs/{id}/breakdown``).

The workers store, on measured steps (``spec.metrics.breakdown_every_steps``), the per-rank breakdown in the metric
row's ``extra`` (``breakdown_per_rank``: term -> [seconds of rank 0, rank 1, ...], terms of
``api.spec.metrics.BREAKDOWN_TERMS``). This module reads the latest ``MAX_ROWS`` rows of the run's series (so a
100k-step run costs the same as a short one), leaves out the warm-up steps of every attempt (``warmup_steps``), and
answers per term: the prediction, the measured seconds over the steady-state steps (of the mean over ranks) and the
same per rank.

The measured seconds are an interquartile mean (``typical_steps``): the steps whose step time lies in the middle half
are kept (robust to a slow outlier step, like a median) and every term is averaged over the SAME steps. So the terms
add up to the step time (the workers' per-rank terms tile each step), overall and per rank; a median taken term by
term does not (each term's median comes from a different step, and with skewed terms they added up to ~80-90%).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from api.spec import BREAKDOWN_ROWS, BREAKDOWN_TERMS, BreakdownTerm, Plan, RankBreakdown, RunBreakdown
from service.store.metrics import segments
from service.store.models import Metric, Run
from service.store.runs import list_events

MAX_ROWS = 2000
PER_RANK = "breakdown_per_rank"
# measured term -> (the planner's term, the measured in-flight term); comm terms compare the EXPOSED part
_MEASURED = {
    "compute": ("compute", None),
    "tp_comm": ("tp_comm", "tp_comm"),
    "pp_comm": ("pp_comm", "pp_comm"),
    "pp_bubble": ("pp_bubble", None),
    "dp_comm": ("dp_comm", "dp_comm"),
    "optimizer": ("optimizer", None),
    "data_wait": (None, None),
    "other": ("other", None),
}
_EXPOSED = {"tp_comm": "tp_comm_exposed", "pp_comm": "pp_comm_exposed", "dp_comm": "dp_comm_exposed"}


def warmup_steps(n: int) -> int:
    """Measured steps of one attempt left out as warm-up: the first (allocator, caches, lazy init), and up to a
    tenth of the rest (at most 10); none when the attempt measured a single step."""
    return 0 if n < 2 else min(10, max(1, n // 10))


def breakdown_rows(session: Session, *, run_id: str, limit: int = MAX_ROWS) -> list[Metric]:
    """The latest ``limit`` rows of the run's series (newest attempt segments first), in step order."""
    out: list[Metric] = []
    for seg in reversed(segments(session, run_id=run_id)):
        stmt = (
            select(Metric)
            .where(Metric.run_id == run_id, seg.clause())
            .order_by(Metric.step.desc())
            .limit(limit - len(out))
        )
        out.extend(session.scalars(stmt).all())
        if len(out) >= limit:
            break
    return sorted(out, key=lambda m: m.step)


def per_rank(m: Metric) -> dict[str, list[float]] | None:
    """The row's per-rank breakdown (None when the step was not measured or the row is malformed)."""
    pr = (m.extra or {}).get(PER_RANK)
    if not isinstance(pr, dict) or not all(isinstance(pr.get(t), list) and pr[t] for t in BREAKDOWN_TERMS):
        return None
    if any(v is None for t in BREAKDOWN_TERMS for v in pr[t]):
        return None
    return {t: [float(v) for v in pr[t]] for t in BREAKDOWN_TERMS}


def steady_steps(rows: Sequence[Metric]) -> tuple[list[tuple[int, dict[str, list[float]]]], int]:
    """(step, per-rank breakdown) of the steady-state measured steps, and how many were left out as warm-up."""
    by_attempt: dict[int, list[tuple[int, dict[str, list[float]]]]] = {}
    for m in rows:
        pr = per_rank(m)
        if pr is not None:
            by_attempt.setdefault(m.attempt, []).append((m.step, pr))
    kept: list[tuple[int, dict[str, list[float]]]] = []
    dropped = 0
    for items in by_attempt.values():
        w = warmup_steps(len(items))
        kept.extend(items[w:])
        dropped += w
    if not kept:  # only warm-up: better than nothing
        kept = [x for items in by_attempt.values() for x in items]
        dropped = 0
    return sorted(kept, key=lambda x: x[0]), dropped


def _median(xs: Sequence[float]) -> float | None:
    return float(statistics.median(xs)) if xs else None


def typical_steps(totals: Sequence[float]) -> list[int]:
    """Indices of the steps whose total lies in the middle half (the interquartile range; at least one step)."""
    order = sorted(range(len(totals)), key=lambda i: totals[i])
    cut = len(order) // 4
    return order[cut : len(order) - cut] or order


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def _term_means(steps: list[dict[str, list[float]]], world: int) -> tuple[dict[str, float], list[dict[str, float]]]:
    """(term -> seconds over the typical steps of the mean over ranks, per rank: term -> seconds over that rank's
    typical steps). Each is an average of whole steps, so its parts add up to its total."""
    if not steps:
        return {}, []
    means = [{t: _mean(s[t]) for t in BREAKDOWN_TERMS} for s in steps]
    keep = typical_steps([m["total"] for m in means])
    overall = {t: _mean([means[i][t] for i in keep]) for t in BREAKDOWN_TERMS}
    ranks = []
    for r in range(world):
        mine = [{t: s[t][r] for t in BREAKDOWN_TERMS} for s in steps if all(r < len(s[t]) for t in BREAKDOWN_TERMS)]
        if not mine:
            ranks.append(dict.fromkeys(BREAKDOWN_TERMS, 0.0))
            continue
        kept = typical_steps([m["total"] for m in mine])
        ranks.append({t: _mean([mine[i][t] for i in kept]) for t in BREAKDOWN_TERMS})
    return overall, ranks


def run_breakdown(session: Session, run: Run) -> RunBreakdown:
    plan = Plan.model_validate(run.plan) if run.plan else None
    pred = plan.predicted.step_time_s if plan is not None and plan.predicted is not None else None
    steady, dropped = steady_steps(breakdown_rows(session, run_id=run.id))
    steps = [pr for _, pr in steady]
    world = max((len(pr["total"]) for pr in steps), default=plan.world_size if plan else 0)
    overall, by_rank = _term_means(steps, world)
    total = overall.get("total")
    total_ranks = [rk["total"] for rk in by_rank]

    def share(x: float | None) -> float | None:
        return x / total if x is not None and total else None

    terms = []
    for term in BREAKDOWN_ROWS:
        planned, in_flight = _MEASURED[term]
        key = _EXPOSED.get(term, term)
        measured = overall.get(key)
        ranks = [rk[key] for rk in by_rank]
        flight = overall.get(in_flight) if in_flight else None
        predicted = getattr(pred, planned) if pred is not None and planned is not None else None
        terms.append(
            BreakdownTerm(
                term=term,
                predicted_s=predicted,
                measured_s=measured,
                measured_total_s=flight,
                share=share(measured),
                per_rank_s=ranks,
            )
        )
    summary: dict[str, Any] = run.summary or {}
    peaks = summary.get("peak_memory_bytes_per_rank") or {}
    nodes = run.rank_nodes or {}
    compute = [rk["compute"] for rk in by_rank]
    ranks_out = []
    for r in range(world):
        peers = [c for i, c in enumerate(compute) if i != r]
        peer_med = _median(peers)
        ranks_out.append(
            RankBreakdown(
                rank=r,
                node_id=nodes.get(str(r)),
                step_time_s=total_ranks[r] if r < len(total_ranks) else None,
                compute_s=compute[r] if r < len(compute) else None,
                compute_vs_peers=compute[r] / peer_med if peer_med and r < len(compute) else None,
                peak_memory_bytes=int(peaks[str(r)]) if str(r) in peaks else None,
            )
        )
    stragglers = list_events(session, run_id=run.id, kinds=["straggler"], limit=20, newest_first=True)
    return RunBreakdown(
        run_id=run.id,
        status=run.status,
        steps_measured=len(steady),
        warmup_steps_excluded=dropped,
        first_step=steady[0][0] if steady else None,
        last_step=steady[-1][0] if steady else None,
        step_time_s=BreakdownTerm(
            term="total",
            predicted_s=pred.total if pred is not None else None,
            measured_s=total,
            share=1.0 if total else None,
            per_rank_s=total_ranks,
        ),
        terms=terms,
        unaccounted_s=total - sum(t.measured_s or 0.0 for t in terms) if total is not None else None,
        ranks=ranks_out,
        predicted_memory_bytes=plan.predicted.memory_bytes.total if plan and plan.predicted else None,
        stragglers=[e.reason or "" for e in stragglers],
    )

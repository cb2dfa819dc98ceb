"""Per-step metrics of runs: writes (upserts that keep the run's summary up to date), pages, downsampled series and
summaries. Every query walks the unique (run_id, attempt, step) index; none loads a run's whole history.

The continuous-series rule: a run's metric history is one series, every step exactly once. An attempt that resumed
from a checkpoint starts recording at the step after it; from that step on, rows of EARLIER attempts belong to an
abandoned trajectory and are hidden (even steps the new attempt has not reached yet). So the series is a
concatenation of *segments*, one per attempt in attempt order: attempt ``a`` contributes its rows with step below the
first step of every later attempt. Each segment is one contiguous range of the (run_id, attempt, step) index.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, select, text, union_all
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from api.spec.metrics import MEASUREMENTS, METRIC_ROW_FIELDS
from service.store.models import Metric, RunStats, utcnow

# one nullable column per measured value of ``api.spec.metrics.MetricRow`` (the one definition of a metric row)
METRIC_FIELDS = MEASUREMENTS
_INTEGER_METRICS = frozenset(n for n in METRIC_FIELDS if METRIC_ROW_FIELDS[n].integer)
MAX_STEP = 2**31 - 1


def json_safe(x: Any) -> Any:
    """``x`` with every non-finite float (NaN, +-inf) replaced by None, recursively through dicts, lists and
    tuples. PostgreSQL rejects NaN inside JSON columns and SQLite silently stores NULL: store None explicitly."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def _insert_for(session: Session):
    name = session.get_bind().dialect.name
    if name == "postgresql":
        return postgresql.insert
    if name == "sqlite":
        return sqlite.insert
    raise RuntimeError(f"unsupported database dialect {name}")


def _distinct_on(stmt: Any, expr: Any) -> Any:
    """PostgreSQL's DISTINCT ON (expr): ``postgresql.distinct_on`` from SQLAlchemy 2.1, ``.distinct(expr)`` before."""
    try:
        from sqlalchemy.dialects.postgresql import distinct_on
    except ImportError:  # SQLAlchemy 2.0
        return stmt.distinct(expr)
    return stmt.ext(distinct_on(expr))


# -------------------------------------------------------------------------------------------- segments
@dataclass(frozen=True)
class Segment:
    """Attempt ``attempt``'s visible rows: ``first <= step < end`` (``end`` None: no later attempt)."""

    attempt: int
    first: int
    end: int | None

    def clause(self, *, after: int = 0, before: int | None = None) -> Any:
        """SQL condition for this segment's rows with ``after < step`` (and ``step < before``)."""
        cond = (Metric.attempt == self.attempt) & (Metric.step > after)
        hi = self.end if before is None else (before if self.end is None else min(before, self.end))
        return cond if hi is None else cond & (Metric.step < hi)


def attempt_firsts(session: Session, *, run_id: str) -> list[tuple[int, int]]:
    """(attempt, its first step) for every attempt with rows, in attempt order. A skip scan over the index: two
    seeks per attempt, whatever the number of rows."""
    firsts: list[tuple[int, int]] = []
    a = session.scalar(select(func.min(Metric.attempt)).where(Metric.run_id == run_id))
    while a is not None:
        first = session.scalar(select(func.min(Metric.step)).where(Metric.run_id == run_id, Metric.attempt == a))
        if first is not None:
            firsts.append((int(a), int(first)))
        a = session.scalar(select(func.min(Metric.attempt)).where(Metric.run_id == run_id, Metric.attempt > a))
    return firsts


def segments(session: Session, *, run_id: str, firsts: list[tuple[int, int]] | None = None) -> list[Segment]:
    """The run's series as attempt segments, in step order."""
    firsts = attempt_firsts(session, run_id=run_id) if firsts is None else firsts
    out: list[Segment] = []
    later: int | None = None  # the smallest first step of the attempts after this one
    for attempt, first in reversed(firsts):
        if later is None or first < later:
            out.append(Segment(attempt, first, later))
        later = first if later is None else min(later, first)
    out.reverse()
    return out


# ------------------------------------------------------------------------------------------------ reads
def list_metrics(
    session: Session, *, run_id: str, since_step: int = 0, attempt: int | None = None, limit: int | None = None
) -> list[Metric]:
    """The run's metric history as one continuous series (see the module doc): every step exactly once, in step
    order. ``since_step`` is exclusive (a page's last step is the next page's ``since_step``); ``attempt`` returns
    one attempt's raw rows; ``limit`` bounds the page."""
    if attempt is not None:
        stmt = (
            select(Metric)
            .where(Metric.run_id == run_id, Metric.attempt == attempt, Metric.step > since_step)
            .order_by(Metric.step)
        )
        return list(session.scalars(stmt.limit(limit) if limit else stmt).all())
    out: list[Metric] = []
    for seg in segments(session, run_id=run_id):
        if seg.end is not None and seg.end <= since_step + 1:
            continue
        stmt = select(Metric).where(Metric.run_id == run_id, seg.clause(after=since_step)).order_by(Metric.step)
        if limit:
            stmt = stmt.limit(limit - len(out))
        out.extend(session.scalars(stmt).all())
        if limit and len(out) >= limit:
            break
    return out


def _visible(run_id: str, segs: list[Segment], *cols: Any, after: int = 0) -> Any:
    """A subquery of the series' rows (``cols``), one SELECT per segment glued with UNION ALL (each an index range)."""
    parts = [select(*cols).where(Metric.run_id == run_id, s.clause(after=after)) for s in segs]
    return (parts[0] if len(parts) == 1 else union_all(*parts)).subquery()


def count_metrics(session: Session, *, run_id: str, segs: list[Segment] | None = None) -> int:
    segs = segments(session, run_id=run_id) if segs is None else segs
    total = 0
    for s in segs:
        total += session.scalar(select(func.count()).where(Metric.run_id == run_id, s.clause())) or 0
    return int(total)


_BUCKETS_SQL = """
WITH RECURSIVE b(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM b WHERE i < :last_bucket),
edges AS (
    SELECT i, :lo + (i * :span + :nb - 1) / :nb AS s0, :lo + ((i + 1) * :span + :nb - 1) / :nb AS s1 FROM b
    WHERE :lo + ((i + 1) * :span + :nb - 1) / :nb > :seg_lo AND :lo + (i * :span + :nb - 1) / :nb < :seg_hi
)
SELECT i,
  (SELECT id FROM metrics WHERE run_id = :run_id AND attempt = :attempt AND step >= s0 AND step >= :seg_lo
     AND step < s1 AND step < :seg_hi ORDER BY {col} IS NULL, {col} ASC, step LIMIT 1) AS min_id,
  (SELECT id FROM metrics WHERE run_id = :run_id AND attempt = :attempt AND step >= s0 AND step >= :seg_lo
     AND step < s1 AND step < :seg_hi ORDER BY {col} IS NULL, {col} DESC, step LIMIT 1) AS max_id,
  (SELECT id FROM metrics WHERE run_id = :run_id AND attempt = :attempt AND step >= s0 AND step >= :seg_lo
     AND step < s1 AND step < :seg_hi ORDER BY step DESC LIMIT 1) AS last_id
FROM edges
"""


def downsample_metrics(session: Session, *, run_id: str, points: int, field: str = "loss") -> tuple[list[Metric], int]:
    """At most ``points`` rows that draw the whole series: the step range cut into ``points // 2`` equal buckets,
    and from each bucket the row with the smallest and the row with the largest ``field`` (so every minimum and
    maximum of the series is kept; a bucket whose two are one row adds its last row instead). One SQL statement per
    segment: each bucket is an index range and its extremes are found in it (``ORDER BY field LIMIT 1``); only the
    chosen rows are loaded. Returns (rows in step order, rows in the series)."""
    if field not in METRIC_FIELDS:
        raise ValueError(f"field must be one of {METRIC_FIELDS}")
    segs = segments(session, run_id=run_id)
    if not segs:
        return [], 0
    st = session.get(RunStats, run_id)
    n = int(st.rows) if st is not None and st.rows else count_metrics(session, run_id=run_id, segs=segs)
    if n <= points:
        return list_metrics(session, run_id=run_id), n
    lo = segs[0].first
    hi = session.scalar(select(func.max(Metric.step)).where(Metric.run_id == run_id, segs[-1].clause())) or lo
    nb = max(1, points // 2)
    span = hi - lo + 1
    # (bucket) -> candidate ids; a bucket cut by a resume has candidates from both segments: compare their values
    cand: dict[int, list[tuple[int, int, int]]] = {}
    sql = text(_BUCKETS_SQL.format(col=field))
    for seg in segs:
        params = {
            "run_id": run_id,
            "attempt": seg.attempt,
            "lo": lo,
            "span": span,
            "nb": nb,
            "last_bucket": nb - 1,
            "seg_lo": seg.first,
            "seg_hi": seg.end if seg.end is not None else MAX_STEP,
        }
        for i, mn, mx, last in session.execute(sql, params):
            if mn is not None:
                cand.setdefault(int(i), []).append((int(mn), int(mx), int(last)))
    ids = {i for c in cand.values() for t in c for i in t}
    rows = {m.id: m for m in session.scalars(select(Metric).where(Metric.id.in_(ids))).all()} if ids else {}

    def value(rid: int) -> float:
        v = getattr(rows[rid], field)
        return float("nan") if v is None else float(v)

    chosen: set[int] = set()
    for c in cand.values():
        mins = [t[0] for t in c if not math.isnan(value(t[0]))] or [c[0][0]]
        maxs = [t[1] for t in c if not math.isnan(value(t[1]))] or [c[-1][1]]
        mn = min(mins, key=value)
        mx = max(maxs, key=value)
        chosen.add(mn)
        chosen.add(mx if mx != mn else c[-1][2] if c[-1][2] != mn else c[0][2])
    return sorted((rows[i] for i in chosen), key=lambda m: m.step), n


# ---------------------------------------------------------------------------------------------- summary
def _aggregate(session: Session, *, run_id: str, segs: list[Segment], after: int = 0) -> dict[str, Any]:
    """Sums, counts and the max peak over the series' rows with step > ``after``, in SQL."""
    vis = _visible(run_id, segs, Metric.tokens_per_s, Metric.mfu, Metric.peak_memory_bytes, after=after)
    row = session.execute(
        select(
            func.count(),
            func.coalesce(func.sum(vis.c.tokens_per_s), 0.0),
            func.count(vis.c.tokens_per_s),
            func.coalesce(func.sum(vis.c.mfu), 0.0),
            func.count(vis.c.mfu),
            func.max(vis.c.peak_memory_bytes),
        )
    ).one()
    return {
        "rows": int(row[0]),
        "tokens_per_s_sum": float(row[1]),
        "tokens_per_s_count": int(row[2]),
        "mfu_sum": float(row[3]),
        "mfu_count": int(row[4]),
        "peak_memory_bytes": int(row[5]) if row[5] is not None else None,
    }


def _last_row(session: Session, *, run_id: str, segs: list[Segment]) -> Metric | None:
    if not segs:
        return None
    return session.scalar(
        select(Metric).where(Metric.run_id == run_id, segs[-1].clause()).order_by(Metric.step.desc()).limit(1)
    )


def recompute_stats(session: Session, *, run_id: str) -> RunStats:
    """Rebuild the run's ``run_stats`` row from its rows (SQL aggregates; after a resume hid rows, or a re-sent
    step replaced one)."""
    st = _stats_row(session, run_id, lock=True)
    firsts = attempt_firsts(session, run_id=run_id)
    segs = segments(session, run_id=run_id, firsts=firsts)
    agg = _aggregate(session, run_id=run_id, segs=segs) if segs else {}
    last = _last_row(session, run_id=run_id, segs=segs)
    st.rows = agg.get("rows", 0)
    st.tokens_per_s_sum = agg.get("tokens_per_s_sum", 0.0)
    st.tokens_per_s_count = agg.get("tokens_per_s_count", 0)
    st.mfu_sum = agg.get("mfu_sum", 0.0)
    st.mfu_count = agg.get("mfu_count", 0)
    st.peak_memory_bytes = agg.get("peak_memory_bytes")
    st.steps_done = last.step if last is not None else 0
    st.final_loss = last.loss if last is not None else None
    st.first_steps = {str(a): f for a, f in firsts}
    st.updated_at = utcnow()
    return st


def _stats_row(session: Session, run_id: str, *, lock: bool = False) -> RunStats:
    """The run's stats row, created if missing. With ``lock``, created race-free and locked for this transaction
    (INSERT .. ON CONFLICT DO NOTHING, then SELECT .. FOR UPDATE; on SQLite the INSERT takes the write lock)."""
    if lock:
        insert = _insert_for(session)
        session.execute(
            insert(RunStats)
            .values(
                run_id=run_id,
                rows=0,
                steps_done=0,
                tokens_per_s_sum=0.0,
                tokens_per_s_count=0,
                mfu_sum=0.0,
                mfu_count=0,
                first_steps={},
                updated_at=utcnow(),
            )
            .on_conflict_do_nothing(index_elements=["run_id"])
        )
        stmt = select(RunStats).where(RunStats.run_id == run_id).with_for_update()
        return session.scalars(stmt.execution_options(populate_existing=True)).one()
    st = session.get(RunStats, run_id, populate_existing=True)
    if st is None:
        st = RunStats(
            run_id=run_id,
            rows=0,
            steps_done=0,
            tokens_per_s_sum=0.0,
            tokens_per_s_count=0,
            mfu_sum=0.0,
            mfu_count=0,
            first_steps={},
        )
        session.add(st)
    return st


def _apply_incremental(st: RunStats, values: list[dict[str, Any]]) -> None:
    st.rows = (st.rows or 0) + len(values)
    for v in values:
        if v["tokens_per_s"] is not None:
            st.tokens_per_s_sum = (st.tokens_per_s_sum or 0.0) + v["tokens_per_s"]
            st.tokens_per_s_count = (st.tokens_per_s_count or 0) + 1
        if v["mfu"] is not None:
            st.mfu_sum = (st.mfu_sum or 0.0) + v["mfu"]
            st.mfu_count = (st.mfu_count or 0) + 1
        if v["peak_memory_bytes"] is not None:
            st.peak_memory_bytes = max(st.peak_memory_bytes or 0, v["peak_memory_bytes"])
    last = values[-1]
    if last["step"] >= (st.steps_done or 0):
        st.steps_done, st.final_loss = last["step"], last["loss"]
    st.updated_at = utcnow()


def get_stats(session: Session, *, run_ids: Iterable[str]) -> dict[str, RunStats]:
    ids = list(run_ids)
    if not ids:
        return {}
    return {s.run_id: s for s in session.scalars(select(RunStats).where(RunStats.run_id.in_(ids))).all()}


def stats_summary(st: RunStats | None) -> dict[str, Any] | None:
    """A RunSummary dict from the maintained stats (None before the first metric row)."""
    if st is None or not st.rows:
        return None
    return json_safe(
        {
            "steps_done": st.steps_done,
            "final_loss": st.final_loss,
            "mean_tokens_per_s": st.tokens_per_s_sum / st.tokens_per_s_count if st.tokens_per_s_count else None,
            "mean_mfu": st.mfu_sum / st.mfu_count if st.mfu_count else None,
            "peak_memory_bytes": st.peak_memory_bytes or None,
        }
    )


# ----------------------------------------------------------------------------------------------- writes
def add_metrics(session: Session, *, run_id: str, attempt: int, rows: Iterable[dict[str, Any]]) -> int:
    """Upsert per-step rows for one attempt (a re-sent step replaces its row: never two rows per
    (run, attempt, step)) and bring the run's summary (``run_stats``) up to date: incrementally for rows appended
    to the latest attempt, by SQL aggregates when rows were replaced or a resumed attempt hid earlier ones.
    Unknown keys go to ``extra``. Returns the number of rows written."""
    values = []
    for r in rows:
        if r.get("step") is None:
            continue
        v: dict[str, Any] = {"run_id": run_id, "attempt": attempt, "step": int(r["step"])}
        for k in METRIC_FIELDS:
            x = json_safe(r.get(k))
            v[k] = int(x) if (k in _INTEGER_METRICS and x is not None) else x
        t = r.get("time")
        v["time"] = datetime.fromtimestamp(t, UTC) if isinstance(t, (int, float)) else (t or utcnow())
        extra = {k: x for k, x in r.items() if k not in METRIC_FIELDS and k not in ("step", "time", "attempt")}
        v["extra"] = json_safe(extra) or None
        values.append(v)
    if not values:
        return 0
    # one row per step (the last wins: a single INSERT .. ON CONFLICT may not touch a row twice), in step order
    # (concurrent writers then lock rows in the same order and cannot deadlock on PostgreSQL)
    values = sorted({v["step"]: v for v in values}.values(), key=lambda v: v["step"])
    lo, hi = values[0]["step"], values[-1]["step"]
    st = _stats_row(session, run_id, lock=True)
    replaced = session.scalar(
        select(func.count()).where(
            Metric.run_id == run_id, Metric.attempt == attempt, Metric.step >= lo, Metric.step <= hi
        )
    )
    firsts = {int(k): int(v) for k, v in (st.first_steps or {}).items()}
    newest = max([attempt, *firsts])
    hides = (attempt not in firsts or lo < firsts[attempt]) and (st.rows or 0) > 0 and lo <= (st.steps_done or 0)
    insert = _insert_for(session)
    stmt = insert(Metric).values(values)
    stmt = stmt.on_conflict_do_update(
        index_elements=["run_id", "attempt", "step"],
        set_={k: getattr(stmt.excluded, k) for k in (*METRIC_FIELDS, "time", "extra")},
    )
    session.execute(stmt)
    if replaced or attempt != newest or hides:
        session.flush()
        recompute_stats(session, run_id=run_id)
    else:
        firsts[attempt] = min(lo, firsts.get(attempt, lo))
        st.first_steps = {str(a): f for a, f in firsts.items()}
        _apply_incremental(st, values)
    return len(values)


def summarize_metrics(session: Session, *, run_id: str, warmup_steps: int = 0) -> dict[str, Any]:
    """Steps done, final loss, mean tokens/s and MFU (excluding warm-up steps), max peak memory. SQL aggregates
    over the series (no row is loaded); with no step past the warm-up, the means cover every step."""
    segs = segments(session, run_id=run_id)
    last = _last_row(session, run_id=run_id, segs=segs)
    if last is None:
        return {"steps_done": 0}
    agg = _aggregate(session, run_id=run_id, segs=segs, after=warmup_steps)
    if not agg["rows"]:
        agg = _aggregate(session, run_id=run_id, segs=segs)
    peak = _aggregate(session, run_id=run_id, segs=segs)["peak_memory_bytes"] if warmup_steps else None
    return json_safe(
        {
            "steps_done": last.step,
            "final_loss": last.loss,
            "mean_tokens_per_s": agg["tokens_per_s_sum"] / agg["tokens_per_s_count"]
            if agg["tokens_per_s_count"]
            else None,
            "mean_mfu": agg["mfu_sum"] / agg["mfu_count"] if agg["mfu_count"] else None,
            "peak_memory_bytes": (peak if warmup_steps else agg["peak_memory_bytes"]) or None,
        }
    )

"""An elastic run's spec in another layout with the same global batch: what the service re-plans a run into
(``service.control.elastic``) and what the spec's checks try for every layout of ``elastic.layouts``."""

from __future__ import annotations

from api.spec.run import Layout, RunSpec

Degrees = tuple[int, int, int]  # (dp, tp, pp)


def degrees(layout: Layout) -> Degrees:
    return (layout.dp, layout.tp, layout.pp)


def preferences(spec: RunSpec) -> list[Degrees]:
    """``elastic.layouts`` as (dp, tp, pp), best first, the run's own layout first unless listed; [] without a list
    (the dp-bounds mode)."""
    if spec.elastic is None or not spec.elastic.layouts:
        return []
    listed = [degrees(lay) for lay in spec.elastic.layouts]
    own = degrees(spec.layout)
    out = [] if own in listed else [own]
    for d in listed:
        if d not in out:
            out.append(d)
    return out


def candidate(spec: RunSpec, dp: int, tp: int | None = None, pp: int | None = None) -> tuple[RunSpec, int, int]:
    """``spec`` in layout (dp, tp, pp) (tp and pp default to the current ones) with the same global batch: (the new
    spec, micro-batches per rank, micro-batch size: the current one when it divides the per-rank batch). The new
    spec keeps how far it may change back (``elastic.max_dp``, or the list with the current layout in it). Raises
    ValueError when the global batch does not split over dp."""
    assert spec.elastic is not None
    lay, gbs, mbs = spec.layout, spec.batch.global_batch_size, spec.batch.micro_batch_size
    tp, pp = lay.tp if tp is None else tp, lay.pp if pp is None else pp
    if dp < 1 or gbs % dp:
        raise ValueError(f"batch.global_batch_size={gbs} does not split over dp={dp}")
    per_rank = gbs // dp
    micro = mbs if per_rank % mbs == 0 else max(d for d in range(1, mbs + 1) if per_rank % d == 0)
    elastic = spec.elastic
    if elastic.layouts:
        ranked = preferences(spec)  # the current layout kept in the list: the run may come back to it
        elastic = elastic.model_copy(update={"layouts": [Layout(dp=d, tp=t, pp=p) for d, t, p in ranked]})
    else:
        elastic = elastic.model_copy(update={"max_dp": elastic.max_dp or lay.dp})
    flavours = {"sequence_parallel": False} if tp == 1 else {}
    new = spec.model_copy(
        update={
            "layout": lay.model_copy(update={"dp": dp, "tp": tp, "pp": pp, **flavours}),
            "batch": spec.batch.model_copy(update={"micro_batch_size": micro}),
            "elastic": elastic,
        }
    )
    return RunSpec.model_validate(new.model_dump()), per_rank // micro, micro

"""Search layouts: every valid (dp, tp, pp, ZeRO stage, HSDP shard group, sequence parallel, schedule, virtual
stages) x micro-batch x activation checkpointing, ranked by predicted tokens/s (``service.planner.core`` prices
each). Pure Python.

Before it scores anything, a search counts its choices from the divisor counts of the world size (divisors come
from the prime factorisation, never from scanning every integer up to the GPU count) and refuses a search space
over ``MAX_SEARCH`` with a ``SpecError`` (the API's 422) that names the field to pin, so a request cannot burn
seconds of CPU. Worlds over ``api.spec.MAX_WORLD_SIZE`` GPUs are refused the same way.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping

from api.spec import (
    MAX_WORLD_SIZE,
    BatchSpec,
    Candidate,
    ClusterSpec,
    Layout,
    ModelConfig,
    ModelSpec,
    Plan,
    PlanCalibration,
    PlanRequest,
    PlanResponse,
    ResolvedLayout,
    RunSpec,
)
from api.spec.presets import PRESETS
from api.spec.validation import SpecError, SpecIssue, check_spec, resolve_model
from service.planner.core import Ctx, Mem, Time, candidate, make_ctx, memory, oom_reason, step_time
from service.planner.devices import device_figures
from service.planner.factors import Factors
from service.planner.prices import resolve_price, with_cost
from service.planner.uncertainty import overlaps

log = logging.getLogger(__name__)

MICRO_BATCH_SIZES = (1, 2, 4, 8, 16, 32)
RECOMPUTE_ORDER = ("none", "selective", "full")
VIRTUAL_STAGES = (2, 3, 4, 6, 8)
MAX_REJECTED = 50
MAX_SEARCH = 250_000  # layout x micro-batch x checkpointing choices one search may score


# ----------------------------------------------------------------------------------------------- divisors
def prime_factors(n: int) -> dict[int, int]:
    """``{prime: exponent}`` by trial division up to sqrt(n)."""
    out: dict[int, int] = {}
    d = 2
    while d * d <= n:
        while n % d == 0:
            out[d] = out.get(d, 0) + 1
            n //= d
        d += 1 if d == 2 else 2
    if n > 1:
        out[n] = out.get(n, 0) + 1
    return out


def divisors(n: int) -> list[int]:
    """Sorted divisors of ``n`` built from its prime factorisation."""
    divs = [1]
    for prime, exp in prime_factors(n).items():
        divs = [d * prime**e for d in divs for e in range(exp + 1)]
    return sorted(divs)


# ------------------------------------------------------------------------------------------------ layouts
def schedules(pp: int, n_layers: int) -> list[tuple[str, int]]:
    if pp == 1:
        return [("1f1b", 1)]
    out = [("1f1b", 1), ("gpipe", 1)]
    out += [("interleaved_1f1b", v) for v in VIRTUAL_STAGES if n_layers % (pp * v) == 0]
    if 2 * pp <= n_layers:
        out += [("interleaved_zero_bubble", 2), ("zbv", 2)]
    return out


def _zeros(dp: int, tp: int, pp: int, gpus_per_node: int) -> list[tuple[int, int]]:
    """(ZeRO stage, FSDP shard degree ``dp_shard``) pairs: all of dp, or (HSDP) one node's data-parallel ranks."""
    if dp == 1:  # nothing to shard over
        return [(0, 1)]
    zeros: list[tuple[int, int]] = [(0, 1), (2, dp), (3, dp)]
    if tp == 1 and pp == 1:
        zeros.insert(1, (1, 1))
    g = gpus_per_node // tp
    if dp > 1 and 1 < g < dp and dp % g == 0:
        zeros += [(2, g), (3, g)]
    return zeros


def _tp_pp(world: int, gpus_per_node: int, n_layers: int) -> Iterator[tuple[int, int]]:
    """(tp, pp) pairs worth scoring: tp divides the node (a TP group never spans nodes); pp <= n_layers."""
    for tp in divisors(world):
        if tp > gpus_per_node or gpus_per_node % tp:
            continue
        for pp in divisors(world // tp):
            if pp <= n_layers:
                yield tp, pp


def layouts(world: int, gpus_per_node: int, n_layers: int) -> Iterator[ResolvedLayout]:
    """Layouts worth scoring for a world size. Generator-level pruning (the rules themselves are
    ``check_spec``'s): tp divides the node; pp <= n_layers; ZeRO stages only with data parallelism, ZeRO-1 only for
    plain data parallel; HSDP shard groups of one node's data-parallel ranks."""
    for tp, pp in _tp_pp(world, gpus_per_node, n_layers):
        dp = world // (tp * pp)
        for sched, v in schedules(pp, n_layers):
            for zero, shard in _zeros(dp, tp, pp, gpus_per_node):
                for sp in (False, True) if tp > 1 else (False,):
                    yield ResolvedLayout(
                        pp=pp,
                        dp_replicate=dp // shard,
                        dp_shard=shard,
                        tp=tp,
                        zero_stage=zero,
                        sequence_parallel=sp,
                        pp_schedule=sched,
                        pp_virtual_stages=v,
                    )


def search_size(world: int, gpus_per_node: int, n_layers: int, *, micro_batches: int, recomputes: int) -> int:
    """How many (layout, micro-batch, checkpointing) choices a search would score, from the divisor counts."""
    n = 0
    for tp, pp in _tp_pp(world, gpus_per_node, n_layers):
        dp = world // (tp * pp)
        n += len(schedules(pp, n_layers)) * len(_zeros(dp, tp, pp, gpus_per_node)) * (2 if tp > 1 else 1)
    return n * micro_batches * recomputes


def check_search_size(
    req: PlanRequest,
    world: int,
    n_layers: int,
    micro_batches: int,
    recomputes: int,
    *,
    parts: list[tuple[int, int]] | None = None,
) -> None:
    """Refuse (SpecError, the API's 422) worlds over MAX_WORLD_SIZE and search spaces over MAX_SEARCH (summed over
    ``parts``, the (world, GPUs per node) pairs a cost ranking searches, when given)."""
    cl = req.cluster
    if world > MAX_WORLD_SIZE:
        most = max(1, MAX_WORLD_SIZE // cl.gpus_per_node)
        raise SpecError(
            [
                SpecIssue(
                    "cluster.nodes",
                    f"nodes x gpus_per_node = {cl.nodes} x {cl.gpus_per_node} = {world:,} GPUs exceeds the "
                    f"{MAX_WORLD_SIZE:,} GPUs the planner searches; use nodes <= {most:,} (plan a part of the "
                    "cluster: data parallelism scales the rest)",
                    "too_large",
                )
            ]
        )
    n = sum(
        search_size(w, per_node, n_layers, micro_batches=micro_batches, recomputes=recomputes)
        for w, per_node in (parts or [(world, cl.gpus_per_node)])
    )
    if n <= MAX_SEARCH:
        return
    if req.micro_batch_size is None:
        param, fix = "micro_batch_size", "pin micro_batch_size (e.g. 1 or 2)"
    elif req.activation_checkpointing is None:
        param, fix = "activation_checkpointing", "pin activation_checkpointing ('none', 'selective' or 'full')"
    else:
        param, fix = "layout", "give a layout to score, or plan for fewer nodes"
    raise SpecError(
        [
            SpecIssue(
                param,
                f"the search space holds {n:,} layout x micro-batch x checkpointing choices, over the "
                f"{MAX_SEARCH:,} one search may score; {fix}",
                "search_too_large",
            )
        ]
    )


# ------------------------------------------------------------------------------------------ validation
def _model_spec_of(cfg: ModelConfig) -> ModelSpec:
    """A ModelSpec that resolves to ``cfg``'s sizes (custom models are checked as a GPT of their sizes)."""
    return ModelSpec(
        name=cfg.name if cfg.name in PRESETS else "gpt",
        preset=None,
        n_layers=cfg.n_layers,
        d_model=cfg.d_model,
        n_heads=cfg.n_heads,
        vocab_size=cfg.vocab_size,
        seq_len=cfg.seq_len,
        d_ff=cfg.d_ff,
    )


class _Validator:
    """``api.spec.validation.check_spec`` on (layout, micro-batch) pairs of one model, batch and precision."""

    def __init__(self, model: ModelSpec, *, global_batch_size: int, precision: str):
        self._base = RunSpec(model=model, precision=precision)
        self._gbs = global_batch_size

    def issues(self, layout: Layout, mb: int) -> list[SpecIssue]:
        spec = self._base.model_copy(
            update={
                "layout": layout,
                "batch": BatchSpec.model_construct(global_batch_size=self._gbs, micro_batch_size=mb),
            }
        )
        return check_spec(spec).errors


class _Rejects:
    """Rejections grouped by reason: one example per group (the closest to fitting, for memory), counted."""

    def __init__(self) -> None:
        self.groups: dict[tuple, list] = {}

    def add(self, key: tuple, item: tuple, size: float = 0.0) -> None:
        g = self.groups.get(key)
        if g is None:
            self.groups[key] = [1, size, item]
        else:
            g[0] += 1
            if size < g[1]:
                g[1], g[2] = size, item

    def candidates(self, c: Ctx, limit: int) -> list[Candidate]:
        out = []
        for count, _, item in sorted(self.groups.values(), key=lambda g: -g[0])[:limit]:
            lay, mb, rec, mem, reason = item
            more = f" [{count} layout and micro-batch choices rejected for this reason]" if count > 1 else ""
            if mem is None:
                mem = Mem(0, 0, 0, 0, 0, 0)
            cand = candidate(c, lay, mb, rec, mem, None, reason=reason + more)
            out.append(cand.model_copy(update={"feasible": False}))
        return out


Scored = tuple[float, float, ResolvedLayout, int, str, Mem, Time]
Priced = Callable[[Candidate], Candidate]  # a candidate -> the same with its cost


def _search(
    c: Ctx,
    model_spec: ModelSpec,
    *,
    micro_batch_sizes: list[int],
    recomputes: list[str],
    lays: Iterable[ResolvedLayout] | None = None,
) -> tuple[list[Scored], _Rejects, int]:
    """Score layouts; returns (feasible results sorted best first, one per layout; rejections; evaluated)."""
    val = _Validator(model_spec, global_batch_size=c.global_batch_size, precision=c.precision)
    rejects = _Rejects()
    feasible: list[Scored] = []
    evaluated = 0
    mem_cap = c.dev.memory_bytes
    for lay in lays if lays is not None else layouts(c.world, c.gpus_per_node, c.shape.L):
        per_dp = c.global_batch_size // lay.dp if c.global_batch_size % lay.dp == 0 else 0
        mbs = [mb for mb in micro_batch_sizes if per_dp and per_dp % mb == 0] or micro_batch_sizes[:1]
        best: Scored | None = None
        spec_layout: Layout | None = None  # the spec form check_spec reads, built once per layout when needed
        for mb in mbs:
            evaluated += len(recomputes)
            # memory before validity: the leanest choice not fitting rejects the pair without check_spec
            leanest = recomputes[-1]
            mem = memory(c, lay, mb, leanest)
            if mem.total > mem_cap:
                rejects.add(("memory", lay.tp, lay.pp), (lay, mb, leanest, mem, oom_reason(c, mem, leanest)), mem.total)
                continue
            spec_layout = spec_layout or lay.to_layout()
            issues = val.issues(spec_layout, mb)
            if issues:
                first = issues[0]
                rejects.add(
                    ("invalid", first.param, first.code),
                    (lay, mb, recomputes[0], None, f"{first.param}: {first.message}"),
                )
                continue
            for rec in recomputes:  # more recompute only adds time: stop at the first that fits
                m = mem if rec == leanest else memory(c, lay, mb, rec)
                if m.total > mem_cap:
                    continue
                tm = step_time(c, lay, mb, rec)
                row: Scored = (-c.global_batch_size * c.shape.s / tm.total, m.total, lay, mb, rec, m, tm)
                if best is None or (row[0], row[1], row[3]) < (best[0], best[1], best[3]):
                    best = row
                break
        if best is not None:  # one answer per layout: its best micro-batch / checkpointing
            feasible.append(best)
    feasible.sort(key=lambda r: (r[0], r[1], r[2].tp * r[2].pp, r[3]))
    return feasible, rejects, evaluated


# ---------------------------------------------------------------------------------------------- answers
def cluster_info(c: Ctx, cluster: ClusterSpec) -> dict:
    return {
        **device_figures(c.dev, c.precision),
        "gpus_per_node": cluster.gpus_per_node,
        "nodes": cluster.nodes,
        "world_size": c.world,
        "precision": c.precision,
        "kernels": c.prof.name,
        "factors": c.fac.to_dict(),
    }


def _response(
    c: Ctx,
    cfg: ModelConfig,
    cluster: ClusterSpec,
    feasible: list[Scored],
    rejects: _Rejects,
    evaluated: int,
    top_k: int,
    t0: float,
    calibration: PlanCalibration | None,
    priced: Priced,
) -> PlanResponse:
    cands = [priced(candidate(c, lay, mb, rec, mem, tm)) for _, _, lay, mb, rec, mem, tm in feasible[:top_k]]
    return PlanResponse(
        model=cfg,
        cluster=cluster_info(c, cluster),
        candidates=cands,
        rejected=rejects.candidates(c, MAX_REJECTED),
        evaluated=evaluated,
        elapsed_s=time.perf_counter() - t0,
        calibration=calibration or PlanCalibration(),
        within_uncertainty=ties(cands),
    )


def ties(cands: list[Candidate], *, per_device: bool = False) -> list[int]:
    """Indexes of the feasible candidates whose step-time interval overlaps the first's (``per_device``: device
    time, devices x step time, as a cost ranking compares them); empty when none but the first is in it."""
    if not cands or not cands[0].feasible or cands[0].step_time_interval is None:
        return []

    def span(cand: Candidate) -> tuple[float, float]:
        iv = cand.step_time_interval
        n = cand.layout.world_size if per_device else 1
        return (iv.low_s * n, iv.high_s * n) if iv is not None else (math.inf, math.inf)

    lo0, hi0 = span(cands[0])
    out = [i for i, cand in enumerate(cands) if cand.feasible and overlaps(*span(cand), lo0, hi0)]
    return out if len(out) > 1 else []


def evaluate(
    model: ModelConfig,
    cluster: ClusterSpec,
    *,
    layout: Layout | ResolvedLayout,
    micro_batch_size: int,
    global_batch_size: int,
    precision: str = "bf16",
    activation_checkpointing: str = "none",
    factors: Factors | None = None,
    validate: bool = True,
) -> Candidate:
    """Score one layout: memory per rank, step time, tokens/s, MFU, feasibility with the reason.

    ``validate`` runs ``api.spec.validation.check_spec`` first and raises ``SpecError`` for a layout the model
    cannot run (the API's 422). The world size is the layout's (dp x tp x pp), on nodes of
    ``cluster.gpus_per_node``. ``layout``: the spec's, or one already resolved (a plan's).
    """
    if validate:
        spec_layout = layout.to_layout() if isinstance(layout, ResolvedLayout) else layout
        errors = _Validator(_model_spec_of(model), global_batch_size=global_batch_size, precision=precision).issues(
            spec_layout, micro_batch_size
        )
        if errors:
            raise SpecError(errors)
    lay = layout if isinstance(layout, ResolvedLayout) else ResolvedLayout.of(layout)
    c = make_ctx(
        model,
        cluster,
        world=lay.world_size,
        global_batch_size=global_batch_size,
        precision=precision,
        factors=factors,
    )
    mem = memory(c, lay, micro_batch_size, activation_checkpointing)
    tm = step_time(c, lay, micro_batch_size, activation_checkpointing)
    return candidate(c, lay, micro_batch_size, activation_checkpointing, mem, tm)


def predict_run(
    spec: RunSpec,
    plan: Plan,
    cluster: ClusterSpec,
    *,
    factors: Factors | None = None,
    prices: Mapping[str, float] | None = None,
) -> Candidate:
    """The prediction stored with a submitted run (``Plan.predicted``); the plan is already validated. Its
    ``cost`` is priced with the spec's ``cluster.price_per_device_hour``, else ``prices`` (the service's settings)
    or the default table for the cluster's device, for the spec's ``train.steps``. A cluster without
    ``kernels`` is priced with meshrun's own loop: ``eager``, ``megatron`` (fused) when the spec compiles."""
    cluster = run_cluster(spec, cluster)
    cand = evaluate(
        plan.model,
        cluster,
        layout=plan.layout,
        micro_batch_size=plan.micro_batch_size,
        global_batch_size=plan.global_batch_size,
        precision=spec.precision,
        activation_checkpointing=spec.activation_checkpointing,
        factors=factors,
        validate=False,
    )
    price, source = resolve_price(cluster.device, spec.cluster.price_per_device_hour, prices)
    return with_cost(cand, tokens_per_step=plan.tokens_per_step, price=price, source=source, steps=spec.train.steps)


def run_cluster(spec: RunSpec, cluster: ClusterSpec) -> ClusterSpec:
    """The cluster a meshrun run is priced on: its ``kernels`` as given, else meshrun's own loop (``eager``;
    ``megatron``, the fused-kernel figures, when the spec compiles its blocks)."""
    if cluster.kernels is not None:
        return cluster
    return cluster.model_copy(update={"kernels": "megatron" if spec.compile else "eager"})


def _request_model(req: PlanRequest) -> tuple[ModelSpec, ModelConfig]:
    model_spec = req.model if req.seq_len is None else req.model.model_copy(update={"seq_len": req.seq_len})
    return model_spec, resolve_model(model_spec)


def search(
    req: PlanRequest,
    *,
    factors: Factors | None = None,
    calibration: PlanCalibration | None = None,
    prices: Mapping[str, float] | None = None,
) -> PlanResponse:
    """Rank layouts for a model on a cluster (world = nodes x gpus_per_node, all of it used).

    Without ``req.layout``: every valid layout x micro-batch x activation checkpointing, best ``top_k`` feasible
    ones by predicted tokens/s; ``rejected`` holds one example per rejection reason (counted in its ``reason``);
    ``evaluated`` counts every combination considered. ``req.micro_batch_size`` and
    ``req.activation_checkpointing`` pin those choices. A search space over ``MAX_SEARCH`` choices (or a world
    over ``MAX_WORLD_SIZE``) is refused with a ``SpecError`` naming the field to pin, before anything is scored.
    ``req.rank_by == "cost"``: the same on every part of the cluster ``cost_parts`` names too, cheapest per
    token first (then fastest).

    With ``req.layout``: scores that layout (raises ``SpecError`` if the model cannot run it) with the best
    micro-batch / checkpointing choice unless pinned; ``candidates`` holds that one answer, feasible or not.
    ``calibration`` (where ``factors`` came from) is passed through to the response. Every feasible candidate
    carries its ``cost``, priced by ``service.planner.prices.resolve_price`` (``prices``: the service's settings).
    """
    t0 = time.perf_counter()
    model_spec, cfg = _request_model(req)
    cluster = req.cluster
    price, source = resolve_price(cluster.device, cluster.price_per_device_hour, prices)
    priced: Priced = functools.partial(
        with_cost, tokens_per_step=req.global_batch_size * cfg.seq_len, price=price, source=source, steps=req.steps
    )
    mbs = [req.micro_batch_size] if req.micro_batch_size else list(MICRO_BATCH_SIZES)
    recs: list[str] = [req.activation_checkpointing] if req.activation_checkpointing else list(RECOMPUTE_ORDER)
    parts = cost_parts(cluster) if req.layout is None and req.rank_by == "cost" else None
    if req.layout is None:
        world = cluster.nodes * cluster.gpus_per_node
        check_search_size(
            req,
            world,
            cfg.n_layers,
            len(mbs),
            len(recs),
            parts=[(p.nodes * p.gpus_per_node, p.gpus_per_node) for p in parts or []] or None,
        )
    else:
        world = req.layout.world_size
    c = make_ctx(
        cfg, cluster, world=world, global_batch_size=req.global_batch_size, precision=req.precision, factors=factors
    )
    if req.layout is None:
        feasible, rejects, evaluated = _search(c, model_spec, micro_batch_sizes=mbs, recomputes=recs)
        if not feasible:
            log.info("no feasible layout for %s on %d x %s", cfg.name, world, c.dev.name)
        if parts is None:
            return _response(c, cfg, cluster, feasible, rejects, evaluated, req.top_k, t0, calibration, priced)
        rows = [(c, row) for row in feasible]
        for part in parts:
            if part.nodes * part.gpus_per_node != world:
                cp = make_ctx(cfg, part, world=part.nodes * part.gpus_per_node, global_batch_size=req.global_batch_size,
                              precision=req.precision, factors=factors)  # fmt: skip
                found, _, n = _search(cp, model_spec, micro_batch_sizes=mbs, recomputes=recs)
                rows += [(cp, row) for row in found]
                evaluated += n
        # cheapest per token first: devices x step time (the global batch, so the tokens per step, is the same)
        rows.sort(key=lambda r: (r[0].world * r[1][6].total, r[1][6].total))
        cands = [priced(candidate(cp, lay, mb, rec, mem, tm)) for cp, (*_, lay, mb, rec, mem, tm) in rows[: req.top_k]]
        resp = _response(c, cfg, cluster, [], rejects, evaluated, req.top_k, t0, calibration, priced)
        return resp.model_copy(
            update={
                "candidates": cands,
                "elapsed_s": time.perf_counter() - t0,
                "within_uncertainty": ties(cands, per_device=True),
            }
        )

    val = _Validator(model_spec, global_batch_size=req.global_batch_size, precision=req.precision)
    valid = [mb for mb in mbs if not val.issues(req.layout, mb)]
    if not valid:
        raise SpecError(val.issues(req.layout, mbs[0]))
    lay = ResolvedLayout.of(req.layout)  # valid (check_spec passed): it resolves
    feasible, rejects, evaluated = _search(c, model_spec, micro_batch_sizes=valid, recomputes=recs, lays=[lay])
    if feasible:
        return _response(c, cfg, cluster, feasible, _Rejects(), evaluated, 1, t0, calibration, priced)
    # nothing fits: answer with the leanest try, infeasible, saying by how much it overflows
    rec = recs[-1]
    mb = min(valid)
    cand = candidate(c, lay, mb, rec, memory(c, lay, mb, rec), step_time(c, lay, mb, rec))
    return PlanResponse(
        model=cfg,
        cluster=cluster_info(c, cluster),
        candidates=[cand],
        evaluated=evaluated,
        elapsed_s=time.perf_counter() - t0,
        calibration=calibration or PlanCalibration(),
    )


def cost_parts(cluster: ClusterSpec) -> list[ClusterSpec]:
    """The parts of a cluster a cost ranking searches: powers of two of GPUs inside one node, powers of two of
    whole nodes, and all of it (a smaller part is often cheaper per token: less communication, no idle bubble)."""
    per_node, nodes = cluster.gpus_per_node, cluster.nodes
    inside = [g for g in _powers_of_two(per_node) if g < per_node] if nodes >= 1 else []
    parts = [cluster.model_copy(update={"nodes": 1, "gpus_per_node": g}) for g in inside]
    parts += [cluster.model_copy(update={"nodes": n}) for n in sorted(set(_powers_of_two(nodes)) | {nodes})]
    return parts


def _powers_of_two(n: int) -> list[int]:
    return [1 << i for i in range(n.bit_length()) if 1 << i <= n]


def best_alternative(spec: RunSpec, cluster: ClusterSpec, *, factors: Factors | None = None) -> Candidate | None:
    """The best feasible layout for the same model, world size (``spec.layout.world_size``), global batch and
    precision, on ``cluster``'s device and node size; None if nothing fits. For the 422 that refuses a
    layout that does not fit."""
    cfg = resolve_model(spec.model)
    world = spec.layout.world_size
    cluster = run_cluster(spec, cluster)
    c = make_ctx(
        cfg,
        cluster,
        world=world,
        global_batch_size=spec.batch.global_batch_size,
        precision=spec.precision,
        factors=factors,
    )
    mbs = sorted(set(MICRO_BATCH_SIZES) | {spec.batch.micro_batch_size})
    if search_size(world, cluster.gpus_per_node, cfg.n_layers, micro_batches=len(mbs), recomputes=3) > MAX_SEARCH:
        return None
    feasible, _, _ = _search(c, spec.model, micro_batch_sizes=mbs, recomputes=list(RECOMPUTE_ORDER))
    if not feasible:
        return None
    _, _, lay, mb, rec, mem, tm = feasible[0]
    return candidate(c, lay, mb, rec, mem, tm)

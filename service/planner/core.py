"""Score and search parallelism layouts: memory per rank, step time, tokens/s and MFU. Pure Python.

How a layout is priced (every number comes from ``formulas``, the device table and ``Factors``):

Memory per rank (the most loaded rank; ``MemoryBreakdown``):
- model states (ZeRO paper; 2 + 2 + 12 bytes/param mixed precision, 4 + 4 + 8 fp32) of the rank's share:
  blocks divided by tp, then by pp (a rank holds ``ceil(L/(p v)) * v`` layers; the embedding -- token and
  position -- sits on the first stage and the final LayerNorm + output head on the last, vocab-parallel over
  tp; we take the larger of the two), then ZeRO-sharded over the data-parallel shard degree (dp for ZeRO-1,
  ``shard_group_size`` or dp for ZeRO-2/3). ``cpu_offload`` moves the states to the host.
- activations: Korthikanti's per-layer bytes (``formulas.activation_bytes_per_layer``) times the layers a
  rank holds times the micro-batches in flight at the schedule's peak (``formulas.pipeline_inflight_factor``);
  full recompute adds one layer's full activations (the recompute working set). The last stage also holds
  one micro-batch's logits: ``s b V / t`` x (activation bytes + 4 fp32 log-probs + 4 fp32 logit grads).
- buffers (the stated allowance): the device's reserved bytes (CUDA context + NCCL, 1 GiB on GPUs; the torch
  + gloo runtime's resident size, 320 MiB, on CPU) + communication buffers (two DDP/ZeRO gradient buckets of
  ``factors.bucket_bytes``, at most the rank's gradients; ZeRO-3: two unsharded FSDP units, params + grads,
  the current and the prefetched one; pipeline send/recv buffers) + ``factors.memory_overhead_fraction`` of
  (states + activations) for allocator fragmentation/workspace.
Feasible = total <= device memory.

Step time (``StepTimeBreakdown``, seconds per optimizer step, on the most loaded rank):
- compute: model GEMM FLOPs (``72 B L s h^2 (1 + s/(6h) + V/(12hL))`` generalised to d_ff) plus recompute
  (full: one more forward of the layers; selective: the attention-score GEMMs again) at
  ``peak x factors.gemm_fraction``, plus ``factors.layer_overhead_s`` per layer per micro-batch and
  ``factors.step_overhead_s``.
- tp_comm: 4 all-reduces of ``b s h`` activations per layer per micro-batch (2 forward, 2 backward; 6 with
  full recompute), ring ``2 n (t-1)/t``; sequence parallelism moves the same bytes as all-gather +
  reduce-scatter pairs. Intra-node tier when the TP group sits in a node, else inter-node. Not overlapped.
- pp_comm: ``b s h / t`` bytes (scatter/gather) per micro-batch per chunk each way; tier: the pipeline
  spans nodes when the world does.
- pp_bubble: ``bubble_fraction`` (``(p-1)/m``, ``/v`` interleaved, ``/3`` more for zero-bubble) of the
  ideal (compute + tp_comm).
- dp_comm (exposed part only): ZeRO-0/1 all-reduce the rank's gradients once per step (``2 Psi'`` ring,
  bucketed), hidden under the last micro-batch's backward up to ``factors.dp_overlap_fraction``; ZeRO-1
  adds the all-gather of updated parameters (not hidden). ZeRO-2/3 (FSDP) communicate every micro-batch:
  reduce-scatter of grads + all-gather of params (ZeRO-3 gathers twice: forward and backward, i.e. 1.5x),
  hidden under that micro-batch's compute up to the overlap fraction; HSDP all-reduces the reduced shard
  across replicas once per step (hidden under the last backward like ZeRO-0). Tiers follow the rank order
  (pp outer, dp_replicate, dp_shard, tp inner; ``api.schemas.Layout``, ``workers.parallel_dims``): a group is
  intra-node when its span of ranks fits in one node.
- total = compute + tp_comm + pp_comm + pp_bubble + dp_comm; tokens/s = B s / total;
  MFU = model FLOPs (no recompute) / (total x world x peak).
Not modelled: optimizer-step time, embedding/vocab collectives, kernel-size effects on GEMM efficiency.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import NamedTuple

from api.presets import PRESETS, gpt_param_count
from api.schemas import (BatchSpec, Candidate, ClusterSpec, Layout, MemoryBreakdown, ModelConfig, ModelSpec,
                         Plan, PlanRequest, PlanResponse, RunSpec, StepTimeBreakdown)
from api.validation import SpecError, SpecIssue, check_spec, resolve_model
from service.planner import formulas as F
from service.planner.devices import GiB, Device, resolve_device
from service.planner.factors import Factors, default_factors

log = logging.getLogger(__name__)

MICRO_BATCH_SIZES = (1, 2, 4, 8, 16, 32)
RECOMPUTE_ORDER = ("none", "selective", "full")
VIRTUAL_STAGES = (2, 3, 4, 6, 8)
MAX_REJECTED = 50


# ----------------------------------------------------------------------------------------------- model
@dataclass(frozen=True)
class _Shape:
    """A model's sizes and per-part parameter/FLOP counts."""

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
    layer_fwd_flops_per_token: float
    attn_score_fwd_flops_per_token: float
    logits_fwd_flops_per_token: float

    @classmethod
    def of(cls, cfg: ModelConfig) -> _Shape:
        L, h, a, V, s, f = cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.vocab_size, cfg.seq_len, cfg.d_ff
        if cfg.name == "mlp":
            block = 2 * h + h * f + f + f * h + h
            embed, head = V * h, V * h + 2 * h
            layer_fwd, attn = 2 * 2 * h * f, 0.0
        else:  # GPT shaped (custom models are priced as a GPT of their sizes)
            block = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h
            embed, head = V * h + s * h, V * h + 2 * h
            attn = 4.0 * s * h  # QK^T and attention x V, forward, per token
            layer_fwd = 2 * (4 * h * h + 2 * h * f) + attn
            n = cfg.n_params or gpt_param_count(n_layers=L, d_model=h, vocab_size=V, seq_len=s, d_ff=f)
            if n != L * block + embed + head and n > embed + head:  # a user model with its own count
                block = (n - embed - head) / L
        return cls(cfg.name, L, h, a, V, s, f, float(block), float(embed), float(head), float(layer_fwd),
                   attn, 2.0 * h * V)

    def model_flops_per_token(self) -> float:
        """Forward + backward GEMM FLOPs per token, no recompute (MFU's numerator)."""
        return 3 * (self.L * self.layer_fwd_flops_per_token + self.logits_fwd_flops_per_token)


class _Lay(NamedTuple):
    """A layout as a plain tuple (fields named like ``api.schemas.Layout``)."""

    dp: int
    tp: int
    pp: int
    zero_stage: int
    shard_group_size: int | None
    sequence_parallel: bool
    pp_schedule: str
    pp_virtual_stages: int
    grad_compression: str = "none"
    cpu_offload: bool = False

    @classmethod
    def of(cls, layout: Layout) -> _Lay:
        return cls(layout.dp, layout.tp, layout.pp, layout.zero_stage, layout.shard_group_size,
                   layout.sequence_parallel, layout.pp_schedule, layout.pp_virtual_stages, layout.grad_compression,
                   layout.cpu_offload)

    def layout(self) -> Layout:
        return Layout(**self._asdict())

    def short(self) -> str:
        s = f"dp={self.dp} tp={self.tp} pp={self.pp} zero={self.zero_stage}"
        if self.shard_group_size:
            s += f" shard_group={self.shard_group_size}"
        if self.sequence_parallel:
            s += " sp"
        if self.pp > 1:
            s += f" {self.pp_schedule}" + (f" v={self.pp_virtual_stages}" if self.pp_virtual_stages > 1 else "")
        return s


class _Mem(NamedTuple):
    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    total: float


class _Time(NamedTuple):
    compute: float
    tp_comm: float
    pp_comm: float
    pp_bubble: float
    dp_comm: float
    total: float


@dataclass(frozen=True)
class _Ctx:
    """Everything fixed during one search: model, device, factors, cluster shape, batch, precision."""

    shape: _Shape
    dev: Device
    fac: Factors
    world: int
    gpus_per_node: int
    global_batch_size: int
    precision: str

    @property
    def act_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    def tier(self, within_node: bool) -> tuple[float, float]:
        """(effective bandwidth bytes/s, latency s) of the intra- or inter-node tier."""
        if within_node:
            return (self.dev.intra_node_bandwidth_bytes_per_s * self.fac.intra_bandwidth_fraction,
                    self.fac.intra_latency_s)
        return (self.dev.inter_node_bandwidth_bytes_per_s * self.fac.inter_bandwidth_fraction,
                self.fac.inter_latency_s)


def _layers_per_rank(c: _Ctx, lay: _Lay) -> int:
    return F.ceil_div(c.shape.L, lay.pp * lay.pp_virtual_stages) * lay.pp_virtual_stages


def _stage_params(c: _Ctx, lay: _Lay) -> float:
    sh = c.shape
    if lay.pp == 1 or lay.pp_schedule == "zbv":  # zbv's V shape puts the first and the last chunk on rank 0
        return (_layers_per_rank(c, lay) * sh.block_params + sh.embed_params + sh.head_params) / lay.tp
    return (_layers_per_rank(c, lay) * sh.block_params + max(sh.embed_params, sh.head_params)) / lay.tp


def _act_per_layer(c: _Ctx, lay: _Lay, mb: int, recompute: str) -> float:
    sh = c.shape
    if sh.family == "mlp":
        return F.mlp_block_activation_bytes(seq_len=sh.s, micro_batch_size=mb, d_model=sh.h, d_ff=sh.f,
                                            recompute=recompute, act_bytes=c.act_bytes)
    return F.activation_bytes_per_layer(seq_len=sh.s, micro_batch_size=mb, d_model=sh.h, n_heads=sh.a,
                                        tp=lay.tp, sequence_parallel=lay.sequence_parallel, recompute=recompute,
                                        flash_attention=c.fac.flash_attention, act_bytes=c.act_bytes)


def _memory(c: _Ctx, lay: _Lay, mb: int, recompute: str) -> _Mem:
    sh, fac = c.shape, c.fac
    t, p, v = lay.tp, lay.pp, lay.pp_virtual_stages
    m = c.global_batch_size // (mb * lay.dp)
    layers = _layers_per_rank(c, lay)
    stage = _stage_params(c, lay)
    shard = (lay.shard_group_size or lay.dp) if lay.zero_stage >= 2 else (lay.dp if lay.zero_stage == 1 else 1)
    params, grads, opt = F.model_state_bytes(stage, zero_stage=lay.zero_stage, shard_degree=shard,
                                             precision=c.precision)
    if lay.cpu_offload:
        params = grads = opt = 0.0
    per_layer = _act_per_layer(c, lay, mb, recompute)
    logits = sh.s * mb * sh.V / t * (c.act_bytes + 8)
    if p == 1:
        act = layers * per_layer + logits
    else:
        inflight = F.pipeline_inflight_factor(schedule=lay.pp_schedule, pp=p, microbatches=m, virtual_stages=v)
        first = inflight * layers * per_layer
        if lay.pp_schedule == "zbv":  # V shape: rank 0 holds the first and the last chunk
            act = first + logits
        else:
            if lay.pp_schedule == "gpipe":
                last_inflight = float(m)
            elif v > 1:
                last_inflight = ((v - 1) * p + 1) / v
            else:
                last_inflight = 1.0
            act = max(first, last_inflight * layers * per_layer + logits)
    if recompute == "full":
        act += _act_per_layer(c, lay, mb, "none")
    pb, gb, _ = F.state_bytes_per_param(c.precision)
    if lay.zero_stage == 3:
        comm = 2 * sh.block_params / t * (pb + gb)
    else:
        comm = 2 * min(fac.bucket_bytes, stage * gb) if lay.dp > 1 else 0
    if p > 1:
        comm += 4 * sh.s * mb * sh.h * c.act_bytes / (t if lay.sequence_parallel else 1)
    buffers = c.dev.reserved_bytes + comm + fac.memory_overhead_fraction * (params + grads + opt + act)
    return _Mem(params, grads, opt, act, buffers, params + grads + opt + act + buffers)


def _time(c: _Ctx, lay: _Lay, mb: int, recompute: str) -> _Time:
    sh, fac = c.shape, c.fac
    t, p, v, dp = lay.tp, lay.pp, lay.pp_virtual_stages, lay.dp
    m = c.global_batch_size // (mb * dp)
    layers = _layers_per_rank(c, lay)
    rate = c.dev.peak_flops_per_s(c.precision) * fac.gemm_fraction
    tokens = mb * sh.s
    layer_flops = 3 * tokens * sh.layer_fwd_flops_per_token
    if recompute == "full":
        layer_flops += tokens * sh.layer_fwd_flops_per_token
    elif recompute == "selective":
        layer_flops += tokens * sh.attn_score_fwd_flops_per_token
    logits_flops = 3 * tokens * sh.logits_fwd_flops_per_token
    compute_mb = (layers * layer_flops + logits_flops) / t / rate + layers * fac.layer_overhead_s

    tp_mb = 0.0
    if t > 1:
        bw, lat = c.tier(F.group_within_node(stride=1, size=t, gpus_per_node=c.gpus_per_node))
        n = tokens * sh.h * c.act_bytes
        n_coll = 6 if recompute == "full" else 4
        if lay.sequence_parallel:
            per = 2 * (lat + F.allgather_wire_bytes(n, t) / bw)
        else:
            per = lat + F.allreduce_wire_bytes(n, t) / bw
        tp_mb = layers * n_coll * per
    pp_mb = 0.0
    if p > 1:
        bw, lat = c.tier(F.group_within_node(stride=t * dp, size=p, gpus_per_node=c.gpus_per_node))
        pp_mb = v * 2 * (lat + tokens * sh.h * c.act_bytes / t / bw)
    bubble = F.bubble_fraction(pp=p, microbatches=m, virtual_stages=v, schedule=lay.pp_schedule) * m * (
        compute_mb + tp_mb)

    dp_comm = 0.0
    if dp > 1:
        stage = _stage_params(c, lay)
        pb, gb, _ = F.state_bytes_per_param(c.precision)
        pbytes, gbytes = stage * pb, stage * gb
        ov = fac.dp_overlap_fraction
        if lay.zero_stage <= 1:
            if lay.grad_compression in ("fp16", "bf16"):
                gbytes = stage * 2
            elif lay.grad_compression == "powersgd":
                gbytes /= 8
            bw, lat = c.tier(F.group_within_node(stride=t, size=dp, gpus_per_node=c.gpus_per_node))
            cost = lat * max(1, F.ceil_div(int(gbytes), fac.bucket_bytes)) + F.allreduce_wire_bytes(gbytes, dp) / bw
            dp_comm = cost - min(ov * cost, compute_mb * 2 / 3)
            if lay.zero_stage == 1:
                dp_comm += lat + F.allgather_wire_bytes(pbytes, dp) / bw
        else:
            ns = lay.shard_group_size or dp
            nr = dp // ns
            units = layers + 1
            gathers = 2 if lay.zero_stage == 3 else 1
            bw, lat = c.tier(F.group_within_node(stride=t, size=ns, gpus_per_node=c.gpus_per_node))
            cost = units * (gathers + 1) * lat + (gathers * F.allgather_wire_bytes(pbytes, ns)
                                                 + F.allgather_wire_bytes(gbytes, ns)) / bw
            if lay.cpu_offload:
                cost += (pbytes + gbytes) / ns / fac.offload_bandwidth_bytes_per_s
            dp_comm = m * (cost - min(ov * cost, compute_mb))
            if nr > 1:  # HSDP: the reduced shards are all-reduced across replicas once per step
                bw_r, lat_r = c.tier(F.group_within_node(stride=t * ns, size=nr, gpus_per_node=c.gpus_per_node))
                rep = units * lat_r + F.allreduce_wire_bytes(gbytes / ns, nr) / bw_r
                dp_comm += rep - min(ov * rep, compute_mb * 2 / 3)
    compute = m * compute_mb + fac.step_overhead_s
    tp_comm, pp_comm = m * tp_mb, m * pp_mb
    return _Time(compute, tp_comm, pp_comm, bubble, dp_comm, compute + tp_comm + pp_comm + bubble + dp_comm)


def _rates(c: _Ctx, tm: _Time) -> tuple[float, float]:
    """(tokens/s, MFU) of a step time."""
    tokens = c.global_batch_size * c.shape.s
    if not (0 < tm.total < math.inf):  # degenerate overrides (e.g. a peak of 1e-300 FLOP/s): report nothing
        return 0.0, 0.0
    mfu = tokens * c.shape.model_flops_per_token() / (tm.total * c.world * c.dev.peak_flops_per_s(c.precision))
    return tokens / tm.total, mfu


def _fmt_gib(x: float) -> str:
    return f"{x / GiB:.1f} GiB"


def _oom_reason(c: _Ctx, mem: _Mem, recompute: str) -> str:
    return (f"out of memory: needs {_fmt_gib(mem.total)} per rank (params {_fmt_gib(mem.params)}, grads "
            f"{_fmt_gib(mem.grads)}, optimizer {_fmt_gib(mem.optimizer)}, activations {_fmt_gib(mem.activations)}"
            f" with activation_checkpointing={recompute}, buffers {_fmt_gib(mem.buffers)}) but {c.dev.name} has "
            f"{_fmt_gib(c.dev.memory_bytes)}; overflows by {_fmt_gib(mem.total - c.dev.memory_bytes)}")


def _fit_reason(c: _Ctx, mem: _Mem, tm: _Time) -> str:
    parts = {"compute": tm.compute, "tp_comm": tm.tp_comm, "pp_comm": tm.pp_comm, "pp_bubble": tm.pp_bubble,
             "dp_comm": tm.dp_comm}
    shares = ", ".join(f"{k} {v / tm.total:.0%}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1])
                       if v / tm.total >= 0.005)
    return (f"fits: {_fmt_gib(mem.total)} of {_fmt_gib(c.dev.memory_bytes)} per rank; step "
            f"{tm.total:.3g} s ({shares})")


def _candidate(c: _Ctx, lay: _Lay, mb: int, recompute: str, mem: _Mem, tm: _Time | None,
               reason: str | None = None) -> Candidate:
    feasible = mem.total <= c.dev.memory_bytes
    tps, mfu = _rates(c, tm) if tm is not None else (0.0, 0.0)
    if reason is None:
        reason = _oom_reason(c, mem, recompute) if not feasible else (_fit_reason(c, mem, tm) if tm else "")
    return Candidate(
        layout=lay.layout(), micro_batch_size=mb, activation_checkpointing=recompute,
        memory_bytes=MemoryBreakdown(**{k: int(round(v)) for k, v in mem._asdict().items()}),
        step_time_s=StepTimeBreakdown(**{k: v if math.isfinite(v) else 0.0 for k, v in tm._asdict().items()})
        if tm is not None else StepTimeBreakdown(),
        tokens_per_s=tps, mfu=mfu, feasible=feasible, reason=reason)


# ------------------------------------------------------------------------------------------ validation
def _model_spec_of(cfg: ModelConfig) -> ModelSpec:
    """A ModelSpec that resolves to ``cfg``'s sizes (custom models are checked as a GPT of their sizes)."""
    return ModelSpec(name=cfg.name if cfg.name in PRESETS else "gpt", preset=None, n_layers=cfg.n_layers,
                     d_model=cfg.d_model, n_heads=cfg.n_heads, vocab_size=cfg.vocab_size, seq_len=cfg.seq_len,
                     d_ff=cfg.d_ff)


class _Validator:
    """``api.validation.check_spec`` on (layout, micro-batch) pairs of one model, batch and precision."""

    def __init__(self, model: ModelSpec, *, global_batch_size: int, precision: str):
        self._base = RunSpec(model=model, precision=precision)
        self._gbs = global_batch_size

    def issues(self, lay: _Lay, mb: int) -> list[SpecIssue]:
        spec = self._base.model_copy(update={
            "layout": Layout.model_construct(**lay._asdict()),
            "batch": BatchSpec.model_construct(global_batch_size=self._gbs, micro_batch_size=mb)})
        return check_spec(spec).errors


def _ctx(cfg: ModelConfig, cluster: ClusterSpec, *, world: int, global_batch_size: int, precision: str,
         factors: Factors | None) -> _Ctx:
    dev = resolve_device(cluster)
    dev.peak_flops_per_s(precision)  # raises for an unsupported precision
    fac = factors if factors is not None else default_factors(is_cpu=dev.is_cpu)
    return _Ctx(_Shape.of(cfg), dev, fac, world, cluster.gpus_per_node, global_batch_size, precision)


def _cluster_info(c: _Ctx, cluster: ClusterSpec) -> dict:
    d = c.dev
    return {"device": d.name, "gpus_per_node": cluster.gpus_per_node, "nodes": cluster.nodes, "world_size": c.world,
            "peak_flops_per_s": d.peak_flops_per_s(c.precision), "memory_bytes": d.memory_bytes,
            "intra_node_bandwidth_bytes_per_s": d.intra_node_bandwidth_bytes_per_s,
            "inter_node_bandwidth_bytes_per_s": d.inter_node_bandwidth_bytes_per_s,
            "precision": c.precision, "factors": c.fac.to_dict()}


# -------------------------------------------------------------------------------------------- evaluate
def evaluate(model: ModelConfig, cluster: ClusterSpec, *, layout: Layout, micro_batch_size: int,
             global_batch_size: int, precision: str = "bf16", activation_checkpointing: str = "none",
             factors: Factors | None = None, validate: bool = True) -> Candidate:
    """Score one layout: memory per rank, step time, tokens/s, MFU, feasibility with the reason.

    ``validate`` runs ``api.validation.check_spec`` first and raises ``SpecError`` for a layout the model
    cannot run (the API's 422). The world size is the layout's (dp x tp x pp), on nodes of
    ``cluster.gpus_per_node``.
    """
    if validate:
        errors = _Validator(_model_spec_of(model), global_batch_size=global_batch_size,
                            precision=precision).issues(_Lay.of(layout), micro_batch_size)
        if errors:
            raise SpecError(errors)
    c = _ctx(model, cluster, world=layout.world_size, global_batch_size=global_batch_size, precision=precision,
             factors=factors)
    lay = _Lay.of(layout)
    mem = _memory(c, lay, micro_batch_size, activation_checkpointing)
    tm = _time(c, lay, micro_batch_size, activation_checkpointing)
    return _candidate(c, lay, micro_batch_size, activation_checkpointing, mem, tm)


def predict_run(spec: RunSpec, plan: Plan, cluster: ClusterSpec, *, factors: Factors | None = None) -> Candidate:
    """The prediction stored with a submitted run (``Plan.predicted``); the plan is already validated."""
    return evaluate(plan.model, cluster, layout=spec.layout, micro_batch_size=plan.micro_batch_size,
                    global_batch_size=plan.global_batch_size, precision=spec.precision,
                    activation_checkpointing=spec.activation_checkpointing, factors=factors, validate=False)


# ---------------------------------------------------------------------------------------------- search
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _schedules(pp: int, n_layers: int) -> list[tuple[str, int]]:
    if pp == 1:
        return [("1f1b", 1)]
    out = [("1f1b", 1), ("gpipe", 1)]
    out += [("interleaved_1f1b", v) for v in VIRTUAL_STAGES if n_layers % (pp * v) == 0]
    if 2 * pp <= n_layers:
        out += [("interleaved_zero_bubble", 2), ("zbv", 2)]
    return out


def _layouts(world: int, gpus_per_node: int, n_layers: int):
    """Layouts worth scoring for a world size. Generator-level pruning (the rules themselves are
    ``check_spec``'s): tp divides the node (a TP group never spans nodes); pp <= n_layers; ZeRO-1 only for
    plain data parallel; HSDP shard groups of one node's data-parallel ranks."""
    for tp in _divisors(world):
        if tp > gpus_per_node or gpus_per_node % tp:
            continue
        for pp in _divisors(world // tp):
            if pp > n_layers:
                continue
            dp = world // (tp * pp)
            zeros: list[tuple[int, int | None]] = [(0, None), (2, None), (3, None)]
            if tp == 1 and pp == 1:
                zeros.insert(1, (1, None))
            g = gpus_per_node // tp
            if dp > 1 and 1 < g < dp and dp % g == 0:
                zeros += [(2, g), (3, g)]
            for sched, v in _schedules(pp, n_layers):
                for zero, sgs in zeros:
                    for sp in ((False, True) if tp > 1 else (False,)):
                        yield _Lay(dp, tp, pp, zero, sgs, sp, sched, v)


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

    def candidates(self, c: _Ctx, limit: int) -> list[Candidate]:
        out = []
        for count, _, item in sorted(self.groups.values(), key=lambda g: -g[0])[:limit]:
            lay, mb, rec, mem, reason = item
            more = f" [{count} layout and micro-batch choices rejected for this reason]" if count > 1 else ""
            if mem is None:
                mem = _Mem(0, 0, 0, 0, 0, 0)
            cand = _candidate(c, lay, mb, rec, mem, None, reason=reason + more)
            out.append(cand.model_copy(update={"feasible": False}))
        return out


def _search(c: _Ctx, model_spec: ModelSpec, *, micro_batch_sizes: list[int], recomputes: list[str],
            layouts=None) -> tuple[list[tuple], _Rejects, int]:
    """Score layouts; returns (feasible results sorted best first, rejections, evaluated count)."""
    val = _Validator(model_spec, global_batch_size=c.global_batch_size, precision=c.precision)
    rejects = _Rejects()
    feasible: list[tuple] = []
    evaluated = 0
    mem_cap = c.dev.memory_bytes
    lays = layouts if layouts is not None else _layouts(c.world, c.gpus_per_node, c.shape.L)
    for lay in lays:
        per_dp = c.global_batch_size // lay.dp if c.global_batch_size % lay.dp == 0 else 0
        mbs = [mb for mb in micro_batch_sizes if per_dp and per_dp % mb == 0] or micro_batch_sizes[:1]
        for mb in mbs:
            evaluated += len(recomputes)
            # memory before validity: the leanest choice not fitting rejects the pair without check_spec
            leanest = recomputes[-1]
            mem = _memory(c, lay, mb, leanest)
            if mem.total > mem_cap:
                rejects.add(("memory", lay.tp, lay.pp), (lay, mb, leanest, mem, _oom_reason(c, mem, leanest)),
                            mem.total)
                continue
            issues = val.issues(lay, mb)
            if issues:
                first = issues[0]
                rejects.add(("invalid", first.param, first.code), (lay, mb, recomputes[0], None,
                                                                    f"{first.param}: {first.message}"))
                continue
            lean_mem = mem
            for rec in recomputes:
                mem = lean_mem if rec == leanest else _memory(c, lay, mb, rec)
                if mem.total > mem_cap:
                    continue
                tm = _time(c, lay, mb, rec)  # more recompute only adds time: stop at the first that fits
                feasible.append((-c.global_batch_size * c.shape.s / tm.total, mem.total, lay, mb, rec, mem, tm))
                break
    feasible.sort(key=lambda r: (r[0], r[1], r[2].tp * r[2].pp, r[3]))
    seen: set[_Lay] = set()
    best_per_layout = []
    for r in feasible:  # one answer per layout: its best micro-batch / checkpointing
        if r[2] not in seen:
            seen.add(r[2])
            best_per_layout.append(r)
    return best_per_layout, rejects, evaluated


def _response(c: _Ctx, cfg: ModelConfig, cluster: ClusterSpec, feasible: list[tuple], rejects: _Rejects,
              evaluated: int, top_k: int, t0: float) -> PlanResponse:
    cands = [_candidate(c, lay, mb, rec, mem, tm) for _, _, lay, mb, rec, mem, tm in feasible[:top_k]]
    return PlanResponse(model=cfg, cluster=_cluster_info(c, cluster), candidates=cands,
                        rejected=rejects.candidates(c, MAX_REJECTED), evaluated=evaluated,
                        elapsed_s=time.perf_counter() - t0)


def _request_model(req: PlanRequest) -> tuple[ModelSpec, ModelConfig]:
    model_spec = req.model if req.seq_len is None else req.model.model_copy(update={"seq_len": req.seq_len})
    return model_spec, resolve_model(model_spec)


def search(req: PlanRequest, *, factors: Factors | None = None) -> PlanResponse:
    """Rank layouts for a model on a cluster (world = nodes x gpus_per_node, all of it used).

    Without ``req.layout``: every valid (dp, tp, pp, ZeRO stage, HSDP shard group, sequence parallel,
    schedule, virtual stages) x micro-batch x activation checkpointing, best ``top_k`` feasible ones by
    predicted tokens/s; ``rejected`` holds one example per rejection reason (counted in its ``reason``);
    ``evaluated`` counts every combination considered. ``req.micro_batch_size`` and
    ``req.activation_checkpointing`` pin those choices.

    With ``req.layout``: scores that layout (raises ``SpecError`` if the model cannot run it) with the best
    micro-batch / checkpointing choice unless pinned; ``candidates`` holds that one answer, feasible or not.
    """
    t0 = time.perf_counter()
    model_spec, cfg = _request_model(req)
    cluster = req.cluster
    world = req.layout.world_size if req.layout is not None else cluster.nodes * cluster.gpus_per_node
    c = _ctx(cfg, cluster, world=world, global_batch_size=req.global_batch_size, precision=req.precision,
             factors=factors)
    mbs = [req.micro_batch_size] if req.micro_batch_size else list(MICRO_BATCH_SIZES)
    recs = [req.activation_checkpointing] if req.activation_checkpointing else list(RECOMPUTE_ORDER)
    if req.layout is None:
        feasible, rejects, evaluated = _search(c, model_spec, micro_batch_sizes=mbs, recomputes=recs)
        if not feasible:
            log.info("no feasible layout for %s on %d x %s", cfg.name, world, c.dev.name)
        return _response(c, cfg, cluster, feasible, rejects, evaluated, req.top_k, t0)

    lay = _Lay.of(req.layout)
    val = _Validator(model_spec, global_batch_size=req.global_batch_size, precision=req.precision)
    valid = [mb for mb in mbs if not val.issues(lay, mb)]
    if not valid:
        raise SpecError(val.issues(lay, mbs[0]))
    feasible, rejects, evaluated = _search(c, model_spec, micro_batch_sizes=valid, recomputes=recs,
                                           layouts=[lay])
    if feasible:
        return _response(c, cfg, cluster, feasible, _Rejects(), evaluated, 1, t0)
    # nothing fits: answer with the leanest try, infeasible, saying by how much it overflows
    rec = recs[-1]
    mb = min(valid)
    cand = _candidate(c, lay, mb, rec, _memory(c, lay, mb, rec), _time(c, lay, mb, rec))
    return PlanResponse(model=cfg, cluster=_cluster_info(c, cluster), candidates=[cand], evaluated=evaluated,
                        elapsed_s=time.perf_counter() - t0)


def best_alternative(spec: RunSpec, cluster: ClusterSpec, *, factors: Factors | None = None) -> Candidate | None:
    """The best feasible layout for the same model, world size (``spec.layout.world_size``), global batch and
    precision, on ``cluster``'s device and node size; None if nothing fits. For the 422 that refuses a
    layout that does not fit."""
    cfg = resolve_model(spec.model)
    world = spec.layout.world_size
    c = _ctx(cfg, cluster, world=world, global_batch_size=spec.batch.global_batch_size, precision=spec.precision,
             factors=factors)
    mbs = sorted(set(MICRO_BATCH_SIZES) | {spec.batch.micro_batch_size})
    feasible, _, _ = _search(c, spec.model, micro_batch_sizes=mbs, recomputes=list(RECOMPUTE_ORDER))
    if not feasible:
        return None
    _, _, lay, mb, rec, mem, tm = feasible[0]
    return _candidate(c, lay, mb, rec, mem, tm)

"""Score one layout: memory per rank and step time (with their breakdowns), tokens/s and MFU. Pure Python.

Memory per rank (the most loaded rank; ``MemoryBreakdown``):
- model states (ZeRO paper; 2 + 2 + 12 bytes/param mixed precision, 4 + 4 + 8 fp32) of the rank's share:
  blocks divided by tp, then by pp (the embedding -- token and position -- sits on the first stage and the final
  LayerNorm + output head on the last, vocab-parallel over tp; we take the larger of the two), then ZeRO-sharded
  over the data-parallel shard degree. ``cpu_offload`` moves the states to the host.
- activations: Korthikanti's per-layer bytes (``formulas.activation_bytes_per_layer``) times the layers a rank
  holds times the micro-batches in flight at the schedule's peak (``formulas.pipeline_inflight_factor``); full
  recompute adds one layer's full activations (the recompute working set). The last stage also holds one
  micro-batch's logits and loss buffers: ``s b V / t`` x (2 bytes of 16-bit logits + 4 of their fp32 copy + 4 of
  the saved log-probs + 4 of the fp32 gradient; 12 in fp32).
- buffers: the device's reserved bytes (CUDA context, cuBLAS workspace, NCCL; the torch + gloo runtime on CPU),
  plus 256 MiB of communicator buffers per parallel dimension in use, DDP/ZeRO gradient buckets (two of
  ``factors.bucket_bytes``), two unsharded FSDP units under ZeRO-3, pipeline send/recv buffers, and the caching
  allocator's slack: ``device.fragmentation_fraction + factors.memory_overhead_fraction`` of states +
  activations (measured on H100: reserved exceeds the allocated peak by 2-14 %).
Feasible = total <= device memory.

Step time (``StepTimeBreakdown``; seconds per optimizer step on the most loaded rank):
- per layer, the embedding and the head: kernel times by shape (``service.planner.compute``); on a GPU a pass
  takes the larger of its device time and its launches x ``kernel_launch_s`` (a 4-norm: some stalls near parity;
  a host-bound pass shows as compute), on a CPU the sum;
- pipeline: per-rank forward/backward times into the schedule (``service.planner.pipeline``): compute and
  tp_comm are the busiest rank's, ``pp_bubble`` its idle time, ``pp_comm`` its point-to-point transfers;
- data parallel (``dp_comm`` exposed, ``dp_comm_total`` all): ZeRO-0/1 all-reduce the gradients once per step in
  buckets that start as the last backward pass produces them (``comm.bucketed_exposed``; ZeRO-1 adds the
  all-gather of the updated parameters); ZeRO-2/3 (FSDP) gather each unit's parameters before its forward (and,
  ZeRO-3, its backward) and reduce-scatter its gradients, every micro-batch, prefetched under the previous unit's
  compute: a unit's transfer shows only where it outlasts that compute; HSDP adds a once-per-step all-reduce of
  the shards across replicas;
- optimizer: the step over the local shard, memory-bound; other: ``factors.step_overhead_s`` plus the kernel
  profile's host time per step and per micro-batch (``service.planner.profiles``: ``megatron`` or ``eager``).
MFU = model FLOPs (no recompute) / (total x world x peak).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

from api.spec import (
    Candidate,
    ClusterSpec,
    MemoryBreakdown,
    ModelConfig,
    ResolvedLayout,
    StepTimeBreakdown,
    StepTimeInterval,
)
from service.planner import comm, uncertainty
from service.planner import formulas as F
from service.planner.compute import Cost, Env, Shape, embed_cost, head_cost, layer_cost, optimizer_time
from service.planner.devices import Device, GiB, MiB, resolve_device
from service.planner.factors import Factors, default_factors
from service.planner.pipeline import pipeline_step
from service.planner.profiles import MEGATRON, KernelProfile, profile

COMM_BUFFER_BYTES = 256 * MiB  # NCCL buffers per process group in use
# Communication that overlaps compute still slows it: NCCL kernels hold SMs (one block per channel, 8-32 channels
# of 108-132 SMs) and HBM bandwidth while they run. The hidden part of data-parallel communication costs this
# fraction of itself.
OVERLAP_INTERFERENCE = 0.25


class Mem(NamedTuple):
    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    total: float


class Time(NamedTuple):
    compute: float
    tp_comm: float
    pp_comm: float
    pp_bubble: float
    dp_comm: float
    optimizer: float
    other: float
    dp_comm_total: float
    total: float


@dataclass(frozen=True)
class Ctx:
    """Everything fixed during one search: model, device, factors, cluster shape, batch, precision."""

    shape: Shape
    dev: Device
    fac: Factors
    world: int
    gpus_per_node: int
    global_batch_size: int
    precision: str
    prof: KernelProfile = MEGATRON

    @property
    def act_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    @property
    def peak(self) -> float:
        return self.dev.peak_flops_per_s(self.precision)

    @property
    def env(self) -> Env:
        return Env(self.dev, self.fac, self.peak, self.act_bytes, self.gpus_per_node, self.prof)


def make_ctx(
    cfg: ModelConfig,
    cluster: ClusterSpec,
    *,
    world: int,
    global_batch_size: int,
    precision: str,
    factors: Factors | None,
) -> Ctx:
    dev = resolve_device(cluster)
    dev.peak_flops_per_s(precision)  # raises for an unsupported precision
    fac = factors if factors is not None else default_factors(is_cpu=dev.is_cpu)
    prof = profile(cluster.kernels)
    return Ctx(Shape.of(cfg), dev, fac, world, cluster.gpus_per_node, global_batch_size, precision, prof)


# ------------------------------------------------------------------------------------------------ layers
def stage_layers(L: int, lay: ResolvedLayout) -> list[int]:
    """Layers each pipeline rank holds: ``p v`` chunks of ``L // (p v)`` layers, the first ``L % (p v)`` chunks
    one more; rank ``i`` holds chunks ``i, i + p, ...`` (the V schedule: ``i`` and ``2p - 1 - i``)."""
    p, v = lay.pp, lay.pp_virtual_stages
    chunks = p * v
    base, extra = divmod(L, chunks)
    sizes = [base + (1 if c < extra else 0) for c in range(chunks)]
    if lay.pp_schedule == "zbv" and v == 2:
        return [sizes[i] + sizes[2 * p - 1 - i] for i in range(p)]
    return [sum(sizes[i::p]) for i in range(p)]


def _layers_per_rank(c: Ctx, lay: ResolvedLayout) -> int:
    return max(stage_layers(c.shape.L, lay))


def _stage_params(c: Ctx, lay: ResolvedLayout) -> float:
    """Parameters of the most loaded rank (its layers plus the embedding or the head), divided over tp."""
    sh = c.shape
    layers = stage_layers(sh.L, lay)
    p = lay.pp
    if p == 1:
        return (layers[0] * sh.block_params + sh.embed_params + sh.head_params) / lay.tp
    if lay.pp_schedule == "zbv":  # the V puts the first and the last chunk on rank 0
        edge = [sh.embed_params + sh.head_params] + [0.0] * (p - 1)
    else:
        edge = [sh.embed_params] + [0.0] * (p - 2) + [sh.head_params]
    return max(n * sh.block_params + e for n, e in zip(layers, edge)) / lay.tp


# ------------------------------------------------------------------------------------------------ memory
def _act_per_layer(c: Ctx, lay: ResolvedLayout, mb: int, recompute: str) -> float:
    sh = c.shape
    if sh.family == "mlp":
        return F.mlp_block_activation_bytes(
            seq_len=sh.s, micro_batch_size=mb, d_model=sh.h, d_ff=sh.f, recompute=recompute, act_bytes=c.act_bytes
        )
    return F.activation_bytes_per_layer(
        seq_len=sh.s,
        micro_batch_size=mb,
        d_model=sh.h,
        n_heads=sh.a,
        tp=lay.tp,
        sequence_parallel=lay.sequence_parallel,
        recompute=recompute,
        flash_attention=sh.flash and c.fac.flash_attention,
        act_bytes=c.act_bytes,
        score_bytes=c.prof.score_bytes,
    )


def memory(c: Ctx, lay: ResolvedLayout, mb: int, recompute: str) -> Mem:
    sh, fac = c.shape, c.fac
    t, p, v = lay.tp, lay.pp, lay.pp_virtual_stages
    m = c.global_batch_size // (mb * lay.dp)
    layers = _layers_per_rank(c, lay)
    stage = _stage_params(c, lay)
    params, grads, opt = F.model_state_bytes(
        stage, zero_stage=lay.zero_stage, shard_degree=lay.shard_degree, precision=c.precision
    )
    if lay.cpu_offload:
        params = grads = opt = 0.0
    per_layer = _act_per_layer(c, lay, mb, recompute)
    # last stage: 16-bit logits, their fp32 copy for the loss, the saved fp32 log-probs and the fp32 gradient
    logits = sh.s * mb * sh.V / t * (c.act_bytes + 12 if c.act_bytes == 2 else 12)
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
        comm_buf = 2 * sh.block_params / t * (pb + gb)
    else:
        comm_buf = 2 * min(fac.bucket_bytes, stage * gb) if lay.dp > 1 else 0
    if p > 1:
        comm_buf += 4 * sh.s * mb * sh.h * c.act_bytes / (t if lay.sequence_parallel else 1)
    if not c.dev.is_cpu:
        comm_buf += COMM_BUFFER_BYTES * sum(1 for d in (lay.dp, t, p) if d > 1)
    slack = (c.dev.fragmentation_fraction + fac.memory_overhead_fraction) * (params + grads + opt + act)
    buffers = c.dev.reserved_bytes + comm_buf + slack
    return Mem(params, grads, opt, act, buffers, params + grads + opt + act + buffers)


# -------------------------------------------------------------------------------------------------- time
@lru_cache(maxsize=4096)
def _costs(env: Env, sh: Shape, mb: int, t: int, sp: bool, recompute: str) -> tuple[Cost, Cost, Cost]:
    return (
        layer_cost(env, sh, mb=mb, t=t, sp=sp, recompute=recompute),
        embed_cost(env, sh, mb=mb, t=t, sp=sp),
        head_cost(env, sh, mb=mb, t=t, sp=sp),
    )


HOST_OVERLAP_NORM = 4.0  # device and host time of a pass combine as a 4-norm: the larger, plus stalls near parity


def _overlap(dev_s: float, host_s: float) -> float:
    """A pass whose kernels take ``dev_s`` on the GPU and ``host_s`` to launch: asynchronous launches hide the
    smaller of the two, except near parity, where the queue runs dry now and then (a p-norm, p = 4: the larger
    time, 19 % more at parity)."""
    if dev_s <= 0 or host_s <= 0:
        return max(dev_s, host_s)
    p = HOST_OVERLAP_NORM
    return (dev_s**p + host_s**p) ** (1 / p)


def _passes(c: Ctx, cost: Cost, launch_s: float) -> tuple[float, float, float, float]:
    """(forward, backward incl. recompute, weight-gradient part, tensor-parallel comm) of a pass, host-bounded."""
    rs = c.fac.recompute_scale * c.prof.recompute_host_scale
    tp_f, tp_b = cost.tp_fwd, cost.tp_bwd + cost.tp_recompute
    dev_f = cost.fwd + tp_f
    dev_b = cost.bwd_input + cost.bwd_weight + cost.recompute + tp_b
    host_f = cost.launches_fwd * launch_s
    host_b = (cost.launches_bwd + rs * cost.launches_recompute) * launch_s
    if c.dev.is_cpu:  # eager CPU ops run synchronously: framework time adds up
        return dev_f + host_f, dev_b + host_b, cost.bwd_weight, tp_f + tp_b
    return _overlap(dev_f, host_f), _overlap(dev_b, host_b), cost.bwd_weight, tp_f + tp_b


def step_time(c: Ctx, lay: ResolvedLayout, mb: int, recompute: str) -> Time:
    sh, fac, dev = c.shape, c.fac, c.dev
    t, p, v, dp = lay.tp, lay.pp, lay.pp_virtual_stages, lay.dp
    m = max(1, c.global_batch_size // (mb * dp))
    env = c.env
    lc, ec, hc = _costs(env, sh, mb, t, lay.sequence_parallel, recompute)
    launch = max(dev.kernel_launch_s, c.prof.host_op_s) * fac.launch_scale
    lf, lb, lw, ltp = _passes(c, lc, launch)
    ef, eb, ew, etp = _passes(c, ec, launch)
    hf, hb, hw, htp = _passes(c, hc, launch)

    layers = stage_layers(sh.L, lay)
    fwd = [n * lf for n in layers]
    bwd = [n * lb for n in layers]
    wgt = [n * lw for n in layers]
    tpc = [n * ltp for n in layers]
    first, last = 0, (0 if lay.pp_schedule == "zbv" else p - 1)
    for i, (f_, b_, w_, tp_) in ((first, (ef, eb, ew, etp)), (last, (hf, hb, hw, htp))):
        fwd[i] += f_
        bwd[i] += b_
        wgt[i] += w_
        tpc[i] += tp_

    p2p_s = 0.0
    if p > 1:
        g = comm.group(stride=t * dp, size=p, gpus_per_node=c.gpus_per_node)
        ln = comm.link(
            dev,
            comm.Group(2, g.per_node if g.nodes == 1 else 1),
            bandwidth_efficiency=fac.pp_bandwidth_efficiency,
            latency_scale=fac.pp_latency_scale,
        )
        act = mb * sh.s * sh.h * c.act_bytes  # one stage's output (the whole activation)
        if lay.sequence_parallel:  # already sharded over the t ranks: each sends its shard
            p2p_s = comm.p2p(act / t, ln)
        elif t > 1 and c.prof.pp_scatter_gather:  # each sends 1/t; the next stage all-gathers it (profiles.py)
            p2p_s = comm.p2p(act / t, ln) + comm.all_gather(act, t, env.tp_link(t))
        else:
            p2p_s = comm.p2p(act, ln)
    total_pipe, bubble, b = pipeline_step(
        fwd, bwd, wgt, microbatches=m, schedule=lay.pp_schedule, virtual_stages=v, p2p_s=p2p_s
    )
    tp_comm = m * tpc[b]
    compute = m * (fwd[b] + bwd[b]) - tp_comm
    pp_comm = m * v * 2 * p2p_s if p > 1 else 0.0
    bubble *= fac.bubble_scale

    dp_exposed = dp_total = 0.0
    if dp > 1 and lay.sync in ("local_sgd", "diloco"):
        dp_exposed, dp_total = _periodic(c, lay, m, lf, lb, layers[b], bwd[b])
    elif dp > 1 and lay.sync == "async_ps":
        dp_exposed, dp_total = _ps(c, lay, compute + tp_comm + pp_comm + bubble)
    elif dp > 1 and lay.zero_stage <= 1:  # buckets hide under the busiest rank's last backward pass
        dp_exposed, dp_total = _ddp(c, lay, bwd[b])
    elif dp > 1:
        dp_exposed, dp_total = _fsdp(c, lay, m, lf, lb, layers[b], bwd[b])
    opt_local = _stage_params(c, lay) / lay.shard_degree
    if lay.cpu_offload:
        opt_s = opt_local * 36 / fac.offload_bandwidth_bytes_per_s
    else:
        opt_s = optimizer_time(env, opt_local)
    opt_s *= fac.optimizer_scale
    other = fac.step_overhead_s + c.prof.step_overhead_s + m * c.prof.microbatch_overhead_s
    total = compute + tp_comm + pp_comm + bubble + dp_exposed + opt_s + other
    return Time(compute, tp_comm, pp_comm, bubble, dp_exposed, opt_s, other, dp_total, total)


def _grad_bytes(c: Ctx, lay: ResolvedLayout, params: float) -> float:
    """Bytes of gradients a rank reduces: fp32 (mixed precision reduces fp32 main grads), halved by fp16/bf16
    compression hooks, /8 for PowerSGD's low-rank factors."""
    b = params * 4
    if lay.grad_compression in ("fp16", "bf16"):
        b = params * 2
    elif lay.grad_compression == "powersgd":
        b /= 8
    return b


def _dp_link(c: Ctx, size: int, stride: int) -> comm.Link:
    g = comm.group(stride=stride, size=size, gpus_per_node=c.gpus_per_node)
    return comm.link(c.dev, g, bandwidth_efficiency=c.fac.dp_bandwidth_efficiency, latency_scale=c.fac.dp_latency_scale)


def _ddp(c: Ctx, lay: ResolvedLayout, last_backward_s: float) -> tuple[float, float]:
    """(exposed, total) seconds of DDP (ZeRO-0) / ZeRO-1 communication per step."""
    stage = _stage_params(c, lay)
    ln = _dp_link(c, lay.dp, lay.tp)
    gbytes = _grad_bytes(c, lay, stage)
    buckets = max(1, math.ceil(gbytes / c.fac.bucket_bytes))
    ar = buckets * comm.all_reduce(gbytes / buckets, lay.dp, ln)
    exposed = comm.bucketed_exposed(ar, buckets, c.fac.dp_overlap_fraction * last_backward_s)
    exposed += OVERLAP_INTERFERENCE * (ar - exposed)
    total = ar
    if lay.zero_stage == 1:  # the updated parameters are gathered after the step: nothing to hide under
        gather = comm.all_gather(stage * c.act_bytes, lay.dp, ln)
        exposed += gather
        total += gather
    return exposed, total


def _fsdp(
    c: Ctx, lay: ResolvedLayout, m: int, lf: float, lb: float, layers: int, last_backward_s: float
) -> tuple[float, float]:
    """(exposed, total) seconds of FSDP (ZeRO-2/3, HSDP) communication per step. Units: one per layer + the root
    (embedding and head); each unit's gather is prefetched under the previous unit's compute (``lf``/``lb`` per
    layer), so it shows only where it outlasts it."""
    ov = c.fac.dp_overlap_fraction
    ns, nr = lay.dp_shard, lay.dp_replicate
    stage = _stage_params(c, lay)
    units = max(1, layers) + 1
    ln = _dp_link(c, ns, lay.tp)
    unit_params = stage / units
    ag = comm.all_gather(unit_params * c.act_bytes, ns, ln)
    rs = comm.reduce_scatter(unit_params * c.act_bytes, ns, ln)
    if lay.cpu_offload:
        move = unit_params * (c.act_bytes + 4) / ns / c.fac.offload_bandwidth_bytes_per_s
        ag += move
        rs += move
    bwd_x = rs + (ag if lay.zero_stage == 3 else 0.0)
    exposed_f = ag + (units - 1) * max(0.0, ag - ov * lf)
    exposed_b = bwd_x + (units - 1) * max(0.0, bwd_x - ov * lb)
    total = m * units * (ag + bwd_x)
    exposed = m * (exposed_f + exposed_b)
    exposed += OVERLAP_INTERFERENCE * (total - exposed)
    if nr > 1:  # HSDP: the reduced shards are all-reduced across replicas once per step
        lr = _dp_link(c, nr, lay.tp * ns)
        gbytes = _grad_bytes(c, lay, stage) / ns
        buckets = max(1, math.ceil(gbytes / c.fac.bucket_bytes))
        rep = buckets * comm.all_reduce(gbytes / buckets, nr, lr)
        total += rep
        rep_exposed = comm.bucketed_exposed(rep, buckets, ov * last_backward_s)
        exposed += rep_exposed + OVERLAP_INTERFERENCE * (rep - rep_exposed)
    return exposed, total


def _periodic(
    c: Ctx, lay: ResolvedLayout, m: int, lf: float, lb: float, layers: int, last_backward_s: float
) -> tuple[float, float]:
    """local_sgd / diloco, (exposed, total) seconds per step: FSDP inside each replica (zero 2/3), and one
    all-reduce of the fp32 parameter deltas across the replicas every ``sync_every_steps`` (H) steps, blocking
    (nothing to hide it under), so 1/H of it per step."""
    ns, replicas = lay.dp_shard, lay.dp_replicate
    exposed = total = 0.0
    if ns > 1:  # FSDP inside one replica: its shard group, nothing replicated
        exposed, total = _fsdp(c, lay.replace(dp_replicate=1), m, lf, lb, layers, last_backward_s)
    avg = comm.all_reduce(_stage_params(c, lay) * 4 / ns, replicas, _dp_link(c, replicas, lay.tp * ns))
    avg /= lay.sync_every_steps
    return exposed + avg, total + avg


def _ps(c: Ctx, lay: ResolvedLayout, busy_s: float) -> tuple[float, float]:
    """async_ps, (exposed, total) seconds per step: every worker pushes its fp32 gradients and pulls the fp32
    parameters over the network tier (the servers are other processes, on other nodes in general); the
    ``ps_shards`` servers take all ``dp`` workers' traffic. With ``max_staleness >= 1`` the transfers of one step
    overlap the next step's compute; with 0 every step waits for them."""
    dev, fac = c.dev, c.fac
    nbytes = _stage_params(c, lay) * 4
    bw = dev.inter_node_bandwidth_bytes_per_s * fac.dp_bandwidth_efficiency
    worker = 2 * nbytes / bw
    server = lay.dp * 2 * nbytes / lay.ps_shards / bw
    total = max(worker, server) + 2 * (dev.inter_node_latency_s * fac.dp_latency_scale + dev.collective_base_s)
    exposed = total if lay.max_staleness == 0 else max(0.0, total - busy_s)
    return exposed, total


PAYOFF = 1.15  # an alternative mode is named when it is predicted at least this much faster


def sync_advice(c: Ctx, lay: ResolvedLayout, mb: int, recompute: str, tm: Time) -> str:
    """When the data-parallel traffic of a synchronous layout is a large share of its step, the modes that cut it
    (diloco at H = 8, async_ps with one server per 4 workers), predicted on the same layout, if they pay off."""
    if lay.sync != "sync" or lay.dp < 2 or tm.dp_comm < 0.2 * tm.total or lay.pp > 1:
        return ""
    out = []
    plain = {"zero_stage": 0, "dp_replicate": lay.dp, "dp_shard": 1}  # the modes' replicas hold whole models
    for name, alt in (  # priced, not run: model_copy (ps_shards may pass the spec's bound)
        ("diloco (sync_every_steps 8)", lay.model_copy(update={**plain, "sync": "diloco", "sync_every_steps": 8})),
        (
            "async_ps (max_staleness 4)",
            lay.model_copy(update={**plain, "sync": "async_ps", "ps_shards": max(1, lay.dp // 4)}),
        ),
    ):
        if name.startswith("async_ps") and lay.tp > 1:
            continue
        alt_t = step_time(c, alt, mb, recompute).total
        if alt_t * PAYOFF < tm.total:
            out.append(f"{name} {tm.total / alt_t:.1f}x faster")
    if not out:
        return ""
    return (
        f"; data-parallel communication is {tm.dp_comm / tm.total:.0%} of the step: layout.sync "
        + ", ".join(out)
        + " (fewer or overlapped cross-group transfers; convergence per step differs)"
    )


# ---------------------------------------------------------------------------------------------- answers
def rates(c: Ctx, tm: Time) -> tuple[float, float]:
    """(tokens/s, MFU) of a step time."""
    tokens = c.global_batch_size * c.shape.s
    if not (0 < tm.total < math.inf):  # degenerate overrides (e.g. a peak of 1e-300 FLOP/s): report nothing
        return 0.0, 0.0
    mfu = tokens * c.shape.model_flops_per_token() / (tm.total * c.world * c.peak)
    return tokens / tm.total, mfu


def fmt_gib(x: float) -> str:
    return f"{x / GiB:.1f} GiB"


def oom_reason(c: Ctx, mem: Mem, recompute: str) -> str:
    return (
        f"out of memory: needs {fmt_gib(mem.total)} per rank (params {fmt_gib(mem.params)}, grads "
        f"{fmt_gib(mem.grads)}, optimizer {fmt_gib(mem.optimizer)}, activations {fmt_gib(mem.activations)}"
        f" with activation_checkpointing={recompute}, buffers {fmt_gib(mem.buffers)}) but {c.dev.name} has "
        f"{fmt_gib(c.dev.memory_bytes)}; overflows by {fmt_gib(mem.total - c.dev.memory_bytes)}"
    )


def fit_reason(c: Ctx, mem: Mem, tm: Time) -> str:
    parts = {k: getattr(tm, k) for k in ("compute", "tp_comm", "pp_comm", "pp_bubble", "dp_comm", "optimizer")}
    shares = ", ".join(
        f"{k} {v / tm.total:.0%}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]) if v / tm.total >= 0.005
    )
    return f"fits: {fmt_gib(mem.total)} of {fmt_gib(c.dev.memory_bytes)} per rank; step {tm.total:.3g} s ({shares})"


def candidate(
    c: Ctx, lay: ResolvedLayout, mb: int, recompute: str, mem: Mem, tm: Time | None, reason: str | None = None
) -> Candidate:
    feasible = mem.total <= c.dev.memory_bytes
    tps, mfu = rates(c, tm) if tm is not None else (0.0, 0.0)
    if reason is None:
        reason = (
            oom_reason(c, mem, recompute)
            if not feasible
            else (fit_reason(c, mem, tm) + sync_advice(c, lay, mb, recompute, tm) if tm else "")
        )
    return Candidate(
        layout=lay.to_layout(),
        micro_batch_size=mb,
        activation_checkpointing=recompute,
        memory_bytes=MemoryBreakdown(**{k: int(round(v)) for k, v in mem._asdict().items()}),
        step_time_s=StepTimeBreakdown(**{k: v if math.isfinite(v) else 0.0 for k, v in tm._asdict().items()})
        if tm is not None
        else StepTimeBreakdown(),
        tokens_per_s=tps,
        mfu=mfu,
        feasible=feasible,
        reason=reason,
        attention="flash" if c.shape.flash else "eager",
        step_time_interval=interval(c, tm.total) if tm is not None and 0 < tm.total < math.inf else None,
    )


def interval(c: Ctx, total_s: float) -> StepTimeInterval:
    """The interval of a predicted step time (``service.planner.uncertainty``)."""
    sh = c.shape
    n_params = sh.L * sh.block_params + sh.embed_params + sh.head_params
    below, above, basis = uncertainty.bounds(c.prof.name, is_cpu=c.dev.is_cpu, n_params=n_params, world=c.world)
    return StepTimeInterval(
        low_s=total_s * (1 - below),
        high_s=total_s * (1 + above),
        below=below,
        above=above,
        kernels=c.prof.name,
        basis=basis,
    )

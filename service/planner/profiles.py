"""Kernel profiles: how a training stack turns a layer into kernels. The device table (``service.planner.devices``)
says how fast a device runs one kernel; a profile says which kernels a stack launches and how many bytes its
element-wise work moves. Two profiles, chosen by ``ClusterSpec.kernels`` (plans) or by the run (meshrun's own runs
use ``eager`` unless ``compile`` is set):

- ``megatron``: fused kernels (Megatron-LM / Megatron-DeepSpeed): fused QKV GEMM, bias-GeLU, bias-dropout-add,
  scale-mask-softmax and fused Adam over 16-bit weights with fp32 master copies. The planner's model as it was fitted
  to the published runs (Narayanan et al. SC21, Korthikanti et al. 2022, BigScience tr11, MosaicML), unchanged.
- ``eager``: meshrun's PyTorch loop (``workers.loop``): one kernel per ``nn`` op, bf16 ``torch.autocast`` over fp32
  weights (every forward casts each weight to bf16 and every backward casts its gradient back and accumulates it
  into ``.grad``), gradient-norm clipping before a fused AdamW, and a Python step loop. Also the profile of
  MosaicML llm-foundry's runs (since 2026-11-28; the bench and ``service.planner.uncertainty`` price them so): its
  MPT trains PyTorch modules under Composer with ``precision: amp_bf16`` (``torch.autocast``), FSDP and norm
  gradient clipping, one kernel per op (Triton flash attention the only fused one), not Megatron's kernels. Priced
  eager with no other change its A100 rows' mean error fell from 10.5 / 11.5 % (80 / 40 GB, bias -8 / -12 %) to
  7.3 / 5.3 % (bias -1 / -3 %). Not exact for it: FSDP's mixed precision may hand autocast bf16 weights (no
  per-forward weight cast) and its residual stream may be bf16; those terms are small beside its GEMMs. Its H100
  rows stay too fast (bias -17 %, megatron -27 %): their MFU (about 40 %) is below what the device table's measured
  H100 GEMM rates allow, likely the 2023 software stack on H100; not modelled.

Each term, its default and the source of the figure:

``launches_fwd`` / ``launches_bwd``: kernels per transformer layer and micro-batch, forward / backward (the host
  launches each one; ``Device.kernel_launch_s`` each, and ``Device.kernel_fixed_s`` of device time each).
  Counted from the code: meshrun's ``workers.models.gpt.Block`` forward is 2 LayerNorms, 3 + 1 + 2 biased GEMMs
  (``addmm``), SDPA, the head-merge copy, GELU and 2 residual adds = 14; its backward two GEMMs and a bias
  reduction per linear (18), 2 LayerNorm backward kernels each (4), SDPA backward (3: preprocess, kernel, dQ
  conversion), GELU backward, the copy and the gradient accumulation into ``.grad`` (autocast: 6 casts) = 33.
  Megatron-LM's layer (fused QKV, fused bias-GeLU, bias-dropout-add) launches fewer; the planner's fitted 14 / 28
  stand for it (every published run is device-bound: the counts do not move those predictions).
``eager_attention_launches``: (forward, backward) kernels the unfused attention adds over flash's one
  (``model.attention == "eager"``): Megatron's scale-mask-softmax is one fused kernel between two batched GEMMs
  (+2 / +3); meshrun's math path (``workers.models.gpt.eager_attention``) scales q, builds the causal mask
  (2 kernels), masks, softmaxes and runs 2 batched GEMMs (+6 / +6).
``softmax_passes``: (forward, backward) passes over the ``b a s^2`` scores in 16-bit, each reading or writing all of
  them, of the unfused attention: Megatron's fused scale-mask-softmax reads the scores and writes the probabilities
  (2), its dropout reads them and writes the dropped probabilities and a 1-byte mask (2.5); backward the dropout
  (read gradient and mask, write: 2.5) and the softmax (read probabilities and gradient, write: 3): 4.5 / 5.5
  (earlier 3 / 6, a guess; with 4.5 / 5.5 and the real micro-batches of SC21 Table 1 the bench's mean error there
  fell from 4.1 to 3.3 %); meshrun's math path
  ``masked_fill`` (read + write) and ``softmax`` (read + write) forward (4), softmax backward (read probabilities
  and their gradient, write one) and the mask's backward (read + write) (5).
``score_bytes``: bytes per score element the unfused attention keeps for backward (Korthikanti et al. 2022, table
  2: softmax output 2 + dropout mask 1 + dropout output 2 = 5); meshrun's model has no dropout: the probabilities
  only, 2.
``weight_cast_bytes``: (forward, backward) bytes per parameter and micro-batch of mixed-precision bookkeeping on the
  weights: 0 for fp16/bf16 weights with fp32 master copies (Megatron); autocast over fp32 weights reads 4 and writes
  2 per forward (the bf16 copy; again when full recompute re-runs the forward) and, backward, casts the bf16 weight
  gradient to fp32 (2 + 4) and accumulates it into ``.grad`` (read 4 + 4, write 4): 6 / 18.
``optimizer_bytes_per_param`` and ``optimizer_launches``: the step's memory traffic and its kernels. Fused Adam, 36
  bytes (fp32 master, momentum, variance read and written, the gradient read: [meas-h100] fused AdamW 11 ps per
  parameter = 32 bytes at 2.93 TB/s) and 20 launches; meshrun adds ``clip_grad_norm_`` (foreach norm: read 4,
  foreach scale: read + write 8) = 48 bytes, and 40 launches (the norms, the clip, the fused step, the scheduler).
``step_overhead_s``: host time per step outside the kernels (Python loop, logging, loss ``.item()`` sync, data):
  0 for the fitted published runs (counted in their measured efficiency); meshrun's loop 2 ms, from the 125M rows of
  ``tests/service/data/h100_measured.json`` (30.4 ms at micro-batch 1, 28.5 at 2: host-bound, the surplus over
  the launches of a step).
``host_op_s``: the least host time per op of the stack (it replaces ``Device.kernel_launch_s`` when larger): 0 for
  Megatron (the device's bare launch, 12 us measured on H100); meshrun's eager loop runs each op through an
  ``nn.Module`` call, autocast, the dispatcher and autograd: 45 us, from the host-bound plateau of the 125M and 350M
  rows of ``h100_measured.json`` (12 layers: 30.4 ms at micro-batch 1, 28.5 at 2; 24 layers: 71 and 66 ms, about
  2.4-2.8 ms per layer and step for 47 ops).
``recompute_host_scale``: host time of a recomputed forward op relative to a plain one. 1 for Megatron; meshrun's
  ``torch.utils.checkpoint`` (non-reentrant: saved-tensor hooks on every op, the re-run forward under autograd)
  4, from the same rows with full recompute (125M: 79 ms against 30; 350M: 145 against 71: 3-4 ms more per layer;
  their micro-batch 4 rows, 58 and 117 ms, say less: 4 is the middle of the bench's 3-5).
``fp32_stream``: the residual stream is fp32 (autocast over fp32 weights: the embedding's output is fp32, the adds
  promote to it, LayerNorm runs in fp32 and each GEMM input is cast to bf16): norms and residual adds move 4-byte
  elements and each norm adds a cast (read 4, write 2). Megatron's stream is 16-bit.
``loss_bytes``: (forward, backward) bytes per logit of the loss: Megatron's fused vocab-parallel cross-entropy
  3 fp32 passes forward, 2 of 4 + 2 bytes backward (12 / 12); meshrun's ``F.cross_entropy`` on bf16 logits casts
  them to fp32 (2 + 4), log-softmaxes (4 + 4) and gathers (4) forward, and backward writes the one-hot gradient
  (4), runs log-softmax's backward (4 + 4 + 4) and casts back (4 + 2): 14 / 22.
``pp_scatter_gather``: a pipeline stage sends its output split over its ``t`` tensor-parallel ranks (each sends
  ``1/t`` over its own NIC) and the next stage all-gathers it over NVLink; without it every tensor-parallel rank sends
  the whole, replicated activation. Megatron-LM's scatter/gather optimisation (Narayanan et al. SC21, section 4.1:
  "reduces the communication between pipeline stages by a factor of t") and DeepSpeed's pipeline engine (partitioned
  activations when model-parallel, Megatron-DeepSpeed's runs): on. meshrun's pipeline (``torch.distributed
  .pipelining``) sends each rank's whole activation: off (with sequence parallelism it is sharded anyway). With it
  on, Korthikanti et al.'s pipelined full-recompute rows (175B / 530B / 1T, pipeline stages across nodes) moved from
  +6.1 / +12.5 / +9.5 % to +4.8 / +8.8 / +5.2 %; BigScience's (DeepSpeed) rows, too fast before, from 9.0 to 12.9 %.
``microbatch_overhead_s``: host time per micro-batch (the loss, the autocast context, the schedule's Python):
  0 / 0.3 ms (assumed: 25 launches' worth of Python at the measured 11 us per launch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

KernelsName = Literal["megatron", "eager"]


@dataclass(frozen=True)
class KernelProfile:
    """How a stack launches a layer's kernels and moves its element-wise bytes (see the module docstring)."""

    name: str
    launches_fwd: float
    launches_bwd: float
    eager_attention_launches: tuple[float, float]
    softmax_passes: tuple[float, float]
    score_bytes: float
    weight_cast_bytes: tuple[float, float]
    optimizer_bytes_per_param: float
    optimizer_launches: float
    step_overhead_s: float
    microbatch_overhead_s: float
    host_op_s: float = 0.0
    recompute_host_scale: float = 1.0
    fp32_stream: bool = False
    loss_bytes: tuple[float, float] = (12, 12)
    pp_scatter_gather: bool = False


MEGATRON = KernelProfile(
    name="megatron",
    launches_fwd=14,
    launches_bwd=28,
    eager_attention_launches=(2, 3),
    softmax_passes=(4.5, 5.5),
    score_bytes=5,
    weight_cast_bytes=(0, 0),
    optimizer_bytes_per_param=36,
    optimizer_launches=20,
    step_overhead_s=0.0,
    microbatch_overhead_s=0.0,
    pp_scatter_gather=True,
)

EAGER = KernelProfile(
    name="eager",
    launches_fwd=14,
    launches_bwd=33,
    eager_attention_launches=(6, 6),
    softmax_passes=(4, 5),
    score_bytes=2,
    weight_cast_bytes=(6, 18),
    optimizer_bytes_per_param=48,
    optimizer_launches=40,
    step_overhead_s=2e-3,
    microbatch_overhead_s=0.3e-3,
    host_op_s=45e-6,
    recompute_host_scale=4.0,
    fp32_stream=True,
    loss_bytes=(14, 22),
)

PROFILES: dict[str, KernelProfile] = {p.name: p for p in (MEGATRON, EAGER)}
DEFAULT_PROFILE = "megatron"  # a plan request without ``cluster.kernels``: the planner as it always priced plans


def profile(name: str | None) -> KernelProfile:
    """The profile of a name (None: ``DEFAULT_PROFILE``)."""
    return PROFILES[name or DEFAULT_PROFILE]

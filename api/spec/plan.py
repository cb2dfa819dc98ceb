"""What meshrun resolved (``Plan``) and what the planner answers (``Candidate`` with its memory and step-time
breakdowns, ``PlanRequest``/``PlanResponse``, the ``ClusterSpec`` to plan for)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import Field

from api.spec._base import MAX_BATCH, MAX_SEQ_LEN, _Public, _Spec
from api.spec.run import Layout, ModelSpec


class ModelConfig(_Public):
    """A model with every size resolved (preset + overrides)."""

    name: str
    n_layers: int
    d_model: int
    n_heads: int
    vocab_size: int
    seq_len: int
    d_ff: int
    n_params: int
    entrypoint: str | None = None
    args: dict[str, Any] = Field(default_factory=dict)


class MemoryBreakdown(_Public):
    """Bytes per rank (the most loaded rank)."""

    total: int = 0
    params: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0
    buffers: int = 0


class StepTimeBreakdown(_Public):
    """Seconds per optimizer step on the most loaded rank. The terms add up to ``total``: ``compute`` (forward,
    backward, recompute; host-bound launch time where kernels are too small to hide it), ``tp_comm``, ``pp_comm``
    (point-to-point), ``pp_bubble`` (pipeline fill/drain idle), ``dp_comm`` (the EXPOSED data-parallel
    communication; ``dp_comm_total`` is all of it, most of which hides under the backward pass), ``optimizer``
    (the optimizer step over the local shard) and ``other`` (fixed per-step costs)."""

    total: float = 0.0
    compute: float = 0.0
    tp_comm: float = 0.0
    pp_comm: float = 0.0
    pp_bubble: float = 0.0
    dp_comm: float = 0.0
    optimizer: float = 0.0
    other: float = 0.0
    dp_comm_total: float = 0.0


class Candidate(_Public):
    """One scored layout (a planner answer)."""

    layout: Layout
    micro_batch_size: int
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    memory_bytes: MemoryBreakdown
    step_time_s: StepTimeBreakdown
    tokens_per_s: float
    mfu: float
    feasible: bool
    reason: str = ""


class Plan(_Public):
    """What meshrun resolved from a RunSpec. Stored with the run, handed to the workers."""

    world_size: int
    dp: int
    tp: int
    pp: int
    dp_replicate: int = Field(description="Data-parallel replicas (HSDP outer dim; dp for zero 0/1).")
    dp_shard: int = Field(description="Data-parallel shard degree (FSDP; 1 for zero 0/1).")
    zero_stage: int
    micro_batch_size: int
    global_batch_size: int
    microbatches_per_step: int = Field(description="Micro-batches per data-parallel rank per optimizer step.")
    grad_accum_steps: int = Field(description="Backward passes accumulated per step (1 when pp > 1).")
    pp_stages_total: int = Field(description="pp x virtual stages.")
    tokens_per_step: int
    model: ModelConfig
    device: Literal["cpu", "cuda", "auto"] = "auto"
    resources_per_worker: dict[str, float]
    placement_strategy: str = "PACK"
    warnings: list[str] = Field(default_factory=list)
    predicted: Candidate | None = None


class ClusterSpec(_Spec):
    """A cluster to plan for: a known device type, or 'live' for the service's Ray cluster. Every figure of the
    device table can be replaced by a measured one (all per device/GPU; bandwidths are ACHIEVED collective bus
    bandwidths, as nccl-tests reports them, not link figures)."""

    device: str = Field("H100", description="Device type, e.g. A100-80GB, H100, H200, L4, cpu; 'live' = Ray.")
    gpus_per_node: int = Field(8, ge=1, le=1024)
    nodes: int = Field(1, ge=1, le=100_000)
    intra_node_bandwidth_bytes_per_s: float | None = Field(
        None, ge=1e3, le=1e15, description="Achieved collective bandwidth per GPU inside a node (NVLink)."
    )
    inter_node_bandwidth_bytes_per_s: float | None = Field(
        None, ge=1e3, le=1e15, description="Achieved network bandwidth per GPU across nodes (its NIC share)."
    )
    peak_flops_per_s: float | None = Field(None, ge=1e6, le=1e18, description="Override the device's peak FLOP/s.")
    memory_bytes: int | None = Field(None, ge=2**20, le=2**50, description="Override the device's memory.")
    memory_bandwidth_bytes_per_s: float | None = Field(
        None,
        ge=1e6,
        le=1e15,
        strict=True,
        description="Achieved device-memory (HBM) bandwidth, e.g. a large copy's bytes/s.",
    )
    matmul_efficiency: float | None = Field(
        None, gt=0, le=1, strict=True, description="Achieved fraction of peak on large, well-shaped matrix products."
    )
    intra_node_latency_s: float | None = Field(
        None, ge=0, le=1, strict=True, description="Latency of one step of a collective inside a node."
    )
    inter_node_latency_s: float | None = Field(
        None, ge=0, le=1, strict=True, description="Latency of one step of a collective across nodes."
    )
    kernel_launch_s: float | None = Field(
        None, ge=0, le=1, strict=True, description="Host time to launch one kernel (eager framework overhead included)."
    )
    attention_efficiency: float | None = Field(
        None,
        gt=0,
        le=1,
        strict=True,
        description="Achieved fraction of peak of flash attention's forward (head dim 128, long s).",
    )


class PlanRequest(_Spec):
    model: ModelSpec
    cluster: ClusterSpec = Field(default_factory=ClusterSpec)
    global_batch_size: int = Field(ge=1, le=MAX_BATCH)
    seq_len: int | None = Field(None, ge=1, le=MAX_SEQ_LEN)
    precision: Literal["fp32", "bf16", "fp16"] = "bf16"
    top_k: int = Field(10, ge=1, le=1000)
    layout: Layout | None = None
    micro_batch_size: int | None = Field(None, ge=1, le=MAX_BATCH)
    activation_checkpointing: Literal["none", "selective", "full"] | None = None


class PlanCalibration(_Public):
    """Where the planner's factors came from: ``measured`` lists the factors a calibration fitted to measured
    runs (sweeps or finished runs), with when and from what; every other factor is the planner's default."""

    source: Literal["default", "measured"] = "default"
    cluster_key: str | None = None
    calibration_id: int | None = None
    measured_at: datetime | None = None
    measured: list[str] = Field(default_factory=list)
    observations: int | None = None
    sweep_id: str | None = None
    error_before: float | None = None
    error_after: float | None = None


class PlanResponse(_Public):
    model: ModelConfig
    cluster: dict[str, Any]
    candidates: list[Candidate]
    rejected: list[Candidate] = Field(default_factory=list)
    evaluated: int = 0
    elapsed_s: float = 0.0
    calibration: PlanCalibration = Field(default_factory=PlanCalibration)

"""What meshrun resolved (``Plan``) and what the planner answers (``Candidate`` with its memory and step-time
breakdowns, ``PlanRequest``/``PlanResponse``, the ``ClusterSpec`` to plan for)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any, Literal

from pydantic import Field, computed_field, model_validator

from api.spec._base import MAX_BATCH, MAX_SEQ_LEN, MAX_STEPS, PricePerDeviceHour, _Public, _Spec
from api.spec.layout import MESH_DIMS, ResolvedLayout
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
    attention: Literal["flash", "eager"] = "flash"
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


class StepTimeInterval(_Public):
    """How far to trust ``step_time_s.total``: ``low_s``-``high_s`` is meant to hold four in five measured steps
    (``service.planner.uncertainty``: the 80th percentiles of the planner's residuals each way on the data behind
    its kernel profile, widened outside that data, at most 25 % each way). ``basis`` says what it rests on, ``kernels``
    the profile."""

    low_s: float = 0.0
    high_s: float = 0.0
    below: float = Field(0.0, description="low_s = total x (1 - below)")
    above: float = Field(0.0, description="high_s = total x (1 + above)")
    kernels: str = "megatron"
    basis: str = ""


PriceSource = Literal["request", "settings", "default", "none"]


class CandidateCost(_Public):
    """What a layout costs: device-hours (devices x predicted time) always; US dollars where a price per
    device-hour is known (``price_source``: the request's ``cluster.price_per_device_hour``, the service's
    ``MESHRUN_DEVICE_PRICES``, the planner's dated default table ``service.planner.prices``, or ``none``, when every
    ``usd_*`` is null, not 0). ``*_for_steps`` need the run's step count (``steps``)."""

    devices: int
    price_per_device_hour: float | None = None
    price_source: PriceSource = "none"
    device_hours_per_step: float = 0.0
    usd_per_step: float | None = None
    usd_per_billion_tokens: float | None = None
    steps: int | None = None
    device_hours_for_steps: float | None = None
    usd_for_steps: float | None = None


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
    cost: CandidateCost | None = None
    attention: Literal["flash", "eager"] = "flash"
    step_time_interval: StepTimeInterval | None = None
    calibration: str | None = Field(
        None, description="A run's prediction: the calibration it used, 'calibration <id>' or 'defaults'."
    )


class Plan(_Public):
    """What meshrun resolved from a RunSpec. Stored with the run, handed to the workers.

    ``layout`` is the resolved layout (degrees and flavours, ``api.spec.layout.ResolvedLayout``); the degrees are
    also served flat (``world_size``, ``dp``, ``tp``, ``pp``, ``dp_replicate``, ``dp_shard``, ``zero_stage``,
    ``pp_stages_total``: read-only, derived from ``layout``), as every plan was before ``layout`` existed. A plan
    stored without ``layout`` loads from those flat degrees, with default flavours (``Plan.stored`` takes the
    flavours from the run's spec)."""

    layout: ResolvedLayout
    micro_batch_size: int
    global_batch_size: int
    microbatches_per_step: int = Field(description="Micro-batches per data-parallel rank per optimizer step.")
    grad_accum_steps: int = Field(description="Backward passes accumulated per step (1 when pp > 1).")
    tokens_per_step: int
    model: ModelConfig
    device: Literal["cpu", "cuda", "auto"] = "auto"
    resources_per_worker: dict[str, float]
    placement_strategy: str = "PACK"
    warnings: list[str] = Field(default_factory=list)
    predicted: Candidate | None = None

    @model_validator(mode="before")
    @classmethod
    def _flat_degrees(cls, data: Any) -> Any:
        """A plan stored before ``layout`` existed: its flat degrees make the layout (default flavours)."""
        if not isinstance(data, dict) or "layout" in data:
            return data
        return {**data, "layout": _layout_of_flat(data)}

    @classmethod
    def stored(cls, plan_json: dict[str, Any], spec_layout: Layout) -> Plan:
        """A plan read back from the store: one stored before ``layout`` existed takes its flavours from the
        run's spec (``spec_layout``; the degrees are the stored ones)."""
        plan = cls.model_validate(plan_json)
        if "layout" in plan_json:
            return plan
        degrees = {d: getattr(plan.layout, d) for d in MESH_DIMS}
        return plan.model_copy(update={"layout": ResolvedLayout.of(spec_layout).replace(**degrees)})

    @computed_field(description="Workers: the product of the layout's degrees.")  # type: ignore[prop-decorator]
    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @computed_field  # type: ignore[prop-decorator]
    @property
    def dp(self) -> int:
        return self.layout.dp

    @computed_field  # type: ignore[prop-decorator]
    @property
    def tp(self) -> int:
        return self.layout.tp

    @computed_field  # type: ignore[prop-decorator]
    @property
    def pp(self) -> int:
        return self.layout.pp

    @computed_field(description="Data-parallel replicas (HSDP outer dim; dp for zero 0/1).")  # type: ignore[prop-decorator]
    @property
    def dp_replicate(self) -> int:
        return self.layout.dp_replicate

    @computed_field(description="Data-parallel shard degree (FSDP; 1 for zero 0/1).")  # type: ignore[prop-decorator]
    @property
    def dp_shard(self) -> int:
        return self.layout.dp_shard

    @computed_field  # type: ignore[prop-decorator]
    @property
    def zero_stage(self) -> int:
        return self.layout.zero_stage

    @computed_field(description="pp x virtual stages.")  # type: ignore[prop-decorator]
    @property
    def pp_stages_total(self) -> int:
        return self.layout.pp_stages_total


def layout_of(plan: Plan | Mapping[str, Any]) -> ResolvedLayout:
    """The resolved layout of a plan or of its JSON (a stored plan; one stored before ``Plan.layout`` existed, or
    a mapping of bare degrees, reads its flat degrees)."""
    if isinstance(plan, Plan):
        return plan.layout
    if plan.get("layout") is not None:
        return ResolvedLayout.model_validate(plan["layout"])
    return ResolvedLayout.model_validate(_layout_of_flat(plan))


def _layout_of_flat(data: Mapping[str, Any]) -> dict[str, Any]:
    """The layout of a plan's flat degrees (a plan stored before ``Plan.layout``); checks they add up."""
    zero = int(data.get("zero_stage", 0))
    pp, tp = int(data.get("pp", 1)), int(data.get("tp", 1))
    world = data.get("world_size")
    dp = int(data["dp"]) if "dp" in data else max(1, int(world or 1) // (pp * tp))  # bare degrees: world + tp
    dpr, dps = data.get("dp_replicate"), data.get("dp_shard")
    if dpr is None or dps is None:
        dpr, dps = (1, dp) if zero >= 2 else (dp, 1)
    out = {"pp": pp, "dp_replicate": int(dpr), "dp_shard": int(dps), "tp": tp, "zero_stage": zero}
    total = data.get("pp_stages_total")
    if total and int(total) % pp == 0:
        out["pp_virtual_stages"] = int(total) // pp
    if world is not None and int(world) != pp * int(dpr) * int(dps) * tp:
        raise ValueError(
            f"world_size={world} but pp x dp_replicate x dp_shard x tp = {pp} x {dpr} x {dps} x {tp}; "
            "a plan's degrees must multiply to its world size"
        )
    return out


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
    kernels: Literal["megatron", "eager"] | None = Field(
        None,
        description="Kernel profile (service/planner/profiles.py): 'megatron' (fused kernels: Megatron-LM, "
        "DeepSpeed, llm-foundry) or 'eager' (meshrun's own PyTorch loop: one kernel per op, autocast over fp32 "
        "weights). Default: 'megatron' for plans; a meshrun run is predicted with 'eager' unless compiled.",
    )
    price_per_device_hour: PricePerDeviceHour = Field(
        None,
        description="US dollars per device (GPU, or CPU worker slot) per hour; default: the service's "
        "MESHRUN_DEVICE_PRICES, else the planner's dated table for known devices, else no money figures.",
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
    steps: int | None = Field(None, ge=1, le=MAX_STEPS, description="The run's optimizer steps: costs for all of them.")
    rank_by: Literal["time", "cost"] = Field(
        "time",
        description="time: the fastest layouts on all of the cluster; cost: the cheapest per token, also on parts "
        "of it (whole nodes in powers of two, or powers of two inside one node), which may be slower.",
    )


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
    defaults: list[str] = Field(
        default_factory=list, description="Factors at the planner's defaults (not measured on this cluster)."
    )
    held_out_error: float | None = Field(
        None, description="Mean error on trials each predicted by a fit to the others (leave-one-out)."
    )
    load_avg: list[float] | None = Field(None, description="The host's 1/5/15-minute load when it was measured.")

    @computed_field(description="The calibration a plan used: 'calibration <id>' or 'defaults'.")  # type: ignore[prop-decorator]
    @property
    def used(self) -> str:
        return f"calibration {self.calibration_id}" if self.source == "measured" else "defaults"


class PlanResponse(_Public):
    model: ModelConfig
    cluster: dict[str, Any]
    candidates: list[Candidate]
    rejected: list[Candidate] = Field(default_factory=list)
    evaluated: int = 0
    elapsed_s: float = 0.0
    calibration: PlanCalibration = Field(default_factory=PlanCalibration)
    within_uncertainty: list[int] = Field(
        default_factory=list,
        description="Indexes of the candidates whose step-time interval overlaps the first's (the first included, "
        "when any other does): the planner cannot tell them apart; measure them (a sweep with layouts 'auto' does).",
    )

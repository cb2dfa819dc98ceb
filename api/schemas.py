"""The HTTP contract: one pydantic model family shared by the server, the SDK, the planner and the workers.

Tiers (see docs/design in the README):
- ``RunSpec``: what the user asks for. Field-level bounds live here; cross-field rules (does tp divide the
  heads, does the batch divide, ...) live in ``api.validation.check_spec`` so every rule can name its field.
- ``Plan``: what meshrun resolved from the spec (degrees, world size, micro-batches, resources, and the
  planner's prediction). Stored as JSON with the run and handed to the workers, who re-validate it.
- ``*Public``: what the API returns. Response models ignore unknown fields so older SDKs keep working.

This module imports only pydantic: the SDK must load without torch or ray.
"""

from __future__ import annotations

import re
from datetime import datetime
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# ----------------------------------------------------------------------------------------------- limits
MAX_WORLD_SIZE = 4096
MAX_STEPS = 10_000_000
MAX_LAYERS = 1024
MAX_D_MODEL = 131_072
MAX_HEADS = 1024
MAX_VOCAB = 4_194_304
MAX_SEQ_LEN = 1_048_576
MAX_BATCH = 10_000_000

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
ENTRYPOINT_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")


class _Spec(BaseModel):
    """Base for request models: unknown fields are an error (a typo must not be silently ignored)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class _Public(BaseModel):
    """Base for response models: tolerate fields added by newer servers."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=(), from_attributes=True)


# ------------------------------------------------------------------------------------------------ spec
class ModelSpec(_Spec):
    """Which model to train. A built-in (``name`` + ``preset``, optionally overriding sizes) or user code
    (``entrypoint: "pkg.module:function"`` returning a ``torch.nn.Module``)."""

    name: str = Field("gpt", description="Built-in model family: 'gpt' or 'mlp'; 'custom' with an entrypoint.")
    preset: str | None = Field("tiny", description="Preset of the family (see api.presets); null = give all sizes.")
    n_layers: int | None = Field(None, ge=1, le=MAX_LAYERS)
    d_model: int | None = Field(None, ge=1, le=MAX_D_MODEL)
    n_heads: int | None = Field(None, ge=1, le=MAX_HEADS)
    vocab_size: int | None = Field(None, ge=2, le=MAX_VOCAB)
    seq_len: int | None = Field(None, ge=1, le=MAX_SEQ_LEN)
    d_ff: int | None = Field(None, ge=1, le=4 * MAX_D_MODEL)
    # user models (bring your own model)
    entrypoint: str | None = Field(None, description="'package.module:function' returning a torch.nn.Module.")
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for the entrypoint.")
    tp_plan: dict[str, Literal["colwise", "rowwise", "sequence_parallel", "vocab_parallel"]] | None = Field(
        None, description="Tensor-parallel plan: module-name pattern (fnmatch) -> style.")
    pp_split_points: list[str] | None = Field(
        None, description="Module names where pipeline stages begin (the first stage starts at the top).")
    block_classes: list[str] | None = Field(
        None, description="Class names of the repeated blocks (FSDP units, checkpointing); found if omitted.")

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint_shape(cls, v: str | None) -> str | None:
        if v is not None and not ENTRYPOINT_RE.match(v):
            raise ValueError("entrypoint must look like 'package.module:function' (identifiers only)")
        return v


class DataSpec(_Spec):
    """Where training tokens come from."""

    source: Literal["synthetic", "text", "tokens", "custom"] = Field(
        "synthetic", description="synthetic | text (byte-level over files; no path = built-in corpus) | "
                                 "tokens (directory of .bin token files) | custom (entrypoint)")
    path: str | None = Field(None, max_length=4096, description="File or directory for text/tokens.")
    entrypoint: str | None = Field(None, description="'package.module:function' returning a map-style dataset.")
    args: dict[str, Any] = Field(default_factory=dict)

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint_shape(cls, v: str | None) -> str | None:
        if v is not None and not ENTRYPOINT_RE.match(v):
            raise ValueError("entrypoint must look like 'package.module:function' (identifiers only)")
        return v


class CodeSpec(_Spec):
    """Where user code (model/data entrypoints) comes from. The directory is shipped to every Ray worker through
    the run's Ray runtime environment (``working_dir``, or ``py_modules`` when meshrun itself is shipped as the
    working dir) and put on ``sys.path`` by the standalone launcher (``python -m workers --code-dir``)."""

    working_dir: str | None = Field(
        None, max_length=4096, description="Directory holding the user's packages (e.g. my_pkg/). Absolute (under "
                                           "the service's allowed roots when auth is on) or relative to the "
                                           "service's data_dir.")

    @field_validator("working_dir")
    @classmethod
    def _path_shape(cls, v: str | None) -> str | None:
        if v is not None:
            if any(ord(c) < 32 or ord(c) == 127 for c in v):
                raise ValueError("code.working_dir contains control characters (NUL, newline, ...); remove them")
            if not v.strip():
                raise ValueError("code.working_dir is empty; give a directory or remove the field")
            if "://" in v:
                raise ValueError("code.working_dir must be a local directory path, not a URL")
        return v


PPSchedule = Literal["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv"]


class Layout(_Spec):
    """Parallelism layout. world size = dp x tp x pp; ranks ordered pp (outer), dp, tp (inner)."""

    dp: int = Field(1, ge=1, le=MAX_WORLD_SIZE, description="Data-parallel degree.")
    tp: int = Field(1, ge=1, le=MAX_WORLD_SIZE, description="Tensor-parallel degree (one node).")
    pp: int = Field(1, ge=1, le=MAX_WORLD_SIZE, description="Pipeline stages.")
    zero_stage: int = Field(0, ge=0, le=3, description="0 DDP, 1 sharded optimizer, 2 + grads, 3 FSDP full shard.")
    shard_group_size: int | None = Field(None, ge=1, le=MAX_WORLD_SIZE,
                                         description="HSDP: shard within groups of this size, replicate across.")
    sequence_parallel: bool = False
    pp_schedule: PPSchedule = "1f1b"
    pp_virtual_stages: int = Field(1, ge=1, le=64, description="Model chunks per pipeline rank (interleaved).")
    grad_compression: Literal["none", "fp16", "bf16", "powersgd"] = Field(
        "none", description="DDP gradient compression hook (zero_stage 0 only).")
    cpu_offload: bool = Field(False, description="Offload parameters/optimizer to CPU (zero_stage 3 only).")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp


class BatchSpec(_Spec):
    global_batch_size: int = Field(16, ge=1, le=MAX_BATCH, description="Sequences per optimizer step.")
    micro_batch_size: int = Field(2, ge=1, le=MAX_BATCH, description="Sequences per forward/backward.")


class OptimizerSpec(_Spec):
    name: Literal["adamw"] = "adamw"
    lr: float = Field(3.0e-4, gt=0, le=10.0)
    weight_decay: float = Field(0.1, ge=0, le=10.0)
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = Field(10, ge=0, le=MAX_STEPS)
    schedule: Literal["cosine", "constant", "linear"] = "cosine"
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    grad_clip: float | None = Field(1.0, gt=0, description="Max global grad norm; null disables clipping.")


class TrainSpec(_Spec):
    steps: int = Field(50, ge=1, le=MAX_STEPS)
    seed: int = Field(0, ge=0, le=2**31 - 1)
    deterministic: bool = Field(False, description="Deterministic algorithms (bitwise-reproducible resumes).")


class CheckpointSpec(_Spec):
    every_steps: int = Field(0, ge=0, le=MAX_STEPS, description="0 = no periodic checkpoints.")
    keep: int = Field(2, ge=1, le=1000)
    storage: str | None = Field(None, max_length=4096,
                                description="Directory or fsspec URL; default: the service's data dir.")


class ResourcesSpec(_Spec):
    device: Literal["auto", "cpu", "gpu"] = "auto"
    cpus_per_worker: float = Field(1, gt=0, le=1024)
    max_failures: int = Field(0, ge=-1, le=1000, description="Worker-group restarts allowed (-1: unlimited).")
    priority: int = Field(0, ge=-1000, le=1000, description="Higher runs first; FIFO within a priority.")


class RunSpec(_Spec):
    """A training run as the user asks for it."""

    name: str = Field("run", description="Human name; letters, digits, '.', '_', '-'.")
    model: ModelSpec = Field(default_factory=ModelSpec)
    data: DataSpec = Field(default_factory=DataSpec)
    layout: Layout = Field(default_factory=Layout)
    batch: BatchSpec = Field(default_factory=BatchSpec)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    train: TrainSpec = Field(default_factory=TrainSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    skip_memory_check: bool = Field(False, description="Submit even if the planner predicts it will not fit.")
    labels: dict[str, str] = Field(default_factory=dict)
    code: CodeSpec | None = Field(None, description="User code directory for model/data entrypoints (shipped to "
                                                    "the workers); omit when the code is installed on the cluster.")

    @field_validator("name")
    @classmethod
    def _name_shape(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError("name must be 1-128 characters of letters, digits, '.', '_' or '-', "
                             "starting with a letter or digit")
        return v


# ------------------------------------------------------------------------------------------------ plan
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
    """Seconds per optimizer step."""

    total: float = 0.0
    compute: float = 0.0
    tp_comm: float = 0.0
    pp_comm: float = 0.0
    pp_bubble: float = 0.0
    dp_comm: float = 0.0


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


# --------------------------------------------------------------------------------------------- public
class RunStatus(str, Enum):
    QUEUED = "QUEUED"
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in (RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED)


TERMINAL_STATUSES = frozenset({RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED})


class RunSummary(_Public):
    steps_done: int = 0
    final_loss: float | None = None
    mean_tokens_per_s: float | None = None
    mean_mfu: float | None = None
    peak_memory_bytes: int | None = Field(None, description="Max over ranks and steps.")
    peak_memory_bytes_per_rank: dict[str, int] = Field(default_factory=dict)
    wall_time_s: float | None = None


class RunPublic(_Public):
    id: str
    name: str
    project: str
    status: RunStatus
    status_reason: str | None = None
    priority: int = 0
    spec: RunSpec
    plan: Plan | None = None
    attempts: int = 0
    sweep_id: str | None = None
    ray_job_id: str | None = None
    dashboard_url: str | None = None
    rank_nodes: dict[str, str] | None = Field(None, description="world rank -> Ray node id")
    summary: RunSummary | None = None
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None


class RunList(_Public):
    items: list[RunPublic]
    total: int
    limit: int
    offset: int


class MetricRow(_Public):
    step: int
    attempt: int = 1
    loss: float | None = None
    tokens_per_s: float | None = None
    step_time_s: float | None = None
    mfu: float | None = None
    peak_memory_bytes: int | None = None
    comm_fraction: float | None = None
    grad_norm: float | None = None
    lr: float | None = None
    time: datetime | None = None


class MetricList(_Public):
    run_id: str
    items: list[MetricRow]


class EventPublic(_Public):
    id: int
    run_id: str
    time: datetime
    kind: str = "state"
    from_status: str | None = None
    to_status: str | None = None
    reason: str | None = None
    actor: str | None = None


class EventList(_Public):
    run_id: str
    items: list[EventPublic]


class CheckpointPublic(_Public):
    run_id: str
    attempt: int
    step: int
    path: str
    size_bytes: int | None = None
    created_at: datetime


class ResumeRequest(_Spec):
    layout: Layout | None = Field(None, description="New layout; the checkpoint is resharded on load.")
    batch: BatchSpec | None = None
    steps: int | None = Field(None, ge=1, le=MAX_STEPS, description="New total step count.")


class LogsPublic(_Public):
    run_id: str
    logs: str


# ------------------------------------------------------------------------------------------- planning
class ClusterSpec(_Spec):
    """A cluster to plan for: a known device type, or 'live' for the service's Ray cluster."""

    device: str = Field("H100", description="Device type, e.g. A100-80GB, H100, H200, L4, cpu; 'live' = Ray.")
    gpus_per_node: int = Field(8, ge=1, le=1024)
    nodes: int = Field(1, ge=1, le=100_000)
    intra_node_bandwidth_bytes_per_s: float | None = Field(None, ge=1e3, le=1e15)
    inter_node_bandwidth_bytes_per_s: float | None = Field(None, ge=1e3, le=1e15)
    peak_flops_per_s: float | None = Field(None, ge=1e6, le=1e18, description="Override the device's peak FLOP/s.")
    memory_bytes: int | None = Field(None, ge=2**20, le=2**50, description="Override the device's memory.")


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


class PlanResponse(_Public):
    model: ModelConfig
    cluster: dict[str, Any]
    candidates: list[Candidate]
    rejected: list[Candidate] = Field(default_factory=list)
    evaluated: int = 0
    elapsed_s: float = 0.0


# ------------------------------------------------------------------------------------------- cluster
class NodePublic(_Public):
    node_id: str
    alive: bool
    address: str | None = None
    cpus: float = 0
    gpus: float = 0
    memory_bytes: int | None = None


class ClusterPublic(_Public):
    address: str | None = None
    dashboard_url: str | None = None
    nodes: list[NodePublic] = Field(default_factory=list)
    cpus_total: float = 0
    cpus_free: float = 0
    gpus_total: float = 0
    gpus_free: float = 0


# --------------------------------------------------------------------------------------------- sweeps
class SweepSearch(_Spec):
    layouts: list[Layout] | Literal["auto"] = "auto"
    micro_batch_sizes: list[int] | None = Field(None, description="Default: the base spec's micro-batch.")


class SweepBudget(_Spec):
    max_trials: int = Field(8, ge=1, le=256)
    steps_per_trial: int = Field(10, ge=2, le=100_000)
    warmup_steps: int = Field(2, ge=0, le=100_000, description="Steps excluded from the measurement.")
    max_concurrent_trials: int = Field(1, ge=1, le=64)


class SweepCreate(_Spec):
    name: str = "sweep"
    base: RunSpec
    search: SweepSearch = Field(default_factory=SweepSearch)
    objective: Literal["tokens_per_s", "mfu"] = "tokens_per_s"
    budget: SweepBudget = Field(default_factory=SweepBudget)
    early_stopping: bool = True


class TrialPublic(_Public):
    id: int
    run_id: str | None = None
    layout: Layout
    micro_batch_size: int
    status: str
    reason: str | None = None
    predicted_tokens_per_s: float | None = None
    measured_tokens_per_s: float | None = None
    measured_mfu: float | None = None
    peak_memory_bytes: int | None = None


class SweepPublic(_Public):
    id: str
    name: str
    project: str
    status: str
    status_reason: str | None = None
    objective: str
    spec: SweepCreate
    trials: list[TrialPublic] = Field(default_factory=list)
    best_trial: TrialPublic | None = None
    calibration: dict[str, Any] | None = None
    ray_job_id: str | None = None
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None = None


class SweepList(_Public):
    items: list[SweepPublic]
    total: int
    limit: int
    offset: int


# ---------------------------------------------------------------------------------------------- errors
class ErrorDetail(_Public):
    code: str
    message: str
    param: str | None = None


class ErrorBody(_Public):
    error: ErrorDetail

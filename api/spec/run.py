"""What the user asks for: ``RunSpec`` and its parts. Field-level bounds live here; cross-field rules (does tp
divide the heads, does the batch divide, ...) live in ``api.spec.validation`` so every rule names its field."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_validator

from api.spec._base import (
    ENTRYPOINT_RE,
    MAX_BATCH,
    MAX_D_MODEL,
    MAX_HEADS,
    MAX_LAYERS,
    MAX_SEQ_LEN,
    MAX_STEPS,
    MAX_VOCAB,
    MAX_WORLD_SIZE,
    NAME_RE,
    PricePerDeviceHour,
    _Spec,
)
from api.spec.tracking import TrackingSpec


class ModelSpec(_Spec):
    """Which model to train. A built-in (``name`` + ``preset``, optionally overriding sizes) or user code
    (``entrypoint: "pkg.module:function"`` returning a ``torch.nn.Module``)."""

    name: str = Field(
        "gpt",
        description="Built-in model family: 'gpt' or 'mlp'; 'hf' with a path (a saved Hugging Face Llama, Mistral, "
        "Qwen2 or GPT-2); 'custom' with an entrypoint.",
    )
    path: str | None = Field(
        None,
        min_length=1,
        max_length=4096,
        description="name 'hf': local directory with config.json and *.safetensors (read by the service and the "
        "workers; no hub download).",
    )
    preset: str | None = Field(
        "tiny",
        description="Preset of the family: gpt tiny, small, 125m, 350m, 1.3b, 2.7b, 7b, 13b, 70b or 175b; mlp tiny or "
        "small (api/spec/presets.py). null = give all sizes.",
    )
    n_layers: int | None = Field(None, ge=1, le=MAX_LAYERS)
    d_model: int | None = Field(None, ge=1, le=MAX_D_MODEL)
    n_heads: int | None = Field(None, ge=1, le=MAX_HEADS)
    vocab_size: int | None = Field(None, ge=2, le=MAX_VOCAB)
    seq_len: int | None = Field(None, ge=1, le=MAX_SEQ_LEN)
    d_ff: int | None = Field(None, ge=1, le=4 * MAX_D_MODEL)
    attention: Literal["flash", "eager"] = Field(
        "flash",
        description="Attention kernels: 'flash' (fused SDPA/flash: no s x s scores stored) or 'eager' (the math "
        "path softmax(QK^T)V: two batched GEMMs, a memory-bound softmax, the s x s probabilities kept for backward; "
        "models without flash kernels and pre-2023 stacks). The planner prices memory and time by it; the built-in "
        "models run the math path when 'eager' is asked for.",
    )
    # user models (bring your own model)
    entrypoint: str | None = Field(None, description="'package.module:function' returning a torch.nn.Module.")
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for the entrypoint.")
    tp_plan: dict[str, Literal["colwise", "rowwise", "sequence_parallel", "vocab_parallel"]] | None = Field(
        None, description="Tensor-parallel plan: module-name pattern (fnmatch) -> style."
    )
    pp_split_points: list[str] | None = Field(
        None, description="Module names where pipeline stages begin (the first stage starts at the top)."
    )
    block_classes: list[str] | None = Field(
        None, description="Class names of the repeated blocks (FSDP units, checkpointing); found if omitted."
    )

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint_shape(cls, v: str | None) -> str | None:
        if v is not None and not ENTRYPOINT_RE.fullmatch(v):
            raise ValueError("entrypoint must look like 'package.module:function' (identifiers only)")
        return v

    @field_validator("path")
    @classmethod
    def _path_shape(cls, v: str | None) -> str | None:
        if v is not None and (any(ord(c) < 32 or ord(c) == 127 for c in v) or "://" in v):
            raise ValueError("model.path must be a local directory path without control characters")
        return v


class DataSpec(_Spec):
    """Where training tokens come from."""

    source: Literal["synthetic", "text", "tokens", "custom"] = Field(
        "synthetic",
        description="synthetic | text (byte-level over files; no path = built-in corpus) | "
        "tokens (directory of .bin token files) | custom (entrypoint)",
    )
    path: str | None = Field(None, min_length=1, max_length=4096, description="File or directory for text/tokens.")
    entrypoint: str | None = Field(None, description="'package.module:function' returning a map-style dataset.")
    args: dict[str, Any] = Field(default_factory=dict)

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint_shape(cls, v: str | None) -> str | None:
        if v is not None and not ENTRYPOINT_RE.fullmatch(v):
            raise ValueError("entrypoint must look like 'package.module:function' (identifiers only)")
        return v


class CodeSpec(_Spec):
    """Where user code (model/data entrypoints) comes from. The directory is shipped to every Ray worker through
    the run's Ray runtime environment (``working_dir``, or ``py_modules`` when meshrun itself is shipped as the
    working dir) and put on ``sys.path`` by the standalone launcher (``python -m workers --code-dir``)."""

    working_dir: str | None = Field(
        None,
        max_length=4096,
        description="Directory holding the user's packages (e.g. my_pkg/). Absolute (under "
        "the service's allowed roots when auth is on) or relative to the "
        "service's data_dir.",
    )

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
SyncMode = Literal["sync", "async_ps", "local_sgd", "diloco"]
GradCompression = Literal["none", "fp16", "bf16", "powersgd"]


class OuterOptimizerSpec(_Spec):
    """DiLoCo's outer optimizer: applied every ``sync_every_steps`` to the mean of the replicas' deltas (the
    outer gradient, start-of-round parameters minus the replica's parameters). ``sgd`` with lr 1 and momentum 0
    is plain parameter averaging (local SGD)."""

    name: Literal["sgd", "nesterov"] = Field("nesterov", description="sgd (heavy-ball momentum) or nesterov.")
    lr: float = Field(0.7, gt=0, le=10.0, description="Outer learning rate (DiLoCo: 0.7).")
    momentum: float = Field(0.9, ge=0, lt=1, description="Outer momentum (DiLoCo: 0.9).")


class Layout(_Spec):
    """Parallelism layout. world size = dp x tp x pp; ranks ordered pp (outer), dp, tp (inner)."""

    dp: int = Field(1, ge=1, le=MAX_WORLD_SIZE, description="Data-parallel degree.")
    tp: int = Field(1, ge=1, le=MAX_WORLD_SIZE, description="Tensor-parallel degree (one node).")
    pp: int = Field(1, ge=1, le=MAX_WORLD_SIZE, description="Pipeline stages.")
    zero_stage: int = Field(0, ge=0, le=3, description="0 DDP, 1 sharded optimizer, 2 + grads, 3 FSDP full shard.")
    shard_group_size: int | None = Field(
        None,
        ge=1,
        le=MAX_WORLD_SIZE,
        description="HSDP: shard within groups of this size, replicate across (needs zero_stage 2 or 3; refused "
        "with 0 or 1).",
    )
    sequence_parallel: bool = False
    pp_schedule: PPSchedule = "1f1b"
    pp_virtual_stages: int = Field(1, ge=1, le=64, description="Model chunks per pipeline rank (interleaved).")
    grad_compression: GradCompression = Field("none", description="DDP gradient compression hook (zero_stage 0 only).")
    cpu_offload: bool = Field(False, description="Offload parameters/optimizer to CPU (zero_stage 3 only).")
    sync: SyncMode = Field(
        "sync",
        description="How data-parallel replicas agree: sync (all-reduce every step), async_ps (parameter "
        "servers as Ray actors, bounded staleness), local_sgd / diloco (replicas step locally and average "
        "every sync_every_steps).",
    )
    ps_shards: int = Field(1, ge=1, le=64, description="async_ps: parameter servers the parameters are sharded over.")
    max_staleness: int = Field(
        4,
        ge=0,
        le=1000,
        description="async_ps: a worker computes step t's gradient on parameters at most this many updates old "
        "(it waits otherwise); 0 = synchronous.",
    )
    sync_every_steps: int = Field(
        8, ge=1, le=100_000, description="local_sgd / diloco: inner steps H between two averagings."
    )
    outer_optimizer: OuterOptimizerSpec = Field(
        default_factory=OuterOptimizerSpec, description="diloco: the outer optimizer (local_sgd averages)."
    )

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp


class BatchSpec(_Spec):
    global_batch_size: int = Field(16, ge=1, le=MAX_BATCH, description="Sequences per optimizer step.")
    micro_batch_size: int = Field(2, ge=1, le=MAX_BATCH, description="Sequences per forward/backward.")


Beta = Annotated[float, Field(ge=0, lt=1)]


class OptimizerSpec(_Spec):
    name: Literal["adamw", "sgd"] = Field(
        "adamw",
        description="adamw, or sgd (with momentum; the inner "
        "optimizer that makes diloco at H=1 equal to synchronous training).",
    )
    momentum: float = Field(0.0, ge=0, lt=1, description="sgd only: heavy-ball momentum.")
    lr: float = Field(3.0e-4, gt=0, le=10.0)
    weight_decay: float = Field(0.1, ge=0, le=10.0)
    betas: tuple[Beta, Beta] = Field((0.9, 0.95), description="AdamW's (beta1, beta2), each in [0, 1).")
    warmup_steps: int = Field(10, ge=0, le=MAX_STEPS)
    schedule: Literal["cosine", "constant", "linear"] = "cosine"
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    grad_clip: float | None = Field(1.0, gt=0, le=1e6, description="Max global grad norm; null disables clipping.")
    lr_anchor_step: int | None = Field(
        None,
        ge=0,
        description="Set by resume when the horizon (train.steps) changes: from this optimizer step on, the decay "
        "starts at lr_anchor_factor and ends at the new horizon (no LR jump).",
    )
    lr_anchor_factor: float | None = Field(None, ge=0, le=1)


class TrainSpec(_Spec):
    steps: int = Field(50, ge=1, le=MAX_STEPS)
    seed: int = Field(0, ge=0, le=2**31 - 1)
    deterministic: bool = Field(False, description="Deterministic algorithms (bitwise-reproducible resumes).")


class CheckpointSpec(_Spec):
    every_steps: int = Field(0, ge=0, le=MAX_STEPS, description="0 = no periodic checkpoints.")
    keep: int = Field(2, ge=1, le=1000)
    storage: str | None = Field(
        None, max_length=4096, description="Directory or fsspec URL; default: the service's data dir."
    )
    # "async" on the wire (a Python keyword: the attribute is async_save); the stored spec may hold either name
    model_config = ConfigDict(extra="forbid", protected_namespaces=(), validate_by_name=True, validate_by_alias=True)

    async_save: bool = Field(
        False,
        alias="async",
        description="`async: true`: write checkpoints in the background (each rank copies its state to host memory, "
        "then training goes on while a writer thread saves it; at most one save in flight; a checkpoint is listed "
        "only once written on every rank, and a failed save fails the attempt). Costs a second copy of the state "
        "in host memory during a save.",
    )
    memory_copy: bool = Field(
        False,
        description="Keep an in-memory copy of the newest checkpoint, every rank's files, in the run's channel actor "
        "(on the driver's node, outside the worker group): a restart after a failure loads it from there when it is "
        "complete and falls back to storage otherwise. Costs the checkpoint's size in that node's memory; worth it "
        "when storage is remote or slow.",
    )


class MetricsSpec(_Spec):
    """How the workers measure and report. Ranks keep their per-step measurements locally and combine them
    in one small collective per report interval (never per step); rank 0 then sends that interval's rows."""

    report_every_s: float = Field(
        1.0,
        ge=0,
        le=3600,
        description="Target seconds between reports (the ranks' one combining collective); the number of "
        "steps per report follows from the measured step time. 0 = report after every step.",
    )
    max_steps_per_report: int = Field(
        100, ge=1, le=100_000, description="At most this many steps between two reports (also bounds stop latency)."
    )
    breakdown_every_steps: int = Field(
        1,
        ge=0,
        le=MAX_STEPS,
        description="Measure the step-time breakdown (compute, tp/pp/dp communication total and exposed, pipeline "
        "bubble, optimizer, data wait, other; per rank) on every N-th step. 1 = every step, 0 = off.",
    )


class ProfileSpec(_Spec):
    """torch.profiler over a window of steps on every rank (Chrome-trace JSON per rank, plus the measured
    pipeline timeline for pp > 1)."""

    start_step: int = Field(ge=1, le=MAX_STEPS, description="First profiled step (1-based).")
    steps: int = Field(3, ge=1, le=100, description="Number of profiled steps.")


class SlowRankFault(_Spec):
    rank: int = Field(ge=0, lt=MAX_WORLD_SIZE, description="Global rank to slow down.")
    delay_s: float = Field(gt=0, le=3600, description="Seconds added to this rank's compute in every step.")


class StepFault(_Spec):
    rank: int = Field(ge=0, lt=MAX_WORLD_SIZE, description="Global rank the fault hits.")
    at_step: int = Field(ge=1, le=MAX_STEPS, description="Step (1-based) at which it hits (first attempt only).")


class PSFault(_Spec):
    shard: int = Field(0, ge=0, lt=64, description="async_ps: the parameter server (shard index) the fault hits.")
    at_step: int = Field(ge=1, le=MAX_STEPS, description="Once that server has applied this update (first time only).")


class FaultsSpec(_Spec):
    """Chaos testing: injected faults (the service allows them for admins or with MESHRUN_ALLOW_FAULTS).
    ``hang_rank`` and ``kill_rank`` fire in the first attempt only, so a recovered run can finish."""

    slow_rank: SlowRankFault | None = Field(None, description="Add delay_s of compute to one rank every step.")
    hang_rank: StepFault | None = Field(None, description="The rank stops making progress at at_step (in compute).")
    kill_rank: StepFault | None = Field(None, description="The rank's process is killed (SIGKILL) at at_step.")
    kill_ps: PSFault | None = Field(
        None, description="async_ps: that server's process dies (as in a crash) once it has applied update at_step."
    )


HANG_FLOOR_S = 300.0
HANG_STEP_FACTOR = 20.0


def hang_limit_s(hang_timeout_s: float | None, slowest_step_s: float) -> float:
    """How long no progress means a hang: ``resources.hang_timeout_s`` when given, else max(300 s, 20 x the slowest
    step seen). One rule for the group-mode watch (``service.runs.watch``) and replica mode's driver."""
    if hang_timeout_s is not None:
        return float(hang_timeout_s)
    return max(HANG_FLOOR_S, HANG_STEP_FACTOR * slowest_step_s)


class ResourcesSpec(_Spec):
    device: Literal["auto", "cpu", "gpu"] = "auto"
    cpus_per_worker: float = Field(1, gt=0, le=1024)
    max_failures: int = Field(0, ge=-1, le=1000, description="Worker-group restarts allowed (-1: unlimited).")
    hang_timeout_s: float | None = Field(
        None,
        gt=0,
        le=7 * 86400,
        description="No step completed for this long on any rank = a hang: every rank's stack is dumped, the attempt "
        "fails with where each rank is stuck, and max_failures decides whether it restarts from the latest "
        "checkpoint. Null: max(300 s, 20 x the slowest measured step). Counted from the attempt's first step. "
        "fault_tolerance.mode replica: how long the live replicas wait for a silent one (their all-reduce, then each "
        "quorum) before going on without it, which is then killed and replaced as hung (null: 60 s / 30 s).",
    )
    priority: int = Field(0, ge=-1000, le=1000, description="Higher runs first; FIFO within a priority.")
    warm_start: bool = Field(
        True,
        description="Start in the service's warm worker pool when it has one (MESHRUN_WARM_WORKERS; CPU runs on one "
        "node): seconds instead of a new Ray Train worker group. A failure there restarts as a Ray Train worker group "
        "from the latest checkpoint (one of max_failures). false: always a new Ray Train worker group.",
    )


class ElasticSpec(_Spec):
    """What the service may change when the run's layout can no longer be placed (a node lost for good), and back
    when capacity returns: the data-parallel degree within [min_dp, max_dp] (the largest that fits), or, with
    ``layouts``, any of the listed layouts (the first that fits, best first). The global batch is kept (more
    gradient accumulation per rank) and the run resumes from its latest checkpoint resharded into that layout."""

    min_dp: int = Field(1, ge=1, le=MAX_WORLD_SIZE)
    max_dp: int | None = Field(None, ge=1, le=MAX_WORLD_SIZE, description="Default: the layout's dp.")
    layouts: list[Layout] | None = Field(
        None,
        min_length=1,
        max_length=16,
        description="Instead of dp bounds: the layouts the run may take, best first (their degrees dp, tp, pp; the "
        "run's other layout settings are kept; the submitted layout ranks "
        "first unless listed). After node loss: the first that fits the alive nodes; when capacity returns and "
        "nothing waits: one listed before the current one that fits the free resources.",
    )

    @field_validator("max_dp")
    @classmethod
    def _bounds(cls, v: int | None, info: Any) -> int | None:
        lo = info.data.get("min_dp", 1)
        if v is not None and v < lo:
            raise ValueError(f"elastic.max_dp={v} is below elastic.min_dp={lo}; use max_dp >= min_dp")
        return v


class FaultToleranceSpec(_Spec):
    """What happens when a worker dies. ``group`` (the default): Ray Train restarts the whole worker group from the
    latest checkpoint (``resources.max_failures`` restarts). ``replica``: each data-parallel replica is its own Ray
    actor coordinated by torchft (a lighthouse in the driver, a quorum per step); when one dies the others keep
    stepping, it is restarted alone (``resources.max_failures`` replacements, -1 unlimited) and heals from a live
    peer's in-memory state, not from storage, then rejoins at a step boundary; a hung replica (alive, not stepping)
    is killed and replaced the same way (``resources.hang_timeout_s``). Layouts: plain data parallel (dp >= 2,
    tp 1, pp 1, zero_stage 0); docs/fault-tolerance.md."""

    mode: Literal["group", "replica"] = Field(
        "group", description="group: restart every worker; replica: only the lost one."
    )
    min_replicas: int = Field(
        1, ge=1, le=MAX_WORLD_SIZE, description="replica: replicas a step needs to commit (fewer: the step waits)."
    )
    batch: Literal["keep", "shrink"] = Field(
        "keep",
        description="replica: keep (the live replicas also train the lost replica's share of the batch: every step "
        "sees the full global batch, the same math as without a failure) or shrink (each replica trains only its own "
        "share, torchft's default: a step with fewer replicas has a smaller batch, averaged over them).",
    )


class RunClusterSpec(_Spec):
    """What the run's cluster costs (the planner's ``ClusterSpec`` describes the rest of it)."""

    price_per_device_hour: PricePerDeviceHour = Field(
        None,
        description="US dollars per device (GPU, or CPU worker) per hour, for the run's cost; default: the "
        "service's MESHRUN_DEVICE_PRICES or the planner's dated table for the cluster's device.",
    )


class RunSpec(_Spec):
    """A training run as the user asks for it."""

    name: str = Field("run", description="Human name; letters, digits, '.', '_', '-'.")
    model: ModelSpec = Field(default_factory=ModelSpec)
    data: DataSpec = Field(default_factory=DataSpec)
    layout: Layout = Field(default_factory=Layout)
    batch: BatchSpec = Field(default_factory=BatchSpec)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    compile: bool = Field(
        False,
        description="torch.compile each transformer block (in place, after TP and activation checkpointing, before "
        "FSDP/DDP). Pays off on GPUs for element-wise-heavy blocks; the first steps include compile time.",
    )
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    train: TrainSpec = Field(default_factory=TrainSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    metrics: MetricsSpec = Field(default_factory=MetricsSpec)
    profile: ProfileSpec | None = Field(None, description="Profile a window of steps on every rank; null = off.")
    faults: FaultsSpec | None = Field(None, description="Injected faults for chaos tests; null = none.")
    elastic: ElasticSpec | None = Field(
        None, description="Re-plan within dp bounds or a list of layouts after node loss; null = off."
    )
    fault_tolerance: FaultToleranceSpec = Field(
        default_factory=FaultToleranceSpec,
        description="group (default): a lost worker restarts the worker group; replica: only the lost replica.",
    )
    cluster: RunClusterSpec = Field(default_factory=RunClusterSpec)
    skip_memory_check: bool = Field(False, description="Submit even if the planner predicts it will not fit.")
    labels: dict[str, str] = Field(default_factory=dict)
    tracking: TrackingSpec | None = Field(
        None, description="Experiment trackers (MLflow, TensorBoard, W&B) the driver logs to; docs/tracking.md."
    )
    code: CodeSpec | None = Field(
        None,
        description="User code directory for model/data entrypoints (shipped to "
        "the workers); omit when the code is installed on the cluster.",
    )

    @field_validator("name")
    @classmethod
    def _name_shape(cls, v: str) -> str:
        if not NAME_RE.fullmatch(v):
            raise ValueError(
                "name must be 1-128 characters of letters, digits, '.', '_' or '-', starting with a letter or digit"
            )
        return v


class ResumeRequest(_Spec):
    fresh: bool = Field(
        False, description="Start again from step 0 when the run has no checkpoint (refused otherwise)."
    )
    layout: Layout | None = Field(None, description="New layout; the checkpoint is resharded on load.")
    batch: BatchSpec | None = None
    steps: int | None = Field(None, ge=1, le=MAX_STEPS, description="New total step count.")

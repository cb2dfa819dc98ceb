"""Cross-field checks of a RunSpec and the resolution of a Plan. Pure Python (no torch, no ray).

Every rule names the field it is about (``param``, dotted like ``layout.tp``) and says what to do. The API
turns errors into 422s; the workers call the same functions again before they build anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from api.spec._base import MAX_WORLD_SIZE
from api.spec.elastic import candidate
from api.spec.hf import HFConfigError, hf_param_count, read_hf_config
from api.spec.layout import LayoutError, ResolvedLayout
from api.spec.plan import ModelConfig, Plan
from api.spec.presets import PRESETS, gpt_param_count, mlp_param_count
from api.spec.run import ModelSpec, RunSpec


@dataclass(frozen=True)
class SpecIssue:
    param: str
    message: str
    code: str = "invalid_spec"


@dataclass
class SpecCheck:
    errors: list[SpecIssue] = field(default_factory=list)
    warnings: list[SpecIssue] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors

    def error(self, param: str, message: str, code: str = "invalid_spec") -> None:
        self.errors.append(SpecIssue(param, message, code))

    def warn(self, param: str, message: str) -> None:
        self.warnings.append(SpecIssue(param, message, "warning"))


class SpecError(ValueError):
    """A spec that cannot run. Carries the first issue's field for the API's error body."""

    def __init__(self, issues: list[SpecIssue]):
        self.issues = issues
        first = issues[0]
        super().__init__(f"{first.param}: {first.message}")

    @property
    def param(self) -> str:
        return self.issues[0].param

    @property
    def code(self) -> str:
        return self.issues[0].code


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def resolve_model(model: ModelSpec) -> ModelConfig:
    """Fill every size of a built-in model from its preset and the spec's overrides.

    Raises SpecError for unknown families/presets or missing sizes. User models (entrypoint) resolve to the
    sizes the spec gives (their real count comes from building them on the meta device).
    """
    if model.name == "hf" and model.entrypoint is None:
        return _resolve_hf(model)
    if model.path is not None:
        raise SpecError([SpecIssue("model.path", "model.path is for model.name 'hf'; remove it or set name: hf")])
    if model.entrypoint is not None or model.name == "custom":
        if model.entrypoint is None:
            raise SpecError(
                [SpecIssue("model.entrypoint", "model.name 'custom' needs an entrypoint 'package.module:function'")]
            )
        base: dict[str, int] = dict(n_layers=1, d_model=1, n_heads=1, vocab_size=256, seq_len=64)
    else:
        family = PRESETS.get(model.name)
        if family is None:
            raise SpecError(
                [
                    SpecIssue(
                        "model.name",
                        f"unknown model '{model.name}'; use one of {sorted(PRESETS)} or give an entrypoint",
                        "unknown_model",
                    )
                ]
            )
        if model.preset is None:
            base = {}
        elif model.preset not in family:
            raise SpecError(
                [
                    SpecIssue(
                        "model.preset",
                        f"unknown preset '{model.preset}' for {model.name}; use one of {list(family)}",
                        "unknown_preset",
                    )
                ]
            )
        else:
            base = dict(family[model.preset])
    given = {
        k: getattr(model, k) if getattr(model, k) is not None else base.get(k)
        for k in ("n_layers", "d_model", "n_heads", "vocab_size", "seq_len")
    }
    missing = [k for k, v in given.items() if v is None]
    if missing:
        raise SpecError([SpecIssue(f"model.{missing[0]}", f"model.{missing[0]} is required when no preset is given")])
    sizes: dict[str, int] = {k: int(v) for k, v in given.items() if v is not None}
    d_ff = model.d_ff or 4 * sizes["d_model"]
    if model.entrypoint is not None:
        n_params = 0
    elif model.name == "mlp":
        n_params = mlp_param_count(**sizes, d_ff=d_ff)
    else:
        n_params = gpt_param_count(**sizes, d_ff=d_ff)
    return ModelConfig(
        name="custom" if model.entrypoint else model.name,
        d_ff=d_ff,
        n_params=n_params,
        entrypoint=model.entrypoint,
        args=model.args,
        attention=model.attention,
        **sizes,
    )


def _resolve_hf(model: ModelSpec) -> ModelConfig:
    """A Hugging Face directory: every size from its config.json (the spec may only shorten seq_len)."""
    if model.path is None:
        raise SpecError([SpecIssue("model.path", "model.name 'hf' needs model.path: a directory with config.json")])
    given = [k for k in ("n_layers", "d_model", "n_heads", "vocab_size", "d_ff") if getattr(model, k) is not None]
    if given:
        raise SpecError(
            [SpecIssue(f"model.{given[0]}", f"model.{given[0]} comes from config.json for 'hf'; remove it")]
        )
    try:
        fields = read_hf_config(model.path)
    except HFConfigError as e:
        raise SpecError([SpecIssue("model.path", str(e), "invalid_model")]) from None
    sizes, args = fields["sizes"], fields["args"]
    n_pos = int(args["n_positions"])
    seq_len = model.seq_len or min(n_pos, 1024)
    if args["arch"] == "gpt2" and seq_len > n_pos:
        raise SpecError([SpecIssue("model.seq_len", f"seq_len={seq_len} exceeds the model's {n_pos} positions")])
    n_params = hf_param_count(**sizes, args=args)
    return ModelConfig(name="hf", seq_len=seq_len, n_params=n_params, args=args, attention=model.attention, **sizes)


def check_spec(spec: RunSpec) -> SpecCheck:
    """All cross-field rules. Never raises; returns errors and warnings."""
    chk = SpecCheck()
    lay, batch = spec.layout, spec.batch
    try:
        cfg = resolve_model(spec.model)
    except SpecError as e:
        chk.errors.extend(e.issues)
        return chk
    custom = cfg.entrypoint is not None

    world = lay.dp * lay.tp * lay.pp
    if world > MAX_WORLD_SIZE:
        chk.error(
            "layout",
            f"world size dp*tp*pp = {world} exceeds the limit {MAX_WORLD_SIZE}; lower the degrees",
            "too_large",
        )

    if not custom:
        attention = cfg.name in ("gpt", "hf")  # the MLP token model has no heads to split
        kv_heads = int(cfg.args.get("n_kv_heads", cfg.n_heads))
        if attention and kv_heads != cfg.n_heads and kv_heads % lay.tp:  # grouped-query attention (hf models)
            ok = [d for d in _divisors(kv_heads) if d <= 64]
            why = f"tp={lay.tp} does not divide the model's {kv_heads} key/value heads; use tp in {ok}"
            chk.error("layout.tp", why)
        if attention and cfg.d_model % cfg.n_heads:
            chk.error(
                "model.n_heads",
                f"n_heads={cfg.n_heads} does not divide d_model={cfg.d_model}; "
                f"use n_heads in {_divisors(cfg.d_model)[:12]}",
            )
        if attention and cfg.n_heads % lay.tp:
            ok = [d for d in _divisors(cfg.n_heads) if d <= 64]
            chk.error("layout.tp", f"tp={lay.tp} does not divide {cfg.n_heads} attention heads; use tp in {ok}")
        elif cfg.d_ff % lay.tp:
            chk.error(
                "layout.tp", f"tp={lay.tp} does not divide the MLP width d_ff={cfg.d_ff}; use a tp that divides it"
            )
        elif cfg.vocab_size % lay.tp:
            chk.error(
                "layout.tp",
                f"tp={lay.tp} does not divide vocab_size={cfg.vocab_size}; pad the vocabulary "
                f"to a multiple of {lay.tp}",
            )
        stages = lay.pp * lay.pp_virtual_stages
        if stages > cfg.n_layers:
            chk.error(
                "layout.pp",
                f"pp={lay.pp} x pp_virtual_stages={lay.pp_virtual_stages} = {stages} stages "
                f"exceeds the model's {cfg.n_layers} layers; use pp*virtual_stages <= {cfg.n_layers}",
            )
    else:
        if lay.tp > 1 and not spec.model.tp_plan:
            chk.error(
                "model.tp_plan",
                f"tp={lay.tp} needs a tensor-parallel plan for a custom model: give "
                "model.tp_plan {module pattern: colwise|rowwise|...} or use tp=1",
                "unsupported_layout",
            )
        if lay.pp > 1 and not spec.model.pp_split_points:
            chk.error(
                "model.pp_split_points",
                f"pp={lay.pp} needs split points for a custom model: give "
                "model.pp_split_points [module names] or use pp=1",
                "unsupported_layout",
            )
        elif (
            spec.model.pp_split_points
            and lay.pp > 1
            and len(spec.model.pp_split_points) != lay.pp * lay.pp_virtual_stages - 1
        ):
            chk.error(
                "model.pp_split_points",
                f"{len(spec.model.pp_split_points)} split points make "
                f"{len(spec.model.pp_split_points) + 1} stages but the layout has "
                f"{lay.pp * lay.pp_virtual_stages}; give pp*virtual_stages-1 split points",
            )

    # pipeline schedule vs virtual stages
    if lay.pp_schedule in ("gpipe", "1f1b") and lay.pp_virtual_stages != 1:
        chk.error(
            "layout.pp_virtual_stages",
            f"schedule {lay.pp_schedule} runs one stage per rank; set "
            "pp_virtual_stages=1 or use pp_schedule interleaved_1f1b / interleaved_zero_bubble",
        )
    if lay.pp_schedule == "zbv" and lay.pp_virtual_stages != 2:
        chk.error(
            "layout.pp_virtual_stages", "schedule zbv needs exactly 2 virtual stages per rank; set pp_virtual_stages=2"
        )
    if lay.pp_schedule in ("interleaved_1f1b", "interleaved_zero_bubble") and lay.pp > 1 and lay.pp_virtual_stages < 2:
        chk.error(
            "layout.pp_virtual_stages",
            f"schedule {lay.pp_schedule} needs pp_virtual_stages >= 2; set it to 2 or use pp_schedule 1f1b",
        )

    # data parallel sharding
    if lay.shard_group_size is not None:
        if lay.zero_stage < 2:
            chk.error(
                "layout.shard_group_size",
                "HSDP shard groups need zero_stage 2 or 3; set zero_stage: 3 or remove shard_group_size",
            )
        elif lay.dp % lay.shard_group_size:
            chk.error(
                "layout.shard_group_size",
                f"shard_group_size={lay.shard_group_size} does not divide dp={lay.dp}; use one of {_divisors(lay.dp)}",
            )
    if lay.grad_compression != "none" and lay.zero_stage != 0:
        chk.error(
            "layout.grad_compression",
            "gradient compression hooks apply to DDP only; use zero_stage 0 or grad_compression none",
        )
    if lay.cpu_offload and lay.zero_stage != 3:
        chk.error("layout.cpu_offload", "cpu_offload needs zero_stage 3 (FSDP full shard)")
    if lay.zero_stage == 1 and (lay.tp > 1 or lay.pp > 1):
        chk.error(
            "layout.zero_stage",
            "zero_stage 1 (ZeroRedundancyOptimizer) works with plain data "
            "parallel only; use zero_stage 2 or 3 with tp/pp",
        )
    _check_sync(spec, chk)
    _check_fault_tolerance(spec, chk)
    if lay.sequence_parallel and lay.tp == 1:
        chk.error("layout.sequence_parallel", "sequence_parallel needs tp > 1; set tp >= 2 or turn it off")
    elif lay.sequence_parallel and cfg.seq_len % lay.tp:
        chk.error(
            "layout.sequence_parallel",
            f"sequence parallel splits seq_len={cfg.seq_len} over tp={lay.tp}; use a seq_len divisible by tp",
        )

    # batch
    if batch.micro_batch_size > batch.global_batch_size:
        chk.error(
            "batch.micro_batch_size",
            f"micro_batch_size={batch.micro_batch_size} exceeds global_batch_size={batch.global_batch_size}",
        )
    elif batch.global_batch_size % (batch.micro_batch_size * lay.dp):
        per = batch.micro_batch_size * lay.dp
        lo = batch.global_batch_size // per * per
        hint = f"{lo} or {lo + per}" if lo else f"{per}"
        chk.error(
            "batch.global_batch_size",
            f"global_batch_size={batch.global_batch_size} is not a multiple of "
            f"micro_batch_size x dp = {batch.micro_batch_size} x {lay.dp} = {per}; use {hint}",
        )
    else:
        m = batch.global_batch_size // (batch.micro_batch_size * lay.dp)
        if lay.pp > 1:
            if m < lay.pp and lay.pp_schedule != "gpipe":
                chk.error(
                    "batch.micro_batch_size",
                    f"the pipeline gets {m} micro-batches per step but has "
                    f"pp={lay.pp} stages; {lay.pp_schedule} needs at least pp micro-batches (global_batch_size >= "
                    f"{lay.pp * batch.micro_batch_size * lay.dp}), a smaller micro_batch_size, or pp_schedule gpipe",
                )
            elif m < lay.pp:
                chk.warn(
                    "batch.micro_batch_size",
                    f"{m} micro-batches for pp={lay.pp}: most stages idle most of the step "
                    f"(bubble {(lay.pp - 1) / (m + lay.pp - 1):.0%}); use >= {4 * lay.pp} micro-batches",
                )
            elif lay.pp_virtual_stages > 1 and m % lay.pp:
                chk.error(
                    "batch.micro_batch_size",
                    f"interleaved schedules need the micro-batch count ({m}) to be a multiple of pp={lay.pp}",
                )
            elif m < 4 * lay.pp:
                chk.warn(
                    "batch.micro_batch_size",
                    f"{m} micro-batches for pp={lay.pp}: the bubble is "
                    f"{(lay.pp - 1) / (m + lay.pp - 1):.0%} of the step; use >= {4 * lay.pp} to keep it small",
                )

    if spec.precision == "fp16" and lay.zero_stage >= 2:
        chk.warn("precision", "fp16 with FSDP uses a sharded gradient scaler; bf16 is simpler where supported")
    if spec.faults is not None and spec.faults.kill_ps is not None and lay.sync != "async_ps":
        chk.error("faults.kill_ps", "kill_ps hits a parameter server: it needs layout.sync async_ps")
    if spec.faults is not None:
        for name in ("slow_rank", "hang_rank", "kill_rank"):
            fault = getattr(spec.faults, name)
            if fault is not None and fault.rank >= world:
                chk.error(
                    f"faults.{name}.rank",
                    f"rank {fault.rank} does not exist: the layout has {world} ranks (dp x tp x pp); "
                    f"use a rank in 0..{world - 1}",
                )
    if spec.profile is not None and spec.profile.start_step > spec.train.steps:
        chk.warn(
            "profile.start_step",
            f"start_step={spec.profile.start_step} > steps={spec.train.steps}: nothing will be profiled",
        )
    if spec.checkpoint.keep < 1:
        chk.error("checkpoint.keep", "keep at least one checkpoint")
    if spec.checkpoint.every_steps and spec.checkpoint.every_steps > spec.train.steps:
        chk.warn(
            "checkpoint.every_steps",
            f"every_steps={spec.checkpoint.every_steps} > steps={spec.train.steps}: no checkpoint will be written",
        )
    if chk.ok and spec.elastic is not None and spec.elastic.layouts:
        _check_elastic_layouts(spec, chk)
    return chk


def _check_elastic_layouts(spec: RunSpec, chk: SpecCheck) -> None:
    """Every listed layout must be one the run can take (its model, its global batch): an entry that can never run
    is found at submission, not after a node is lost."""
    assert spec.elastic is not None and spec.elastic.layouts
    for i, lay in enumerate(spec.elastic.layouts):
        where, what = f"elastic.layouts[{i}]", f"dp={lay.dp} tp={lay.tp} pp={lay.pp}"
        try:
            cand, _, _ = candidate(spec, lay.dp, lay.tp, lay.pp)
        except ValueError as e:
            chk.error(where, f"{what}: {e}; remove it or change batch.global_batch_size")
            continue
        sub = check_spec(cand.model_copy(update={"elastic": None}))
        if not sub.ok:
            chk.error(where, f"{what}: {sub.errors[0].param}: {sub.errors[0].message}; remove this layout or fix it")


def _check_fault_tolerance(spec: RunSpec, chk: SpecCheck) -> None:
    """``fault_tolerance.mode: replica``: each replica is one worker of plain data parallelism, or an FSDP shard group
    of ``shard_group_size`` workers (HSDP's replicate dimension), tied to the others by a torchft quorum."""
    ft, lay = spec.fault_tolerance, spec.layout
    if ft.mode != "replica":
        return
    fix = "(or fault_tolerance.mode: group)"
    try:
        res = ResolvedLayout.of(lay)  # the one split of dp into (replicas, shards)
    except LayoutError:
        return  # reported by the layout's own check, naming layout.shard_group_size
    hsdp = res.dp_shard > 1 and res.dp_replicate > 1  # replicas of FSDP shard groups
    replicas, sgs = res.dp_replicate, res.dp_shard
    for name, bad, why in (
        ("layout.dp", lay.dp < 2, "needs data-parallel replicas to keep training: set dp >= 2"),
        ("layout.tp", lay.tp > 1, "a replica is data parallel (one worker, or an FSDP shard group): use tp 1"),
        ("layout.pp", lay.pp > 1, "a replica is data parallel (one worker, or an FSDP shard group): use pp 1"),
        (
            "layout.zero_stage",
            lay.zero_stage == 1 or (lay.zero_stage >= 2 and not hsdp),
            "replicas hold whole copies of the state (zero_stage 0), or shard it inside groups of "
            "layout.shard_group_size workers with HSDP (zero_stage 2 or 3 and shard_group_size < dp): use one of those",
        ),
        (
            "layout.shard_group_size",
            hsdp and lay.sync != "sync",
            "local_sgd and diloco replicas are one worker each: remove shard_group_size and use zero_stage 0",
        ),
        ("layout.cpu_offload", lay.cpu_offload, "use cpu_offload false"),
        (
            "layout.sync",
            lay.sync not in ("sync", "local_sgd", "diloco"),
            "replicas agree every step (sync) or every round (local_sgd, diloco): use one of those",
        ),
        ("layout.grad_compression", lay.grad_compression != "none", "use grad_compression none"),
        ("precision", spec.precision == "fp16", "use fp32 or bf16 (no loss scaler across a changing quorum)"),
        ("elastic", spec.elastic is not None, "a lost replica is replaced, not re-planned: remove elastic"),
    ):
        if bad:
            chk.error(name, f"fault_tolerance.mode replica: {why} {fix}", "unsupported_layout")
    if ft.min_replicas > replicas:
        chk.error(
            "fault_tolerance.min_replicas",
            f"min_replicas={ft.min_replicas} > {replicas} replicas (dp={lay.dp}"
            + (f" in shard groups of {sgs}" if hsdp else "")
            + f"): no step could commit; use 1..{replicas}",
        )


def _check_sync(spec: RunSpec, chk: SpecCheck) -> None:
    """The asynchronous and periodic-averaging modes (``layout.sync``): what composes with what."""
    lay = spec.layout
    mode = lay.sync
    if mode == "sync":
        return
    if lay.dp < 2:
        chk.error("layout.dp", f"layout.sync {mode} needs data-parallel replicas; set dp >= 2 or sync: sync")
    if mode == "async_ps":
        for name, bad, why in (
            ("layout.pp", lay.pp > 1, "pipeline stages would each need their own servers; use pp 1"),
            ("layout.tp", lay.tp > 1, "workers push whole (unsharded) gradients; use tp 1"),
            ("layout.zero_stage", lay.zero_stage != 0, "the servers hold the optimizer state; use zero_stage 0"),
            ("layout.grad_compression", lay.grad_compression != "none", "use grad_compression none"),
        ):
            if bad:
                chk.error(
                    name, f"layout.sync async_ps does not support this: {why} (or sync: sync)", "unsupported_layout"
                )
        if spec.precision != "fp32":
            chk.error(
                "precision",
                "layout.sync async_ps trains in fp32 (the servers keep fp32 parameters); use precision fp32",
                "unsupported_layout",
            )
        if not spec.checkpoint.every_steps:
            chk.warn(
                "checkpoint.every_steps",
                "async_ps without checkpoint.every_steps: a lost parameter server restarts every server from the "
                "initial parameters (step 0); set every_steps to bound the steps lost",
            )
        if spec.faults is not None and spec.faults.kill_ps is not None and spec.faults.kill_ps.shard >= lay.ps_shards:
            chk.error(
                "faults.kill_ps.shard",
                f"shard {spec.faults.kill_ps.shard} does not exist: ps_shards is {lay.ps_shards}",
            )
        if lay.ps_shards > 1 and spec.optimizer.grad_clip is not None:
            chk.error(
                "optimizer.grad_clip",
                f"async_ps with ps_shards={lay.ps_shards} cannot clip by the global gradient norm (each server "
                "sees its own shard); set optimizer.grad_clip null or ps_shards 1",
                "unsupported_layout",
            )
        return
    # local_sgd / diloco: each replica is a group (tp, optionally FSDP over shard_group_size inside it)
    if lay.pp > 1:
        chk.error(
            "layout.pp",
            f"layout.sync {mode} averages whole replicas; pipeline parallel is not "
            "supported with it, use pp 1 (tp inside each replica works)",
            "unsupported_layout",
        )
    if lay.zero_stage == 1:
        chk.error(
            "layout.zero_stage",
            f"layout.sync {mode} keeps the inner optimizer per replica; zero_stage 1 "
            "shards it across replicas, use zero_stage 0 (or 2/3 with shard_group_size)",
            "unsupported_layout",
        )
    if lay.zero_stage >= 2 and (lay.shard_group_size is None or lay.shard_group_size == lay.dp):
        chk.error(
            "layout.shard_group_size",
            f"layout.sync {mode} with FSDP shards inside each replica group: set shard_group_size < dp "
            "(dp / shard_group_size replicas average every sync_every_steps), or zero_stage 0",
            "unsupported_layout",
        )
    if lay.grad_compression != "none":
        chk.error(
            "layout.grad_compression",
            f"layout.sync {mode} sends no per-step gradients; use grad_compression none",
            "unsupported_layout",
        )
    if lay.sync_every_steps > spec.train.steps:
        chk.warn(
            "layout.sync_every_steps",
            f"sync_every_steps={lay.sync_every_steps} > steps={spec.train.steps}: "
            "the replicas average only once, at the end",
        )


def build_plan(spec: RunSpec, *, device: str = "auto") -> Plan:
    """Resolve degrees, micro-batches and resources. Raises SpecError if the spec cannot run.

    The planner adds ``predicted`` (memory and time) afterwards.
    """
    chk = check_spec(spec)
    if not chk.ok:
        raise SpecError(chk.errors)
    batch = spec.batch
    layout = ResolvedLayout.of(spec.layout)
    cfg = resolve_model(spec.model)
    m = batch.global_batch_size // (batch.micro_batch_size * layout.dp)
    if spec.resources.device != "auto":
        device = "cuda" if spec.resources.device == "gpu" else "cpu"
    resources: dict[str, float] = {"CPU": float(spec.resources.cpus_per_worker)}
    if device == "cuda":
        resources["GPU"] = 1.0
    return Plan(
        layout=layout,
        micro_batch_size=batch.micro_batch_size,
        global_batch_size=batch.global_batch_size,
        microbatches_per_step=m,
        grad_accum_steps=1 if layout.pp > 1 else m,
        tokens_per_step=batch.global_batch_size * cfg.seq_len,
        model=cfg,
        device=device,
        resources_per_worker=resources,
        placement_strategy="PACK",
        warnings=[f"{w.param}: {w.message}" for w in chk.warnings],
    )

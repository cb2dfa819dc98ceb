"""Parallelize one model (or one pipeline stage part): the order is decided here, the work is in apply_*.

Order (torchtitan): materialise (unless FSDP on meta) -> TP (+SP) -> activation checkpointing -> FSDP2/DDP
-> materialise (meta path). Each ``apply_*`` takes (model, mesh/group, a few plain arguments).

Data-parallel flavour: the plan's resolved layout decides it (``ResolvedLayout.dp_wrapper``, ``hsdp``; by
``zero_stage``; ``layout.sync`` local_sgd / diloco: nothing across the replicas, FSDP over each replica's shard
group for zero_stage 2/3; ``workers.periodic`` averages them):
- 0: DDP (``grad_compression`` hooks) when the model is otherwise unsharded; with tp > 1 or pp > 1, FSDP2
  on the 2-D (dp_replicate, dp_shard=1) mesh, i.e. replicated parameters with all-reduced gradients (DDP
  does not take DTensor parameters).
- 1: DDP + ``ZeroRedundancyOptimizer`` (see ``workers.optim.build_optimizer``).
- 2: FSDP2 ``fully_shard(reshard_after_forward=False)``; 3: ``fully_shard``; HSDP via the 2-D mesh.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from torch import nn

from api.spec import Plan, RunSpec
from api.spec.layout import ResolvedLayout
from workers.models import materialize
from workers.parallel_dims import ParallelDims

log = logging.getLogger(__name__)
# DTensor warns on every multi-dim norm reduction (HSDP x TP grad norms); the result is correct
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def meta_init_bytes() -> int:
    """Above this many parameter bytes a meta-built model under FSDP is sharded before it gets storage
    (env MESHRUN_META_INIT_BYTES, default 1 GiB; 0 forces the meta path)."""
    return int(os.environ.get("MESHRUN_META_INIT_BYTES", str(1 << 30)))


# ------------------------------------------------------------------------------------------ blocks
def find_blocks(model: nn.Module, block_classes: Iterable[str] | None = None) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute/key, block) for every repeated block: ``model.layers`` for built-ins, else
    modules whose class name is in ``block_classes``, else the children of the largest ModuleList/Dict."""
    names = set(block_classes or ())
    layers = getattr(model, "layers", None)
    if not names and isinstance(layers, (nn.ModuleDict, nn.ModuleList)):
        return [(layers, k, b) for k, b in layers.named_children()]
    block_class = getattr(model, "block_class", None)
    if not names and block_class is not None:
        names = {block_class.__name__}
    no_split: list[str] = list(getattr(model, "_no_split_modules", None) or [])
    if not names and no_split:  # Hugging Face models name their blocks
        present = {type(m).__name__ for m in model.modules()}
        names = {n for n in no_split if n in present}
    if names:
        out = []
        for _pname, parent in model.named_modules():
            for k, child in parent.named_children():
                inner = getattr(child, "_checkpoint_wrapped_module", child)
                if type(inner).__name__ in names or any(type(inner).__name__ == f"FSDP{n}" for n in names):
                    out.append((parent, k, child))
        return out
    best: list = []
    for _, mod in model.named_modules():
        if isinstance(mod, (nn.ModuleList, nn.ModuleDict)) and len(mod) > len(best):
            best = [(mod, k, b) for k, b in mod.named_children()]
    return best


def _set_child(parent: nn.Module, key: str, module: nn.Module) -> None:
    if isinstance(parent, (nn.ModuleDict,)):
        parent[key] = module
    elif isinstance(parent, nn.ModuleList):
        parent[int(key)] = module
    else:
        setattr(parent, key, module)


# ---------------------------------------------------------------------------------------------- TP
def _styles_from_strings(model: nn.Module, plan: dict[str, str]) -> dict:
    """A declared plan (spec.model.tp_plan) -> ParallelStyles; a pattern matching no module (or colwise/rowwise
    on a module that is not Linear/Embedding) raises ``workers.user_code.UserCodeError`` naming it."""
    from workers.user_code import tp_styles

    return tp_styles(model, plan)


def apply_tp(
    model: nn.Module,
    tp_mesh,
    *,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    tp_plan: dict[str, str] | None = None,
) -> nn.Module:
    """Megatron tensor parallelism from the model's own plan (or a user plan of style strings)."""
    from torch.distributed.tensor.parallel import parallelize_module

    if tp_plan:  # a user plan (spec.model.tp_plan) wins over the model's own
        styles = _styles_from_strings(model, tp_plan)
    elif hasattr(model, "tp_plan") and callable(model.tp_plan):
        styles = model.tp_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    else:
        raise ValueError("tensor parallel needs a plan: give model.tp_plan or use tp=1")
    parallelize_module(model, tp_mesh, styles)
    log.info(
        "applied TP over %d ranks (sequence_parallel=%s, loss_parallel=%s) to %d modules",
        tp_mesh.size(),
        sequence_parallel,
        loss_parallel,
        len(styles),
    )
    return model


# ---------------------------------------------------------------------------------------------- AC
def apply_ac(model: nn.Module, mode: str, *, block_classes: Iterable[str] | None = None) -> nn.Module:
    """Activation checkpointing (non-reentrant) per block: 'full' = every block, 'selective' = every other
    block (by layer key, so the choice is the same for every pipeline split)."""
    if mode == "none":
        return model
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    n = 0
    for idx, (parent, key, block) in enumerate(find_blocks(model, block_classes)):
        pos = int(key) if str(key).isdigit() else idx
        if mode == "selective" and pos % 2:
            continue
        _set_child(
            parent,
            key,
            checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=False),
        )
        n += 1
    log.info("activation checkpointing '%s' on %d blocks", mode, n)
    return model


# -------------------------------------------------------------------------------------------- FSDP
def apply_compile(model: nn.Module, *, block_classes: Iterable[str] | None = None) -> nn.Module:
    """``torch.compile`` each repeated block in place (``nn.Module.compile``: parameter names and checkpoints stay
    the same); torchtitan's order: after TP and activation checkpointing, before FSDP."""
    for _parent, _key, block in find_blocks(model, block_classes):
        block.compile()
    return model


def apply_fsdp(
    model: nn.Module,
    dp_mesh,
    *,
    reshard_after_forward: bool = True,
    param_dtype: torch.dtype | None = None,
    cpu_offload: bool = False,
    block_classes: Iterable[str] | None = None,
) -> nn.Module:
    """FSDP2: shard each block, then the root (ZeRO-3; reshard_after_forward=False ~ ZeRO-2).
    A 2-D mesh (replicate, shard) gives HSDP."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kw: dict[str, Any] = {"mesh": dp_mesh}
    if param_dtype is not None and param_dtype != torch.float32:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    if cpu_offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    blocks = find_blocks(model, block_classes)
    for i, (_, _, block) in enumerate(blocks):
        # the last block's params are needed again right away by backward: keep them unsharded
        fully_shard(block, reshard_after_forward=reshard_after_forward and i < len(blocks) - 1, **kw)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **kw)
    log.info(
        "applied FSDP2 over mesh %s (reshard_after_forward=%s, %d blocks)",
        dp_mesh.mesh_dim_names,
        reshard_after_forward,
        len(blocks),
    )
    return model


# --------------------------------------------------------------------------------------------- DDP
def _allreduce_hook(pg, bucket):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.allreduce_hook(pg, bucket)


def _bf16_hook(pg, bucket):
    """bf16 compression that also runs on gloo (``bf16_compress_hook`` refuses non-CUDA backends)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks._compress_hook(torch.bfloat16, pg, bucket)


def _fp16_hook(pg, bucket):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.fp16_compress_hook(pg, bucket)


def apply_ddp(
    model: nn.Module, dp_group, *, compression: str = "none", device: torch.device | None = None
) -> nn.Module:
    """DDP with the gradient-compression hook, timed per bucket (``workers.comm_hooks.timed_ddp_hook``)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from workers.comm_hooks import timed_ddp_hook

    device_ids = [device.index] if device is not None and device.type == "cuda" else None
    ddp = DDP(model, process_group=dp_group, device_ids=device_ids, bucket_cap_mb=25, gradient_as_bucket_view=True)
    if compression == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        state = psgd.PowerSGDState(
            process_group=dp_group, matrix_approximation_rank=1, start_powerSGD_iter=2, min_compression_rate=2
        )
        ddp.register_comm_hook(state, timed_ddp_hook(psgd.powerSGD_hook))
    else:
        hook = {"none": _allreduce_hook, "fp16": _fp16_hook, "bf16": _bf16_hook}[compression]
        ddp.register_comm_hook(dp_group, timed_ddp_hook(hook))
    log.info("applied DDP over %d ranks (compression=%s)", dist.get_world_size(dp_group), compression)
    return ddp


# ------------------------------------------------------------------------------------- the decision
@dataclass(frozen=True)
class Parallelized:
    """What ``parallelize_model`` made of one model (or one pipeline part): the wrapped module and what the step
    needs to know about it (how its gradients sync, the autocast dtype and whether logits come vocab-sharded)."""

    model: nn.Module
    dp: Literal["ddp", "fsdp"] | None = None  # how gradients are reduced across data-parallel ranks
    autocast: torch.dtype | None = None  # forward under torch.autocast (unsharded low-precision models)
    loss_parallel: bool = False  # logits are a vocab-sharded DTensor: compute the loss under loss_parallel()

    def grad_sync(self, is_last_microbatch: bool) -> contextlib.AbstractContextManager[Any]:
        """Context for one micro-batch's forward+backward: skip the gradient reduction except on the last."""
        if self.dp == "ddp" and not is_last_microbatch:
            return cast(Any, self.model).no_sync()  # DistributedDataParallel
        if self.dp == "fsdp":
            cast(Any, self.model).set_requires_gradient_sync(is_last_microbatch)  # FSDPModule
        return contextlib.nullcontext()


def parallelize_model(
    model: nn.Module,
    dims: ParallelDims,
    plan: Plan,
    spec: RunSpec,
    *,
    device: torch.device | str | None = None,
    init_on_meta: bool | None = None,
) -> Parallelized:
    """Apply TP -> AC -> compile -> FSDP/DDP to ``model`` (a whole model or one pipeline part), give it weights,
    and return it with what the step needs to know (``Parallelized``).

    ``model`` may be on the meta device: it is materialised on ``device`` with ``init_weights`` (seeded by
    ``spec.train.seed`` and parameter names) BEFORE sharding for small models or DDP, or AFTER FSDP
    sharding (never holding the full model) when ``init_on_meta`` or its size exceeds ``meta_init_bytes()``.
    A new parallel dimension or precision is one ``apply_*`` function and one line in the order below.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    lay = plan.layout  # degrees and flavours, resolved once
    dtype = _DTYPES[spec.precision]
    block_classes = spec.model.block_classes
    init_after_sharding = _place_weights(model, lay, device=device, seed=spec.train.seed, init_on_meta=init_on_meta)
    user_plan: dict[str, str] | None = dict(spec.model.tp_plan) if spec.model.tp_plan else None
    loss_parallel = _loss_parallel(model, dims, user_plan)

    # the order (torchtitan's): each line one apply_* of workers.parallelize
    if dims.tp_enabled:
        apply_tp(
            model, dims.tp_mesh, sequence_parallel=lay.sequence_parallel, loss_parallel=loss_parallel, tp_plan=user_plan
        )
    if spec.activation_checkpointing != "none":
        apply_ac(model, spec.activation_checkpointing, block_classes=block_classes)
    if spec.compile:
        apply_compile(model, block_classes=block_classes)
    model = apply_dp(model, dims, device=device, param_dtype=dtype, block_classes=block_classes)
    if init_after_sharding:
        materialize(model, device=device, seed=spec.train.seed)

    # FSDP casts parameters itself (its mixed-precision policy); other low-precision models run under autocast
    autocast = dtype if dtype != torch.float32 and lay.dp_wrapper != "fsdp" else None
    if autocast is not None and dims.pp_enabled:
        apply_autocast(model, device.type, autocast)  # the pipeline schedule calls forward itself
        autocast = None
    wrapper = lay.dp_wrapper
    dp: Literal["ddp", "fsdp"] | None = None if wrapper == "none" else wrapper
    return Parallelized(model=model, dp=dp, autocast=autocast, loss_parallel=loss_parallel)


def _place_weights(
    model: nn.Module, lay: ResolvedLayout, *, device: torch.device, seed: int, init_on_meta: bool | None
) -> bool:
    """Give ``model`` its weights now (materialise a meta model, or move a real one to ``device``), or leave a
    large meta model for after FSDP sharding. Returns True when the weights are to be made after sharding."""
    on_meta = any(p.is_meta for p in model.parameters())
    use_fsdp = lay.dp_wrapper == "fsdp"
    if init_on_meta is None:
        init_on_meta = use_fsdp and sum(p.numel() for p in model.parameters()) * 4 > meta_init_bytes()
    after_sharding = bool(init_on_meta and use_fsdp and on_meta)
    if on_meta and not after_sharding:
        materialize(model, device=device, seed=seed)
    elif not on_meta:
        model.to(device)
    return after_sharding


def _loss_parallel(model: nn.Module, dims: ParallelDims, user_plan: dict[str, str] | None) -> bool:
    """Logits stay vocab-sharded (loss under ``loss_parallel()``): meshrun's own TP plan, no pipeline."""
    return bool(
        dims.tp_enabled
        and not dims.pp_enabled
        and user_plan is None
        and hasattr(model, "tp_plan")
        and getattr(model, "output", None) is not None
    )


def apply_dp(
    model: nn.Module,
    dims: ParallelDims,
    *,
    device: torch.device,
    param_dtype: torch.dtype,
    block_classes: Iterable[str] | None,
) -> nn.Module:
    """Data parallelism as the layout says: FSDP (ZeRO-2/3, HSDP), DDP, or nothing."""
    lay = dims.layout
    if lay.dp_wrapper == "fsdp":
        return apply_fsdp(
            model,
            dims.fsdp_mesh,  # HSDP's 2-D mesh, or the shard dim (periodic modes: inside each replica only)
            reshard_after_forward=lay.reshard_after_forward,
            param_dtype=param_dtype,
            cpu_offload=lay.cpu_offload,
            block_classes=block_classes,
        )
    if lay.dp_wrapper == "ddp":
        return apply_ddp(model, dims.mesh["dp_replicate"].get_group(), compression=lay.ddp_compression, device=device)
    return model


def apply_autocast(model: nn.Module, device_type: str, dtype: torch.dtype) -> nn.Module:
    """Put autocast inside ``model.forward`` (pipeline parts: the schedule calls forward, not the loop)."""
    model.forward = torch.autocast(device_type=device_type, dtype=dtype)(model.forward)
    return model


# ----------------------------------------------------------------------------- training-step helpers
def unwrap(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "module") and isinstance(model.module, nn.Module) else model


@torch.no_grad()
def clip_grad_norm_(
    params: Iterable[torch.Tensor], max_norm: float | None, *, pp_group=None, norm_type: float = 2.0
) -> torch.Tensor:
    """Global gradient norm (and clipping when ``max_norm``) over parameters on several meshes.

    ``torch.nn.utils.clip_grad_norm_`` fails on a mix of DTensor meshes and plain tensors, so: group by
    mesh, norm per group (``full_tensor()`` reduces a sharded norm), sum squares, all-reduce over the
    pipeline group (each stage holds different parameters), scale every group by the same coefficient.
    Returns the total norm (a plain tensor, identical on every rank).
    """
    from torch.distributed.tensor import DTensor

    groups: dict[Any, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        if p.grad is not None:
            groups[p.grad.device_mesh if isinstance(p.grad, DTensor) else None].append(p.grad)
    total_sq = None
    for grads in groups.values():
        n = torch.nn.utils.get_total_norm(grads, norm_type)
        if isinstance(n, DTensor):
            n = n.full_tensor()
        sq = n.float() ** 2
        total_sq = sq if total_sq is None else total_sq + sq.to(total_sq.device)
    if total_sq is None:
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        total_sq = torch.zeros((), device=dev)
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(total_sq, group=pp_group)
    total = total_sq.sqrt()
    if max_norm is not None:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grads in groups.values():
            local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
            by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
            for g in local:
                by_device[g.device].append(g)
            for gdev, gs in by_device.items():
                torch._foreach_mul_(gs, coef.to(gdev))  # one fused multiply per device (no per-tensor loop)
    return total

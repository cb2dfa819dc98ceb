"""Pipeline parallelism: split a model into stages, parallelize each part, run a schedule.

Modelled on torchtitan's ``torchtitan/distributed/pipeline_parallel.py``:

1. ``stage_module_names`` decides which top-level modules (and which entries of the layer container) each of
   the ``plan.pp_stages_total`` stages keeps. Built-in GPT: embeddings on the first stage, the layers split
   evenly, final norm + head on the last stage. User models: ``spec.model.pp_split_points`` (module names
   where stages begin).
2. ``split_model_part`` deep-copies the full model and drops what the stage does not keep. Fully qualified
   parameter names stay those of the full model (``layers.3.attn.qkv.weight`` stays that on any stage), so
   checkpoints written under one pipeline split load under another.
3. ``stage_ids_for_rank``: looped schedules put stages ``[r, r + pp, ...]`` on pp rank ``r``, V-shaped ones
   (zbv) ``[r, 2 pp - 1 - r]``.
4. Each part goes through ``parallelize_fn`` (TP -> activation checkpointing -> FSDP/DDP), then into a
   ``PipelineStage`` on the pp process group, and the stages into the schedule.

Loss scaling: the schedule sums the gradients of the per-micro-batch losses. The loss function given to the
schedule is ``loss_fn(out, y) / n_microbatches`` and ``scale_grads=False``, so the gradients are those of
the mean loss over the rank's batch (the same as gradient accumulation without pipelining) and the sum of the
recorded micro-batch losses is the mean loss; ``PipelineRunner.step`` returns that sum on the last stage.

Gradient clipping across pp ranks and loss reporting from the last stage are the training loop's job.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

if TYPE_CHECKING:
    from workers.parallelize import Parallelized

logger = logging.getLogger(__name__)

__all__ = [
    "SCHEDULES",
    "PipelineRunner",
    "build_pipeline",
    "split_model_part",
    "stage_ids_for_rank",
    "stage_module_names",
]

# schedule name (api.spec.PPSchedule) -> (torch class name, stages per rank rule)
SCHEDULES: dict[str, str] = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "interleaved_zero_bubble": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
}
_SINGLE_STAGE = frozenset({"gpipe", "1f1b"})
_V_SHAPED = frozenset({"zbv"})


def _schedule_class(name: str) -> type:
    from torch.distributed.pipelining import schedules

    if name not in SCHEDULES:
        raise ValueError(f"layout.pp_schedule: unknown schedule '{name}'; use one of {sorted(SCHEDULES)}")
    return getattr(schedules, SCHEDULES[name])


# ------------------------------------------------------------------------------------------ splitting
class _KeptLayers(nn.ModuleDict):
    """What is left of an ``nn.ModuleList`` on one stage: keyed by the ORIGINAL indices (so parameter names
    stay ``layers.<i>...``) but iterating and indexing like a list, so ``for block in self.layers`` in a
    user model's forward keeps working."""

    def __iter__(self) -> Iterator[nn.Module]:  # type: ignore[override]
        return iter(self.values())

    def __getitem__(self, idx: int | str) -> nn.Module:
        if isinstance(idx, int):
            return list(self.values())[idx]
        return super().__getitem__(idx)


def _is_container(m: nn.Module | None) -> bool:
    return isinstance(m, (nn.ModuleDict, nn.ModuleList)) and not isinstance(m, nn.Sequential)


def _units(model: nn.Module) -> list[str]:
    """The model's splittable units in order: top-level children, with layer containers (ModuleDict /
    ModuleList) expanded one level (``layers.0``, ``layers.1``, ...)."""
    out: list[str] = []
    for name, child in model.named_children():
        if child is None:
            continue
        if _is_container(child):
            out.extend(f"{name}.{k}" for k, _ in child.named_children())
        else:
            out.append(name)
    return out


def _layer_container_name(model: nn.Module) -> str:
    if _is_container(getattr(model, "layers", None)):
        return "layers"
    names = [n for n, c in model.named_children() if _is_container(c)]
    if len(names) != 1:
        raise ValueError(
            f"cannot find the model's layer container (found {names or 'none'}); give "
            "model.pp_split_points [module names where stages begin]"
        )
    return names[0]


def stage_module_names(
    model: nn.Module, n_stages: int, *, split_points: Sequence[str] | None = None
) -> list[list[str]]:
    """Module names kept by each of ``n_stages`` stages (names as in ``_units``: ``tok_emb``, ``layers.3``).

    Without split points (built-in models): the layers of the layer container are spread evenly over the
    stages (the first ``n_layers % n_stages`` stages get one more), modules registered before the container
    (embeddings) go to the first stage, modules after it (final norm, head) to the last.
    With split points: stage ``i + 1`` begins at ``split_points[i]``; each must be a unit name and they must
    be in model order.
    """
    if n_stages < 1:
        raise ValueError(f"n_stages must be >= 1, got {n_stages}")
    units = _units(model)
    if split_points:
        if len(split_points) != n_stages - 1:
            raise ValueError(
                f"model.pp_split_points: {len(split_points)} split points make "
                f"{len(split_points) + 1} stages but the layout has {n_stages}; give "
                f"{n_stages - 1} split points"
            )
        idx = []
        for sp in split_points:
            if sp not in units:
                raise ValueError(
                    f"model.pp_split_points: '{sp}' is not a top-level module or an entry of a "
                    f"layer container of the model; use names from {units[:8]}..."
                )
            idx.append(units.index(sp))
        bounds = [0, *idx, len(units)]
        if any(b >= e for b, e in zip(bounds, bounds[1:])):
            raise ValueError("model.pp_split_points must be in model order, distinct, and not the first module")
        return [units[b:e] for b, e in zip(bounds, bounds[1:])]

    container = _layer_container_name(model)
    layers = [u for u in units if u.startswith(container + ".")]
    if n_stages > len(layers):
        raise ValueError(
            f"layout.pp: {n_stages} pipeline stages exceed the model's {len(layers)} layers; use "
            f"pp x pp_virtual_stages <= {len(layers)}"
        )
    first = units.index(layers[0])
    before, after = units[:first], units[first + len(layers) :]
    per, extra = divmod(len(layers), n_stages)
    out: list[list[str]] = []
    start = 0
    for s in range(n_stages):
        n = per + (1 if s < extra else 0)
        out.append(layers[start : start + n])
        start += n
    out[0] = before + out[0]
    out[-1] = out[-1] + after
    return out


def _tolerates_none(model: nn.Module) -> bool:
    """Built-in models declare pipeline support (``split_for_pipeline``): their forward skips None modules."""
    return callable(getattr(model, "split_for_pipeline", None))


def split_model_part(model: nn.Module, keep: Sequence[str], *, drop_as: str | None = None) -> nn.Module:
    """A deep copy of ``model`` that holds only the units in ``keep`` (names from ``stage_module_names``).

    Dropped top-level modules become ``None`` for models that declare pipeline support (the GPT treats its
    input as a hidden state without ``tok_emb`` and returns the hidden state without ``output``) and
    ``nn.Identity()`` for user models (``drop_as="identity"``; a forward like ``head(blocks(emb(x)))`` then
    passes the hidden state through). Dropped container entries are deleted; in an ``nn.Sequential`` dropped
    children are removed. Parameter names stay those of the full model.
    """
    drop_as = drop_as or ("none" if _tolerates_none(model) else "identity")
    part = copy.deepcopy(model)
    keep_set = set(keep)
    seq = isinstance(part, nn.Sequential)
    for name, child in list(part.named_children()):
        if child is None:
            continue
        if _is_container(child):
            kept = {k: c for k, c in child.named_children() if f"{name}.{k}" in keep_set}
            if isinstance(child, nn.ModuleDict):
                for k in list(child.keys()):
                    if k not in kept:
                        del child[k]
            else:
                setattr(part, name, _KeptLayers(kept))
        elif name not in keep_set:
            if seq:
                del part._modules[name]
            else:
                setattr(part, name, None if drop_as == "none" else nn.Identity())
    return part


def stage_ids_for_rank(pp_rank: int, pp: int, n_stages: int, *, schedule: str) -> list[int]:
    """Stage indices held by ``pp_rank``: looped ``[r, r + pp, ...]``, V-shaped ``[r, 2 pp - 1 - r]``."""
    if n_stages % pp:
        raise ValueError(f"{n_stages} stages do not divide over pp={pp} ranks")
    per_rank = n_stages // pp
    if schedule in _SINGLE_STAGE and per_rank != 1:
        raise ValueError(
            f"layout.pp_virtual_stages: schedule {schedule} runs one stage per rank, got "
            f"{per_rank}; set pp_virtual_stages=1 or use interleaved_1f1b"
        )
    if schedule in _V_SHAPED:
        if per_rank != 2:
            raise ValueError(
                f"layout.pp_virtual_stages: schedule {schedule} needs 2 stages per rank, got "
                f"{per_rank}; set pp_virtual_stages=2"
            )
        return [pp_rank, n_stages - 1 - pp_rank]
    return [pp_rank + s * pp for s in range(per_rank)]


# ------------------------------------------------------------------------------------------ runner
def _pp_mesh(dims: Any):
    """The 1-D pipeline mesh from a ParallelDims-like object (or a DeviceMesh)."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(dims, DeviceMesh):
        return dims["pp"] if dims.mesh_dim_names and len(dims.mesh_dim_names) > 1 else dims
    pp_mesh = getattr(dims, "pp_mesh", None)
    if pp_mesh is not None:
        return pp_mesh
    get = getattr(dims, "get_mesh", None)
    if callable(get):
        try:
            return get("pp")
        except Exception:
            pass
    for attr in ("world_mesh", "mesh", "device_mesh"):
        mesh = getattr(dims, attr, None)
        if mesh is not None:
            return mesh["pp"] if len(mesh.mesh_dim_names or ()) > 1 else mesh
    raise TypeError(f"cannot find a 'pp' device mesh on {type(dims).__name__}")


def _scaled_loss(loss_fn: Callable[..., torch.Tensor], n: int) -> Callable[..., torch.Tensor]:
    def loss(output: torch.Tensor, target: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return loss_fn(output, target, **kwargs) / n

    return loss


class PipelineRunner:
    """The model parts, stages and schedule of this rank.

    ``step(inputs, targets)`` runs forward and backward of all micro-batches of one optimizer step (the
    input is the rank's whole batch: ``microbatches_per_step x micro_batch_size`` sequences) and returns
    the mean loss over that batch on ranks holding the last stage, ``None`` elsewhere. Gradients are left
    in the parts' parameters (already reduced over dp by FSDP/DDP); the optimizer step is the caller's.
    """

    def __init__(
        self,
        *,
        schedule: Any,
        stages: list[Any],
        parts: list[Parallelized],
        schedule_name: str,
        n_microbatches: int,
    ):
        self.schedule = schedule
        self.stages = stages
        self.parts = parts
        self.model_parts = [p.model for p in parts]
        self.schedule_name = schedule_name
        self.n_microbatches = n_microbatches
        self.stage_ids = [s.stage_index for s in stages]
        self.has_first_stage = any(s.is_first for s in stages)
        self.has_last_stage = any(s.is_last for s in stages)

    def step(self, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> torch.Tensor | None:
        for name, t in (
            ("inputs", inputs if self.has_first_stage else None),
            ("targets", targets if self.has_last_stage else None),
        ):
            if t is not None and t.shape[0] % self.n_microbatches:
                raise ValueError(
                    f"{name} hold {t.shape[0]} sequences, not a multiple of the pipeline's "
                    f"{self.n_microbatches} micro-batches; pass the rank's whole batch "
                    "(microbatches_per_step x micro_batch_size)"
                )
        args = (inputs,) if self.has_first_stage else ()
        with self._context():
            if self.has_last_stage:
                losses: list[torch.Tensor] = []
                self.schedule.step(*args, target=targets, losses=losses)
                return torch.stack([_local(x).detach().float() for x in losses]).sum()
            self.schedule.step(*args)
        return None

    def _context(self) -> contextlib.AbstractContextManager:
        """Autocast / loss_parallel as ``workers.parallelize`` decided for the parts (``Parallelized.autocast``:
        a dtype for unsharded low-precision parts; ``Parallelized.loss_parallel``: vocab-sharded logits)."""
        stack = contextlib.ExitStack()
        dtype = next((p.autocast for p in self.parts if p.autocast is not None), None)
        if dtype is not None:
            dev = self.stages[0].device.type if self.stages else "cpu"
            stack.enter_context(torch.autocast(dev, dtype=dtype))
        if any(p.loss_parallel for p in self.parts):
            from torch.distributed.tensor.parallel import loss_parallel

            stack.enter_context(loss_parallel())
        return stack

    def __repr__(self) -> str:
        return (
            f"PipelineRunner(schedule={self.schedule_name}, stages={self.stage_ids}, "
            f"microbatches={self.n_microbatches})"
        )


def _local(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def build_pipeline(
    model: nn.Module,
    *,
    dims: Any,
    plan: Any,
    spec: Any,
    device: torch.device | str,
    parallelize_fn: Callable[[nn.Module], Parallelized],
    loss_fn: Callable[..., torch.Tensor],
) -> PipelineRunner:
    """Split ``model`` into ``plan.pp_stages_total`` stages, keep this rank's, parallelize them, schedule.

    ``model`` is the full model (on any device, meta included: the parts are deep copies and the caller
    initialises/moves them afterwards if it built on meta). ``parallelize_fn(part)`` applies TP/AC/FSDP/DDP
    to one part (``workers.parallelize.parallelize_model``). ``loss_fn(output, target)`` is the mean loss
    of one micro-batch.
    """
    from torch.distributed.pipelining import PipelineStage

    pp_mesh = _pp_mesh(dims)
    pp_rank, pp = pp_mesh.get_local_rank(), pp_mesh.size()
    n_stages = int(plan.pp_stages_total)
    if pp != plan.pp:
        raise ValueError(
            f"the pp mesh has {pp} ranks but the plan says pp={plan.pp}; build ParallelDims from this plan"
        )
    layout = getattr(spec, "layout", None)
    schedule_name = layout.pp_schedule if layout is not None else ("1f1b" if n_stages == pp else "interleaved_1f1b")
    model_spec = getattr(spec, "model", None)
    split_points = getattr(model_spec, "pp_split_points", None)
    device = torch.device(device)

    names = stage_module_names(model, n_stages, split_points=split_points)
    ids = stage_ids_for_rank(pp_rank, pp, n_stages, schedule=schedule_name)
    group = pp_mesh.get_group()
    parts: list[Parallelized] = []
    stages: list[Any] = []
    for sid in ids:
        part = split_model_part(model, names[sid])
        # (the built-in models also offer split_for_pipeline(i, n); it keeps the same modules as this
        # generic split, which also serves user models with split points)
        done = parallelize_fn(part)
        logger.info("pp rank %d builds stage %d/%d with %s", pp_rank, sid, n_stages, names[sid])
        parts.append(done)
        stages.append(PipelineStage(done.model, sid, n_stages, device, group=group))

    n_mb = int(plan.microbatches_per_step)
    cls = _schedule_class(schedule_name)
    schedule = cls(
        stages[0] if schedule_name in _SINGLE_STAGE else stages,
        n_microbatches=n_mb,
        loss_fn=_scaled_loss(loss_fn, n_mb),
        scale_grads=False,
    )
    return PipelineRunner(
        schedule=schedule, stages=stages, parts=parts, schedule_name=schedule_name, n_microbatches=n_mb
    )

"""Distributed checkpoints with torch.distributed.checkpoint (DCP), reshardable on load.

One checkpoint is a directory:

- DCP files: ``__<rank>_<n>.distcp`` (data written by each rank; names are unique per rank) and
  ``.metadata`` (written by rank 0, the DCP coordinator, after every rank has written its data).
- ``meshrun.json`` (rank 0, written last, atomically): format, step, world size, the plan and spec as JSON,
  torch version. Its presence marks a complete checkpoint (``prune_checkpoints``/``latest_checkpoint`` look
  for it).

What is saved (keys of the DCP state dict):

- ``model.<fqn>``: every parameter/buffer under the fully qualified name of the FULL model, from
  ``get_model_state_dict`` (strips DDP ``module.``, activation-checkpoint and compile wrappers; FSDP2/TP
  parameters are DTensors and are saved as shards). Pipeline parts keep the full model's names
  (``workers.pipeline.split_model_part``), so their dicts merge without clashes and a checkpoint written
  with one pp split loads under another, or without pp.
- ``optim.state.<fqn>.<key>`` / ``optim.hypers.<fqn>``: the optimizer state, flattened per parameter
  (``StateDictOptions(flatten_optimizer_state_dict=True)``), so several optimizers (one per pipeline part)
  merge and the state reshards like the parameters. The hyperparameters of a parameter's group (lr, betas,
  eps, ... : ``param_groups.<fqn>.<hyper>`` once flattened) go in as one pickled blob per parameter: as
  separate DCP items they were three quarters of all items and most of the time a save takes. Checkpoints
  written before (one item per hyperparameter) still load.
  ZeroRedundancyOptimizer (zero 1) is saved PER RANK, not consolidated: each rank saves (in the same key format)
  the state of the whole parameters it owns; their union is the full state (no gather, no memory spike). On load
  each rank reads the keys of the parameters it owns under the NEW layout: zero 1 reloads as plain AdamW (any
  layout) or as zero 1 with another dp, and a plain checkpoint reloads into ZeRO.
- ``train`` (one blob, same on every rank): step, world size, ``state_dict()`` of the LR schedulers.
- ``rank<r>`` (one blob per rank r): RNG states (torch CPU, CUDA if present, Python ``random``, numpy if
  importable) and ``extra`` (the caller's data position etc.).

Resuming on a different world size: model/optimizer reshard; RNG and ``extra`` come from the same rank when
the world size matches, else every rank gets rank 0's (logged). Samplers should derive their position from
the step (or from ``extra``, which the caller interprets).

Per-rank directories (Ray Train): every rank may pass its own ``path`` (its ``__<rank>_*.distcp`` files; rank 0's
also ``.metadata`` and ``meshrun.json``); merged, they are the complete checkpoint. Without a process group (single
process) DCP runs with ``no_dist``. ``workers.checkpoint_async`` writes in the background (``checkpoint.async``).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import pickle
import random
import re
import shutil
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from workers.checkpoint_manifest import (
    META_FILE,
    PARTIAL_SUFFIX,
    checkpoint_path,
    checkpoint_size_bytes,
    latest_checkpoint,
    list_checkpoints,
    manifest_name,
    prune_checkpoints,
    rank_files,
    removed_on_failure,
    verify_checkpoint,
    write_json_atomic,
    write_manifest,
)

logger = logging.getLogger(__name__)

__all__ = [
    "FORMAT_VERSION",
    "META_FILE",
    "checkpoint_path",
    "checkpoint_size_bytes",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "prune_checkpoints",
    "read_checkpoint_meta",
    "checkpoint_state",
    "save_checkpoint",
    "usable_checkpoint",
    "write_checkpoint",
    "verify_checkpoint",
]

FORMAT_VERSION = 1
_STEP_IN_NAME_RE = re.compile(r"step_(\d+)")
_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


# ------------------------------------------------------------------------------------------- helpers
def _as_list(x: Any) -> list[Any]:
    if x is None:
        return []
    if isinstance(x, (list, tuple)):
        return list(x)
    # containers with their own iteration (e.g. an OptimizersContainer) expose .optimizers / .schedulers
    for attr in ("optimizers", "schedulers"):
        inner = getattr(x, attr, None)
        if isinstance(inner, (list, tuple)):
            return list(inner)
    return [x]


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist_on() else 0


def _world() -> int:
    return dist.get_world_size() if _dist_on() else 1


def _local_optimizer(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """ZeroRedundancyOptimizer -> the local optimizer over the parameters this rank owns. (Not imported here:
    torch.distributed.optim costs a restarting worker 0.2-0.3 s, and a ZeRO optimizer means it is loaded.)"""
    zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    return opt.optim if zero is not None and isinstance(opt, zero.ZeroRedundancyOptimizer) else opt


def _pairs(model_parts: Sequence[nn.Module], optimizers: Any) -> list[tuple[nn.Module, torch.optim.Optimizer]]:
    opts = _as_list(optimizers)
    if not opts:
        return []
    if len(opts) == len(model_parts):
        return list(zip(model_parts, opts))
    if len(opts) == 1 and len(model_parts) > 1:
        raise ValueError(
            f"one optimizer over {len(model_parts)} model parts: give one optimizer per model part "
            "(as torchtitan's OptimizersContainer does) so each part's optimizer state can be "
            "named by its parameters"
        )
    raise ValueError(f"{len(opts)} optimizers for {len(model_parts)} model parts; give one per part")


def _model_state(model_parts: Sequence[nn.Module]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in model_parts:
        sd = get_model_state_dict(part)
        clash = out.keys() & sd.keys()
        if clash:
            raise ValueError(
                f"model parts share parameter names {sorted(clash)[:3]}; parts must be disjoint "
                "pieces of one model (workers.pipeline.split_model_part keeps full-model names)"
            )
        out.update(sd)
    return out


_GROUPS, _HYPERS = "param_groups.", "hypers."


def _pack_hypers(flat: dict[str, Any]) -> dict[str, Any]:
    """The flattened optimizer state with every ``param_groups.<fqn>.<hyper>`` of one parameter packed into
    ``hypers.<fqn>`` (a pickled dict in a BytesIO, which DCP keeps as one item); tensors are left as they are
    (the same objects: a load into them is in place)."""
    out: dict[str, Any] = {}
    hypers: dict[str, dict[str, Any]] = {}
    for k, v in flat.items():
        if k.startswith(_GROUPS):
            fqn, name = k[len(_GROUPS) :].rsplit(".", 1)
            hypers.setdefault(fqn, {})[name] = v
        else:
            out[k] = v
    for fqn, h in hypers.items():
        out[_HYPERS + fqn] = io.BytesIO(pickle.dumps(h))
    return out


def _unpack_hypers(packed: dict[str, Any]) -> dict[str, Any]:
    """``_pack_hypers`` undone (after a load: the blobs hold what was saved)."""
    out: dict[str, Any] = {}
    for k, v in packed.items():
        if k.startswith(_HYPERS):
            fqn = k[len(_HYPERS) :]
            for name, h in pickle.loads(v.getvalue()).items():
                out[f"{_GROUPS}{fqn}.{name}"] = h
        else:
            out[k] = v
    return out


def _optim_state(pairs: list[tuple[nn.Module, torch.optim.Optimizer]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part, opt in pairs:
        local = _local_optimizer(opt)
        if local is opt:
            out.update(get_optimizer_state_dict(part, opt, options=_OPTIM_OPTIONS))
        else:
            out.update(_zero_flat_state(part, local))
    return out


# ZeroRedundancyOptimizer: the local optimizer holds plain tensors of the parameters this rank owns and may
# have EMPTY param groups, which get/set_optimizer_state_dict's flattening cannot take; so it is flattened
# here, into the same format (``state.<fqn>.<key>``, ``param_groups.<fqn>.<hyper>``).
_WRAPPER_PARTS = ("module.", "_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def _canonical(name: str) -> str:
    for w in _WRAPPER_PARTS:
        name = name.replace(w, "")
    return name


def _init_local_state(opt: torch.optim.Optimizer) -> None:
    """Create the optimizer's state with one zero-gradient, zero-lr step (as DCP's helper does)."""
    if opt.state:
        return
    params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
    if any(p.grad is not None for p in params):
        return
    for p in params:
        p.grad = torch.zeros_like(p)
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
    opt.step()
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr
    opt.zero_grad(set_to_none=True)


def _zero_flat_state(part: nn.Module, local: torch.optim.Optimizer) -> dict[str, Any]:
    """The flattened state of a ZeRO rank's local optimizer. Its tensors ARE the optimizer's state tensors,
    so loading into this dict loads in place."""
    _init_local_state(local)
    names = {id(p): _canonical(n) for n, p in part.named_parameters()}
    out: dict[str, Any] = {}
    for g in local.param_groups:
        for p in g["params"]:
            fqn = names[id(p)]
            for k, v in local.state.get(p, {}).items():
                out[f"state.{fqn}.{k}"] = v
            for k, v in g.items():
                if k != "params":
                    out[f"param_groups.{fqn}.{k}"] = v
    return out


def _zero_apply_hypers(part: nn.Module, zero: torch.optim.Optimizer, flat: dict[str, Any]) -> None:
    """After an in-place load: hyperparameters of each local group from the checkpoint, mirrored into the
    ZeRO wrapper's groups (which drive the local ones at every step)."""
    local = zero.optim  # type: ignore[attr-defined]
    names = {id(p): _canonical(n) for n, p in part.named_parameters()}
    for g, lg in zip(zero.param_groups, local.param_groups):
        if not lg["params"]:
            continue
        fqn = names[id(lg["params"][0])]
        for k in list(lg.keys()):
            key = f"param_groups.{fqn}.{k}"
            if k != "params" and key in flat:
                lg[k] = flat[key]
                g[k] = flat[key]


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy is optional
        pass
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "python" in state:
        random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
    if "numpy" in state:
        try:
            import numpy as np

            np.random.set_state(state["numpy"])
        except ImportError:  # pragma: no cover
            pass


def _to_jsonable(x: Any) -> Any:
    if x is None:
        return None
    dump = getattr(x, "model_dump", None)
    if callable(dump):
        return dump(mode="json")
    return json.loads(json.dumps(x, default=str))


def _blob(obj: Any) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def _unblob(x: Any) -> Any:
    # DCP pickles a BytesIO value as an object, so what comes back is our BytesIO: open it
    if isinstance(x, io.BytesIO):
        x.seek(0)
        return torch.load(x, weights_only=False)
    return x


@contextlib.contextmanager
def _quiet_no_dist() -> Iterator[None]:
    """DCP warns on every single-process save/load; that is the intended use here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _barrier(group: Any = None) -> None:
    if _dist_on():
        dist.barrier(group=group)


# ------------------------------------------------------------------------------------------- save/load
def save_checkpoint(
    path: str | os.PathLike,
    *,
    model_parts: Sequence[nn.Module] | nn.Module,
    optimizers: Any,
    schedulers: Any,
    step: int,
    plan: Any = None,
    spec: Any = None,
    extra: dict[str, Any] | None = None,
) -> None:
    """Save a checkpoint at ``path`` (a directory; this rank's own or one shared by all). Collective: every
    rank calls it with its model parts (the pipeline parts of this rank, or ``[model]``), their optimizers
    (one per part), LR schedulers, the step just completed, and ``extra`` (this rank's data position etc.).
    """
    state = checkpoint_state(model_parts=model_parts, optimizers=optimizers, schedulers=schedulers, step=step,
                             extra=extra)  # fmt: skip
    write_checkpoint(path, state, step=step, plan=plan, spec=spec)


def checkpoint_state(
    *, model_parts: Sequence[nn.Module] | nn.Module, optimizers: Any, schedulers: Any, step: int, extra: Any = None
) -> dict[str, Any]:
    """This rank's DCP state dict (live tensors: ``workers.checkpoint_async`` copies them before writing)."""
    parts = _as_list(model_parts)
    return {
        "model": _model_state(parts),
        "optim": _pack_hypers(_optim_state(_pairs(parts, optimizers))),
        # python objects go in as opaque blobs (DCP would otherwise flatten nested dicts/lists into keys)
        "train": _blob(
            {"step": int(step), "world_size": _world(), "lr_scheduler": [s.state_dict() for s in _as_list(schedulers)]}
        ),
        f"rank{_rank()}": _blob({"rng": _rng_state(), "extra": dict(extra or {})}),
    }


def write_checkpoint(
    path: str | os.PathLike, state: dict[str, Any], *, step: int, plan: Any = None, spec: Any = None, group: Any = None
) -> None:
    """Write ``state`` (``checkpoint_state``) as the checkpoint of ``step`` at ``path``: collective over ``group``
    (default: the world; the background writer passes its own gloo group of the same ranks)."""
    t0 = time.perf_counter()
    rank, world = _rank(), _world()
    path = Path(path)
    staging = path.with_name(path.name + PARTIAL_SUFFIX)  # published (renamed to ``path``) only when complete
    with removed_on_failure(staging):  # ENOSPC or a crash mid-save: the unpublished directory goes
        staging.mkdir(parents=True, exist_ok=True)
        writer = dcp.FileSystemWriter(str(staging), overwrite=True)
        with _quiet_no_dist():
            dcp.save(state, storage_writer=writer, process_group=group, no_dist=not _dist_on())
        write_manifest(staging, rank, rank_files(staging, rank))
    _barrier(group)
    # one directory for all ranks (rank 0 publishes it) or one per rank: decided while nobody can have published yet
    shared = rank != 0 and (staging / manifest_name(0)).exists()
    if rank == 0:
        meta = {
            "format": FORMAT_VERSION,
            "step": int(step),
            "world_size": world,
            "manifests": True,
            "plan": _to_jsonable(plan),
            "spec": _to_jsonable(spec),
            "torch_version": torch.__version__,
            "created_at": time.time(),
        }
        write_json_atomic(staging / META_FILE, meta)
    _barrier(group)
    if not shared:
        _publish(staging, path)
    _barrier(group)
    logger.info("saved checkpoint step %d to %s in %.2f s", step, path, time.perf_counter() - t0)


def _publish(staging: Path, path: Path) -> None:
    """Rename the finished ``staging`` directory to ``path`` (an older ``path`` is moved aside, then removed)."""
    old = path.with_name(path.name + ".old")
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(staging, path)
    shutil.rmtree(old, ignore_errors=True)


def usable_checkpoint(path: str | os.PathLike) -> Path | None:
    """``path`` if it verifies (sizes and checksums); else the newest checkpoint beside it that does (logged), or
    None. A resume never loads a truncated or half-published checkpoint."""
    p = Path(path)
    why = verify_checkpoint(p)
    if why is None:
        return p
    logger.warning("checkpoint %s is not usable: %s; looking for the previous good one", p, why)
    siblings = [d for d in (p.parent.iterdir() if p.parent.is_dir() else []) if d != p and d.is_dir()]
    candidates = []
    for d in siblings:
        m = _STEP_IN_NAME_RE.search(d.name)
        if m and not d.name.endswith((PARTIAL_SUFFIX, ".old")):
            candidates.append((int(m.group(1)), d.name, d))
    for _, _, d in sorted(candidates, reverse=True):
        why_d = verify_checkpoint(d)
        if why_d is None:
            logger.warning("resuming from %s instead", d)
            return d
        logger.warning("checkpoint %s is not usable either: %s", d, why_d)
    return None


def read_checkpoint_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The ``meshrun.json`` of a checkpoint (raises FileNotFoundError if it is incomplete or missing)."""
    p = Path(path) / META_FILE
    if not p.is_file():
        raise FileNotFoundError(f"{path} is not a complete meshrun checkpoint (no {META_FILE})")
    return json.loads(p.read_text())


def load_checkpoint(
    path: str | os.PathLike, *, model_parts: Sequence[nn.Module] | nn.Module, optimizers: Any, schedulers: Any
) -> dict[str, Any]:
    """Load a checkpoint into already built (and parallelized) model parts, optimizers and schedulers,
    resharding to the current layout. Collective. Returns ``{"step", "extra", "plan", "spec",
    "world_size"}`` (``extra`` of this rank, or of rank 0 when the world size changed)."""
    t0 = time.perf_counter()
    path = Path(path)
    meta = read_checkpoint_meta(path)
    why = verify_checkpoint(path)
    if why is not None:
        raise ValueError(f"checkpoint {path} cannot be loaded: {why}")
    parts = _as_list(model_parts)
    pairs = _pairs(parts, optimizers)
    scheds = _as_list(schedulers)
    rank, world = _rank(), _world()
    saved_world = int(meta.get("world_size", 1))
    src = rank if saved_world == world else 0
    if saved_world != world and rank == 0:
        logger.warning(
            "checkpoint %s was saved by %d ranks, loading on %d: model and optimizer reshard; RNG "
            "state and extra come from saved rank 0 on every rank",
            path,
            saved_world,
            world,
        )

    saved_keys = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    model_sds = [get_model_state_dict(p) for p in parts]
    missing = sorted(f"model.{k}" for sd in model_sds for k in sd if f"model.{k}" not in saved_keys)
    if missing:
        raise ValueError(
            f"checkpoint {path} does not hold {len(missing)} tensors of this model (e.g. "
            f"{missing[:3]}); it was saved from another model (see its {META_FILE}): resume with "
            "the model it was saved with"
        )
    if pairs and not any(k.startswith("optim.") for k in saved_keys):
        logger.warning("checkpoint %s holds no optimizer state: the optimizer starts fresh", path)
        pairs = []
    optim_sd = _optim_state(pairs)
    packed = any(k.startswith("optim." + _HYPERS) for k in saved_keys)  # else: written before packing
    if packed:
        optim_sd = _pack_hypers(optim_sd)
    state: dict[str, Any] = {
        "model": {k: v for sd in model_sds for k, v in sd.items()},
        "train": io.BytesIO(),
        f"rank{src}": io.BytesIO(),
    }
    if optim_sd:
        state["optim"] = optim_sd
    with _quiet_no_dist():
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(path)), no_dist=not _dist_on())
    train = _unblob(state["train"])
    if optim_sd and packed:
        state["optim"] = _unpack_hypers(state["optim"])

    for part, sd in zip(parts, model_sds):
        set_model_state_dict(part, {k: state["model"][k] for k in sd})
    for part, opt in pairs:
        if _local_optimizer(opt) is opt:
            set_optimizer_state_dict(part, opt, state["optim"], options=_OPTIM_OPTIONS)
        else:  # ZeRO: tensors were loaded in place; hyperparameters here
            _zero_apply_hypers(part, opt, state["optim"])
    saved_scheds = train.get("lr_scheduler") or []
    if scheds and not saved_scheds:
        logger.warning("checkpoint %s holds no LR scheduler state: the schedule starts from step 0", path)
    elif scheds and len(saved_scheds) != len(scheds):
        # one scheduler per pipeline part, all stepped together: a different number of parts per rank
        # (another pp split) gets the first saved state everywhere
        logger.info(
            "checkpoint has %d LR schedulers per rank, the run %d: restoring the first to all",
            len(saved_scheds),
            len(scheds),
        )
        saved_scheds = [saved_scheds[0]] * len(scheds)
    for sched, sd in zip(scheds, saved_scheds):
        sched.load_state_dict(sd)
        # the optimizer's lr is the scheduler's last lr (ZeRO wrappers and groups without state included)
        for g, lr in zip(sched.optimizer.param_groups, sched.get_last_lr()):
            g["lr"] = lr
    per_rank = _unblob(state[f"rank{src}"])
    if per_rank.get("rng") is not None:
        _set_rng_state(per_rank["rng"])
    _barrier()
    step = int(train["step"])
    logger.info("loaded checkpoint step %d from %s in %.2f s", step, path, time.perf_counter() - t0)
    return {
        "step": step,
        "extra": per_rank.get("extra") or {},
        "plan": meta.get("plan"),
        "spec": meta.get("spec"),
        "world_size": saved_world,
    }

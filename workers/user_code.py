"""User code: model and data entrypoints (bring your own model), their TP plans, split points and inspection.

A run names user code by entrypoint (``model.entrypoint: "my_pkg.models:build"``, ``data.entrypoint``); the
directory holding ``my_pkg`` reaches the workers through the Ray runtime environment (``spec.code.working_dir``)
or, standalone, through ``PYTHONPATH`` / ``python -m workers --code-dir DIR``.

- ``import_entrypoint``: validated ``package.module:function`` -> the callable, with errors that say which field,
  what failed and what to do (nothing is eval'd; ``importlib`` only).
- ``build_user_model``: calls the model entrypoint so that PARAMETERS land on the meta device (no memory) while
  BUFFERS are real (rotary tables, causal masks: values that meshrun's init cannot recompute);
  ``workers.models.materialize`` keeps those buffers across ``to_empty``. Outputs with a ``.logits`` field
  (Hugging Face ``ModelOutput``) are reduced to the logits tensor the training loop expects.
- ``block_classes``: the repeated blocks (FSDP units / activation checkpointing): ``spec.model.block_classes``,
  else a model's ``block_class`` / Hugging Face ``_no_split_modules``, else the class of the children of the
  largest ``nn.ModuleList`` / ``nn.ModuleDict``.
- ``tp_styles`` / ``check_tp_plan``: a declared plan ``{fnmatch pattern of module names: colwise | rowwise |
  sequence_parallel | vocab_parallel}`` -> torch ``ParallelStyle`` objects; a pattern that matches no module,
  or colwise/rowwise on a module that is not ``nn.Linear``/``nn.Embedding``, is an error naming the pattern.
- ``check_split_points``: declared pipeline split points against the model's units.
- ``inspect_model`` (``python -m workers.user_code inspect --spec run.json``): builds the model on the meta
  device and reports its parameter count and per-block shape for the planner, plus plan/split problems.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import importlib
import json
import logging
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

TP_STYLES = ("colwise", "rowwise", "sequence_parallel", "vocab_parallel")
_ENTRY_HELP = "give an importable 'package.module:function' and ship its directory with code.working_dir"


class UserCodeError(ValueError):
    """User code that cannot be used as the spec says; ``param`` names the spec field."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param, self.message = param, message

    def __reduce__(self) -> tuple[type[UserCodeError], tuple[str, str]]:
        # Ray pickles a worker's exception to the driver; the default rebuilds it from ``args`` (one string) and
        # failed with "__init__() missing 1 required positional argument" instead of this error's message
        return (type(self), (self.param, self.message))


# ------------------------------------------------------------------------------------------------ import
def add_code_path(path: str | os.PathLike | None) -> str | None:
    """Put a user code directory first on ``sys.path`` (standalone launcher, inspection). Returns it resolved."""
    if not path:
        return None
    p = Path(path).expanduser().resolve()
    if not p.is_dir():
        raise UserCodeError(
            "code.working_dir",
            f"'{path}' is not a directory on this machine; give the directory that holds your package",
        )
    s = str(p)
    if s not in sys.path:
        sys.path.insert(0, s)
        importlib.invalidate_caches()
    return s


def import_entrypoint(entrypoint: str, *, param: str = "model.entrypoint") -> Callable[..., Any]:
    """``'pkg.module:function'`` -> the callable (importlib only). Raises UserCodeError naming ``param``."""
    from api.spec import ENTRYPOINT_RE

    if not isinstance(entrypoint, str) or not ENTRYPOINT_RE.fullmatch(entrypoint):
        raise UserCodeError(param, f"'{entrypoint}' must look like 'package.module:function' (identifiers only)")
    mod_name, _, attr = entrypoint.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        missing = e.name or mod_name
        where = (
            "the module"
            if mod_name.startswith(missing) or missing.startswith(mod_name.split(".")[0])
            else "a module it imports"
        )
        raise UserCodeError(
            param,
            f"cannot import '{mod_name}': {where} '{missing}' is not found on the workers' "
            f"path ({e}); {_ENTRY_HELP} (or install it on the cluster)",
        ) from e
    except Exception as e:
        raise UserCodeError(param, f"importing '{mod_name}' failed: {type(e).__name__}: {e}") from e
    fn = getattr(mod, attr, None)
    if fn is None:
        raise UserCodeError(param, f"module '{mod_name}' has no attribute '{attr}'; {_ENTRY_HELP}")
    if not callable(fn):
        raise UserCodeError(param, f"'{entrypoint}' is a {type(fn).__name__}, not a function or class")
    return fn


# ------------------------------------------------------------------------------------------------- build
@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """While active, every parameter registered on any module moves to the meta device (its storage is freed at
    once); buffers and other tensors stay where they are created (CPU). Tied parameters stay tied (a parameter
    already on meta is registered as is)."""
    original = nn.Module.register_parameter

    def register_parameter(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(self, name, param)
        if param is not None and not param.is_meta:
            kw = dict(param.__dict__)
            kw["requires_grad"] = param.requires_grad
            self._parameters[name] = type(param)(param.to("meta"), **kw)

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def _logits_only(_module: nn.Module, _args: Any, output: Any) -> Any:
    """Forward hook: a Hugging Face ``ModelOutput`` (or a dict with 'logits') -> its logits tensor."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, dict):
        logits = output.get("logits")
    return logits if logits is not None else output


def call_model_entrypoint(entrypoint: str, args: dict[str, Any] | None = None) -> nn.Module:
    fn = import_entrypoint(entrypoint, param="model.entrypoint")
    try:
        model = fn(**(args or {}))
    except TypeError as e:
        raise UserCodeError("model.args", f"{entrypoint}(**model.args) failed: {e}; check the argument names") from e
    if not isinstance(model, nn.Module):
        raise UserCodeError("model.entrypoint", f"{entrypoint} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def build_user_model(
    entrypoint: str, args: dict[str, Any] | None = None, *, device: str | torch.device = "meta"
) -> nn.Module:
    """Build a user model. ``device="meta"``: parameters on meta (no memory), buffers real on CPU (kept by
    ``workers.models.materialize``); another device: built there for real."""
    if torch.device(device).type == "meta":
        with params_on_meta():
            model = call_model_entrypoint(entrypoint, args)
    else:
        with torch.device(device):
            model = call_model_entrypoint(entrypoint, args)
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "use_cache", None):
        config.use_cache = False  # Hugging Face: no KV cache while training
    model.register_forward_hook(_logits_only)
    return model


# ------------------------------------------------------------------------------------------------ blocks
def _class_names(model: nn.Module) -> set[str]:
    return {type(m).__name__ for m in model.modules()}


def block_classes(model: nn.Module, declared: Iterable[str] | None = None) -> list[str]:
    """Class names of the model's repeated blocks (see the module docstring for the order of the rules)."""
    if declared:
        names = list(declared)
        missing = [n for n in names if n not in _class_names(model)]
        if missing:
            raise UserCodeError(
                "model.block_classes",
                f"no module of class {missing} in the model; classes present: {sorted(_class_names(model))[:20]}",
            )
        return names
    own = getattr(model, "block_class", None)
    if isinstance(own, type):
        return [own.__name__]
    hf = [n for n in (getattr(model, "_no_split_modules", None) or []) if n in _class_names(model)]
    if hf:
        return hf
    best: list[nn.Module] = []
    for _, mod in model.named_modules():
        if isinstance(mod, (nn.ModuleList, nn.ModuleDict)) and len(mod) > len(best):
            best = list(mod.children())
    return sorted({type(b).__name__ for b in best})


def block_modules(model: nn.Module, names: Iterable[str]) -> list[tuple[str, nn.Module]]:
    names = set(names)
    out: list[tuple[str, nn.Module]] = []
    inside: list[str] = []
    for n, m in model.named_modules():
        if type(m).__name__ in names and not any(n.startswith(p + ".") for p in inside):
            out.append((n, m))
            inside.append(n)
    return out


# -------------------------------------------------------------------------------------------------- TP
def check_tp_plan(model: nn.Module, tp_plan: dict[str, str] | None) -> list[str]:
    """Problems of a declared TP plan against the model (empty = fine)."""
    if not tp_plan:
        return []
    errors = []
    modules = {n: m for n, m in model.named_modules() if n}
    for pattern, style in tp_plan.items():
        if style not in TP_STYLES:
            errors.append(f"model.tp_plan['{pattern}']: unknown style '{style}'; use one of {list(TP_STYLES)}")
            continue
        hits = [n for n in modules if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            errors.append(
                f"model.tp_plan pattern '{pattern}' matches no module of the model; module names look "
                f"like {_examples(modules)}"
            )
            continue
        if style in ("colwise", "rowwise", "vocab_parallel"):
            bad = [n for n in hits if not isinstance(modules[n], (nn.Linear, nn.Embedding))]
            if bad:
                errors.append(
                    f"model.tp_plan['{pattern}'] = {style} matches {bad[0]} "
                    f"({type(modules[bad[0]]).__name__}); {style} applies to nn.Linear / nn.Embedding "
                    "modules only: make the pattern name those"
                )
    return errors


def _examples(modules: dict[str, nn.Module], k: int = 8) -> list[str]:
    leaves = [n for n, m in modules.items() if isinstance(m, (nn.Linear, nn.Embedding))] or list(modules)
    return leaves[:k]


def tp_styles(model: nn.Module, tp_plan: dict[str, str]) -> dict[str, Any]:
    """Declared plan -> {module name: ParallelStyle} for ``parallelize_module``. Raises UserCodeError."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    errors = check_tp_plan(model, tp_plan)
    if errors:
        raise UserCodeError("model.tp_plan", "; ".join(errors))
    make: dict[str, Callable[[], Any]] = {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "sequence_parallel": SequenceParallel,
        "vocab_parallel": lambda: RowwiseParallel(input_layouts=Replicate()),
    }
    names = [n for n, _ in model.named_modules() if n]
    out: dict[str, Any] = {}
    for pattern, style in tp_plan.items():
        for n in names:
            if fnmatch.fnmatchcase(n, pattern):
                out[n] = make[style]()
    return out


# -------------------------------------------------------------------------------------------------- PP
def check_split_points(model: nn.Module, split_points: list[str] | None, n_stages: int) -> list[str]:
    if n_stages <= 1:
        return []
    from workers.pipeline import stage_module_names

    try:
        stage_module_names(model, n_stages, split_points=split_points or None)
    except ValueError as e:
        return [str(e) if str(e).startswith("model.") else f"model.pp_split_points: {e}"]
    return []


def sequential_split_points(model: nn.Module, n_stages: int) -> list[str]:
    """Even split points for an ``nn.Sequential`` model (a suggestion for ``model.pp_split_points``)."""
    names = [n for n, _ in model.named_children()]
    if n_stages > len(names):
        raise UserCodeError("layout.pp", f"{n_stages} stages exceed the model's {len(names)} top-level modules")
    per, extra = divmod(len(names), n_stages)
    out, start = [], 0
    for s in range(n_stages - 1):
        start += per + (1 if s < extra else 0)
        out.append(names[start])
    return out


# ---------------------------------------------------------------------------------------------- inspect
def _numel(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def _d_model_guess(model: nn.Module, blocks: list[nn.Module]) -> int | None:
    embs = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    if embs:
        return int(max(embs, key=lambda e: e.weight.numel()).embedding_dim)
    widths: Counter[int] = Counter()
    for b in blocks or [model]:
        for m in b.modules():
            if isinstance(m, nn.Linear):
                widths[m.in_features] += 1
    return widths.most_common(1)[0][0] if widths else None


def inspect_model(spec: Any) -> dict[str, Any]:
    """Build ``spec``'s user model on the meta device (nothing allocated) and describe it for the planner:
    ``n_params``, ``n_blocks``, ``block_classes``, ``block_params`` (largest block), ``d_model`` / ``vocab_size``
    guesses, and ``errors`` (TP plan / split points / block classes that do not fit the model)."""
    from api.spec import RunSpec

    spec = spec if isinstance(spec, RunSpec) else RunSpec.model_validate(spec)
    ms = spec.model
    if not ms.entrypoint:
        raise UserCodeError("model.entrypoint", "inspection is for user models (model.entrypoint)")
    with torch.device("meta"):
        model = call_model_entrypoint(ms.entrypoint, ms.args)
    errors: list[str] = []
    try:
        classes = block_classes(model, ms.block_classes)
    except UserCodeError as e:
        errors.append(str(e))
        classes = []
    blocks = [m for _, m in block_modules(model, classes)]
    embs = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    lay = spec.layout
    if lay.tp > 1:
        errors += check_tp_plan(model, ms.tp_plan)
    if lay.pp > 1:
        errors += check_split_points(model, ms.pp_split_points, lay.pp * lay.pp_virtual_stages)
    vocab = int(max(embs, key=lambda e: e.weight.numel()).num_embeddings) if embs else None
    warnings: list[str] = []
    if vocab is not None and ms.vocab_size is not None and ms.vocab_size > vocab:
        errors.append(
            f"model.vocab_size={ms.vocab_size} exceeds the model's largest embedding ({vocab} rows): "
            f"token ids would be out of range; set model.vocab_size <= {vocab}"
        )
    return {
        "entrypoint": ms.entrypoint,
        "class": type(model).__name__,
        "n_params": _numel(model),
        "n_blocks": len(blocks),
        "block_classes": classes,
        "block_params": max((_numel(b) for b in blocks), default=0),
        "d_model": _d_model_guess(model, blocks),
        "vocab_size": vocab,
        "n_buffers": sum(1 for _ in model.buffers()),
        "top_level_modules": [n for n, _ in model.named_children()][:32],
        "errors": errors,
        "warnings": warnings,
    }


# -------------------------------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    """``python -m workers.user_code inspect --spec FILE|- [--code-dir DIR]``: one JSON object on stdout
    (``{"ok": true, ...inspection}`` or ``{"ok": false, "param": ..., "error": ...}``); exit 0 / 2."""
    ap = argparse.ArgumentParser(prog="python -m workers.user_code")
    sub = ap.add_subparsers(dest="cmd", required=True)
    ins = sub.add_parser("inspect", help="build the spec's user model on the meta device and describe it")
    ins.add_argument("--spec", required=True, help="RunSpec as JSON/YAML file, or '-' for stdin")
    ins.add_argument("--code-dir", default=None, help="directory to put on sys.path (default: spec.code)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    from api.spec.yamlio import load_yaml

    raw = sys.stdin.read() if args.spec == "-" else Path(args.spec).read_text()
    try:
        from api.spec import RunSpec

        spec = RunSpec.model_validate(load_yaml(raw) or {})
        code_dir = args.code_dir or (spec.code.working_dir if spec.code else None)
        if code_dir and Path(code_dir).expanduser().is_dir():
            add_code_path(code_dir)
        out = {"ok": True, **inspect_model(spec)}
        rc = 0
    except UserCodeError as e:
        out, rc = {"ok": False, "param": e.param, "error": e.message}, 2
    except Exception as e:
        out, rc = {"ok": False, "param": "model.entrypoint", "error": f"{type(e).__name__}: {e}"}, 2
    sys.stdout.write(json.dumps(out) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())

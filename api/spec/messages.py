"""Validation messages said so that the user knows what to do, for pydantic errors of any spec model: the service's
422 bodies and the CLI's offline ``meshrun validate`` use the same ``describe_errors``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel

MAX_SHOWN_INPUT_CHARS = 80


def _param(loc: Sequence[Any]) -> str | None:
    parts = [str(p) for p in loc]
    if parts and parts[0] in ("body", "query", "path", "header", "cookie"):
        parts = parts[1:]
    return ".".join(parts) or None


def _shown(value: Any) -> str:
    try:
        s = repr(value)
    except Exception:
        return "?"
    return s if len(s) <= MAX_SHOWN_INPUT_CHARS else s[:MAX_SHOWN_INPUT_CHARS] + "..."


def _allowed_fields(model: type[BaseModel] | None, loc: Sequence[Any]) -> list[str] | None:
    """Field names of the sub-model at ``loc[:-1]`` (for 'unknown field' hints)."""
    for part in loc[:-1]:
        if model is None:
            return None
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        ann = field.annotation
        candidates = [ann, *getattr(ann, "__args__", ())]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
    return sorted(model.model_fields) if model is not None else None


def describe_errors(
    errors: Sequence[Mapping[str, Any]], *, model: type[BaseModel] | None = None
) -> tuple[str, str, str | None]:
    """(code, message, param) for pydantic errors: the first error, said so that the user knows what to do."""
    first = errors[0]
    loc = list(first.get("loc", ()))
    if loc and loc[0] in ("body",):
        loc = loc[1:]
    param = _param(loc)
    kind = first.get("type", "")
    msg = str(first.get("msg", "invalid value"))
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    where = param or "request body"
    if kind == "missing":
        code, message = "missing_field", f"{where} is required; add it"
    elif kind == "extra_forbidden":
        allowed = _allowed_fields(model, loc)
        hint = f" (allowed here: {', '.join(allowed)})" if allowed else ""
        code, message = "unknown_field", f"unknown field '{where}'; remove it or fix its spelling{hint}"
    else:
        code = "invalid_value"
        msg = msg[:1].lower() + msg[1:]
        message = f"{where}: {msg}"
        if "input" in first and kind not in ("model_type", "dict_type"):
            message += f" (got {_shown(first['input'])})"
    if len(errors) > 1:
        others = sorted({p for p in (_param(list(e.get("loc", ()))) for e in errors[1:]) if p and p != param})
        if others:
            message += f"; also check: {', '.join(others[:8])}"
    return code, message, param

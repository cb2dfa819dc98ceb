"""Turning what users hand us (a model, a dict, a YAML/JSON path, ``dp=2,tp=2``) into request bodies."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pydantic

from ._errors import ValidationError

SpecInput = Any  # pydantic model | Mapping | str | os.PathLike


def load_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a YAML or JSON file into a dict (ValidationError naming the file when it is not a mapping)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"spec file not found: {p}")
    text = p.read_text()
    if p.suffix == ".json":
        data = json.loads(text)
    else:
        from api.spec.yamlio import YAMLError, load_yaml  # YAML-1.2 numbers: "lr: 3e-4" is a float

        try:
            data = load_yaml(text)
        except YAMLError as e:
            raise ValidationError(f"{p}: not valid YAML: {e}", code="invalid_yaml", param=None, status_code=422) from e
    if not isinstance(data, dict):
        raise ValidationError(
            f"{p}: expected a mapping of fields at the top level, got {type(data).__name__}",
            code="invalid_spec",
            status_code=422,
        )
    return data


def to_body(obj: SpecInput) -> dict[str, Any]:
    """A request body from a pydantic model, a mapping, or a path to a YAML/JSON file.

    Dicts and files are sent as they are (the server validates them and names the bad field), so an SDK
    older than the server can still submit fields it does not know."""
    if isinstance(obj, pydantic.BaseModel):
        return obj.model_dump(mode="json", exclude_unset=False)
    if isinstance(obj, (str, os.PathLike)):
        return load_file(obj)
    if isinstance(obj, Mapping):
        return json.loads(json.dumps(dict(obj), default=str))
    raise TypeError(f"expected a pydantic model, a dict or a path to a YAML/JSON file, got {type(obj).__name__}")


def _parse_scalar(text: str) -> Any:
    from api.spec.yamlio import YAMLError, load_yaml  # same loader as spec files: "1e-3" is a float

    try:
        return load_yaml(text)
    except YAMLError:
        return text


def apply_overrides(body: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Apply ``key.sub=value`` overrides in place (values parsed as YAML 1.2: ``3``, ``1e-3``, ``true``,
    ``[1, 2]``)."""
    for item in overrides:
        if "=" not in item:
            raise ValidationError(
                f"override {item!r} must look like key.sub=value (e.g. layout.tp=2)",
                code="invalid_override",
                param=item,
                status_code=422,
            )
        key, _, raw = item.partition("=")
        parts = [k for k in key.strip().split(".") if k]
        if not parts:
            raise ValidationError(
                f"override {item!r} has an empty key", code="invalid_override", param=item, status_code=422
            )
        node = body
        for k in parts[:-1]:
            nxt = node.get(k)
            if nxt is None:
                nxt = node[k] = {}
            if not isinstance(nxt, dict):
                raise ValidationError(
                    f"override {item!r}: '{k}' is not a mapping", code="invalid_override", param=key, status_code=422
                )
            node = nxt
        node[parts[-1]] = _parse_scalar(raw.strip())
    return body


_LAYOUT_ALIASES = {
    "zero": "zero_stage",
    "sp": "sequence_parallel",
    "vpp": "pp_virtual_stages",
    "schedule": "pp_schedule",
    "shard": "shard_group_size",
}


def parse_layout(text: str) -> dict[str, Any]:
    """``"dp=2,tp=2,pp=1"`` (also ``zero=3``, ``sp=true``, ``schedule=gpipe``) -> a Layout dict."""
    out: dict[str, Any] = {}
    for part in (p.strip() for p in text.replace(" ", ",").split(",")):
        if not part:
            continue
        if "=" not in part:
            raise ValidationError(
                f"layout part {part!r} must look like name=value (e.g. dp=2,tp=2)",
                code="invalid_layout",
                param="layout",
                status_code=422,
            )
        k, _, v = part.partition("=")
        k = _LAYOUT_ALIASES.get(k.strip(), k.strip())
        out[k] = _parse_scalar(v.strip())
    if not out:
        raise ValidationError(
            "empty layout; give e.g. dp=2,tp=2", code="invalid_layout", param="layout", status_code=422
        )
    return out


def parse_layouts(text: str) -> list[dict[str, Any]] | str:
    """``"auto"`` or ``"dp=2,tp=2; dp=4"`` -> list of Layout dicts."""
    if text.strip() == "auto":
        return "auto"
    return [parse_layout(chunk) for chunk in text.split(";") if chunk.strip()]

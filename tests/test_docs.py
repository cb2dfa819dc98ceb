"""The docs name what exists: every file path and every dotted module of meshrun that the README, docs/ and the
examples' notes mention is in the tree, and the text the OpenAPI schema ships about presets lists the presets."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").rglob("*.md"))]
PATH_RE = re.compile(r"(?<![\w./-])((?:api|service|workers|tests|bench|scripts|examples|deploy|migrations)/[\w./-]*\w)")
MODULE_RE = re.compile(r"`((?:api|service|workers)(?:\.[A-Za-z_]\w*)+)")


def _is_module(dotted: list[str]) -> bool:
    path = ROOT.joinpath(*dotted)
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def test_every_path_the_docs_name_exists() -> None:
    missing = []
    for doc in DOCS:
        for m in PATH_RE.finditer(doc.read_text()):
            p = m.group(1)
            if not (ROOT / p).exists() and not (ROOT / f"{p}.py").exists():  # "service/runs/driver" in a diagram
                missing.append(f"{doc.relative_to(ROOT)}: {p}")
    assert not missing, missing


def test_every_module_the_docs_name_exists() -> None:
    """`api.spec.validation.build_plan`: the longest prefix that is a module must be more than the top package, and
    the name after it must be defined in that module."""
    missing = []
    for doc in DOCS:
        for m in MODULE_RE.finditer(doc.read_text()):
            parts = m.group(1).split(".")
            n = next((i for i in range(len(parts), 0, -1) if _is_module(parts[:i])), 0)
            if n < 2 and len(parts) > 1:
                missing.append(f"{doc.relative_to(ROOT)}: {m.group(1)}")
                continue
            if n < len(parts):
                path = ROOT.joinpath(*parts[:n])
                source = (path.with_suffix(".py") if path.with_suffix(".py").exists() else path / "__init__.py")
                if not re.search(rf"\b{re.escape(parts[n])}\b", source.read_text()):
                    missing.append(f"{doc.relative_to(ROOT)}: {m.group(1)} ({parts[n]} not in {source.name})")
    assert not missing, missing


def test_the_preset_field_lists_every_preset() -> None:
    from api.spec import RunSpec
    from api.spec.presets import PRESETS

    description = RunSpec.model_json_schema()["$defs"]["ModelSpec"]["properties"]["preset"]["description"]
    for family, presets in PRESETS.items():
        assert family in description
        assert [p for p in presets if not re.search(rf"(?<![\w.]){re.escape(p)}\b", description)] == [], description

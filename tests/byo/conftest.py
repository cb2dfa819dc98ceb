"""Fixtures for the bring-your-own-model tests: a user package OUTSIDE meshrun's tree.

``user_code_dir``: a temp directory holding package ``byo_user_pkg`` (a copy of ``examples/byo/my_pkg``:
``models:build``, ``data:build``, ``hf:gpt2``, ``hf:llama``), not importable from meshrun's tree.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = "byo_user_pkg"


def make_user_package(dest: Path) -> Path:
    shutil.copytree(ROOT / "examples" / "byo" / "my_pkg", dest / PKG,
                    ignore=shutil.ignore_patterns("__pycache__"))
    return dest


@pytest.fixture(scope="session")
def user_code_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = make_user_package(tmp_path_factory.mktemp("byo-user-code"))
    assert ROOT not in d.parents
    return d


@pytest.fixture
def on_path(user_code_dir: Path):
    """The user package importable in this process (and in processes it spawns)."""
    sys.path.insert(0, str(user_code_dir))
    try:
        yield user_code_dir
    finally:
        sys.path.remove(str(user_code_dir))
        for name in [m for m in sys.modules if m == PKG or m.startswith(PKG + ".")]:
            del sys.modules[name]

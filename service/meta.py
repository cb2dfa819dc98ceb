"""Facts about this installation: the package version and the directory that holds meshrun's packages (put on
``PYTHONPATH`` of every Ray Job meshrun submits, so drivers and workers import the same code as the service)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]

try:
    VERSION = version("meshrun")
except PackageNotFoundError:  # running from a checkout
    VERSION = "0.1.0"

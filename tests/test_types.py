"""The type checker runs with the tests: ``mypy`` (configured in pyproject.toml) reports nothing on ``api/``,
``service/`` and ``workers/``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_finds_nothing_in_api_service_and_workers() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "mypy", "api", "service", "workers"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert r.returncode == 0, f"mypy api service workers:\n{r.stdout[-8000:]}{r.stderr[-2000:]}"
    assert "Success: no issues found" in r.stdout

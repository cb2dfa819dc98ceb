"""The type checker runs with the tests: ``mypy`` (configured in pyproject.toml) reports nothing on ``api/``,
``service/`` and ``workers/``. In a serial session mypy starts in the background once the test is collected
(``tests/background.py``); the test collects its result."""

from __future__ import annotations

from tests import background


def test_mypy_finds_nothing_in_api_service_and_workers() -> None:
    r = background.result("mypy")
    assert r.returncode == 0, f"mypy api service workers:\n{r.stdout[-8000:]}{r.stderr[-2000:]}"
    assert "Success: no issues found" in r.stdout

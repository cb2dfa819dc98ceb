"""Fixtures of the end-to-end tests (all marked ``ray``; they share the session's cluster and service)."""

from __future__ import annotations

import pytest

from tests.ray.helpers import metrics, submit, tiny_spec, wait_for


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/ray/" in str(item.fspath):
            item.add_marker(pytest.mark.ray)


FT_STEPS = 30


def ft_spec(name: str, **over):
    """dp2, checkpoint every 5 steps, deterministic: the fault-tolerance run and its uninterrupted twin."""
    over = {"train": {"steps": FT_STEPS, "seed": 1, "deterministic": True},
            "checkpoint": {"every_steps": 5, "keep": 2}, **over}
    return tiny_spec(name, dp=2, steps=FT_STEPS, **over)


@pytest.fixture(scope="session")
def reference_dp2_run(live_service):
    """An uninterrupted dp2 run of ``ft_spec`` (SUCCEEDED), with its metrics."""
    url = live_service.url
    run = submit(url, ft_spec("e2e-dp2-reference"))
    done = wait_for(url, run["id"], {"SUCCEEDED"}, timeout_s=300)
    return done, metrics(url, run["id"])

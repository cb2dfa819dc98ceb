from __future__ import annotations

import pytest

from tests.workers.dist_utils import run_world, tiny_spec


@pytest.fixture(scope="module")
def ddp_losses() -> list[float]:
    """A 10-step dp=2 gloo DDP run's losses (constant LR, data by step: a shorter run's are its prefix)."""
    return run_world(2, [tiny_spec(dp=2, steps=10)])[0]["losses"]

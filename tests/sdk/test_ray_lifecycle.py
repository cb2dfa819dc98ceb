"""The SDK against the Ray-backed live service (tests/conftest.py ``live_service``).

The SDK's run lifecycle on real training runs (progress, metrics, summary, events, checkpoints, logs, cancel, a
resume on another layout) is checked on the runs examples/quickstart.py submits: tests/cli/test_quickstart.py.
"""

from __future__ import annotations

import pytest

from api import client as sdk

pytestmark = pytest.mark.ray


@pytest.fixture()
def rclient(ray_service_url):
    with sdk.Client(ray_service_url, timeout=30) as c:
        yield c


def test_cluster_reports_cpus_and_dashboard(rclient):
    cl = rclient.cluster.get()
    # the session's cluster may list nodes that other tests added and removed: dead nodes are reported
    # (alive=False) but never counted
    alive = [n for n in cl.nodes if n.alive]
    assert alive and cl.cpus_total == pytest.approx(sum(n.cpus for n in alive)) and cl.cpus_total > 0
    assert 0 <= cl.cpus_free <= cl.cpus_total
    assert cl.dashboard_url and cl.dashboard_url.startswith("http://")

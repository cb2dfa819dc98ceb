"""Two Ray nodes on this machine: a tp=4 x dp=2 run keeps each tensor-parallel group on one node."""

from __future__ import annotations

import pytest

from tests.ray.helpers import events, metrics, submit, tiny_spec, wait_for

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def second_node(ray_cluster):
    node = ray_cluster.add_node(num_cpus=4)
    try:
        yield node
    finally:
        ray_cluster.remove_node(node)


def test_tp4_dp2_places_each_tp_group_on_one_node(live_service, ray_cluster, second_node):
    url = live_service.url
    head = next(n for n in ray_cluster.alive_nodes() if n.is_head)
    assert head.total["CPU"] < 8, "the head alone must not hold the whole run for this test to mean anything"
    run = submit(url, tiny_spec("e2e-tp4-dp2", dp=2, tp=4, steps=3))
    done = wait_for(url, run["id"], {"SUCCEEDED"}, timeout_s=420)
    rank_nodes = [done["rank_nodes"][str(r)] for r in range(8)]
    assert len(set(rank_nodes[:4])) == 1 and len(set(rank_nodes[4:])) == 1, rank_nodes
    assert set(rank_nodes) == {head.node_id, second_node.node_id}
    placement = [e for e in events(url, run["id"]) if e["kind"] == "placement"]
    assert placement and "rank -> node" in placement[-1]["reason"]
    assert [r["step"] for r in metrics(url, run["id"])] == [1, 2, 3]

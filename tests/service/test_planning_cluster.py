"""The live cluster as the planner sees it: an oversubscribed CPU head (more slots than cores, ``meshrun serve``'s
default on a laptop) counts its cores as devices, not its slots; GPU nodes by their GPUs."""

from __future__ import annotations

from service.cluster.capacity import CORES_RESOURCE, planning_cluster


def test_oversubscribed_cpu_head_plans_for_its_cores() -> None:
    cl = planning_cluster([{"CPU": 10.0, CORES_RESOURCE: 2.0, "memory": 8e9}])
    assert cl is not None and (cl.device, cl.gpus_per_node, cl.nodes) == ("cpu", 2, 1)
    assert cl.memory_bytes == int(4e9)


def test_cpu_nodes_without_the_marker_plan_for_their_slots() -> None:
    cl = planning_cluster([{"CPU": 6.0, "memory": 6e9}, {"CPU": 4.0, "memory": 8e9}])
    assert cl is not None and (cl.gpus_per_node, cl.nodes, cl.memory_bytes) == (6, 2, int(1e9))


def test_gpu_nodes() -> None:
    cl = planning_cluster([{"CPU": 10.0, CORES_RESOURCE: 2.0, "GPU": 8.0, "accelerator_type:H100": 1.0}])
    assert cl is not None and (cl.device, cl.gpus_per_node) == ("H100", 8)

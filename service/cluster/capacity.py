"""The cluster as the planner sees it: GPU nodes by accelerator type, or CPU nodes with the memory and the
measured FLOP/s one CPU worker gets. One function serves the service (from its cached node view) and the run
driver (from ``ray.nodes()`` inside the job)."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

from api.spec import ClusterSpec

_cpu_peak_lock = threading.Lock()

# A custom resource that meshrun's own head carries when it has more CPU slots than cores (``meshrun serve`` on a
# laptop: max(cores, 10) slots): its physical cores. The planner counts those as the node's CPU devices (five
# workers sharing one core are not five times faster); placement still uses the slots.
CORES_RESOURCE = "meshrun_cores"


def cpu_peak_flops_per_s() -> float:
    """fp32 matmul FLOP/s of one CPU core (a 1-CPU worker's peak), measured once per process."""
    with _cpu_peak_lock:
        from workers.metrics import measured_cpu_peak_flops

        return measured_cpu_peak_flops(seconds=0.2, n=512, threads=1)


def planning_cluster(node_totals: Sequence[Mapping[str, float]]) -> ClusterSpec | None:
    """A ``ClusterSpec`` for the alive nodes' total resources (Ray resource dicts), or None without nodes."""
    if not node_totals:
        return None
    gpu_nodes = [r for r in node_totals if r.get("GPU", 0) > 0]
    if gpu_nodes:
        acc = next(
            (k.split("accelerator_type:", 1)[1] for r in gpu_nodes for k in r if k.startswith("accelerator_type:")),
            None,
        )
        per_node = int(max(r["GPU"] for r in gpu_nodes))
        return ClusterSpec(device=acc or "H100", gpus_per_node=max(1, per_node), nodes=len(gpu_nodes))
    devices = [min(r.get("CPU", 1), r.get(CORES_RESOURCE) or r.get("CPU", 1)) for r in node_totals]
    per_node = int(max(devices))
    mem = min(r.get("memory", 0) / max(1.0, d) for r, d in zip(node_totals, devices))
    return ClusterSpec(
        device="cpu",
        gpus_per_node=max(1, per_node),
        nodes=len(node_totals),
        memory_bytes=int(mem) if mem > 0 else None,
        peak_flops_per_s=cpu_peak_flops_per_s(),
    )

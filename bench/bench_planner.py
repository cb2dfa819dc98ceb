"""Time the layout search and show what it recommends.

    python bench/bench_planner.py            # 175B on 1024 H100s and a few other sizes
    python bench/bench_planner.py --repeat 5 --top 5

Prints, per case, the search time (best of ``--repeat``), how many layouts were evaluated, and the top layouts
as a table (layout, micro-batch, checkpointing, memory per rank, step time, tokens/s, MFU, where time goes).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from api.spec import ClusterSpec, ModelSpec, PlanRequest
from service.planner import search

GiB = 1 << 30

# (preset, device, nodes, gpus_per_node, global batch in sequences)
CASES = [
    ("175b", "H100", 128, 8, 1536),
    ("175b", "A100-80GB", 128, 8, 1536),
    ("70b", "H100", 8, 8, 512),
    ("13b", "A100-80GB", 4, 8, 256),
    ("7b", "L40S", 1, 8, 64),
    ("1.3b", "H100", 1, 8, 256),
    ("175b", "H100", 2048, 8, 4096),  # 16,384 GPUs
]


def _layout(c) -> str:
    lay = c.layout
    s = f"dp{lay.dp} tp{lay.tp} pp{lay.pp} z{lay.zero_stage}"
    if lay.shard_group_size:
        s += f"/sg{lay.shard_group_size}"
    if lay.sequence_parallel:
        s += " sp"
    if lay.pp > 1:
        s += f" {lay.pp_schedule}" + (f"x{lay.pp_virtual_stages}" if lay.pp_virtual_stages > 1 else "")
    return s


def _where(c) -> str:
    st = c.step_time_s
    parts = {"tp": st.tp_comm, "pp": st.pp_comm, "bubble": st.pp_bubble, "dp": st.dp_comm, "opt": st.optimizer}
    return " ".join(f"{k} {v / st.total:.0%}" for k, v in parts.items() if v / st.total >= 0.005) or "-"


def run_case(preset: str, device: str, nodes: int, gpn: int, gbs: int, *, repeat: int, top: int) -> float:
    req = PlanRequest(
        model=ModelSpec(name="gpt", preset=preset),
        cluster=ClusterSpec(device=device, nodes=nodes, gpus_per_node=gpn),
        global_batch_size=gbs,
        top_k=top,
    )
    best = best_cpu = float("inf")
    resp = None
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        resp = search(req)
        best = min(best, time.perf_counter() - t0)
        best_cpu = min(best_cpu, time.process_time() - c0)
    assert resp is not None
    print(
        f"\n## {preset} on {nodes * gpn} x {device} ({nodes} nodes x {gpn}), global batch {gbs}: "
        f"search {best * 1e3:.0f} ms wall, {best_cpu * 1e3:.0f} ms CPU (best of {repeat}), {resp.evaluated} "
        f"layout x micro-batch x checkpointing choices evaluated, "
        f"{len(resp.rejected)} rejection groups"
    )
    hdr = (
        f"{'#':>2}  {'layout':<44} {'mb':>3} {'recompute':<9} {'mem GiB':>8} {'step s':>8} {'tokens/s':>10} "
        f"{'MFU':>5}  comm/bubble share"
    )
    print(hdr)
    print("-" * len(hdr))
    for i, c in enumerate(resp.candidates, 1):
        print(
            f"{i:>2}  {_layout(c):<44} {c.micro_batch_size:>3} {c.activation_checkpointing:<9} "
            f"{c.memory_bytes.total / GiB:>8.1f} {c.step_time_s.total:>8.3f} {c.tokens_per_s:>10.0f} "
            f"{c.mfu:>5.2f}  {_where(c)}"
        )
    if not resp.candidates:
        print("   (nothing fits)", resp.rejected[0].reason if resp.rejected else "")
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--top", type=int, default=5)
    args = ap.parse_args()
    times = [run_case(*case, repeat=args.repeat, top=args.top) for case in CASES]
    print(f"\n175B on 1024 H100: {times[0] * 1e3:.0f} ms (target < 1000 ms of CPU)")


if __name__ == "__main__":
    main()

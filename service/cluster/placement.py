"""Layout -> Ray Train scaling: how many workers, what each needs, and on which node each one runs.

Pure logic (no Ray import): the scheduler feeds it free/total resources per node, the driver turns the result
into a ``ScalingConfig``.

Rules (design: placement):
- one Ray Train worker per rank; each needs ``plan.resources_per_worker`` (1 GPU, or ``cpus_per_worker`` CPUs);
- ranks are ordered pp (outer), dp, tp (inner): a tensor-parallel group is ``tp`` consecutive ranks and must
  sit on one node; pipeline stages and data-parallel replicas may cross nodes, but only as needed;
- whole TP groups go to nodes, using as few nodes as possible (one node if any can hold the whole run: the
  tightest such node; else the roomiest nodes first);
- with more than one node the assignment is handed to Ray Train as a per-worker ``label_selector``
  (``{"ray.io/node-id": <node>}``, one entry per worker in rank order). Ray Train groups ranks by node in the
  order the workers come up, so every node holds a contiguous block of ranks whose size is a multiple of
  ``tp`` — every TP group on one node. The worker checks this again at start-up.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from api.spec import Plan, ResolvedLayout
from api.spec.plan import layout_of

NODE_ID_LABEL = "ray.io/node-id"
_EPS = 1e-9


@dataclass(frozen=True)
class NodeCapacity:
    """Resources of one alive node: ``total`` (what it has) and ``free`` (what is unclaimed now)."""

    node_id: str
    total: Mapping[str, float]
    free: Mapping[str, float]


@dataclass
class Placement:
    """A decision for one run. ``fits`` False -> ``reason`` says why (and nothing else is meaningful)."""

    fits: bool
    reason: str = ""
    layout: ResolvedLayout = field(default_factory=ResolvedLayout)
    resources_per_worker: dict[str, float] = field(default_factory=dict)
    use_gpu: bool = False
    rank_nodes: list[str] = field(default_factory=list)  # rank -> node id
    label_selector: list[dict[str, str]] | None = None  # per worker, rank order (None: not pinned)
    placement_strategy: str = "PACK"

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def workers_per_node(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for n in self.rank_nodes:
            out[n] = out.get(n, 0) + 1
        return out

    def scaling_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``ray.train.ScalingConfig``."""
        kw: dict[str, Any] = {
            "num_workers": self.world_size,
            "use_gpu": self.use_gpu,
            "resources_per_worker": dict(self.resources_per_worker),
            "placement_strategy": self.placement_strategy,
        }
        if self.label_selector is not None:
            kw["label_selector"] = [dict(s) for s in self.label_selector]
        return kw

    def to_json(self) -> dict[str, Any]:
        return {
            "fits": self.fits,
            "reason": self.reason,
            "world_size": self.world_size,
            "tp": self.layout.tp,
            "layout": self.layout.model_dump(mode="json"),
            "resources_per_worker": self.resources_per_worker,
            "use_gpu": self.use_gpu,
            "rank_nodes": self.rank_nodes,
            "label_selector": self.label_selector,
            "placement_strategy": self.placement_strategy,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Placement:
        if d.get("layout") is not None:
            layout = ResolvedLayout.model_validate(d["layout"])
        else:  # written before Placement.layout: its world size and tp
            tp = int(d.get("tp") or 1)
            layout = ResolvedLayout(dp_replicate=max(1, int(d.get("world_size") or 0) // tp), tp=tp)
        return cls(
            layout=layout,
            **{
                k: d[k]
                for k in (
                    "fits",
                    "reason",
                    "resources_per_worker",
                    "use_gpu",
                    "rank_nodes",
                    "label_selector",
                    "placement_strategy",
                )
                if k in d
            },
        )


# ----------------------------------------------------------------------------------------- resources
PlanLike = Plan | Mapping[str, Any]  # a Plan, or a stored plan (its JSON)


def _get(plan: PlanLike, key: str, default: Any = None) -> Any:
    return plan.get(key, default) if isinstance(plan, Mapping) else getattr(plan, key, default)


def worker_resources(plan: PlanLike) -> dict[str, float]:
    """What one worker reserves: the plan's ``resources_per_worker`` (GPU plans always 1 GPU per worker)."""
    res = {k: float(v) for k, v in (_get(plan, "resources_per_worker") or {}).items() if float(v) > 0}
    if _get(plan, "device") == "cuda":
        res["GPU"] = 1.0
    if not res:
        res = {"CPU": 1.0}
    return res


def _fmt_amount(n: float, unit: str) -> str:
    s = f"{int(n)}" if float(n).is_integer() else f"{n:g}"
    return f"{s} {unit}{'s' if n > 1 and unit in ('CPU', 'GPU') else ''}"


def slot_description(res: Mapping[str, float]) -> str:
    """'1 CPU', '2 CPUs', '1 GPU + 4 CPUs' — what one worker slot is."""
    parts = []
    if res.get("GPU"):
        parts.append(_fmt_amount(res["GPU"], "GPU"))
    if res.get("CPU"):
        parts.append(_fmt_amount(res["CPU"], "CPU"))
    parts += [_fmt_amount(v, k) for k, v in res.items() if k not in ("GPU", "CPU")]
    return " + ".join(parts)


def slots(available: Mapping[str, float], res: Mapping[str, float]) -> int:
    """How many workers needing ``res`` fit into ``available``."""
    n = math.inf
    for k, need in res.items():
        if need <= 0:
            continue
        n = min(n, math.floor((float(available.get(k, 0.0)) + _EPS) / need))
    return 0 if n is math.inf else max(0, int(n))


# ------------------------------------------------------------------------------------------ assignment
def _assign_groups(groups: int, cap: Mapping[str, int]) -> dict[str, int] | None:
    """Whole groups per node using the fewest nodes: best fit on one node, else roomiest first."""
    if groups <= 0:
        return {}
    single = [n for n, c in cap.items() if c >= groups]
    if single:
        best = min(single, key=lambda n: (cap[n], n))
        return {best: groups}
    out: dict[str, int] = {}
    left = groups
    for n in sorted(cap, key=lambda n: (-cap[n], n)):
        if left == 0:
            break
        take = min(left, cap[n])
        if take > 0:
            out[n] = take
            left -= take
    return out if left == 0 else None


def place(
    plan: PlanLike,
    nodes: list[NodeCapacity],
    *,
    use_free: bool = True,
    reserved: Mapping[str, Mapping[str, float]] | None = None,
    pin: bool | None = None,
) -> Placement:
    """Place ``plan``'s workers on ``nodes`` (free resources by default, minus ``reserved`` per node).

    ``pin``: express the assignment as per-worker label selectors (default: when the cluster has more than one
    node). Returns ``Placement(fits=False, reason=...)`` when it cannot fit now.
    """
    return _place(layout_of(plan), worker_resources(plan), nodes, use_free=use_free, reserved=reserved, pin=pin)


def _place(
    layout: ResolvedLayout,
    res: dict[str, float],
    nodes: list[NodeCapacity],
    *,
    use_free: bool = True,
    reserved: Mapping[str, Mapping[str, float]] | None = None,
    pin: bool | None = None,
) -> Placement:
    world, tp = layout.world_size, layout.tp
    use_gpu = res.get("GPU", 0) > 0
    unit = slot_description(res)
    cap_slots: dict[str, int] = {}
    for n in nodes:
        avail = dict(n.free if use_free else n.total)
        for k, v in ((reserved or {}).get(n.node_id) or {}).items():
            avail[k] = avail.get(k, 0.0) - v
        cap_slots[n.node_id] = slots(avail, res)
    total_slots = sum(cap_slots.values())
    word = "free" if use_free else "in the cluster"
    if world > total_slots:
        return Placement(
            fits=False,
            layout=layout,
            resources_per_worker=res,
            use_gpu=use_gpu,
            reason=f"needs {world} worker slots of {unit}; {total_slots} {word}",
        )
    groups = world // tp  # the layout's degrees multiply to the world: whole TP groups
    per_node_groups = _assign_groups(groups, {n: c // tp for n, c in cap_slots.items()})
    if per_node_groups is None:
        per_node = sorted(cap_slots.values(), reverse=True)
        return Placement(
            fits=False,
            layout=layout,
            resources_per_worker=res,
            use_gpu=use_gpu,
            reason=f"needs {groups} tensor-parallel group(s) of {tp} worker slots of {unit}, each "
            f"group on one node; slots {word} per node: {per_node}",
        )
    rank_nodes: list[str] = []
    for node_id, g in per_node_groups.items():
        rank_nodes += [node_id] * (g * tp)
    if pin is None:
        pin = len([n for n in nodes if slots(n.total, res) > 0]) > 1
    selector = [{NODE_ID_LABEL: n} for n in rank_nodes] if pin else None
    return Placement(
        fits=True,
        layout=layout,
        resources_per_worker=res,
        use_gpu=use_gpu,
        rank_nodes=rank_nodes,
        label_selector=selector,
        placement_strategy="PACK",
    )


def never_fits(
    plan: PlanLike, nodes: list[NodeCapacity], *, cpu_setting: str | None = None, reserved_cpu: float = 0.0
) -> str | None:
    """Why ``plan`` can never run on this cluster (even empty), or None if it could. The reason names the
    smaller layout that would fit and, for CPU workers, ``cpu_setting`` (the setting that sizes the cluster's
    CPU slots, when the service owns it) with the value that would fit. ``reserved_cpu``: CPUs the work's own
    helpers hold on any node while it runs (a sweep's trial drivers), taken from every node's total."""
    if reserved_cpu > 0:
        nodes = [
            NodeCapacity(n.node_id, {**n.total, "CPU": max(0.0, n.total.get("CPU", 0.0) - reserved_cpu)}, n.free)
            for n in nodes
        ]
    res = worker_resources(plan)
    if res.get("GPU") and not any(n.total.get("GPU", 0) > 0 for n in nodes):
        return (
            f"needs {layout_of(plan).world_size} workers with 1 GPU each; the cluster has no GPUs "
            "(use resources.device: cpu)"
        )
    p = place(plan, nodes, use_free=False, pin=False)
    if p.fits:
        return None
    fixes = []
    if cpu_setting and not p.use_gpu and len(nodes) == 1:
        have = nodes[0].total.get("CPU", 0.0)
        need = int(-(-p.world_size * res.get("CPU", 1.0) // 1)) + 1  # the workers + the run's driver
        if need > have:
            fixes.append(f"restart the service with {cpu_setting}={need} (logical CPU slots; workers share cores)")
    smaller = smaller_layout(plan, nodes)
    if smaller:
        fixes.append(f"use a smaller layout that fits: {smaller}")
    held = f" (after the {reserved_cpu:g} CPU its sweep's trial drivers hold)" if reserved_cpu > 0 else ""
    return p.reason + held + (f"; {' or '.join(fixes)}" if fixes else "")


def smaller_layout(plan: PlanLike, nodes: list[NodeCapacity]) -> str | None:
    """The largest layout that fits the empty cluster, reached by halving dp, then pp, then tp
    ("dp=1, tp=2, pp=2 (4 workers)": what to set in the spec), or None."""
    lay = layout_of(plan)
    deg = {"dp": lay.dp, "tp": lay.tp, "pp": lay.pp}
    res = worker_resources(plan)
    while True:
        for k in ("dp", "pp", "tp"):
            if deg[k] > 1:
                deg[k] = deg[k] // 2 if deg[k] % 2 == 0 else 1
                break
        else:
            return None
        trial = ResolvedLayout(pp=deg["pp"], dp_replicate=deg["dp"], tp=deg["tp"])
        if _place(trial, res, nodes, use_free=False, pin=False).fits:
            return f"dp={deg['dp']}, tp={deg['tp']}, pp={deg['pp']} ({trial.world_size} workers)"


def reservation(p: Placement) -> dict[str, dict[str, float]]:
    """Resources a placed run claims per node (to subtract while its workers have not started yet)."""
    out: dict[str, dict[str, float]] = {}
    for node_id, count in p.workers_per_node.items():
        out[node_id] = {k: v * count for k, v in p.resources_per_worker.items()}
    return out


def add_reservations(*parts: Mapping[str, Mapping[str, float]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for part in parts:
        for node_id, res in part.items():
            acc = out.setdefault(node_id, {})
            for k, v in res.items():
                acc[k] = acc.get(k, 0.0) + v
    return out


def check_tp_groups(rank_nodes: list[str], tp: int) -> str | None:
    """None if every TP group (tp consecutive ranks) is on one node, else a message naming the first split."""
    for start in range(0, len(rank_nodes), max(1, tp)):
        grp = rank_nodes[start : start + tp]
        if len(set(grp)) > 1:
            return (
                f"tensor-parallel group of ranks {start}..{start + len(grp) - 1} spans nodes "
                f"{sorted(set(grp))}; a TP group must share one node (fast links)"
            )
    return None

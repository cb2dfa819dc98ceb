"""Warm worker groups: one worker start per shape, not one per job (a sweep's trials, the service's runs).

Two owners of a ``WarmPool`` actor: a sweep (``budget.warm_workers``, default true; CPU trials: the sweep driver
starts a pool named per sweep, in the sweep's Ray Job, so it ends with the job) and the service
(``MESHRUN_WARM_WORKERS``: ``service.cluster.warm_host``, a Ray Job of its own that prestarts a group and keeps
it for every run of that shape). A job (a trial, a run) then trains like this (``warm_fit``):

1. a placement group of the trial's workers (the plan's worker resources, its placement strategy) reserves the
   CPUs for this trial only, exactly as Ray Train's own placement group would: the scheduler and Ray see them
   taken while the trial trains and free as soon as it ends, so a queued run is never starved by idle warm workers;
2. the pool hands out an idle group of ``WarmWorker`` actors (``workers.warm``: torch and the engine imported, no
   resources of their own) pinned to the nodes of those bundles, or starts one (a sweep event says so);
3. every worker trains the job as its rank (a new process group per job, re-meshed in place), rank 0 through
   the run's channel like a Ray Train worker; the placement group is removed at the end;
4. a job that fails (a worker raised or died) or does not stop when asked costs only itself: its group is killed
   and the next job starts a new one. At most ``max_idle`` idle groups are kept (the oldest go first), and with
   ``idle_s`` a group idle that long goes too (at the pool's next ``reap``), except the newest idle group of the
   standing shape (``prestart``): that bounds the memory idle workers hold (each a process with torch imported,
   about 500 MB) and the CPU they still take (Ray's core worker wakes them up: about 1 % of a core each, idle).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, cast

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from api.spec import Plan
from service.cluster.placement import worker_resources

log = logging.getLogger(__name__)


class NotOneNode(RuntimeError):
    """The job's workers did not land on one node (``warm_fit(one_node=True)``): nothing was trained."""


MAX_IDLE_GROUPS = 2
PLACE_TIMEOUT_S = 60.0  # like Ray Train's worker-group start timeout: a trial that cannot be placed fails
POLL_S = 0.5


WARM_NAMESPACE = "meshrun-warm"  # the service pool's Ray namespace (run drivers find it by name there)


def usable(plan: Plan) -> bool:
    """Warm groups train CPU jobs (a GPU worker would need its device chosen per job)."""
    return plan.device != "cuda" and "GPU" not in worker_resources(plan)


@ray.remote(num_cpus=0)
class WarmPool:
    """Warm worker groups, keyed by (nodes of their ranks, threads)."""

    def __init__(self, max_idle: int = MAX_IDLE_GROUPS, idle_s: float | None = None) -> None:
        self.groups: dict[int, dict[str, Any]] = {}
        self.starts = 0
        self.max_idle = max(1, int(max_idle))
        self.idle_s = float(idle_s) if idle_s else None
        self.standing: tuple[tuple[str, ...], int] | None = None  # the prestarted shape: one idle group of it stays

    def prestart(self, nodes: list[str], threads: int) -> int:
        """A new idle group on these nodes (ready when this returns): the service's standing group."""
        gid, _, _, _ = self.acquire(nodes, threads, fresh=True)
        self.release(gid, True)
        self.groups[gid]["jobs"] = 0  # prestarted: it ran nothing yet
        self.standing = self.groups[gid]["key"]
        return gid

    def acquire(
        self, nodes: list[str], threads: int, fresh: bool = False, owner: Any = None
    ) -> tuple[int, list[Any], int, bool]:
        """An idle group on exactly these nodes (rank i on nodes[i]), or a new one: (group id, workers, jobs it
        ran before, new?). ``owner``: an actor that lives as long as the job (its run channel, which dies with its
        driver): a group whose owner died is never released by it, and ``reap`` takes it back."""
        key = (tuple(nodes), int(threads))
        for gid, g in self.groups.items():
            if not fresh and not g["busy"] and g["key"] == key:
                g["busy"], g["owner"] = True, owner
                return gid, g["workers"], g["jobs"], False
        from workers.warm import WarmWorker  # torch: in the pool's process only, never a run driver's

        workers = [
            WarmWorker.options(  # type: ignore[attr-defined]
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
            ).remote(threads)
            for node in nodes
        ]
        ray.get([w.info.remote() for w in workers])  # up: torch and the engine imported
        self.starts += 1
        gid = self.starts
        self.groups[gid] = {
            "key": key,
            "workers": workers,
            "busy": True,
            "jobs": 0,
            "used": time.time(),
            "owner": owner,
        }
        self._evict()
        return gid, workers, 0, True

    def release(self, gid: int, healthy: bool) -> None:
        g = self.groups.get(gid)
        if g is None:
            return
        if not healthy:
            self._kill(gid)
            return
        g["busy"], g["jobs"], g["used"], g["owner"] = False, g["jobs"] + 1, time.time(), None
        self._evict()

    def reap(self) -> list[int]:
        """Busy groups whose owner died (a run driver SIGKILLed, or lost with its node, before it could release its
        group): their workers are killed (their job stopped at its next poll of the dead channel, in whatever state)
        and the groups dropped. Returns their ids. Idle groups past ``idle_s`` go too (``expire``)."""
        self.expire()
        asked = {
            gid: g["owner"].__ray_ready__.remote()
            for gid, g in self.groups.items()
            if g["busy"] and g.get("owner") is not None
        }
        if not asked:
            return []
        # all at once, briefly: a live owner answers in milliseconds, a dead one fails at once (this actor serves
        # ``acquire`` too, and must not wait on a slow owner)
        ready, _ = ray.wait(list(asked.values()), num_returns=len(asked), timeout=2)
        dead = []
        for gid, ref in asked.items():
            if ref not in ready:
                continue  # slow to answer: alive, or the next pass tells
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                dead.append(gid)
            except Exception:
                continue
        for gid in dead:
            log.warning("warm group #%d: the job's owner died without releasing it; its workers are killed", gid)
            self._kill(gid)
        return dead

    def expire(self, now: float | None = None) -> list[int]:
        """Kill the idle groups unused for ``idle_s`` or longer, except the newest idle group of the standing shape
        (the next run of that shape still starts warm). Returns their ids."""
        if self.idle_s is None:
            return []
        now = time.time() if now is None else now
        idle = sorted(((g["used"], gid) for gid, g in self.groups.items() if not g["busy"]), reverse=True)
        standing = next((gid for _, gid in idle if self.groups[gid]["key"] == self.standing), None)
        expired = [gid for used, gid in idle if gid != standing and now - used >= self.idle_s]
        for gid in expired:
            log.info("warm group #%d: idle for %.0f s or more, its workers are stopped", gid, self.idle_s)
            self._kill(gid)
        return expired

    def _evict(self) -> None:
        idle = sorted((g["used"], gid) for gid, g in self.groups.items() if not g["busy"])
        for _, gid in idle[: max(0, len(idle) - self.max_idle)]:
            self._kill(gid)

    def _kill(self, gid: int) -> None:
        for w in self.groups.pop(gid, {}).get("workers", []):
            with contextlib.suppress(Exception):
                ray.kill(w)

    def stats(self) -> dict[str, Any]:
        return {
            "starts": self.starts,
            "groups": len(self.groups),
            "busy": sum(g["busy"] for g in self.groups.values()),
            "idle_shapes": [[len(g["key"][0]), g["key"][1]] for g in self.groups.values() if not g["busy"]],
        }

    def shutdown(self) -> None:
        for gid in list(self.groups):
            self._kill(gid)


def _place(plan: Plan, bundle: dict[str, float] | None = None, strategy: str | None = None) -> tuple[Any, list[str]]:
    """The job's placement group (its resources for as long as it trains; ``bundle``: one rank's resources, the
    scheduler's placement when it made one, else the plan's) and the node of each rank."""
    bundle = dict(bundle or worker_resources(plan))
    pg = placement_group([bundle] * plan.world_size, strategy=strategy or plan.placement_strategy or "PACK")
    try:
        ray.get(pg.ready(), timeout=PLACE_TIMEOUT_S)
    except Exception as e:
        remove_placement_group(pg)
        raise RuntimeError(
            f"the {plan.world_size} workers could not be placed within {PLACE_TIMEOUT_S:.0f} s "
            f"({type(e).__name__}); the cluster has fewer free resources than the job needs"
        ) from e
    table = placement_group_table(pg)
    by_bundle = table.get("bundles_to_node_id") or {}
    return pg, [str(by_bundle[i]) for i in range(plan.world_size)]


def warm_fit(
    *,
    pool: Any,
    run_id: str,
    run_name: str,
    spec_json: dict[str, Any],
    plan: Plan,
    channel: Any,
    cancel: threading.Event,
    on_group: Callable[[int, int, bool], None] | None = None,
    timeout_s: float = 120.0,
    bundle: dict[str, float] | None = None,
    strategy: str | None = None,
    files: dict[str, Any] | None = None,
    one_node: bool = False,
    attempt: int = 1,
    channel_first: bool = False,
) -> dict[str, Any]:
    """Train one job on a warm group of ``pool``; raises what a worker raised. ``on_group(group id, jobs it ran
    before, new?)`` once the group is known. ``cancel`` set: the job is abandoned and its group killed. ``files``:
    where the workers checkpoint and resume from (``workers.warm.WarmWorker.train``). ``one_node``: every rank must
    land on one node (else ``NotOneNode`` before any worker is used). ``attempt``: the number the job registers with
    ``channel`` (its workers do not wait for the channel to answer). ``channel_first``: the workers start once the
    channel actor is up (it starts while the job is placed): a sweep trial measures, and a tiny trial ran its every
    step while the new channel's process started on the same cores, at half its speed."""
    channel_up = channel.__ray_ready__.remote() if channel_first else None
    pg, nodes = _place(plan, bundle, strategy)
    if one_node and len(set(nodes)) > 1:
        remove_placement_group(pg)
        raise NotOneNode(f"the placement group spread the {plan.world_size} workers over {len(set(nodes))} nodes")
    healthy = False
    gid = -1
    workers: list[Any] = []
    try:
        threads = max(1, int(worker_resources(plan).get("CPU", 1)))
        got = cast(
            tuple[int, list[Any], int, bool], ray.get(pool.acquire.remote(nodes, threads, False, channel), timeout=300)
        )
        gid, workers, jobs, new = got
        if on_group is not None:
            on_group(gid, jobs, new)
        addr, port = ray.get(workers[0].endpoint.remote(plan.world_size), timeout=60)
        if channel_up is not None:
            ray.get(channel_up, timeout=60)
        per_node: dict[str, int] = {}
        refs = []
        for rank, (w, node) in enumerate(zip(workers, nodes)):
            local = per_node.get(node, 0)
            per_node[node] = local + 1
            cfg = {
                "rank": rank,
                "world_size": plan.world_size,
                "local_rank": local,
                "local_world_size": nodes.count(node),
                "master_addr": addr,
                "master_port": port,
                "spec": spec_json,
                "plan": plan.model_dump(mode="json"),
                "channel": channel,
                "run_id": run_id,
                "run_name": run_name,
                "group": f"group #{gid}",
                "timeout_s": timeout_s,
                "attempt": attempt,
                **(files or {}),
            }
            refs.append(w.train.remote(cfg))
        pending = list(refs)
        while pending:
            if cancel.is_set():
                raise RuntimeError("the job was abandoned (its workers did not stop when asked)")
            done, pending = ray.wait(pending, num_returns=1, timeout=POLL_S)
            for ref in done:
                ray.get(ref)  # a worker's error ends the trial at once (its group is killed below)
        out = ray.get(refs[0])
        healthy = True
        return dict(out)
    finally:
        if gid >= 0 and not healthy:  # failed, abandoned, or this driver is stopping (a cancel): its workers go now
            for w in workers:
                with contextlib.suppress(Exception):
                    ray.kill(w)
        if gid >= 0:
            with contextlib.suppress(Exception):
                release = pool.release.remote(gid, healthy)
                if not healthy:
                    ray.get(release, timeout=10)  # delivered before a stopping driver exits
        remove_placement_group(pg)

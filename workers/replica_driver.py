"""The driver side of ``fault_tolerance.mode: replica`` (``workers.replica_ft`` has the replicas): torchft's
lighthouse in this process, one ``ReplicaWorker`` actor per data-parallel replica, and the loop that forwards every
committed step once, replaces a lost replica (it heals from a live peer), kills a hung one (stuck past the hang
timeout in a phase of its own) and restores every replica from storage when none is left. A replica of several
workers (HSDP: an FSDP shard group, ``workers.replica_shard``) is started, lost and replaced as a whole, its
workers packed in a placement group of their own."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from api.spec import Plan, RunSpec
from api.spec.run import hang_limit_s
from workers.replica_ft import JOIN_TIMEOUT_MS, NoPeerToHeal, ReplicaWorker, node_ip, timeouts

POLL_S = 0.2
HEARTBEAT_TIMEOUT_MS = 1500  # a replica silent this long is out of the next quorum (the survivors' detection)
WAITING = frozenset({"quorum", "allreduce", "commit"})  # phases that wait on the peers (or the lighthouse)
PREEMPT_POLL_S = 1.0  # how often the service's preemption request is polled
FINISH_GRACE_S = 120.0  # how long the last step's other participants get to return (a checkpoint to write)


def _lighthouse(min_replicas: int, join_timeout_ms: int = JOIN_TIMEOUT_MS) -> tuple[Any, str]:
    """torchft's lighthouse in this process, on this node's IP (the replicas may run on other nodes)."""
    from torchft.coordination import LighthouseServer

    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum at info
    ip = node_ip()
    server = LighthouseServer(
        bind=f"{ip}:0",
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout_ms,
        heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS,
    )
    port = server.address().rsplit(":", 1)[1]
    return server, f"http://{ip}:{port}"


def _replica_placement(opts: dict[str, Any], size: int, name: str) -> Any:
    """A sharded replica's workers in one placement group, packed on as few nodes as fit (FSDP's collectives
    stay inside a node where they can), or None: one worker per replica, or workers that ask for no resource."""
    bundle = {k: float(opts.get(o) or 0) for k, o in (("CPU", "num_cpus"), ("GPU", "num_gpus"))}
    bundle = {k: v for k, v in bundle.items() if v > 0}
    if size < 2 or not bundle:
        return None
    return placement_group([bundle] * size, strategy="PACK", name=name)


def _bundle(pg: Any, j: int) -> dict[str, Any]:
    """Actor options placing worker ``j`` of a replica in its bundle of ``pg`` (none without one)."""
    if pg is None:
        return {}
    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=j)}


def _finish(running: dict[Any, int], last: dict[str, Any]) -> None:
    """Every step is committed: wait (``FINISH_GRACE_S``) for the replicas that trained the last step, which return
    once their checkpoint is written, and drop the others. Those are replacements still joining, which would wait
    for a quorum that never comes: the finished replicas' Managers still heartbeat until they are killed."""
    mask = int(last.get("replica_mask") or 0)
    wait = [ref for ref, i in running.items() if mask >> i & 1]
    if wait:
        ray.wait(wait, num_returns=len(wait), timeout=FINISH_GRACE_S)
    running.clear()


def run_replicas(
    spec: RunSpec,
    plan: Plan,
    *,
    sink: Callable[[dict[str, Any]], None] | None = None,
    on_event: Callable[[str, str], None] | None = None,
    worker_options: dict[str, Any] | None = None,
    ckpt_dir: str | None = None,
    on_start: Callable[[list[dict[str, Any]]], None] | None = None,
    on_checkpoint: Callable[[int, str], None] | None = None,
    preempt_request: Callable[[], str | None] | None = None,
) -> dict[str, Any]:
    """Train ``spec`` as ``dp`` fault-tolerant replicas on the connected Ray cluster; returns the run's summary.

    A replica whose actor dies is replaced (``resources.max_failures`` times, -1 unlimited) while the others go on;
    the replacement heals from a peer. ``on_event(kind, text)``: ``replica_lost``, ``replica_rejoined``,
    ``replicas_restored``. The summary's ``replica_recoveries`` has one entry per loss: the step it was lost at,
    detection, restart (a new actor ready) and rejoin (its first committed step) times. ``on_start(ranks)``: once
    the first replicas are ready, before any row reaches ``sink`` (rank, node_id, pid, host per replica).
    ``on_checkpoint(step, path)``: each checkpoint written to ``ckpt_dir``, once, after the rows up to its step.

    Preemption: ``preempt_request()`` (polled; a reason when the service wants the workers back) makes every replica
    stop after the same committed step, checkpointed by the quorum's first replica, and so does a SIGTERM on every
    replica; the summary then says ``preempted``. A SIGTERM on some replicas only makes them leave at a step
    boundary (``replica_preempted``) and be replaced like a lost one, without spending ``max_failures``."""
    ft = spec.fault_tolerance
    n, size = plan.layout.dp_replicate, plan.layout.dp_shard  # replicas, workers per replica (HSDP: > 1)
    spec_json, plan_json = spec.model_dump_json(), plan.model_dump_json()
    opts: dict[str, Any] = {
        "num_cpus": spec.resources.cpus_per_worker,
        "max_concurrency": 2,  # take_rows while run() trains
        "runtime_env": {"env_vars": {"RUST_LOG": os.environ.get("RUST_LOG", "warn")}},
    }
    if plan.device == "cuda":
        opts["num_gpus"] = 1
    opts.update(worker_options or {})
    emit = on_event or (lambda kind, text: None)
    server, address = _lighthouse(ft.min_replicas, timeouts(spec)[1])
    incarnation = dict.fromkeys(range(n), 1)
    actors: dict[int, Any] = {}  # replica -> its worker 0 (rows, phases, the run's summary)
    group: dict[int, list[Any]] = {}  # replica -> all its workers
    running: dict[Any, int] = {}  # worker 0's run() -> replica
    follow: dict[Any, int] = {}  # the other workers' run() -> replica (their end only matters if they die)
    pgs: dict[int, Any] = {}  # replica -> the placement group that packs its workers (several per replica)
    seen: dict[int, dict[str, Any]] = {}
    recoveries: list[dict[str, Any]] = []
    pending: dict[int, dict[str, Any]] = {}  # replica -> its open recovery (rejoin not yet seen)
    restarts, restores = 0, 0
    gone: set[int] = set()  # lost replicas without a replacement (max_failures spent)
    raised_at: int | None = None  # the last committed step when a replica last raised (not died)
    budget = spec.resources.max_failures
    t0 = time.time()

    slowest = [0.0]  # the slowest committed step's step_time_s
    phases: dict[int, tuple[str, float]] = {}  # replica -> (phase, seconds in it), from its last take_rows
    hung: set[int] = set()  # replicas killed as hung, until their replacement starts
    asked: list[str] = []  # the service's preemption reason, once asked (passed on to every replica)
    stopped: dict[str, Any] = {}  # the replicas stopped for a preemption: the step, the cause, who got a SIGTERM
    noticed: set[int] = set()  # replicas that left after a SIGTERM
    last_saved: list[str] = []
    next_poll = [0.0]

    def start(i: int, from_storage: bool) -> list[Any]:
        phases.pop(i, None)
        hung.discard(i)
        where = _replica_placement(opts, size, f"meshrun-replica-{i}-{incarnation[i]}-{os.getpid()}")
        if where is not None:
            pgs[i] = where
        group[i] = [
            ReplicaWorker.options(**opts, **_bundle(where, j)).remote(  # type: ignore[attr-defined]
                i, incarnation[i], spec_json, plan_json, ckpt_dir, from_storage, j
            )
            for j in range(size)
        ]
        actors[i] = group[i][0]
        for a in group[i]:
            if asked:
                a.request_preempt.remote(asked[0])
        return group[i]

    def launch(ids: list[int], from_storage: bool, min_step: int = 0) -> list[dict[str, Any]]:
        """Start replicas ``ids``; every worker's info (rank order)."""
        started = [start(i, from_storage) for i in ids]
        stores = ray.get([ws[0].open_store.remote() for ws in started])
        # every Manager heartbeats before any quorum; a replica's workers join its process group together
        infos = ray.get([a.ready.remote(address, *store) for ws, store in zip(started, stores) for a in ws])
        for i, ws in zip(ids, started):
            running[ws[0].run.remote(min_step)] = i
            for a in ws[1:]:
                follow[a.run.remote(min_step)] = i
        return infos

    def kill(i: int) -> None:
        """Every worker of replica ``i``: one lost worker loses its replica (the others would wait on it in FSDP's
        collectives), whose worker 0 then ends as a lost replica's."""
        for ref in [ref for ref, j in follow.items() if j == i]:
            del follow[ref]
        for a in group.get(i, []):
            with contextlib.suppress(Exception):
                ray.kill(a)
        if i in pgs:
            with contextlib.suppress(Exception):
                remove_placement_group(pgs.pop(i))

    def placed(infos: list[dict[str, Any]]) -> None:
        emit(
            "placement",
            "rank -> node: " + json.dumps({str(x["rank"]): f"{x['node_id'][:12]} pid {x['pid']}" for x in infos}),
        )

    def drain() -> None:
        for i, a in list(actors.items()):
            try:
                got = ray.get(a.take_rows.remote(), timeout=30)
            except (RayActorError, GetTimeoutError):
                continue
            phases[i] = (got["phase"], got["phase_s"])
            for row in got["rows"]:
                s = int(row["step"])
                if s in seen:
                    continue
                seen[s] = row
                slowest[0] = max(slowest[0], float(row.get("step_time_s") or 0.0))
                for rec in list(pending.values()):
                    if rec.get("resume_s") is None and s > rec["lost_step"]:
                        rec["resume_s"] = row["time"] - rec["lost_at"]  # the live replicas commit again
                    back = int(row.get("replica_mask") or 0) >> rec["replica"] & 1  # it trained this step
                    if back and rec["rejoin_s"] is None and s > rec["lost_step"]:
                        rec["rejoin_s"] = row["time"] - rec["lost_at"]
                        rec["rejoin_step"] = s
                        pending.pop(rec["replica"], None)
                        emit(
                            "replica_rejoined",
                            f"replica {rec['replica']} rejoined at step {s} ({rec['rejoin_s']:.1f} s after it was "
                            f"lost; healed from a live peer, not from storage); {row['replicas']} of {n} replicas "
                            "train",
                        )
                if sink is not None:
                    sink(row)
            for step, path in got["saved"]:
                last_saved[:] = [str(path)]
                if on_checkpoint is not None:
                    on_checkpoint(int(step), str(path))

    def pass_on_preemption() -> None:
        if preempt_request is None or asked or time.monotonic() < next_poll[0]:
            return
        next_poll[0] = time.monotonic() + PREEMPT_POLL_S
        reason = preempt_request()
        if reason:
            asked.append(reason)
            for i in running.values():
                actors[i].request_preempt.remote(reason)

    def stop_all(i: int, out: dict[str, Any]) -> None:
        """Every replica stops after ``out["step"]`` (the service asked, or each got a SIGTERM): wait for the
        others that trained that step (the first of them checkpoints it); the others (a replacement still
        joining) are dropped."""
        follow.clear()
        stopped.update(step=int(out["step"]), cause=out.get("cause"), ranks=set(noticed))
        if out.get("noticed"):
            stopped["ranks"].add(i)
        drain()
        mask = int(seen.get(stopped["step"], {}).get("replica_mask") or 0)
        wait = [ref for ref, j in running.items() if mask >> j & 1]
        ready, _ = ray.wait(wait, num_returns=len(wait), timeout=FINISH_GRACE_S) if wait else ([], [])
        for ref in ready:
            with contextlib.suppress(Exception):
                if ray.get(ref).get("noticed"):
                    stopped["ranks"].add(running[ref])
        running.clear()

    def replace_preempted(i: int, out: dict[str, Any]) -> None:
        """Replica ``i`` got a SIGTERM and left after step ``out["step"]``: a replacement heals from the others (a
        notice is no failure: ``max_failures`` is not spent)."""
        kill(i)
        incarnation[i] += 1
        noticed.add(i)
        emit(
            "replica_preempted",
            f"replica {i} got a preemption notice ({out.get('noticed') or 'SIGTERM'}) and left after step "
            f"{out['step']}; {len(running)} of {n} replicas go on; a replacement starts and heals from a live peer",
        )
        placed(launch([i], from_storage=False, min_step=int(out["step"])))
        pending[i] = {"replica": i, "lost_step": int(out["step"]), "lost_at": time.time(), "rejoin_s": None}

    def kill_hung() -> None:
        """A live replica that has stayed longer than the hang timeout in a phase of its own (computing, saving:
        not waiting on its peers) makes no progress. It still heartbeats, so torchft keeps counting it: its peers'
        all-reduce fails and their next quorum waits for a majority it is part of. Kill it; its run then ends as a
        lost replica's and is replaced. A replacement still healing is left alone (its heal is a ``quorum``)."""
        limit = hang_limit_s(spec.resources.hang_timeout_s, slowest[0])
        for i in list(running.values()):
            phase, in_phase = phases.get(i, ("", 0.0))
            if i in hung or phase in WAITING or phase == "start" or in_phase <= limit:
                continue
            hung.add(i)
            emit(
                "replica_hung",
                f"replica {i} has been in {phase} for {in_phase:.0f} s, over the hang timeout of {limit:.0f} s "
                f"(resources.hang_timeout_s): hung; it is killed and replaced",
            )
            kill(i)

    try:
        infos = launch(list(range(n)), from_storage=True)
        if on_start is not None:
            on_start(infos)
        resumed = infos[0]["step"]
        if resumed:
            emit("replicas_restored", f"{n} replicas start from the checkpoint of step {resumed} on storage")
        while running:
            done, _ = ray.wait([*running, *follow], num_returns=1, timeout=POLL_S)
            drain()
            kill_hung()
            pass_on_preemption()
            for ref in done:
                if ref in follow:  # a worker of a sharded replica other than its worker 0
                    i = follow.pop(ref)
                    try:
                        ray.get(ref)
                    except (RayActorError, RayTaskError):
                        kill(i)  # its replica is lost with it: handled when worker 0's run() ends
                    continue
                if ref not in running:
                    continue
                i = running.pop(ref)
                try:
                    out = ray.get(ref)
                    if out.get("left") and int(out["step"]) < spec.train.steps:
                        replace_preempted(i, out)
                    elif out.get("preempted"):
                        stop_all(i, out)
                    continue
                except (RayActorError, RayTaskError) as e:
                    if max(seen, default=0) >= spec.train.steps:
                        continue  # every step is committed: what a replica does after that loses nothing
                    if isinstance(e, RayTaskError) and not isinstance(e.cause, NoPeerToHeal):
                        # a replica that raised (a torchft RPC that timed out under load, a peer lost mid-heal) is
                        # lost like one that died, unless no step was committed since the last one raised: the same
                        # error again is the replica's own code (a bad model, bad data), which no replacement fixes
                        if raised_at == max(seen, default=0):
                            raise
                        raised_at = max(seen, default=0)
                    kill(i)
                    lost_at = time.time()
                    step = max(seen, default=0)
                    spent = budget != -1 and restarts >= budget
                    alive = len(running)
                    rec: dict[str, Any] = {"replica": i, "lost_step": step, "lost_at": lost_at}
                    if alive == 0:  # nobody to heal from: every replica from storage (a failure of its own)
                        if spent:
                            raise RuntimeError(
                                f"every replica lost (replica {i} last, at step {step + 1}) after {restarts} "
                                f"replacement(s) (resources.max_failures={budget}): {type(e).__name__}"
                            ) from e
                        restarts += 1
                        restores += 1
                        for j in range(n):
                            kill(j)
                            incarnation[j] += 1
                        gone.clear()
                        back = launch(list(range(n)), from_storage=True)[0]["step"]
                        for k in [k for k in seen if k > back]:
                            del seen[k]  # trained again: their new rows replace the old ones
                        pending.clear()
                        where = f"the checkpoint of step {back}" if back else "step 0 (no checkpoint on storage)"
                        emit("replicas_restored", f"every replica lost (replica {i} last); all restart from {where}")
                        continue
                    if spent:  # no replacement left: the others go on while they are enough for a quorum
                        gone.add(i)
                        if alive < ft.min_replicas:
                            raise RuntimeError(
                                f"replica {i} lost at step {step + 1}: {alive} left, fewer than "
                                f"fault_tolerance.min_replicas={ft.min_replicas}, and no replacement left "
                                f"(resources.max_failures={budget})"
                            ) from e
                        emit(
                            "replica_lost",
                            f"replica {i} lost at step {step + 1} ({type(e).__name__}); {alive} of {n} replicas go "
                            f"on without a replacement (resources.max_failures={budget} spent)",
                        )
                        recoveries.append({**rec, "rejoin_s": None})
                        continue
                    restarts += 1
                    incarnation[i] += 1
                    rec["incarnation"] = incarnation[i]
                    emit(
                        "replica_lost",
                        f"replica {i} lost at step {step + 1} ({type(e).__name__}); {alive} of {n} replicas go on; "
                        f"replacement {restarts}"
                        + (f" of {budget}" if budget != -1 else "")
                        + " starts and heals from a live peer",
                    )
                    t_start = time.time()
                    placed(launch([i], from_storage=False, min_step=step))  # the replacement, as the attempt's ranks
                    rec.update(detect_s=t_start - lost_at, restart_s=time.time() - t_start, rejoin_s=None)
                    recoveries.append(rec)
                    pending[i] = rec
            if max(seen, default=0) >= spec.train.steps and running:
                _finish(running, seen[max(seen)])
                follow.clear()
        drain()
    finally:
        for i in list(group):
            kill(i)
        server.shutdown()
    ordered = [seen[k]["loss"] for k in sorted(seen)]
    return {
        "steps_done": max(seen, default=0),
        "final_loss": ordered[-1] if ordered else None,
        "losses": ordered,
        "wall_time_s": time.time() - t0,
        "replica_restarts": restarts,
        "replica_restores": restores,
        "replica_recoveries": [
            {k: (round(v, 3) if isinstance(v, float) else v) for k, v in rec.items() if k != "lost_at"}
            for rec in recoveries
        ],
        "min_replicas_seen": min((r["replicas"] for r in seen.values()), default=None),
        "replicas_gone": sorted(gone),
        "host": socket.gethostname(),
        **(
            {
                "preempted": True,
                "preempt_cause": stopped.get("cause"),
                "preempted_ranks": sorted(stopped.get("ranks", ())),
                "last_checkpoint": last_saved[0] if last_saved else None,
            }
            if "step" in stopped
            else {}
        ),
    }

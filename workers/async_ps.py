"""``layout.sync: async_ps``: workers and their supervisor around the parameter servers of ``workers.ps``.

``run_async_ps(spec, plan, sink=...)`` runs on a Ray driver (the run's Ray Job, or a test) and:

1. builds the model once (seeded, as every synchronous rank would) and starts ``ps_shards`` ``ParameterServer``
   actors with its parameters split between them;
2. starts ``dp`` ``PSWorker`` actors (no torch process group: nothing ties the workers together); worker ``i``
   trains on data-parallel shard ``i`` of each step's global batch, so with ``max_staleness: 0`` the run is
   synchronous data parallelism;
3. forwards server 0's rows (one per parameter update) to ``sink``;
4. when a worker dies (its process is killed, its node is lost), removes it from the servers (the next updates
   go on without it) and starts a replacement that rejoins from the servers' current parameters, up to
   ``resources.max_failures`` times (-1: always; 0: the run still goes on with the workers left);
5. with ``ckpt_dir``, the servers checkpoint their shards every ``checkpoint.every_steps`` updates
   (``workers.ps_checkpoint``); when a server dies (a worker's push or pull fails on it, or a periodic probe
   finds it dead), every server and worker is restarted: the servers from the latest complete checkpoint (all
   shards at the same step N), the workers from step N + 1, re-pulling the parameters (``on_ps_restored``).

A worker's step ``t``: use its parameters if their version is ``>= t - 1 - max_staleness`` (taking a newer copy
if a pull started earlier has arrived), else wait for a pull of that version; forward/backward over its
micro-batches; push the gradient (split by server) without waiting, and start the next pull. At most
``max_staleness + 1`` pushes are in flight.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import ray
import torch
from ray.exceptions import RayActorError, RayTaskError

from api.spec import Plan, RunSpec
from api.spec.run import PSFault
from workers.data import build_batches
from workers.diagnostics import FaultInjector, RankState
from workers.models import build_model, materialize
from workers.ps import ParameterServer, split_params
from workers.ps_checkpoint import latest_complete

log = logging.getLogger(__name__)

POLL_S = 0.2
PROBE_S = 10.0  # a server's answer to a liveness probe (a busy one only delays it)
PROBE_EVERY_S = 2.0  # servers probed this often even when no push or pull failed


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


@ray.remote
class PSWorker:
    def __init__(self, index: int, incarnation: int, spec_json: str, plan_json: str, servers: list[Any]) -> None:
        torch.set_num_threads(1)
        self.index, self.incarnation = index, incarnation
        self.spec = spec = RunSpec.model_validate_json(spec_json)
        self.plan = plan = Plan.model_validate_json(plan_json)
        self.servers = servers
        torch.manual_seed(spec.train.seed)
        self.model = materialize(build_model(plan.model, device="meta"), device="cpu", seed=spec.train.seed)
        self.params = [p for p in self.model.parameters()]
        self.split = split_params([p.numel() for p in self.params], len(servers))
        self.batches = build_batches(
            spec.data,
            seq_len=plan.model.seq_len,
            vocab_size=plan.model.vocab_size,
            seed=spec.train.seed,
            global_batch_size=plan.global_batch_size,
            micro_batch_size=plan.micro_batch_size,
            dp_rank=index,
            dp_size=plan.dp,
        )
        state = RankState(rank=index, world_size=plan.dp, run_id="async_ps", attempt=incarnation)
        self.faults = FaultInjector(spec.faults, rank=index, attempt=incarnation, state=state)

    def _pull(self, min_version: int) -> list[Any]:
        return [s.pull.remote(min_version) for s in self.servers]

    def _load(self, got: list[tuple[int, torch.Tensor]]) -> tuple[int, int]:
        """Copy pulled shards into the model; returns (version, bytes)."""
        version = min(v for v, _ in got)
        nbytes = 0
        with torch.no_grad():
            for idx, (_, flat) in zip(self.split, got):
                off = 0
                for i in idx:
                    p = self.params[i]
                    p.copy_(flat[off : off + p.numel()].view_as(p))
                    off += p.numel()
                nbytes += flat.numel() * flat.element_size()
        return version, nbytes

    def run(self, first_step: int) -> dict[str, Any]:
        spec = self.spec
        s, last = spec.layout.max_staleness, spec.train.steps
        version, nbytes = self._load(ray.get(self._pull(first_step - 1 - s)))
        inflight_pull = self._pull(version + 1) if s > 0 else None
        pushes: list[Any] = []
        max_stale = 0
        for step in range(first_step, last + 1):
            self.faults.before_step(step)
            need = step - 1 - s
            if inflight_pull is not None:
                ready, _ = ray.wait(inflight_pull, num_returns=len(inflight_pull), timeout=0)
                if len(ready) == len(inflight_pull) or version < need:
                    v, b = self._load(ray.get(inflight_pull))
                    version, nbytes = max(version, v), nbytes + b
                    inflight_pull = self._pull(version + 1) if version < last else None
            if version < need:
                v, b = self._load(ray.get(self._pull(need)))
                version, nbytes = v, nbytes + b
            max_stale = max(max_stale, step - 1 - version)
            self.faults.in_compute(step)
            micro = self.batches.micro_batches(step - 1)
            loss_sum = 0.0
            for p in self.params:
                p.grad = None
            for x, y in micro:
                logits = self.model(x)
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten(0, 1)) / len(micro)
                loss.backward()
                loss_sum += float(loss.detach())
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
            tokens = sum(int(x.numel()) for x, _ in micro)
            info = {"loss": loss_sum, "tokens": float(tokens), "bytes": 0.0}
            parts = [_flat([grads[i] for i in idx]) for idx in self.split]
            info["bytes"] = float(nbytes + sum(g.numel() * g.element_size() for g in parts))
            nbytes = 0
            pushes += [srv.push.remote(self.index, step, g, version, info) for srv, g in zip(self.servers, parts)]
            while len(pushes) > (s + 1) * len(self.servers):  # bound the pushes in flight
                ray.get(pushes.pop(0))
            if s == 0:  # synchronous: the next step needs this update, pull it now
                continue
            if inflight_pull is None and version < last:
                inflight_pull = self._pull(version + 1)
        ray.get(pushes)
        return {"worker": self.index, "incarnation": self.incarnation, "max_staleness": max_stale}


def _initial_params(spec: RunSpec, plan: Plan) -> list[torch.Tensor]:
    """The seeded model's parameters (as every synchronous rank would build them)."""
    torch.manual_seed(spec.train.seed)
    model = materialize(build_model(plan.model, device="meta"), device="cpu", seed=spec.train.seed)
    return [p.detach() for p in model.parameters()]


def _start_servers(
    spec: RunSpec,
    plan: Plan,
    split: list[list[int]],
    members: list[int],
    ckpt_dir: str | None,
    step: int,
    kill_ps: PSFault | None = None,
) -> list[Any]:
    """``ps_shards`` servers: from the initial parameters (``step`` 0) or from their checkpoint of ``step``;
    ``kill_ps``: the server it names dies once it has applied that update (the first servers only)."""
    spec_json = spec.model_dump_json()
    if step == 0:
        params = _initial_params(spec, plan)
        shards: list[list[torch.Tensor] | None] = [[params[i] for i in idx] for idx in split]
    else:
        shards = [None] * len(split)
    return [
        ParameterServer.remote(  # type: ignore[attr-defined]
            k, spec_json, shard, members, ckpt_dir, step, kill_ps.at_step if kill_ps and kill_ps.shard == k else None
        )
        for k, shard in enumerate(shards)
    ]


def _dead_servers(servers: list[Any]) -> list[int]:
    """Servers whose actor is dead (a busy one, writing a checkpoint, is not)."""
    pings = {s.state.remote(): k for k, s in enumerate(servers)}
    ready, _ = ray.wait(list(pings), num_returns=len(pings), timeout=PROBE_S)
    dead = []
    for ref in ready:
        try:
            ray.get(ref)
        except RayActorError:
            dead.append(pings[ref])
    return sorted(dead)


def run_async_ps(
    spec: RunSpec,
    plan: Plan,
    *,
    sink: Callable[[dict[str, Any]], None] | None = None,
    worker_options: dict[str, Any] | None = None,
    on_worker_lost: Callable[[int, str], None] | None = None,
    ckpt_dir: str | None = None,
    on_ps_restored: Callable[[list[int], int, str], None] | None = None,
) -> dict[str, Any]:
    """Train ``spec`` with parameter servers on the connected Ray cluster; returns the run's summary.

    With ``ckpt_dir`` the servers checkpoint every ``checkpoint.every_steps`` updates; a lost server (its actor
    died: a worker's push or pull failed on it, or a probe did) restarts EVERY server from the latest complete
    checkpoint (step 0, the initial parameters, without one) and every worker from the step after it, and calls
    ``on_ps_restored(lost_servers, step, text)``. Up to ``resources.max_failures`` times (-1: always; 0: once)."""
    lay = spec.layout
    split = split_params([p.numel() for p in _initial_params(spec, plan)], lay.ps_shards)
    spec_json, plan_json = spec.model_dump_json(), plan.model_dump_json()
    workers = list(range(plan.dp))
    servers = _start_servers(spec, plan, split, workers, ckpt_dir, 0, spec.faults.kill_ps if spec.faults else None)
    opts = {"num_cpus": spec.resources.cpus_per_worker, **(worker_options or {})}
    incarnation = dict.fromkeys(workers, 1)
    actors = {w: PSWorker.options(**opts).remote(w, 1, spec_json, plan_json, servers) for w in workers}  # type: ignore[attr-defined]
    running = {actors[w].run.remote(1): w for w in workers}
    losses: dict[int, float] = {}
    rows_total = 0
    restarts, lost = 0, []
    gone: set[int] = set()  # lost workers without a replacement (max_failures spent)
    restores: list[dict[str, Any]] = []
    budget = spec.resources.max_failures
    ps_budget = -1 if budget == -1 else max(budget, 1)
    t0 = last_probe = time.time()

    def drain() -> None:
        nonlocal rows_total
        for row in ray.get(servers[0].take_rows.remote()):
            rows_total += 1
            if row.get("loss") is not None:
                losses[int(row["step"])] = float(row["loss"])
            if sink is not None:
                sink(row)

    def restore(dead: list[int]) -> None:
        nonlocal servers
        if ps_budget != -1 and len(restores) >= ps_budget:
            raise RuntimeError(f"parameter server(s) {dead} lost after {len(restores)} restore(s) (max_failures)")
        members = [w for w in workers if w not in gone]
        for a in [*actors.values(), *servers]:
            ray.kill(a)
        running.clear()
        step = latest_complete(ckpt_dir, lay.ps_shards)
        servers = _start_servers(spec, plan, split, members, ckpt_dir, step)
        for w in members:
            incarnation[w] += 1
            actors[w] = PSWorker.options(**opts).remote(w, incarnation[w], spec_json, plan_json, servers)  # type: ignore[attr-defined]
            running[actors[w].run.remote(step + 1)] = w
        where = f"the checkpoint of step {step}" if step else "the initial parameters (step 0: no checkpoint yet)"
        text = (
            f"parameter server {', '.join(map(str, dead))} lost; all {lay.ps_shards} server(s) restored from {where}, "
            f"the workers re-pull and train again from step {step + 1}"
        )
        log.warning("async_ps: %s", text)
        restores.append({"servers": dead, "step": step})
        if on_ps_restored is not None:
            on_ps_restored(dead, step, text)

    try:
        while running:
            done, _ = ray.wait(list(running), num_returns=1, timeout=POLL_S)
            suspect, known_dead = False, set()
            try:
                drain()
            except RayActorError:
                suspect = True
            for ref in done:
                if ref not in running:
                    continue  # a restore replaced it
                w = running.pop(ref)
                try:
                    ray.get(ref)
                except RayActorError as e:
                    # the worker died, or its push/pull found a server dead (Ray may raise that ActorDiedError
                    # as it is, or wrapped in the worker's RayTaskError): the servers say which
                    hit = {x._actor_id.hex(): k for k, x in enumerate(servers)}.get(getattr(e, "actor_id", None) or "")
                    if hit is not None or _dead_servers(servers):
                        running[ref] = w  # restarted below with the others
                        suspect = True
                        known_dead.update([] if hit is None else [hit])
                        continue
                    if isinstance(e, RayTaskError):
                        raise
                    reason = f"worker {w} (incarnation {incarnation[w]}) lost: {type(e).__name__}"
                    log.warning("async_ps: %s; the run goes on without it", reason)
                    lost.append(w)
                    try:
                        ray.get([s.remove_worker.remote(w) for s in servers])
                    except RayActorError:  # a server died too: the restore below restarts everyone
                        suspect = True
                        continue
                    if on_worker_lost is not None:
                        on_worker_lost(w, reason)
                    if budget == -1 or restarts < budget:
                        restarts += 1
                        incarnation[w] += 1
                        first = max(ray.get([s.max_step_pushed.remote() for s in servers])) + 1
                        if first <= spec.train.steps:
                            ray.get([s.add_worker.remote(w, first) for s in servers])
                            actors[w] = PSWorker.options(**opts).remote(  # type: ignore[attr-defined]
                                w, incarnation[w], spec_json, plan_json, servers
                            )
                            running[actors[w].run.remote(first)] = w
                            log.info("async_ps: worker %d rejoins at step %d", w, first)
                    else:
                        gone.add(w)
            if suspect or time.time() - last_probe > PROBE_EVERY_S:
                last_probe = time.time()
                dead = sorted(known_dead | set(_dead_servers(servers)))
                if dead:
                    restore(dead)
        drain()
        state = ray.get(servers[0].state.remote())
        final = [ray.get(s.params_flat.remote()) for s in servers]
    finally:
        for a in [*actors.values(), *servers]:
            ray.kill(a)
    ordered = [losses[k] for k in sorted(losses)]
    return {
        "steps_done": state["version"],
        "final_loss": ordered[-1] if ordered else None,
        "losses": ordered,
        "rows": rows_total,
        "wall_time_s": time.time() - t0,
        "max_staleness": state["max_staleness"],
        "workers_lost": lost,
        "workers_restarted": restarts,
        "ps_restores": restores,
        "final_params": final,
        "split": split,
    }

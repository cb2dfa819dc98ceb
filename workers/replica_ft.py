"""``fault_tolerance.mode: replica``: data-parallel replicas that keep training when one of them dies.

Each replica is one Ray actor (``ReplicaWorker``) with a whole copy of the model and the optimizer, or, with HSDP
(``zero_stage`` 2/3, ``shard_group_size`` < dp), ``shard_group_size`` actors that shard them with FSDP2 over a
process group of their own (``workers.replica_shard``; worker j of every replica is then tied to worker j of the
others). The replicas are tied together by torchft (pinned: ``torchft==0.2.0``), not by one torch process group:

- the driver (``workers.replica_driver.run_replicas``) runs torchft's Rust ``LighthouseServer``; every replica
  runs a torchft ``Manager`` (its own ``TCPStore``, a reconfigurable gloo process group, NCCL on GPUs) that asks
  the lighthouse for a quorum at the start of every step: the replicas alive now;
- a step: forward/backward over this replica's share of the global batch, one all-reduce of the flattened
  gradients (and the loss) inside the quorum, then ``should_commit``: the optimizer steps only if every participant
  got through the step; a step that failed (a peer died in the all-reduce) is trained again in the next quorum;
- ``batch: keep`` (default): the global batch is cut into ``dp`` shards as in DDP and the live replicas share all of
  them (participant r of q trains the shards s with s % q == r, each weighted q/dp before the average), so every
  step sees the same samples with the same weights whatever the quorum: the losses are those of the unfaulted run.
  ``batch: shrink`` (torchft's default): replica i trains shard i only, averaged over the participants;
- when a replica dies, the driver sees its actor die, starts a replacement (``resources.max_failures`` of them,
  -1 unlimited; with none left the others go on without it while they are at least ``min_replicas``): it joins
  the next quorum behind the others and heals from a live peer's in-memory state
  (torchft's checkpoint transport: model, optimizer, LR schedule, step), never from storage. Only when every
  replica is gone does the driver restart them all from the newest checkpoint on storage (a failure too);
- ``checkpoint.every_steps``: participant 0 writes the state (``torch.save``, atomically) under ``ckpt_dir``; a new
  driver of the run (a resume) starts every replica from the newest one.

Every committed step is recorded exactly once: every participant buffers its row, the driver forwards a step the
first time it sees it. Rows carry ``replicas`` (the quorum size of that step) and ``samples``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import time
from datetime import timedelta
from pathlib import Path
from threading import Lock
from typing import Any

import ray
import torch

from api.spec import Plan, RunSpec
from workers import preemption  # its NOTICE by module: a Ray actor class pickles the globals it names
from workers.data import StepBatches, make_source
from workers.diagnostics import FaultInjector, RankState
from workers.models import build_model, materialize
from workers.optim import build_optimizer, build_scheduler
from workers.parallelize import clip_grad_norm_
from workers.periodic import outer_optimizer
from workers.replica_quorum import NoPeerToHeal, shards_of
from workers.replica_rounds import run_rounds
from workers.replica_shard import ShardGroup, flat_local, load_local, local, state_file, to_local
from workers.step import loss_fn

log = logging.getLogger(__name__)

JOIN_TIMEOUT_MS = 30000  # how long a quorum waits for a replica that heartbeats but has not asked to join
COLLECTIVE_TIMEOUT_S = 60.0  # an all-reduce waiting this long on a silent peer fails the step (not the replica)
CKPT_RE = re.compile(r"^step_(\d{8})$")
PERIODIC = ("local_sgd", "diloco")


def node_ip() -> str:
    try:
        return str(ray.util.get_node_ip_address())
    except Exception:
        return "127.0.0.1"


def latest_checkpoint(ckpt_dir: str | None) -> Path | None:
    """The newest complete replica checkpoint under ``ckpt_dir``: a ``step_XXXXXXXX`` directory holding the state
    (written under another name, then renamed: no partial checkpoint is ever listed)."""
    if not ckpt_dir or not Path(ckpt_dir).is_dir():
        return None
    found = sorted(p for p in Path(ckpt_dir).iterdir() if CKPT_RE.match(p.name) and (p / state_file(0)).is_file())
    return found[-1] if found else None


@ray.remote
class ReplicaWorker:
    """One data-parallel replica (or worker ``rank`` of an HSDP replica): model, optimizer, LR schedule, data shards
    and a torchft Manager."""

    def __init__(
        self,
        index: int,
        incarnation: int,
        spec_json: str,
        plan_json: str,
        ckpt_dir: str | None,
        from_storage: bool,
        rank: int = 0,
    ) -> None:
        self.index, self.incarnation = index, incarnation
        self.spec = spec = RunSpec.model_validate_json(spec_json)
        self.plan = plan = Plan.model_validate_json(plan_json)
        # HSDP in replica mode: ``size`` workers per replica shard the model (``workers.replica_shard``); this is
        # worker ``rank`` of replica ``index``, global rank index * size + rank
        self.rank, self.size, self.replicas = rank, plan.layout.dp_shard, plan.layout.dp_replicate
        torch.set_num_threads(max(1, int(spec.resources.cpus_per_worker)))
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if plan.device == "cuda" else torch.device("cpu")
        )
        torch.manual_seed(spec.train.seed)
        self.model = materialize(build_model(plan.model, device="meta"), device=self.device, seed=spec.train.seed)
        src = make_source(spec.data, seq_len=plan.model.seq_len, vocab_size=plan.model.vocab_size, seed=spec.train.seed)
        self.batches = [  # replica share s of the global batch: this worker's slice of it (a DDP/HSDP dp rank's)
            StepBatches(
                src,
                global_batch_size=plan.global_batch_size,
                micro_batch_size=plan.micro_batch_size,
                dp_rank=s * self.size + rank,
                dp_size=plan.dp,
                seed=spec.train.seed,
            )
            for s in range(self.replicas)
        ]
        self.ckpt_dir, self.from_storage = ckpt_dir, from_storage
        self.restored_step = 0
        self.periodic = spec.layout.sync in PERIODIC  # local SGD / DiLoCo rounds (``workers.replica_rounds``)
        state = RankState(rank=index * self.size + rank, world_size=plan.dp, run_id="replica", attempt=incarnation)
        self.faults = FaultInjector(spec.faults, rank=index * self.size + rank, attempt=incarnation, state=state)
        self.rows: list[dict[str, Any]] = []
        self.saved: list[tuple[int, str]] = []  # checkpoints written, not yet taken by the driver
        self.lock = Lock()
        self.manager: Any = None
        self.shards: ShardGroup | None = None
        self.healed_from_peer = False
        self.rejoining = incarnation > 1 and not from_storage  # a replacement: its first step waits for its heal
        self.phase, self.phase_t = "start", time.monotonic()  # where run() is, and since when (``take_rows``)
        self.stop_cause: str | None = None  # the service wants every replica's workers back (``request_preempt``)
        self.leave_armed = False  # its SIGTERM vote was counted in a committed step (``_preemption``)
        preemption.NOTICE.reset()
        preemption.install(preemption.NOTICE)  # SIGTERM = a notice; a threaded actor's __init__ is on its main thread

    def _setup(self) -> None:
        """The optimizer, the LR schedule and the periodic modes' anchor (after FSDP sharded the model), then the
        newest checkpoint on storage when this replica starts from it."""
        spec = self.spec
        self.optimizer = build_optimizer([self.model], spec, self.plan)
        self.scheduler = build_scheduler(self.optimizer, spec)
        if self.periodic:
            with torch.no_grad():
                self.anchor = [p.detach().clone().float() for p in self.model.parameters() if p.requires_grad]
            self.outer = outer_optimizer(self.anchor, spec)
            self.steps_done = 0  # the steps of the committed rounds (torchft's step counts rounds)
            self.divergences: list[float] = []
        if self.from_storage and (path := latest_checkpoint(self.ckpt_dir)) is not None:
            state = torch.load(path / state_file(self.rank), map_location=self.device, weights_only=False)
            self._load({k: v for k, v in state.items() if k != "torchft"})
            self.restored_step = self.steps_done if self.periodic else int(state["torchft"]["step"])
            self._restored_torchft = state["torchft"]

    def _enter(self, phase: str) -> None:
        self.phase, self.phase_t = phase, time.monotonic()

    # ------------------------------------------------------------------ state shared with peers
    def _state(self) -> dict[str, Any]:
        """This worker's state (its shards when the replica is sharded: ``replica_shard.to_local``)."""
        state: dict[str, Any] = {
            "model": to_local(self.model.state_dict()),
            "optim": to_local(self.optimizer.state_dict()),
            "sched": self.scheduler.state_dict(),
        }
        if self.periodic:  # the round's anchor and the outer optimizer, and how far the committed rounds got
            state.update(anchor=self.anchor, outer=self.outer.state_dict(), steps_done=self.steps_done)
        return state

    def _load(self, state: dict[str, Any]) -> None:
        load_local(self.model, self.optimizer, state["model"], state["optim"])
        self.scheduler.load_state_dict(state["sched"])
        if self.periodic:
            with torch.no_grad():
                for a, v in zip(self.anchor, state["anchor"]):
                    a.copy_(v)
            self.outer.load_state_dict(state["outer"])
            self.steps_done = int(state["steps_done"])

    def _heal(self, state: dict[str, Any]) -> None:
        self._load(state)
        self.healed_from_peer = True

    def open_store(self) -> tuple[str, int]:
        """Worker 0 of the replica: the replica's ``TCPStore`` (torchft's Manager and the replica's process group
        meet on it); its address for every worker's ``ready``."""
        ip = node_ip()
        self.store = torch.distributed.TCPStore(host_name=ip, port=0, is_master=True, wait_for_workers=False)
        return ip, int(self.store.port)

    def ready(self, lighthouse: str, store_host: str, store_port: int) -> dict[str, Any]:
        """Join the replica's process group and shard the model over it (several workers per replica), build the
        optimizer, then start this worker's torchft Manager (the replica heartbeats to the lighthouse from now
        on). Every worker of the replica calls it at once: each waits for the others."""
        from torchft import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        ip = node_ip()
        if self.rank:
            self.store = torch.distributed.TCPStore(
                host_name=store_host, port=store_port, is_master=False, wait_for_workers=False
            )
        if self.size > 1:
            self.shards = ShardGroup(self.store, self.rank, self.size, self.device)
            self.model = self.shards.shard(self.model, self.plan)
        self._setup()
        timeout = timedelta(seconds=timeouts(self.spec)[0])
        pg = ProcessGroupNCCL(timeout=timeout) if self.device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        self.manager = Manager(
            pg=pg,
            load_state_dict=self._heal,
            state_dict=self._state,
            min_replica_size=self.spec.fault_tolerance.min_replicas,
            use_async_quorum=False,  # heal before the forward pass: a replica that joins trains this very step
            timeout=timeout,
            quorum_timeout=timedelta(seconds=120),
            connect_timeout=timedelta(seconds=30),
            rank=self.rank,  # worker j of every replica: one cross-replica group of torchft (HSDP's replicate dim)
            world_size=self.size,
            store_addr=store_host,
            store_port=store_port,
            lighthouse_addr=lighthouse,
            replica_id=f"replica_{self.index}",
            hostname=ip,
            init_sync=False,  # every replica builds the same seeded model
        )
        if self.restored_step:
            self.manager.load_state_dict(self._restored_torchft)
        if not self.rank:
            announce(lighthouse, self.store)
        return {
            "rank": self.index * self.size + self.rank,
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
            "local_rank": self.rank,
            "host": os.uname().nodename,
            "step": self.restored_step,
        }

    def request_preempt(self, reason: str) -> None:
        """The service wants the run's workers back: every replica stops after the same committed step, which the
        quorum's first replica checkpoints (``run`` returns ``preempted``)."""
        self.stop_cause = reason

    def take_rows(self) -> dict[str, Any]:
        """The committed steps' rows and the checkpoints written since the last call, and the phase ``run()`` is in
        (``quorum``, ``compute``, ``allreduce``, ``commit``, ``save``) with how long it has been there."""
        with self.lock:
            rows, saved, self.rows, self.saved = self.rows, self.saved, [], []
        return {"rows": rows, "saved": saved, "phase": self.phase, "phase_s": time.monotonic() - self.phase_t}

    # ------------------------------------------------------------------ training
    def run(self, min_step: int = 0) -> dict[str, Any]:
        """Train until ``train.steps`` are committed. ``min_step``: a replacement must heal to at least that step
        (else it would restart training alone from its initial state: ``NoPeerToHeal``)."""
        if self.periodic:
            return run_rounds(self, min_step)
        spec, plan, mgr = self.spec, self.plan, self.manager
        ft = spec.fault_tolerance
        params = [p for p in self.model.parameters() if p.requires_grad]
        autocast = (
            torch.autocast(self.device.type, dtype=torch.bfloat16)
            if spec.precision == "bf16"
            else contextlib.nullcontext()
        )
        shard_samples = plan.global_batch_size // self.replicas
        first_step: int | None = None
        failed_steps = 0
        failed_since: float | None = None
        prev_q: int | None = None
        while mgr.current_step() < spec.train.steps:
            t0 = time.perf_counter()
            self.faults.before_step(mgr.current_step() + 1)
            self._enter("quorum")
            mgr.start_quorum()
            tq = time.perf_counter()
            step = mgr.current_step() + 1  # after a heal: the peers' step
            if first_step is None and step <= min_step:
                raise NoPeerToHeal(f"replica {self.index} is at step {step - 1} with no live peer at step {min_step}")
            first_step = step if first_step is None else first_step
            q, r = mgr.num_participants(), mgr.participating_rank()
            mine = shards_of(r, q, self.replicas, self.index, ft.batch)
            weight = q / self.replicas if ft.batch == "keep" else 1.0
            self._enter("compute")
            self.faults.in_compute(step)
            loss = self.backward(step, mine, weight, autocast)  # sharded: FSDP averages the gradients in the replica
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            noticed = preemption.NOTICE.requested and r is not None  # what this replica votes (``_preemption``)
            loss, stop, noticed = self._agree(loss, self.stop_cause is not None, noticed)
            me = torch.zeros(self.replicas, device=self.device)  # who trained this step (a one-hot, summed below)
            me[self.index] = 1.0 if r is not None else 0.0
            votes = torch.tensor([float(stop), float(noticed)], device=self.device)
            flat = torch.cat([flat_local(grads), loss.reshape(1), me, votes])
            self._enter("allreduce")
            mgr.allreduce(flat).wait()  # averaged over the participants (worker j's shards with worker j's)
            self._enter("compute")
            tail = (flat[-self.replicas - 2 :] * max(q, 1)).round().tolist()
            who, (stops, leaving) = tail[: self.replicas], tail[self.replicas :]
            mask = sum(1 << i for i, v in enumerate(who) if v > 0)
            flat = flat[: -self.replicas - 2]
            off = 0
            with torch.no_grad():
                for p, g in zip(params, grads):
                    mine_g = local(g)
                    n = mine_g.numel()
                    mine_g.copy_(flat[off : off + n].view_as(mine_g))
                    p.grad = g
                    off += n
            grad_norm = clip_grad_norm_(params, spec.optimizer.grad_clip)
            lr = self.optimizer.param_groups[0]["lr"]
            self._enter("commit")
            committed = mgr.should_commit()
            self._enter("compute")
            if committed:
                self.optimizer.step()
                self.scheduler.step()
                # a quorum that lost a replica (or failed tries) or gained one: its wait is recovery, not step time
                shrank = failed_since is not None or (prev_q is not None and q < prev_q)
                grew = (prev_q is not None and q > prev_q) or (prev_q is None and self.rejoining)
                began = failed_since if failed_since is not None else t0
                dt = time.perf_counter() - (tq if shrank or grew else t0)
                samples = plan.global_batch_size if ft.batch == "keep" else q * shard_samples
                row = {
                    "step": step,
                    "loss": float(flat[-1]),
                    "step_time_s": dt,
                    "tokens_per_s": samples * plan.model.seq_len / dt if dt > 0 else None,
                    "lr": lr,
                    "grad_norm": float(grad_norm),
                    "replicas": q,
                    "replica_mask": mask,  # bit i: replica i trained this step
                    "samples": samples,
                    "time": time.time(),
                }
                if shrank:  # a peer lost: failed tries and the wait for a quorum without it (failure detection)
                    row["recovery_s"] = tq - began
                elif grew:  # a replacement joined: the wait while it healed from a peer
                    row["rejoin_s"] = tq - began
                failed_since, prev_q = None, q
                if self.rank == 0:  # the replica's row (its other workers have the same)
                    with self.lock:
                        self.rows.append(row)
                periodic = bool(spec.checkpoint.every_steps) and step % spec.checkpoint.every_steps == 0
                leave = self._preemption(stops, leaving, q, noticed)
                if r == 0 and (periodic or leave == "preempted"):
                    self._enter("save")
                    self._save(step)
                if leave is not None:
                    self.optimizer.zero_grad(set_to_none=True)
                    return self._left(leave, step, first_step, failed_steps)
            else:
                failed_steps += 1
                failed_since = t0 if failed_since is None else failed_since
            self.optimizer.zero_grad(set_to_none=True)
        preemption.NOTICE.finish()  # a SIGTERM from now on is the actor's shutdown
        return self.result(first_step, failed_steps)

    def _agree(self, loss: torch.Tensor, stop: bool, noticed: bool) -> tuple[torch.Tensor, bool, bool]:
        """A sharded replica's workers agree on the step's loss (their mean) and on its votes (any worker's):
        every worker of a replica then adds the same values to the cross-replica all-reduce."""
        if self.shards is None:
            return loss, stop, noticed
        t = torch.tensor([float(loss), float(stop), float(noticed)], device=self.device)
        got = self.shards.sum(t).tolist()
        return torch.tensor(got[0] / self.size, device=self.device), got[1] > 0, got[2] > 0

    def backward(self, step: int, shards: list[int], scale: float, autocast: Any) -> torch.Tensor:
        """Forward and backward over ``shards`` of ``step``'s global batch, each micro-batch's loss scaled by
        ``scale`` over the shard's micro-batch count (gradients accumulate); returns the summed scaled loss."""
        loss = torch.zeros((), device=self.device)
        for s in shards:
            micro = self.batches[s].micro_batches(step - 1)
            for x, y in micro:
                x, y = x.to(self.device), y.to(self.device)
                with autocast:
                    logits = self.model(x)
                part = loss_fn(logits, y) * (scale / len(micro))
                part.backward()
                loss += part.detach().float()
        return loss

    def result(self, first_step: int | None, failed: int, **more: Any) -> dict[str, Any]:
        """What ``run`` returns: this replica, where it started, whether it healed from a peer, its failed tries."""
        return {
            "replica": self.index,
            "incarnation": self.incarnation,
            "first_step": first_step,
            "healed_from_peer": self.healed_from_peer,
            "failed_steps": failed,
            **more,
        }

    def _preemption(self, stops: float, leaving: float, participants: int, noticed: bool) -> str | None:
        """After a committed step, from the votes summed in its all-reduce (what every participant got alike) and
        this replica's own vote (``noticed``: it had a SIGTERM): ``preempted`` (the service asked, or every
        participant had a SIGTERM: all stop after this step, which the first one checkpoints), ``left`` (this
        replica had one, some others did not: it leaves, they go on and a replacement heals from them) or None
        (train on). A replica leaves one step after its vote was first counted: SIGTERMs sent to every replica at
        once (a node drained) may reach them on either side of a step's all-reduce, and that step gives each one
        the chance to vote, so that they stop together instead of leaving one by one."""
        if stops > 0 or (leaving > 0 and leaving >= participants):
            return "preempted"
        if not noticed:
            return None
        if self.leave_armed:
            return "left"
        self.leave_armed = True
        return None

    def _left(self, how: str, step: int, first_step: int | None, failed_steps: int) -> dict[str, Any]:
        """``run``'s result when it stops for a preemption after ``step`` (``_preemption``)."""
        preemption.NOTICE.finish()  # done in time: no forced exit
        if how == "left" and self.manager is not None:
            self.manager.shutdown(wait=False)  # its heartbeat stops: the peers' next quorum goes on without it
        more = {how: True, "step": step, "cause": self.stop_cause, "noticed": preemption.NOTICE.cause}
        return self.result(first_step, failed_steps, **more)

    def _save(self, step: int) -> None:
        """The replica state at ``step`` in ``step_XXXXXXXX/`` (a temporary directory renamed when complete: a
        crash never leaves a listed partial checkpoint); keeps the newest ``checkpoint.keep``. A sharded replica:
        every worker writes its shards (``state_file(rank)``), worker 0 renames once all have."""
        if not self.ckpt_dir:
            return
        d = Path(self.ckpt_dir)
        tmp = d / f".step_{step:08d}.{self.index}.{self.incarnation}.tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        torch.save({**self._state(), "torchft": self.manager.state_dict()}, tmp / state_file(self.rank))
        if self.shards is not None:
            self.shards.barrier()
        if self.rank:
            return
        final = d / f"step_{step:08d}"
        if final.exists():  # the same step saved before a restore from storage: replace it
            shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        with self.lock:
            self.saved.append((step, str(final)))
        for old in sorted(p for p in d.iterdir() if CKPT_RE.match(p.name))[: -self.spec.checkpoint.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def shutdown(self) -> None:
        if self.manager is not None:
            self.manager.shutdown(wait=False)
        if self.shards is not None:
            self.shards.close()


def announce(lighthouse: str, store: Any) -> None:
    """One heartbeat of a replica to the lighthouse, answered before this returns: its worker 0 calls it at the end of
    ``ready``, once its torchft Manager has written its full id (with its uuid) to the replica's ``store``.

    The Manager's own heartbeats start on a background thread a moment later, and a quorum waits only for the
    replicas the lighthouse has heard from. The driver starts every replica's ``run`` once all are ready; without
    this, one replica's first quorum could form alone (seen in a fresh-clone run of the suite: replica 1 asked while
    the lighthouse had heard only from it, committed step 1 alone, and replica 0 joined at step 2 by healing)."""
    from torchft.coordination import LighthouseClient
    from torchft.manager import REPLICA_ID_KEY

    replica_id = store.get(REPLICA_ID_KEY).decode()
    LighthouseClient(lighthouse, connect_timeout=timedelta(seconds=30)).heartbeat(replica_id)


def timeouts(spec: RunSpec) -> tuple[float, int]:
    """(collective timeout in s, the lighthouse's join timeout in ms): ``resources.hang_timeout_s`` bounds both (a
    hung replica stalls its peers' all-reduce, then every quorum, for at most that long each), else 60 s / 30 s."""
    hang = spec.resources.hang_timeout_s
    if hang is None:
        return COLLECTIVE_TIMEOUT_S, JOIN_TIMEOUT_MS
    return min(COLLECTIVE_TIMEOUT_S, hang), min(JOIN_TIMEOUT_MS, int(hang * 1000))

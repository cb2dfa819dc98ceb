"""Warm workers: torch processes that train one job after another, re-meshing in place between them.

A ``WarmWorker`` is a Ray actor that has imported torch and the engine once. ``train(cfg)`` runs one job (a sweep
trial) on it as rank ``cfg["rank"]`` of ``cfg["world_size"]``:

1. a new default process group for this job only, on a new TCP store that rank 0 serves (``endpoint()``, a fresh
   port per job; gloo on CPU), so no communicator or store key of an earlier job is reused;
2. the attempt registered with the job's run channel (rank -> node map, pids), as a Ray Train worker would, under
   the number its driver gave (``cfg["attempt"]``), without waiting for the channel, which may still be starting;
3. ``workers.loop.train_job`` with the run channel's hooks (rows, heartbeats, stragglers, profiles, stop). A sweep
   trial checkpoints nowhere lasting (a scratch directory per rank, removed after it); a run gets ``checkpoint_dir``
   (one directory every rank writes into, on the run's storage: the ranks of a warm run share a node) and
   ``resume_from``, and rank 0 reports each complete checkpoint to the channel as Ray Train's callback would;
4. whatever happens: the process group destroyed (every sub-group and device mesh with it), compiled graphs
   dropped (``torch._dynamo.reset``), the default RNG re-seeded and the thread count restored, and the job's objects
   collected (what the imports made is frozen out of collections, ``gc.freeze``: the collection walks the job's
   objects only), so nothing of one job leaks into the next (the engine seeds every job from its spec anyway).

Its actor reserves no CPU or GPU: the job's placement group (created by whoever runs the job, on the same nodes)
holds the resources while a job trains, so an idle warm worker holds only its memory. CPU only for now (a GPU
worker would need its device chosen per job).

Imports ray at import time, torch only in the actor's own process: a driver that receives WarmWorker handles (a run
driver taking a group from the pool) deserializes them by importing this module, and must not pay torch's import for
it (1.5-2 s here).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import ray

log = logging.getLogger(__name__)

ENV_KEYS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@ray.remote(num_cpus=0)
class WarmWorker:
    def __init__(self, threads: int = 1) -> None:
        # the engine and the run channel's hooks, imported once per process: the warm part, with the parts of torch
        # the engine imports only for some layouts (pipelining, ZeRO: 0.4 s and 0.2 s here), so that no job pays
        # them; not ray.train (a warm job runs in no Ray Train session; tests/workers/test_startup.py)
        import torch
        import torch.distributed.optim
        import torch.distributed.pipelining

        import workers.loop
        import workers.ray_worker  # noqa: F401

        self.threads = max(1, int(threads))
        torch.set_num_threads(self.threads)
        self.jobs = 0
        self.started = time.time()
        self.store: Any = None  # rank 0: the next job's rendezvous (``endpoint``)
        # what the imports made lives as long as the process: out of every later collection (``_reset``'s)
        gc.collect()
        gc.freeze()

    def info(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "host": os.uname().nodename,
            "jobs": self.jobs,
        }

    def endpoint(self, world_size: int) -> tuple[str, int]:
        """Rank 0's rendezvous for the next job: a new TCP store served from this worker (listening before any
        other rank connects, so none of them waits in a connect retry), its IP and port."""
        import torch.distributed as dist

        ip = ray.util.get_node_ip_address()
        self.store = dist.TCPStore(ip, 0, world_size, is_master=True, wait_for_workers=False)
        return ip, int(self.store.port)

    def train(self, cfg: dict[str, Any]) -> dict[str, Any]:
        """One job as ``cfg["rank"]``; returns this worker's part of the result (rank 0: the summary)."""
        import torch.distributed as dist

        from api.spec import Plan, RunSpec
        from workers.engine import WorkerJob
        from workers.loop import train_job
        from workers.preemption import NOTICE, install
        from workers.ray_worker import ControlPoll, RowSink, _gather_objects, _publisher, channel_hooks

        rank, world = int(cfg["rank"]), int(cfg["world_size"])
        spec, plan = RunSpec.model_validate(cfg["spec"]), Plan.model_validate(cfg["plan"])
        channel, run_id = cfg["channel"], cfg["run_id"]
        os.environ.update(
            MASTER_ADDR=str(cfg["master_addr"]),
            MASTER_PORT=str(cfg["master_port"]),
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(cfg.get("local_rank", 0)),
            LOCAL_WORLD_SIZE=str(cfg.get("local_world_size", world)),
        )
        self.jobs += 1
        root = Path(tempfile.gettempdir()) / "meshrun-warm" / run_id
        scratch = not cfg.get("checkpoint_dir")  # a sweep trial: its checkpoints are scratch, removed after it
        rows: RowSink | None = None
        summary: dict[str, Any] = {}
        t0 = time.perf_counter()
        timeout = timedelta(seconds=float(cfg.get("timeout_s", 120)))
        store = self.store if rank == 0 else None
        if store is None:
            store = dist.TCPStore(str(cfg["master_addr"]), int(cfg["master_port"]), world, is_master=False)
        dist.init_process_group(backend=None, store=store, rank=rank, world_size=world, timeout=timeout)
        self.store = None  # this job's store: nothing of it serves the next one
        # a run's job: SIGTERM while it trains = a preemption notice, as in a Ray Train worker; the handler is taken
        # off again after the job, so that between jobs (and for sweep trials) SIGTERM keeps Ray's meaning
        before = signal.getsignal(signal.SIGTERM)
        NOTICE.reset()
        if not scratch and not install(NOTICE):
            log.warning("rank %d: no preemption handler (not the actor's main thread); SIGTERM ends this worker", rank)
        try:
            me = {**self.info(), "rank": rank, "local_rank": int(cfg.get("local_rank", 0))}
            ranks = _gather_objects(me)
            attempt = int(cfg["attempt"])  # the driver's number for it: no rank waits for the channel
            if rank == 0:
                cause = cfg.get("cause") or (
                    f"start in a warm worker group ({cfg.get('group', 'warm')}, job {self.jobs} of this worker)"
                )
                # not waited for: the channel actor may still be starting (about 1 s of every job's start here);
                # what rank 0 sends it later (rows, checkpoints) is delivered after this, in order
                channel.begin_attempt.remote({"ranks": ranks, "cause": cause, "attempt": attempt})
            if rank == 0:
                rows = RowSink(channel, attempt, _publisher(run_id, cfg.get("run_name") or run_id, rank))
            hooks = channel_hooks(channel, attempt, rank, rows)
            if hooks.control is not None:  # a warm job outlives no driver: a dead channel stops it
                hooks = dataclasses.replace(hooks, control=ControlPoll(channel, stop_if_gone=True))
            if not scratch:
                hooks = dataclasses.replace(hooks, on_checkpoint=_listed(channel, attempt, rank, rows))
            job = WorkerJob(
                spec=spec,
                plan=plan,
                run_id=run_id,
                attempt=attempt,
                checkpoint_dir=str(cfg.get("checkpoint_dir") or root / f"rank{rank}"),
                resume_from=cfg.get("resume_from"),
                state_dir=str(Path(cfg.get("state_root") or root / "state") / f"a{attempt}"),
                profile_dir=str(Path(cfg.get("profile_root") or root / "profiles") / f"a{attempt}"),
                prune=scratch,  # a run's checkpoints are pruned by its driver, once recorded
            )
            summary = train_job(job, hooks) or {}
        finally:
            NOTICE.finish()  # a SIGTERM between jobs is no preemption notice
            if not scratch and before is not None and threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, before)
            if rows is not None:
                rows.flush()
            self._reset()
            shutil.rmtree(root / f"rank{rank}" if scratch else root, ignore_errors=True)
        if rank == 0:
            done = {k: v for k, v in summary.items() if k != "losses"}
            ray.get(channel.done.remote(done), timeout=60)
        return {"rank": rank, "pid": os.getpid(), "jobs": self.jobs, "wall_s": time.perf_counter() - t0,
                "losses": summary.get("losses") if rank == 0 else None}  # fmt: skip

    def _reset(self) -> None:
        """Nothing of this job may reach the next: its process group and every sub-group and mesh, compiled
        graphs, the job's objects; the default RNG and thread count back to a fresh worker's."""
        import torch
        import torch.distributed as dist

        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        with contextlib.suppress(Exception):
            torch._dynamo.reset()
        for k in ENV_KEYS:
            os.environ.pop(k, None)
        torch.manual_seed(0)
        torch.set_num_threads(self.threads)
        # the job's cyclic garbage (modules, optimizer state, hooks): a few tens of ms, the imports being frozen out
        # of every collection (``__init__``); a full collection walked all of torch, about 0.5 s with the GIL held
        gc.collect()


def _listed(channel: Any, attempt: int, rank: int, rows: Any) -> Any:
    """A warm run's ``on_checkpoint``: the checkpoint is one directory on the run's storage, complete once every rank
    is here (``write_checkpoint`` publishes it before returning); rank 0 flushes the rows up to it and reports it to
    the channel, as Ray Train's ``ChannelCallback`` reports a merged one."""

    def on_checkpoint(step: int, path: str | None) -> None:
        if rank != 0 or not path:
            return
        if rows is not None:
            rows.flush()
        channel.checkpoint.remote({"step": int(step), "path": str(path), "attempt_reported": attempt})

    return on_checkpoint

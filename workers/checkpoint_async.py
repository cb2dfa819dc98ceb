"""Checkpoints written in the background (``checkpoint.async: true``): torchtitan's async mode, on DCP.

At a checkpoint step every rank copies its state (``checkpoint_state``: model and optimizer shards, schedulers,
RNG, data position) into memory of its own with DCP's stager (a CPU copy: training goes on changing the live
tensors) and hands the copy to a writer thread, which writes it with ``write_checkpoint`` over a gloo process group
of its own (created once, same ranks: the writer's collectives never share a communicator with the training's; on
GPUs NCCL trains while gloo writes). The loop goes on at once: what a save costs it is the copy.

- At most one save in flight: a save due while the previous one is still writing waits for it first.
- Listed only when complete on every rank: at each step boundary while a save is in flight the ranks agree (one
  two-number all-reduce: is any rank still writing, did any fail) and then, at the same step everywhere, the
  checkpoint is handed to ``on_done`` (the loop's: rank 0 prunes old ones, the checkpoint is reported to Ray Train
  and so to the run's record). A save that failed on any rank fails the attempt on every rank with its cause (the
  recovery resumes from the last listed checkpoint); its unpublished directory is removed, never listed.
- The end of training, a stop and a preemption's emergency save first wait for the save in flight.

Costs: a second copy of this rank's state in host memory while a save is in flight, and the writer's CPU time.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.staging import BlockingAsyncStager

from workers.checkpoint import write_checkpoint

logger = logging.getLogger(__name__)

Done = Callable[[int, str], None]  # (step, path) of a checkpoint complete on every rank


class CheckpointWriteError(RuntimeError):
    """A background save failed on another rank (the failing rank raises its own error)."""


@dataclass
class _Write:
    step: int
    path: str
    thread: threading.Thread | None = None
    error: BaseException | None = None
    seconds: float = 0.0

    def writing(self) -> bool:
        return self.thread is not None and self.thread.is_alive()


class AsyncCheckpointer:
    """One writer thread and its gloo group; ``save`` / ``poll`` / ``wait`` are called by every rank at the same
    points of the loop (their agreement is a collective on the training group, on ``device``)."""

    def __init__(self, device: torch.device, group: Any = None) -> None:
        self.device = device
        self.group = group
        self.stager = BlockingAsyncStager(cache_staged_state_dict=False)
        self.inflight: _Write | None = None
        self.copy_s: list[float] = []  # the loop's cost of each save: the copy
        self.write_s: list[float] = []  # the writer's time per save (overlapped with training)

    @classmethod
    def create(cls, device: torch.device) -> AsyncCheckpointer:
        """Collective on a process group of more than one rank: every rank creates its writer group here."""
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        return cls(device, dist.new_group(backend="gloo") if distributed else None)

    def save(self, path: str, state: dict[str, Any], *, step: int, plan: Any, spec: Any, on_done: Done) -> None:
        """Copy ``state`` and start writing it as the checkpoint of ``step`` (after the previous save is listed)."""
        self.wait(on_done)
        t0 = time.perf_counter()
        staged = self.stager.stage(state)
        self.copy_s.append(time.perf_counter() - t0)
        write = _Write(step, path)

        def run() -> None:
            t = time.perf_counter()
            try:
                write_checkpoint(path, staged, step=step, plan=plan, spec=spec, group=self.group)
            except BaseException as e:  # handed to the loop's thread, which raises it
                write.error = e
            write.seconds = time.perf_counter() - t

        write.thread = threading.Thread(target=run, daemon=True, name=f"meshrun-checkpoint-{step}")
        self.inflight = write
        write.thread.start()
        logger.info("checkpoint of step %d: copied in %.3f s, writing in the background", step, self.copy_s[-1])

    def poll(self, on_done: Done) -> None:
        """A step boundary: when every rank's write is done, list the checkpoint (``on_done``); a failed one raises."""
        if self.inflight is not None:
            self._settle(on_done, block=False)

    def wait(self, on_done: Done) -> None:
        """Block until the save in flight is written everywhere and listed (or raise its failure)."""
        if self.inflight is not None:
            if self.inflight.thread is not None:
                self.inflight.thread.join()
            self._settle(on_done, block=True)

    def _settle(self, on_done: Done, *, block: bool) -> None:
        write = self.inflight
        assert write is not None
        flags = torch.tensor([float(write.writing()), float(write.error is not None)], device=self.device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        writing, failed = (bool(v) for v in flags.tolist())
        if failed:
            self.inflight = None
            if write.error is not None:
                raise write.error
            raise CheckpointWriteError(f"the background checkpoint of step {write.step} failed on another rank")
        if writing:
            assert not block, "a joined writer is not writing"
            return
        self.inflight = None
        self.write_s.append(write.seconds)
        logger.info("checkpoint of step %d written in the background in %.2f s", write.step, write.seconds)
        on_done(write.step, write.path)

"""Parameter servers for ``layout.sync: async_ps`` (Ray actors; the workers are in ``workers.async_ps``).

The model's parameters are split over ``ps_shards`` servers (whole tensors, balanced by size). A server holds
its parameters in fp32, the optimizer (the run's AdamW/SGD, nanoGPT decay groups) and the LR schedule.

Bounded staleness (stale-synchronous parallel): update ``t`` of the parameters is the mean of the step-``t``
gradients of the live workers (each on its own shard of step t's global batch, as in synchronous data
parallelism), clipped by the global norm (``ps_shards`` 1), then one optimizer step. A worker may compute step
``t``'s gradient on any parameter version ``v >= t - 1 - max_staleness`` (the gradient's staleness is
``t - 1 - v``); ``pull(min_version)`` waits until the servers have that version. So no gradient is ever older
than the bound, ``max_staleness: 0`` is synchronous training, and a fast worker runs up to ``max_staleness``
steps ahead of the slowest instead of waiting at every step (its pushes and pulls overlap its compute).

Membership: ``remove_worker`` (the supervisor saw it die) lets the updates it has not pushed go on without it;
``add_worker`` (its replacement) returns the first step it must push, after every step any worker pushed so far.

An artificial link delay (``MESHRUN_LINK_DELAY_S`` in the server's environment) is added to every push and
pull on the server side (the worker's compute thread does not sleep: the transfer is what is slow).

Checkpoints (``checkpoint.every_steps``, with a ``ckpt_dir``): after every ``every_steps``-th update each server
writes its shard (``workers.ps_checkpoint``); a server started with ``restore_step`` N reloads its shard of step
N (parameters, optimizer, LR schedule, update counter) instead of taking parameters.

Server 0 also records one metric row per update (``api.spec.metrics.MetricRow`` keys) for the supervisor.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from typing import Any

import ray
import torch

from api.spec import RunSpec
from api.spec.metrics import SYNC_ALERT
from workers.optim import lr_factor
from workers.ps_checkpoint import load_shard, prune, save_shard

log = logging.getLogger(__name__)


def split_params(sizes: list[int], shards: int) -> list[list[int]]:
    """Parameter indices per server: largest first onto the least loaded server (each list in index order)."""
    loads = [0] * shards
    out: list[list[int]] = [[] for _ in range(shards)]
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        s = loads.index(min(loads))
        out[s].append(i)
        loads[s] += sizes[i]
    return [sorted(x) for x in out]


@ray.remote(num_cpus=0)
class ParameterServer:
    def __init__(
        self,
        index: int,
        spec_json: str,
        params: list[torch.Tensor] | None,
        workers: list[int],
        ckpt_dir: str | None = None,
        restore_step: int = 0,
        exit_at: int | None = None,
    ) -> None:
        torch.set_num_threads(1)
        self.index = index
        self.exit_at = exit_at  # faults.kill_ps: this process dies once it has applied that update
        self.spec = spec = RunSpec.model_validate_json(spec_json)
        self.ckpt_dir = ckpt_dir
        saved = load_shard(ckpt_dir, restore_step, index) if ckpt_dir and restore_step else None
        if saved is not None:
            params = saved["params"]
        assert params is not None, "a server needs its parameters or a checkpoint to restore"
        self.params = [torch.nn.Parameter(p.detach().clone().float()) for p in params]
        o = spec.optimizer
        decay = [p for p in self.params if p.dim() >= 2]
        no_decay = [p for p in self.params if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        self.opt: torch.optim.Optimizer = (
            torch.optim.SGD(groups, lr=o.lr, momentum=o.momentum)
            if o.name == "sgd"
            else torch.optim.AdamW(groups, lr=o.lr, betas=(o.betas[0], o.betas[1]), eps=1e-8)
        )
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt,
            lambda s: lr_factor(
                s,
                warmup_steps=o.warmup_steps,
                total_steps=spec.train.steps,
                schedule=o.schedule,
                min_lr_ratio=o.min_lr_ratio,
            ),
        )
        self.version = 0  # updates applied
        self.joined = dict.fromkeys(workers, 1)  # live worker -> first step it pushes
        self.pending: dict[int, dict[int, tuple[torch.Tensor, int, dict[str, float]]]] = {}
        self.max_pushed = 0
        self.cond = asyncio.Condition()
        self.delay_s = float(os.environ.get("MESHRUN_LINK_DELAY_S", "0") or 0)
        self.rows: list[dict[str, Any]] = []
        self.last_update_time = time.time()
        self.max_staleness_seen = 0
        self.alerted = False
        if saved is not None:  # every server restarts from the same update: the workers re-pull from there
            self.opt.load_state_dict(saved["optim"])
            self.sched.load_state_dict(saved["sched"])
            self.version = self.max_pushed = int(saved["step"])
            self.max_staleness_seen = int(saved.get("max_staleness_seen", 0))
            self.alerted = bool(saved.get("alerted", False))
            self.rows = list(saved.get("rows", []))

    # ------------------------------------------------------------------------------------------- protocol
    async def pull(self, min_version: int) -> tuple[int, torch.Tensor]:
        """The parameters (flat fp32) once ``version >= min_version``: (version, flat)."""
        async with self.cond:
            await self.cond.wait_for(lambda: self.version >= min_version)
            version, flat = self.version, torch.cat([p.detach().reshape(-1) for p in self.params])
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return version, flat

    async def push(self, worker: int, step: int, grad: torch.Tensor, version: int, info: dict[str, float]) -> int:
        """Worker ``worker``'s step-``step`` gradient (flat), computed on parameters of ``version``."""
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        async with self.cond:
            if step <= self.version or worker not in self.joined:
                return self.version  # a step already applied without it (it was presumed lost, or rejoined late)
            staleness = step - 1 - version
            if staleness > self.spec.layout.max_staleness or staleness < 0:
                raise RuntimeError(
                    f"worker {worker} pushed step {step} computed on version {version}: staleness {staleness} "
                    f"outside 0..{self.spec.layout.max_staleness}"
                )
            self.pending.setdefault(step, {})[worker] = (grad, staleness, info)
            self.max_pushed = max(self.max_pushed, step)
            self._apply_ready()
            self.cond.notify_all()
            return self.version

    async def remove_worker(self, worker: int) -> int:
        async with self.cond:
            self.joined.pop(worker, None)
            self._apply_ready()
            self.cond.notify_all()
            return self.version

    async def add_worker(self, worker: int, from_step: int) -> int:
        async with self.cond:
            self.joined[worker] = from_step
            return from_step

    async def max_step_pushed(self) -> int:
        return self.max_pushed

    async def state(self) -> dict[str, Any]:
        return {"version": self.version, "workers": dict(self.joined), "max_staleness": self.max_staleness_seen}

    async def take_rows(self) -> list[dict[str, Any]]:
        rows, self.rows = self.rows, []
        return rows

    async def params_flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def _checkpoint(self, step: int) -> None:
        """This shard's state after update ``step`` (``workers.ps_checkpoint``), then prune its older files."""
        assert self.ckpt_dir is not None
        state = {
            "params": [p.detach().clone() for p in self.params],
            "optim": self.opt.state_dict(),
            "sched": self.sched.state_dict(),
            "max_staleness_seen": self.max_staleness_seen,
            "alerted": self.alerted,
            # server 0's rows not taken yet (their steps are not trained again after a restore): sent once more
            "rows": list(self.rows),
        }
        save_shard(self.ckpt_dir, step, self.index, state)
        prune(self.ckpt_dir, self.spec.layout.ps_shards, self.spec.checkpoint.keep)

    # -------------------------------------------------------------------------------------------- updates
    def _expected(self, step: int) -> set[int]:
        return {w for w, first in self.joined.items() if first <= step}

    def _apply_ready(self) -> None:
        while True:
            step = self.version + 1
            got = self.pending.get(step, {})
            expected = self._expected(step)
            if not expected or not expected <= set(got) or step > self.spec.train.steps:
                return
            self._apply(step, {w: got[w] for w in expected})
            self.pending.pop(step, None)
            if step == self.exit_at:
                # the injected fault: the process dies at once, as in a crash (no reply, no clean-up); here
                # rather than from the driver, which sees the update late and could find the run already done
                log.warning("parameter server %d: injected fault kill_ps after update %d", self.index, step)
                os._exit(1)

    @torch.no_grad()
    def _apply(self, step: int, got: dict[int, tuple[torch.Tensor, int, dict[str, float]]]) -> None:
        n = len(got)
        mean = torch.stack([g for g, _, _ in got.values()]).sum(0) / n
        off = 0
        for p in self.params:
            k = p.numel()
            p.grad = mean[off : off + k].view_as(p).clone()
            off += k
        norm = torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None])
        clip = self.spec.optimizer.grad_clip
        if clip is not None and self.spec.layout.ps_shards == 1:
            torch.nn.utils.clip_grads_with_norm_(self.params, clip, norm)
        lr = self.opt.param_groups[0]["lr"]
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        self.version = step
        stale = [s for _, s, _ in got.values()]
        self.max_staleness_seen = max(self.max_staleness_seen, *stale)
        if self.index == 0:
            self._record(step, got, float(norm), lr)
        every = self.spec.checkpoint.every_steps
        if self.ckpt_dir and every and step % every == 0 and step < self.spec.train.steps:
            self._checkpoint(step)

    def _record(
        self, step: int, got: dict[int, tuple[torch.Tensor, int, dict[str, float]]], norm: float, lr: float
    ) -> None:
        """Server 0: the update's metric row (and a sync_alert once staleness reaches the bound)."""
        n = len(got)
        stale = [s for _, s, _ in got.values()]
        now = time.time()
        period = max(now - self.last_update_time, 1e-9)
        self.last_update_time = now
        infos = [i for _, _, i in got.values()]
        loss = sum(i["loss"] for i in infos) / n
        tokens = sum(i["tokens"] for i in infos)
        self.rows.append(
            {
                "step": step,
                "loss": loss,
                "tokens_per_s": tokens / period,
                "step_time_s": period,
                "grad_norm": norm if self.spec.layout.ps_shards == 1 else None,
                "lr": lr,
                "time": now,
                "staleness_mean": sum(stale) / n,
                "staleness_max": max(stale),
                "workers_in_update": n,
                "cross_group_bytes": int(sum(i["bytes"] for i in infos) / n),
            }
        )
        if not math.isfinite(loss):
            self.rows[-1]["loss"] = None
        bound = self.spec.layout.max_staleness
        if bound and max(stale) >= bound and not self.alerted:
            self.alerted = True  # once per run: the event says the bound is active, the rows say how often
            self.rows[-1][SYNC_ALERT] = (
                f"a gradient of staleness {max(stale)} reached max_staleness {bound}: the fastest worker waits for "
                "the slowest (a straggler, or a slow link); rows carry staleness_max per update"
            )

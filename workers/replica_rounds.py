"""``fault_tolerance.mode: replica`` with ``layout.sync: local_sgd | diloco``: replicas that train alone for a round of
``sync_every_steps`` (H) steps and agree at its end, each round committed in a torchft quorum.

The math is ``workers.periodic.PeriodicAverager``'s (group mode), with torchft's quorum around each round instead of
one process group:

1. ``start_quorum`` at the round's start: the replicas alive now; a replacement heals here from a live peer (the
   anchor, the outer and inner optimizers, the LR schedule, the steps done) and trains this very round;
2. H local steps: each participant trains its data shards (``batch: keep``: participant r of q takes the shards
   s with s % q == r, so every shard is trained whatever the quorum; ``shrink``: its own shard), clips, and steps the
   inner optimizer, with no cross-replica traffic;
3. ONE all-reduce (averaged over the participants) of the outer gradient ``anchor - local``, the round's per-step
   losses, who trained it, ``||delta||^2`` (the replicas' divergence) and the stop votes; ``should_commit``;
4. committed: the outer optimizer steps the anchor with the mean delta, the anchor goes into the model, the round's
   rows are recorded (every step once, with the quorum size), the first participant checkpoints when a
   ``checkpoint.every_steps`` multiple fell in the round. Not committed (a peer died in the round): the model goes
   back to the anchor and the inner optimizer to its state at the round's start, and the round is trained again in
   the next quorum, the same steps on the same data.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from typing import Any

import torch

from workers import preemption
from workers.periodic import divergence_alert
from workers.replica_quorum import NoPeerToHeal, shards_of


def _local_steps(w: Any, first: int, last: int, mine: list[int], autocast: Any) -> tuple[list[float], list[dict]]:
    """The round's steps on this replica's shards: (the local losses, per step its time, lr and grad norm)."""
    spec = w.spec
    params = [p for p in w.model.parameters() if p.requires_grad]
    losses, info = [], []
    for step in range(first, last + 1):
        t0 = time.perf_counter()
        w.faults.before_step(step)
        w._enter("compute")
        w.faults.in_compute(step)
        loss = w.backward(step, mine, 1.0 / max(len(mine), 1), autocast)  # the mean over its shards
        if spec.optimizer.grad_clip is not None:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, spec.optimizer.grad_clip)
        else:
            norms = [torch.linalg.vector_norm(p.grad) for p in params if p.grad is not None]
            grad_norm = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
        lr = w.optimizer.param_groups[0]["lr"]
        if mine:
            w.optimizer.step()
        w.scheduler.step()
        w.optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))
        info.append({"step_time_s": time.perf_counter() - t0, "lr": lr, "grad_norm": float(grad_norm)})
    return losses, info


def run_rounds(w: Any, min_step: int) -> dict[str, Any]:
    """``ReplicaWorker.run`` for the periodic modes (see the module docstring)."""
    spec, plan, mgr = w.spec, w.plan, w.manager
    ft, every, total, dp = spec.fault_tolerance, spec.layout.sync_every_steps, spec.train.steps, plan.dp
    params = [p for p in w.model.parameters() if p.requires_grad]
    autocast = (
        torch.autocast(w.device.type, dtype=torch.bfloat16) if spec.precision == "bf16" else contextlib.nullcontext()
    )
    shard_samples = plan.global_batch_size // dp
    first_round: int | None = None
    failed_rounds = 0
    failed_since: float | None = None
    prev_q: int | None = None
    while w.steps_done < total:
        t0 = time.perf_counter()
        w._enter("quorum")
        mgr.start_quorum()  # a replacement heals here (``_heal``): anchor, optimizers, steps_done
        tq = time.perf_counter()
        first, last = w.steps_done + 1, min(w.steps_done + every, total)
        if first_round is None and w.steps_done < min_step:
            raise NoPeerToHeal(f"replica {w.index} is at step {w.steps_done} with no live peer at step {min_step}")
        first_round = first if first_round is None else first_round
        q, r = mgr.num_participants(), mgr.participating_rank()
        mine = shards_of(r, q, dp, w.index, ft.batch)
        inner = (copy.deepcopy(w.optimizer.state_dict()), copy.deepcopy(w.scheduler.state_dict()))
        losses, info = _local_steps(w, first, last, mine, autocast)

        n = last - first + 1
        with torch.no_grad():
            delta = torch.cat([(a - p.detach().float()).reshape(-1) for a, p in zip(w.anchor, params)])
            me = torch.zeros(dp, device=w.device)
            me[w.index] = 1.0 if r is not None else 0.0
            noticed = preemption.NOTICE.requested and r is not None
            tail = torch.tensor(
                [*losses, float(delta.pow(2).sum()), float(w.stop_cause is not None), float(noticed)], device=w.device
            )
            flat = torch.cat([delta, tail, me])
        w._enter("allreduce")
        mgr.allreduce(flat).wait()  # averaged over the participants
        w._enter("commit")
        committed = mgr.should_commit()
        w._enter("compute")
        if not committed:  # a peer was lost in the round: back to its start, trained again in the next quorum
            failed_rounds += 1
            failed_since = t0 if failed_since is None else failed_since
            with torch.no_grad():
                for p, a in zip(params, w.anchor):
                    p.copy_(a.to(p.dtype))
            w.optimizer.load_state_dict(inner[0])
            w.scheduler.load_state_dict(inner[1])
            continue
        qf = float(max(q, 1))
        k = delta.numel()
        mean_delta = flat[:k]
        round_losses = flat[k : k + n].tolist()
        sq_mean, stops, leaving = (flat[k + n : k + n + 3] * qf).tolist()
        who = (flat[k + n + 3 :] * qf).round().tolist()
        mask = sum(1 << i for i, v in enumerate(who) if v > 0)
        with torch.no_grad():
            off = 0
            for a in w.anchor:
                a.grad = mean_delta[off : off + a.numel()].view_as(a).clone()
                off += a.numel()
            # the replicas' spread before the sync, relative to their mean's size (PeriodicAverager's divergence):
            # sum_i ||d_i - mean||^2 = sum_i ||d_i||^2 - q ||mean||^2, and the mean of the local models is a - mean
            spread = max(sq_mean - qf * float(mean_delta.pow(2).sum()), 0.0)
            size = sum(float((a - a.grad).pow(2).sum()) for a in w.anchor)
            w.outer.step()
            w.outer.zero_grad(set_to_none=True)
            for p, a in zip(params, w.anchor):
                p.copy_(a.to(p.dtype))
        w.divergences.append(math.sqrt(spread / max(size, 1e-30)))
        w.steps_done = last

        shrank = failed_since is not None or (prev_q is not None and q < prev_q)
        grew = (prev_q is not None and q > prev_q) or (prev_q is None and w.rejoining)
        began = failed_since if failed_since is not None else t0
        samples = plan.global_batch_size if ft.batch == "keep" else q * shard_samples
        sync_s = time.perf_counter() - tq - sum(i["step_time_s"] for i in info)  # the all-reduce and the commit
        rows = []
        for j, step in enumerate(range(first, last + 1)):
            dt = info[j]["step_time_s"] + (sync_s if step == last else 0.0)
            row: dict[str, Any] = {
                "step": step,
                "loss": round_losses[j],
                "step_time_s": dt,
                "tokens_per_s": samples * plan.model.seq_len / dt if dt > 0 else None,
                "lr": info[j]["lr"],
                "grad_norm": info[j]["grad_norm"],
                "replicas": q,
                "replica_mask": mask,
                "samples": samples,
                "time": time.time(),
            }
            if step == last:
                row.update(replica_divergence=w.divergences[-1], **divergence_alert(w.divergences))
            rows.append(row)
        if shrank:  # the failed tries of the round and the wait for a quorum without the lost replica
            rows[0]["recovery_s"] = tq - began
        elif grew:
            rows[0]["rejoin_s"] = tq - began
        failed_since, prev_q = None, q
        with w.lock:
            w.rows.extend(rows)
        periodic = bool(spec.checkpoint.every_steps) and last // spec.checkpoint.every_steps > (first - 1) // (
            spec.checkpoint.every_steps
        )
        leave = w._preemption(stops, leaving, q, noticed)
        if r == 0 and (periodic or leave == "preempted"):
            w._enter("save")
            w._save(last)
        if leave is not None:
            return w._left(leave, last, first_round, failed_rounds)
    preemption.NOTICE.finish()
    return w.result(first_round, failed_rounds)

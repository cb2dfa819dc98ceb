"""``fault_tolerance.mode: replica`` with HSDP's replicate dimension, on the session's Ray cluster: dp=4 in FSDP
shard groups of 2 (``zero_stage: 3``, ``shard_group_size: 2``) is two replicas of two workers each. Inside a replica
FSDP2 shards the model over its own gloo group; across replicas worker j's gradient shards are averaged by torchft.

- unfaulted: the losses equal a DDP run's (the same global batch, in a different cut) within fp32 tolerance;
- worker 1 of replica 1 SIGKILLed at step 3: its replica is lost with it (both workers), the other replica trains on
  alone (``replicas`` 1, the whole batch: ``batch: keep``), the replacement's workers each heal from the live
  replica's worker of the same rank (their own shards, not storage) and rejoin; every step once, the same losses;
- a checkpoint holds one file per worker of the replica; a resumed run starts from it;
- a SIGTERM on one worker makes its whole replica leave at a step boundary, replaced without a failure.
(through the service: ``tests/ray/test_replica_rest.py``).
"""

from __future__ import annotations

import pytest
import ray

from tests.replica.test_replica_ft import FP32_TOL, _ft, _run
from tests.replica.test_replica_preempt import _sigterm_at
from tests.workers.dist_utils import tiny_spec
from workers.replica_ft import latest_checkpoint

pytestmark = pytest.mark.slow


def _hsdp(**kw: object) -> dict:
    return tiny_spec(dp=4, zero=3, layout={"shard_group_size": 2}, fault_tolerance=_ft(), **kw)


def test_hsdp_replicas_match_ddp_and_heal_a_lost_shard_group(ray_session, ddp_losses) -> None:
    steps = 8
    ref = ddp_losses[:steps]
    out, rows, events = _run(_hsdp(steps=4))
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert {r["replicas"] for r in rows} == {2} and {r["replica_mask"] for r in rows} == {3}
    assert max(abs(a - b) for a, b in zip(out["losses"], ref)) < FP32_TOL
    placement = [t for k, t in events if k == "placement"]
    assert not placement  # the first workers' placement is on_start's (the attempt's ranks)

    before = set(ray.util.placement_group_table())
    spec = _hsdp(
        steps=steps,
        faults={"kill_rank": {"rank": 3, "at_step": 3}, "slow_rank": {"rank": 0, "delay_s": 0.8}},
        resources={"max_failures": 1},
    )
    out, rows, events = _run(spec)
    by = sorted(rows, key=lambda r: r["step"])
    assert [r["step"] for r in by] == list(range(1, steps + 1))  # every step once
    replicas = [r["replicas"] for r in by]
    assert replicas[:2] == [2, 2] and 1 in replicas, replicas  # replica 0 went on alone
    assert max(abs(a - b) for a, b in zip(out["losses"], ref)) < FP32_TOL  # keep: the same math
    kinds = [k for k, _ in events]
    assert kinds.count("replica_lost") == 1, events
    assert dict(events)["replica_lost"].startswith("replica 1 lost at step 3"), events
    (rec,) = out["replica_recoveries"]
    assert rec["replica"] == 1 and out["replica_restores"] == 0  # healed from the peer, never from storage
    # both workers of the replacement were started (ranks 2 and 3 of the run)
    (placed,) = [t for k, t in events if k == "placement"]
    assert '"2":' in placed and '"3":' in placed, placed
    if replicas[-1] == 2:  # the replacement rejoined before the last step (not certain on a loaded machine)
        assert kinds.count("replica_rejoined") == 1, events
        assert rec["rejoin_step"] > 3
    # each replica's workers were packed in a placement group of their own (replica 1's twice: the replacement),
    # every one removed with its replica
    pgs = [g for k, g in ray.util.placement_group_table().items() if k not in before]
    names = sorted(g["name"].rsplit("-", 1)[0] for g in pgs)
    assert names == ["meshrun-replica-0-1", "meshrun-replica-1-1", "meshrun-replica-1-2"], names
    assert all(len(g["bundles"]) == 2 and g["strategy"] == "PACK" for g in pgs)
    assert {g["state"] for g in pgs} == {"REMOVED"}, pgs


def test_an_hsdp_checkpoint_holds_every_workers_shards_and_resumes(ray_session, ddp_losses, tmp_path) -> None:
    spec = _hsdp(steps=4, checkpoint={"every_steps": 2, "keep": 1})
    first, _, _ = _run(spec, ckpt_dir=str(tmp_path))
    ck = latest_checkpoint(str(tmp_path))
    assert ck is not None and ck.name == "step_00000004"
    assert sorted(p.name for p in ck.iterdir()) == ["state.1.pt", "state.pt"]  # worker 0's and worker 1's shards
    longer = {**spec, "train": {**spec["train"], "steps": 6}}
    out, rows, events = _run(longer, ckpt_dir=str(tmp_path))
    assert [r["step"] for r in rows] == [5, 6]
    assert "replicas_restored" in [k for k, _ in events]
    assert max(abs(a - b) for a, b in zip(out["losses"], ddp_losses[4:6])) < FP32_TOL


def test_a_sigterm_on_one_worker_makes_its_whole_replica_leave(ray_session, ddp_losses) -> None:
    """A SIGTERM on worker 1 of replica 1 only: its workers agree on the vote (any worker's), so both leave after the
    same step, the other replica trains on, and a replacement of both heals from it; no ``max_failures`` spent."""
    steps = 8
    on_start, kill = _sigterm_at(2, [3])
    spec = _hsdp(steps=steps, faults={"slow_rank": {"rank": 0, "delay_s": 0.8}}, resources={"max_failures": 0})
    out, rows, events = _run(spec, on_start=on_start, sink=kill)
    by = sorted(rows, key=lambda r: r["step"])
    assert [r["step"] for r in by] == list(range(1, steps + 1))
    assert "preempted" not in out and 1 in [r["replicas"] for r in by]
    assert max(abs(a - b) for a, b in zip(out["losses"], ddp_losses[:steps])) < FP32_TOL
    kinds = [k for k, _ in events]
    assert kinds.count("replica_preempted") == 1 and "replica_lost" not in kinds, events
    assert dict(events)["replica_preempted"].startswith("replica 1 got a preemption notice"), events
    assert out["replica_restarts"] == 0

"""``fault_tolerance.mode: replica`` with ``layout.sync: local_sgd | diloco`` (issue 33): each round of
``sync_every_steps`` local steps commits in a torchft quorum (``workers.replica_rounds``).

- unfaulted: the losses (and the divergence at each sync) equal group mode's local SGD / DiLoCo run of the same spec
  (``workers.periodic``, one gloo process group);
- a replica SIGKILLed mid-round: the round fails for the survivor, which trains it again (alone, ``batch: keep``:
  all the shards; or with the replacement if that is up by then), the replacement heals at a round's start and
  rejoins; every step is recorded once, with the quorum size of its round.
"""

from __future__ import annotations

import pytest

from tests.replica.test_replica_ft import FP32_TOL, _ft, _run
from tests.workers.dist_utils import run_world, tiny_spec

pytestmark = pytest.mark.slow
STEPS = 12


def _spec(sync: str, **extra: object) -> dict:
    return tiny_spec(dp=2, steps=STEPS, layout={"sync": sync, "sync_every_steps": 4}, **extra)


@pytest.mark.parametrize("sync", ["local_sgd", "diloco"])
def test_rounds_match_group_mode(ray_session, sync: str) -> None:
    group = run_world(2, [_spec(sync)])[0]
    out, rows, events = _run(_spec(sync, fault_tolerance=_ft()))
    by = sorted(rows, key=lambda r: r["step"])
    assert [r["step"] for r in by] == list(range(1, STEPS + 1))
    assert max(abs(a - b) for a, b in zip(out["losses"], group["losses"])) < FP32_TOL, (out["losses"], group)
    assert all(r["replicas"] == 2 and r["replica_mask"] == 3 for r in by)
    synced = [r["step"] for r in by if "replica_divergence" in r]
    assert synced == [4, 8, 12], synced  # one sync per round
    assert not events


def test_a_replica_killed_mid_round_is_replaced_and_the_round_trained_again(ray_session) -> None:
    spec = _spec(
        "diloco",
        fault_tolerance=_ft(),
        # replica 1 dies inside the second round; the survivor's steps take 0.5 s so that the replacement (a new
        # process importing torch and torchft) can rejoin within the run
        faults={"kill_rank": {"rank": 1, "at_step": 6}, "slow_rank": {"rank": 0, "delay_s": 0.5}},
        resources={"max_failures": 1},
    )
    out, rows, events = _run(spec)
    by = sorted(rows, key=lambda r: r["step"])
    assert [r["step"] for r in by] == list(range(1, STEPS + 1))  # every step once, the failed round's included
    replicas = [r["replicas"] for r in by]
    # round 2 failed and was trained again as one round: alone (mask 1), or with the replacement if it was up by
    # then (a quorum waits for a replica that heartbeats)
    assert replicas[:4] == [2] * 4 and len(set(replicas[4:8])) == 1, replicas
    assert replicas[4] == 2 or all(r["replica_mask"] == 1 for r in by[4:8])
    assert by[4]["recovery_s"] > 0  # the failed try and the wait for the next quorum
    kinds = [k for k, _ in events]
    assert kinds.count("replica_lost") == 1, events
    assert out["replica_restarts"] == 1 and out["replica_restores"] == 0
    if "replica_rejoined" in kinds:  # on a loaded machine the replacement may come after the last round
        assert replicas[-1] == 2
    assert all(r["loss"] == r["loss"] for r in by) and by[-1]["loss"] < by[0]["loss"]

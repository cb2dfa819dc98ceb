"""Preemption in ``fault_tolerance.mode: replica`` on the session's Ray cluster (issue 33):

- the service asks for the workers back (``preempt_request``): every replica stops after the same committed step,
  the quorum's first replica checkpoints that step, the summary says ``preempted`` with the cause; a resumed run
  (a new driver on the same checkpoint directory) trains the remaining steps, each once, with the losses of the
  unfaulted run;
- a SIGTERM on one replica (its node is reclaimed): it leaves at a step boundary, the other trains on, a replacement
  heals from it without spending ``max_failures``, and the run ends done with the unfaulted losses;
- a SIGTERM on every replica (the whole node is drained): a preemption of the run, checkpointed.
(the service's side: ``tests/ray/test_replica_rest.py``.)
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.replica.test_replica_ft import FP32_TOL, _ft, _run
from tests.workers.dist_utils import tiny_spec
from workers.replica_ft import latest_checkpoint

pytestmark = pytest.mark.slow
STEPS = 10


def _paced(delay_s: float = 0.3, **extra: object) -> dict:
    """A dp2 replica run whose steps take ``delay_s`` (rank 0 slowed; the math unchanged): a request lands mid-run."""
    return tiny_spec(
        dp=2, steps=STEPS, fault_tolerance=_ft(), faults={"slow_rank": {"rank": 0, "delay_s": delay_s}}, **extra
    )


def test_a_preemption_request_stops_every_replica_at_one_checkpointed_step(ray_session, ddp_losses, tmp_path) -> None:
    seen: list[int] = []

    def asked() -> str | None:
        return "preempted by run r-high (priority 10 > 0)" if max(seen, default=0) >= 3 else None

    saved: list[tuple[int, str]] = []
    first, rows, events = _run(
        _paced(),
        sink=lambda row: seen.append(int(row["step"])),
        ckpt_dir=str(tmp_path),
        preempt_request=asked,
        on_checkpoint=lambda s, p: saved.append((s, p)),
    )
    stop = first["steps_done"]
    assert 3 <= stop < STEPS, first
    assert first["preempted"] is True and first["preempt_cause"].startswith("preempted by run r-high"), first
    assert first["preempted_ranks"] == []  # nobody got a SIGTERM
    assert sorted(r["step"] for r in rows) == list(range(1, stop + 1))  # each step once, none after the stop
    assert all(r["replicas"] == 2 for r in rows)  # both stopped after the same step
    assert saved == [(stop, first["last_checkpoint"])]  # the emergency checkpoint, of that very step
    assert latest_checkpoint(str(tmp_path)).name == f"step_{stop:08d}"
    assert first["replica_restarts"] == 0 and not [k for k, _ in events if k.startswith("replica_")]

    # a new driver (the run re-queued and resumed): every replica from that checkpoint, the rest of the steps
    second, rows2, events2 = _run(_paced(), ckpt_dir=str(tmp_path))
    assert [r["step"] for r in sorted(rows2, key=lambda r: r["step"])] == list(range(stop + 1, STEPS + 1))
    assert "preempted" not in second
    assert "replicas_restored" in [k for k, _ in events2]
    losses = first["losses"] + second["losses"]
    assert max(abs(a - b) for a, b in zip(losses, ddp_losses)) < FP32_TOL  # the unfaulted run's


def _sigterm_at(step: int, replicas: list[int]) -> tuple:
    """(on_start, sink) that SIGTERM ``replicas``' processes once ``step`` is committed."""
    pids: dict[int, int] = {}
    sent: list[int] = []

    def on_start(infos: list[dict]) -> None:
        pids.update({int(i["rank"]): int(i["pid"]) for i in infos})

    def sink(row: dict) -> None:
        if int(row["step"]) >= step and not sent:
            for r in replicas:
                os.kill(pids[r], signal.SIGTERM)
                sent.append(r)

    return on_start, sink


def test_a_sigterm_on_one_replica_makes_it_leave_and_be_replaced(ray_session, ddp_losses) -> None:
    on_start, kill = _sigterm_at(2, [1])
    # max_failures 0: a notice spends none (a failure would leave replica 0 alone to the end); the survivor's steps
    # take 0.8 s so that the replacement (a new process importing torch and torchft) rejoins before the last one
    out, rows, events = _run(_paced(0.8, resources={"max_failures": 0}), on_start=on_start, sink=kill)
    by = sorted(rows, key=lambda r: r["step"])
    assert [r["step"] for r in by] == list(range(1, STEPS + 1))  # every step once
    assert "preempted" not in out, out  # the run goes on: one replica's notice is no preemption of the run
    replicas = [r["replicas"] for r in by]
    assert 1 in replicas, replicas  # replica 0 went on alone
    assert max(abs(a - b) for a, b in zip(out["losses"], ddp_losses)) < FP32_TOL  # keep: the same math
    kinds = [k for k, _ in events]
    assert kinds.count("replica_preempted") == 1 and "replica_lost" not in kinds, events
    text = dict(events)["replica_preempted"]
    assert text.startswith("replica 1 got a preemption notice (SIGTERM) and left after step "), text
    assert kinds.count("placement") == 1, events  # the replacement started
    if "replica_rejoined" in kinds:  # it rejoins unless the last step comes first (the full suite's load once did)
        assert replicas[-1] == 2, replicas
    assert out["replica_restarts"] == 0 and out["replicas_gone"] == []


def test_a_sigterm_on_every_replica_preempts_the_run(ray_session, tmp_path: Path) -> None:
    on_start, kill = _sigterm_at(3, [0, 1])
    out, rows, events = _run(_paced(), ckpt_dir=str(tmp_path), on_start=on_start, sink=kill)
    assert out["preempted"] is True and out["preempt_cause"] is None, out
    assert out["preempted_ranks"] == [0, 1]
    stop = out["steps_done"]
    assert 3 <= stop < STEPS
    assert latest_checkpoint(str(tmp_path)).name == f"step_{stop:08d}"
    assert "replica_preempted" not in [k for k, _ in events] and "replica_lost" not in [k for k, _ in events]

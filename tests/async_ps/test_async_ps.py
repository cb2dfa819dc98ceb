"""``layout.sync: async_ps`` on the session's Ray cluster: parameter servers as Ray actors, bounded staleness.

- ``max_staleness: 0`` is synchronous data parallelism: the losses equal those of a dp=2 DDP run (gloo) within
  fp32 tolerance (AdamW, global-norm clipping on the server);
- ``max_staleness: 4`` with one worker slowed down: the loss falls, the fast worker really runs ahead (some
  gradient is stale) and no recorded staleness exceeds 4;
- a parameter server killed mid-run (``faults.kill_ps``: ``ray.kill`` on its actor): every server restarts from
  the latest complete checkpoint of its shard, the workers re-pull, the run ends with every step, and (bound 0,
  deterministic) its losses equal those of the same run without the fault;
(a worker or a server killed mid-run, through the service: ``tests/ray/test_async_ps_rest.py``).
"""

from __future__ import annotations

import pytest
import ray
import torch

from api.spec import RunSpec
from api.spec.metrics import SYNC_ALERT
from api.spec.validation import build_plan
from tests.workers.dist_utils import run_world, tiny_spec
from workers.async_ps import run_async_ps
from workers.ps import ParameterServer

pytestmark = pytest.mark.slow
FP32_TOL = 1e-5


def _run(spec_d: dict, **kw: object) -> tuple[dict, list[dict]]:
    spec = RunSpec.model_validate(spec_d)
    plan = build_plan(spec, device="cpu")
    rows: list[dict] = []
    return run_async_ps(spec, plan, sink=rows.append, worker_options={"num_cpus": 0.5}, **kw), rows  # type: ignore[arg-type]


def test_staleness_zero_equals_synchronous_training(ray_session) -> None:
    ref = run_world(2, [tiny_spec(dp=2)])[0]["losses"]
    out, rows = _run(tiny_spec(dp=2, layout={"sync": "async_ps", "max_staleness": 0}))
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert max(abs(a - b) for a, b in zip(out["losses"], ref)) < FP32_TOL
    assert all(r["staleness_max"] == 0 and r["workers_in_update"] == 2 for r in rows)
    assert all(r["cross_group_bytes"] > 0 for r in rows)


def test_bound_four_learns_and_staleness_never_exceeds_it(ray_session) -> None:
    spec = tiny_spec(
        dp=2,
        steps=10,
        layout={"sync": "async_ps", "max_staleness": 4, "ps_shards": 2},
        optimizer={"grad_clip": None},
        faults={"slow_rank": {"rank": 1, "delay_s": 0.2}},
    )
    out, rows = _run(spec)
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert out["losses"][-1] < out["losses"][0]
    stale = [r["staleness_max"] for r in rows]
    assert max(stale) <= 4 and out["max_staleness"] <= 4
    assert max(stale) > 0  # the fast worker ran ahead of the slow one


def test_lost_parameter_server_restores_from_its_latest_checkpoint(ray_session, tmp_path) -> None:
    base = tiny_spec(
        dp=2,
        steps=9,
        layout={"sync": "async_ps", "max_staleness": 0, "ps_shards": 2},
        optimizer={"grad_clip": None},
        checkpoint={"every_steps": 3, "keep": 1},
    )
    ref, _ = _run(base, ckpt_dir=str(tmp_path / "ref"))
    restored: list[tuple[list[int], int, str]] = []
    out, rows = _run(
        {**base, "faults": {"kill_ps": {"shard": 1, "at_step": 5}}},
        ckpt_dir=str(tmp_path / "ps"),
        on_ps_restored=lambda servers, step, text: restored.append((servers, step, text)),
    )
    assert len(restored) == 1, restored
    servers, step, text = restored[0]
    assert servers == [1] and step in (3, 6)  # the latest complete checkpoint when the loss was seen
    assert f"restored from the checkpoint of step {step}" in text
    assert out["ps_restores"] == [{"servers": [1], "step": step}]
    assert out["steps_done"] == 9 and sorted({r["step"] for r in rows}) == list(range(1, 10))
    # rows up to N are not trained again (server 0's rows not yet taken at its checkpoint are sent once more,
    # the same rows: the store keeps one per step)
    before = {}
    for r in rows:
        if r["step"] <= step:
            assert before.setdefault(r["step"], r["loss"]) == r["loss"]
    assert sorted(before) == list(range(1, step + 1))
    # the servers came back exactly as they were at step N: the same losses as without the fault
    assert max(abs(a - b) for a, b in zip(out["losses"], ref["losses"])) < FP32_TOL
    assert out["losses"][-1] < out["losses"][step - 1] < out["losses"][0]
    # checkpoints after the restore went on (keep 1: only the latest complete step is left)
    assert sorted(p.name for p in (tmp_path / "ps").iterdir()) == ["step-00000006"]


def test_staleness_reaching_the_bound_raises_one_sync_alert(ray_session) -> None:
    """Server 0 marks the first update whose gradient reached ``max_staleness`` (the run's ``sync_alert`` event)."""
    spec = RunSpec.model_validate(tiny_spec(dp=2, steps=4, layout={"sync": "async_ps", "max_staleness": 1}))
    srv = ParameterServer.remote(0, spec.model_dump_json(), [torch.zeros(3, 2), torch.zeros(2)], [0, 1])
    g, info = torch.ones(8), {"loss": 1.0, "tokens": 4.0, "bytes": 0.0}
    try:
        ray.get([srv.push.remote(w, 1, g, 0, info) for w in (0, 1)])  # step 1 on version 0: staleness 0
        ray.get([srv.push.remote(0, 2, g, 1, info), srv.push.remote(1, 2, g, 0, info)])  # worker 1: staleness 1
        ray.get([srv.push.remote(0, 3, g, 1, info), srv.push.remote(1, 3, g, 1, info)])  # staleness 1 again
        rows = ray.get(srv.take_rows.remote())
    finally:
        ray.kill(srv)
    assert [r["staleness_max"] for r in rows] == [0, 1, 1]
    assert [SYNC_ALERT in r for r in rows] == [False, True, False]  # once per run: the rows say how often
    assert "staleness 1 reached max_staleness 1" in rows[1][SYNC_ALERT]

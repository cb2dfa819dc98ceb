"""A user model package outside meshrun's tree trains through the REST API on the local Ray cluster.

The package directory reaches the run's Ray Job (driver and every Train worker) as the job's runtime-env
``working_dir`` (``spec.code.working_dir``); the driver inspects the model on the meta device (a Ray task) and
records its size on the run's plan before the workers start.
"""

from __future__ import annotations

import pytest

from tests.byo.conftest import PKG
from tests.ray.helpers import events, get_run, metrics, submit, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _spec(name: str, code_dir, **over) -> dict:
    spec = {
        "name": name,
        "code": {"working_dir": str(code_dir)},
        "model": {"name": "custom", "preset": None, "entrypoint": f"{PKG}.models:build",
                  "args": {"d": 32, "n_layers": 2, "n_heads": 2, "seq_len": 32}, "seq_len": 32},
        "data": {"source": "custom", "entrypoint": f"{PKG}.data:build", "args": {"n": 256}},
        "layout": {"dp": 2, "zero_stage": 3},
        "batch": {"global_batch_size": 8, "micro_batch_size": 2},
        "optimizer": {"lr": 1e-2, "warmup_steps": 0, "schedule": "constant"},
        "train": {"steps": 12, "seed": 0},
        "resources": {"device": "cpu", "cpus_per_worker": 1},
    }
    spec.update(over)
    return spec


def test_user_package_trains_dp2_zero3_through_rest(live_service, user_code_dir) -> None:
    url = live_service.url
    run = submit(url, _spec("byo-dp2-zero3", user_code_dir))
    assert run["plan"]["model"]["n_params"] == 0  # unknown until inspected
    submitted_params_bytes = (run["plan"].get("predicted") or {}).get("memory_bytes", {}).get("params")
    run = wait_for(url, run["id"], {"SUCCEEDED"}, timeout_s=300)
    rows = metrics(url, run["id"])
    assert [r["step"] for r in rows] == list(range(1, 13))
    losses = [r["loss"] for r in rows]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.2, losses  # it learns
    inspected = [e for e in events(url, run["id"]) if e["kind"] == "inspect"]
    assert inspected and "2 blocks of Block" in inspected[0]["reason"]
    plan = get_run(url, run["id"])["plan"]
    model = plan["model"]
    assert model["n_params"] > 20_000 and model["n_layers"] == 2 and model["d_model"] == 32
    if submitted_params_bytes is not None:  # the memory prediction was redone with the inspected size
        assert plan["predicted"]["memory_bytes"]["params"] != submitted_params_bytes


def test_tp_plan_that_matches_nothing_fails_before_workers_start(live_service, user_code_dir) -> None:
    url = live_service.url
    spec = _spec("byo-bad-plan", user_code_dir, layout={"tp": 2})
    spec["model"]["tp_plan"] = {"blocks.*.mlp.fc1": "colwise"}
    run = wait_for(url, submit(url, spec)["id"], {"FAILED"}, timeout_s=240)
    assert "model.tp_plan pattern 'blocks.*.mlp.fc1' matches no module" in run["status_reason"]
    assert run["attempts"] == 0 and metrics(url, run["id"]) == []

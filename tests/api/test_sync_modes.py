"""layout.sync through HTTP: the asynchronous and periodic-averaging modes are accepted where they compose and
refused with a 422 that names the field where they do not."""

from __future__ import annotations

import pytest


def _spec(**layout) -> dict:
    return {"name": "sync-modes", "layout": {"dp": 2, **layout}, "train": {"steps": 8}}


@pytest.mark.parametrize(
    "layout",
    [
        {"sync": "diloco", "sync_every_steps": 4, "outer_optimizer": {"name": "nesterov", "lr": 0.7}},
        {"sync": "local_sgd", "tp": 2, "sync_every_steps": 2},
        {"sync": "local_sgd", "dp": 4, "zero_stage": 3, "shard_group_size": 2},
        {"sync": "async_ps", "max_staleness": 4},
    ],
)
def test_supported_modes_are_accepted(client, layout) -> None:
    r = client.post("/v1/runs", json=_spec(**layout))
    assert r.status_code == 201, r.text
    assert r.json()["spec"]["layout"]["sync"] == layout["sync"]


@pytest.mark.parametrize(
    ("spec", "param", "words"),
    [
        (_spec(sync="async_ps", pp=2), "layout.pp", "async_ps"),
        (_spec(sync="async_ps", tp=2), "layout.tp", "async_ps"),
        (_spec(sync="async_ps", zero_stage=3), "layout.zero_stage", "async_ps"),
        ({**_spec(sync="async_ps", ps_shards=2)}, "optimizer.grad_clip", "ps_shards"),
        (_spec(sync="diloco", pp=2), "layout.pp", "diloco"),
        (_spec(sync="local_sgd", zero_stage=1), "layout.zero_stage", "local_sgd"),
        (_spec(sync="local_sgd", zero_stage=3), "layout.shard_group_size", "shard_group_size"),
        ({**_spec(sync="diloco"), "layout": {"dp": 1, "sync": "diloco"}}, "layout.dp", "dp >= 2"),
        (_spec(sync="diloco", sync_every_steps=0), "layout.sync_every_steps", ""),
        (_spec(sync="gossip"), "layout.sync", ""),
    ],
)
def test_unsupported_combinations_are_422_naming_the_field(client, spec, param, words) -> None:
    r = client.post("/v1/runs", json=spec)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert words in err["message"]


def test_async_ps_with_shards_and_no_clipping_is_accepted(client) -> None:
    spec = {**_spec(sync="async_ps", ps_shards=2), "optimizer": {"grad_clip": None}}
    assert client.post("/v1/runs", json=spec).status_code == 201


def test_async_ps_checkpoint_warning_and_kill_ps_fault_rules() -> None:
    from api.spec import RunSpec, check_spec

    def issues(spec: dict) -> tuple[dict, dict]:
        chk = check_spec(RunSpec.model_validate(spec))
        return {i.param: i.message for i in chk.errors}, {i.param: i.message for i in chk.warnings}

    errors, warnings = issues(_spec(sync="async_ps"))
    assert not errors and "initial parameters" in warnings["checkpoint.every_steps"]
    errors, warnings = issues({**_spec(sync="async_ps"), "checkpoint": {"every_steps": 2}})
    assert not errors and "checkpoint.every_steps" not in warnings
    errors, _ = issues({**_spec(sync="async_ps"), "faults": {"kill_ps": {"shard": 1, "at_step": 2}}})
    assert "ps_shards is 1" in errors["faults.kill_ps.shard"]
    errors, _ = issues({**_spec(sync="diloco"), "faults": {"kill_ps": {"at_step": 2}}})
    assert "async_ps" in errors["faults.kill_ps"]

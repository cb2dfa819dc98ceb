"""fault_tolerance through HTTP: replica mode is accepted for plain data parallelism and for replicas of FSDP shard
groups (HSDP), and refused with a 422 that
names the field and the fix where it does not compose; the default stays whole-group restart."""

from __future__ import annotations

import pytest


def _spec(ft: dict | None = None, **layout) -> dict:
    spec = {"name": "ft", "layout": {"dp": 2, **layout}, "batch": {"global_batch_size": 8, "micro_batch_size": 2}}
    if ft is not None:
        spec["fault_tolerance"] = ft
    return spec


def test_default_is_group_and_replica_mode_is_stored(client) -> None:
    r = client.post("/v1/runs", json=_spec())
    assert r.status_code == 201, r.text
    assert r.json()["spec"]["fault_tolerance"] == {"mode": "group", "min_replicas": 1, "batch": "keep"}
    r = client.post("/v1/runs", json=_spec({"mode": "replica", "batch": "shrink"}, dp=4))
    assert r.status_code == 201, r.text
    assert r.json()["spec"]["fault_tolerance"]["mode"] == "replica"
    run = client.get(f"/v1/runs/{r.json()['id']}").json()
    assert run["spec"]["fault_tolerance"] == {"mode": "replica", "min_replicas": 1, "batch": "shrink"}
    hung = {
        **_spec({"mode": "replica"}),
        "faults": {"hang_rank": {"rank": 1, "at_step": 3}},
        "resources": {"hang_timeout_s": 5},
    }
    r = client.post("/v1/runs", json=hung)  # a hung replica is detected and replaced in replica mode too
    assert r.status_code == 201, r.text
    assert r.json()["spec"]["resources"]["hang_timeout_s"] == 5
    hsdp = _spec({"mode": "replica", "min_replicas": 2}, dp=4, zero_stage=3, shard_group_size=2)
    r = client.post("/v1/runs", json=hsdp)  # replicas of FSDP shard groups (HSDP's replicate dimension)
    assert r.status_code == 201, r.text
    assert (r.json()["plan"]["dp_replicate"], r.json()["plan"]["dp_shard"]) == (2, 2)


@pytest.mark.parametrize(
    ("spec", "param", "words"),
    [
        (_spec({"mode": "replica"}, dp=1), "layout.dp", "dp >= 2"),
        (_spec({"mode": "replica"}, tp=2), "layout.tp", "tp 1"),
        (_spec({"mode": "replica"}, pp=2), "layout.pp", "pp 1"),
        (_spec({"mode": "replica"}, zero_stage=3), "layout.zero_stage", "shard_group_size < dp"),  # one group
        (_spec({"mode": "replica"}, zero_stage=1), "layout.zero_stage", "zero_stage 0"),
        (
            _spec({"mode": "replica"}, dp=4, zero_stage=3, shard_group_size=2, sync="diloco"),
            "layout.shard_group_size",
            "remove shard_group_size",
        ),
        (
            _spec({"mode": "replica"}, dp=4, zero_stage=3, shard_group_size=2, cpu_offload=True),
            "layout.cpu_offload",
            "false",
        ),
        (
            _spec({"mode": "replica", "min_replicas": 3}, dp=4, zero_stage=3, shard_group_size=2),
            "fault_tolerance.min_replicas",
            "1..2",
        ),
        (_spec({"mode": "replica"}, sync="async_ps"), "layout.sync", "local_sgd, diloco"),
        ({**_spec({"mode": "replica"}), "precision": "fp16"}, "precision", "bf16"),
        ({**_spec({"mode": "replica"}), "elastic": {"min_dp": 1}}, "elastic", "remove elastic"),
        (_spec({"mode": "replica", "min_replicas": 3}), "fault_tolerance.min_replicas", "1..2"),
        (_spec({"mode": "replicas"}), "fault_tolerance.mode", ""),
        (_spec({"mode": "replica", "batch": "grow"}), "fault_tolerance.batch", ""),
    ],
)
def test_replica_mode_refusals_name_the_field(client, spec, param, words) -> None:
    r = client.post("/v1/runs", json=spec)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert words in err["message"]
    if param.startswith("layout") or param in ("precision", "elastic"):
        assert "fault_tolerance.mode: group" in err["message"]  # the other way out

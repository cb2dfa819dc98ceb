"""Bounded work per request: YAML depth/size/key limits hold before libyaml builds anything (no C-stack
overflow), integers beyond 64 bits and non-physical values are 422 naming the field, the audit's huge plan is a
422 before any search."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from api.spec.yamlio import YamlLimitError, check_yaml_limits, load_yaml


def _error(r, status: int, param: str | None = "any") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    if param != "any":
        assert err["param"] == param, err
    return err


def test_deep_yaml_never_reaches_libyaml_s_recursion():
    code = "from api.spec.yamlio import load_yaml\ntry:\n    load_yaml('[' * 30000 + ']' * 30000)\n" \
           "except ValueError as e:\n    print('refused:', e)\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "nested deeper than 64" in r.stdout, (r.returncode, r.stderr[-500:])


@pytest.mark.parametrize("text,why", [
    ("- " * 70 + "x", "deeper"), ("a: " + "{b: " * 70 + "1" + "}" * 70, "deeper"),
    ("k: [" + ", ".join("1" for _ in range(20_001)) + "]", "values"),
    ("".join(f"k{i}: {i}\n" for i in range(1001)), "keys"),
    ("x" * 100, "bytes"),
])
def test_yaml_limits(text, why):
    with pytest.raises(YamlLimitError, match=why):
        check_yaml_limits(text, max_bytes=50 if why == "bytes" else 10**7)
    assert load_yaml("a: [1, {b: 3e-4}]\nc: &x [1]\nd: *x\n") == {"a": [1, {"b": 0.0003}], "c": [1], "d": [1]}


@pytest.mark.parametrize("text", [
    "[" * 30000 + "]" * 30000,  # past PyYAML's own scanner limit (6.0.4+): meshrun's limit still speaks
    "a: " + "{b: " * 1500 + "1" + "}" * 1500,
    "a: |\n  '\nb: " + "[" * 1500 + "]" * 1500,  # a quote in a block scalar hides the brackets from the pre-scan
])
def test_deep_flow_nesting_is_meshrun_s_limit_whatever_the_pyyaml_version(text):
    with pytest.raises(YamlLimitError, match="nested deeper than 64 levels"):
        load_yaml(text)


def test_brackets_in_quotes_and_comments_do_not_count_as_nesting():
    text = "a: '" + "[" * 100 + "'\nb: \"" + "{" * 100 + "\\\" [\"\n# " + "[" * 100 + "\nc: [[1]]\n"
    assert load_yaml(text) == {"a": "[" * 100, "b": "{" * 100 + '" [', "c": [[1]]}


HOSTILE_YAML = [
    ("[" * 30000 + "]" * 30000, None),
    ("model:\n  args: " + "[" * 10000 + "]" * 10000, None),
    ("model:\n  args:\n" + "".join(f"    k{i}: {i}\n" for i in range(60_000)), None),
]


def test_hostile_yaml_is_422_and_the_service_stays_up(make_client):
    c = make_client(raise_server_exceptions=False, max_request_bytes=4_000_000)
    for body, _ in HOSTILE_YAML:
        r = c.post("/v1/runs", content=body.encode(), headers={"Content-Type": "application/yaml"})
        assert _error(r, 422)["code"] == "too_large"
    assert c.get("/v1/runs").json()["total"] == 0


OUT_OF_BOUNDS = [
    ({"model": {"args": {f"k{i}": i for i in range(60_000)}}}, "model.args"),
    ({"labels": {f"k{i}": "v" for i in range(1001)}}, "labels"),
    ({"model": {"args": {"x": int("1" + "0" * 4000)}}}, "model.args.x"),
    ({"model": {"args": {"x": [-(2**63) - 1]}}}, "model.args.x.0"),
    ({"train": {"seed": 2**64}}, "train.seed"),
    ({"optimizer": {"betas": [5, -3]}}, "optimizer.betas.0"),
    ({"optimizer": {"betas": [0.9, 1.0]}}, "optimizer.betas.1"),
    ({"optimizer": {"betas": [-0.1, 0.9]}}, "optimizer.betas.0"),
    ({"optimizer": {"grad_clip": 1e300}}, "optimizer.grad_clip"),
]


def test_out_of_bounds_values_are_422_naming_the_field(make_client):
    c = make_client(raise_server_exceptions=False, max_request_bytes=4_000_000)
    for body, param in OUT_OF_BOUNDS:
        r = c.post("/v1/runs", content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        _error(r, 422, param)
    ok = c.post("/v1/runs", json={"optimizer": {"betas": [0.0, 0.999]}, "model": {"args": {"x": 2**63 - 1}}})
    assert ok.status_code == 201, ok.text


def test_the_audit_s_huge_plan_is_a_422_before_any_search(client):
    r = client.post("/v1/plans", json={"model": {"name": "gpt", "preset": "7b"},
                                       "cluster": {"gpus_per_node": 1024, "nodes": 100000},
                                       "global_batch_size": 10000000, "top_k": 1000})
    assert _error(r, 422, "cluster.nodes")["code"] == "too_large"

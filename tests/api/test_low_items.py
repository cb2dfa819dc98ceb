"""The audit's low items (issue 34): hostile cursors and numbers are 4xx (never a 500 that drops the connection),
a custom data entrypoint returning a non-dataset is a clear error that survives Ray's pickling, and the OpenAPI
schema states what the server refuses."""

from __future__ import annotations

import base64
import json
import pickle

from tests.api.test_security import SPEC, _error


def _cursor(*values) -> str:
    raw = json.dumps(list(values), separators=(",", ":"), ensure_ascii=True).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def test_runs_cursor_with_a_lone_surrogate_is_422(make_client):
    c = make_client(raise_server_exceptions=False)
    c.post("/v1/runs", json=SPEC)
    for cur in (_cursor("runs", "2026-01-01T00:00:00", "\ud800"), _cursor("runs", "\udfff", "run-1"),
                _cursor("runs", "2026-01-01T00:00:00", "a\x00b"), _cursor("\ud800", "x", "y")):
        err = _error(c.get("/v1/runs", params={"cursor": cur}), 422)
        assert err["param"] == "cursor", err
    # characters outside the cursor alphabet are refused by the schema's pattern
    for raw in ("%ED%A0%80", "%F0%9F%92%A5", "%00"):  # a lone surrogate as (invalid) UTF-8, an emoji, NUL
        assert _error(c.get(f"/v1/runs?cursor={raw}"), 422)["param"] == "cursor", raw
    assert _error(c.get("/v1/runs", params={"cursor": "abc=="}), 422)["param"] == "cursor"
    # the connection still serves the next request
    assert c.get("/v1/runs").status_code == 200


def test_negative_cursor_offsets_are_422(client):
    run = client.post("/v1/runs", json=SPEC).json()
    err = _error(client.get(f"/v1/runs/{run['id']}/logs", params={"cursor": _cursor("logs", -5)}), 422)
    assert err["param"] == "cursor"
    err = _error(client.get(f"/v1/runs/{run['id']}/metrics", params={"cursor": _cursor("metrics", 0, -1)}), 422)
    assert err["param"] == "cursor"


def test_plan_form_with_an_absurd_memory_is_4xx(make_client):
    c = make_client(raise_server_exceptions=False)
    form = "preset=tiny&device=H100&gpus_per_node=8&nodes=1&global_batch_size=8&memory_gib="
    headers = {"Content-Type": "application/x-www-form-urlencoded"}
    for value in ("1e308", "1e400", "inf", "9" * 400):
        r = c.post("/ui/plan", content=form + value, headers=headers)
        assert r.status_code == 422, (value, r.status_code, r.text[:300])
        assert "memory_gib" in r.text and "out of range" in r.text
    r = c.post("/ui/plan", content=form.replace("memory_gib=", "peak_tflops=1e308&memory_gib=80"), headers=headers)
    assert r.status_code == 422 and "peak_tflops" in r.text
    assert c.post("/ui/plan", content=form + "80", headers=headers).status_code == 200


def test_custom_data_returning_a_non_dataset_is_a_clear_error_across_pickling(tmp_path):
    from api.spec import DataSpec
    from workers.data import make_source
    from workers.user_code import UserCodeError

    try:
        make_source(DataSpec(source="custom", entrypoint="os:getpid"), seq_len=8, vocab_size=16, seed=0)
    except UserCodeError as e:
        err = e
    else:
        raise AssertionError("a non-dataset was accepted")
    back = pickle.loads(pickle.dumps(err))  # what Ray does between the worker and the driver
    assert isinstance(back, UserCodeError) and back.param == "data.entrypoint"
    assert "returned int, not a map-style dataset" in str(back) and str(back) == str(err)


def test_openapi_states_what_the_server_refuses(client):
    schema = client.get("/openapi.json").json()
    params = {p["name"]: p for p in schema["paths"]["/v1/runs"]["get"]["parameters"]}
    cursor = params["cursor"]["schema"]
    cursor = next((s for s in cursor.get("anyOf", [cursor]) if s.get("type") == "string"), cursor)
    assert cursor["pattern"] == "^[A-Za-z0-9_-]*$"
    comps = schema["components"]["schemas"]
    path = comps["DataSpec"]["properties"]["path"]
    path = next(s for s in path.get("anyOf", [path]) if s.get("type") == "string")
    assert path["minLength"] == 1
    assert "zero_stage 2 or 3" in comps["Layout"]["properties"]["shard_group_size"]["description"]
    # and the server agrees
    err = _error(client.post("/v1/runs", json={**SPEC, "data": {"source": "text", "path": ""}}), 422)
    assert err["param"] == "data.path"
    hsdp = {**SPEC, "layout": {"dp": 2, "zero_stage": 0, "shard_group_size": 1}}
    assert "zero_stage" in _error(client.post("/v1/runs", json=hsdp), 422)["message"]

"""Property-based: arbitrary Unicode (lone surrogates, NUL, control and bidi characters, path tricks) in every
string field of the run, sweep and plan requests, as values and as mapping keys, never gives a 5xx; every error has
the one error body, and a stored run reads back."""

from __future__ import annotations

import json
import types
import typing
from typing import Any, Literal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from api.spec import PlanRequest, RunSpec, SweepCreate

TRICKY = ["\ud800", "\udfff", "\ud83d", "\x00", "\n", "\r", "\u202e", "\ufeff", "%2e%2e", "..", "/", "~", "::",
          "\\", "'", '"', "{", "$(", "é", "🚀", "\U0010ffff"]
TEXT = st.one_of(
    st.text(max_size=40),
    st.text(st.characters(codec=None, exclude_categories=()), max_size=20),  # surrogates included
    st.lists(st.sampled_from(TRICKY), max_size=6).map("".join),
)


def _string_paths(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], str]]:
    """(path, how) for every string-typed field: how = "value" (the field) or "key" (a key of a mapping)."""
    out: list[tuple[tuple[str, ...], str]] = []
    for name, field in model.model_fields.items():
        path = (*prefix, name)
        todo: list[Any] = [field.annotation]
        while todo:
            ann = todo.pop()
            origin, args = typing.get_origin(ann), typing.get_args(ann)
            if ann is str or origin is Literal and any(isinstance(a, str) for a in args):
                out.append((path, "value"))
            elif isinstance(ann, type) and issubclass(ann, BaseModel):
                out.extend(_string_paths(ann, path))
            elif origin is dict:
                out.extend([((*path, "k"), "value"), (path, "key")])
            elif origin is list and args and args[0] is str:
                out.append(((*path, "0"), "value"))
            elif origin in (typing.Union, types.UnionType):
                todo.extend(args)
    return out


def _with(body: dict, path: tuple[str, ...], how: str, text: str) -> dict:
    body = json.loads(json.dumps(body))
    node = body
    for part in path[:-1]:
        nxt = node.get(part)
        if not isinstance(nxt, dict):
            nxt = node[part] = {}
        node = nxt
    last = path[-1]
    if how == "key":
        node[last] = {text: "x"}
    elif last == "0":
        node[last] = [text]
    else:
        node[last] = text
    return body


def _post(client, url: str, body: dict):
    data = json.dumps(body, ensure_ascii=True)  # \\ud800 escapes: the service sees the lone surrogate
    return client.post(url, content=data.encode(), headers={"Content-Type": "application/json"})


def _check(r) -> None:
    assert r.status_code < 500, r.text
    body = json.loads(r.content)
    if r.status_code >= 400:
        assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "param"}, body


RUN = {"name": "fz", "layout": {"dp": 1}, "batch": {"global_batch_size": 4, "micro_batch_size": 2}}
ENDPOINTS = {
    "/v1/runs": (RunSpec, RUN),
    "/v1/sweeps": (SweepCreate, {"name": "fz", "base": RUN}),
    "/v1/plans": (PlanRequest, {"model": {"name": "gpt", "preset": "tiny"}, "global_batch_size": 8,
                                "cluster": {"device": "H100", "gpus_per_node": 2}, "layout": {"dp": 2}}),
}


@pytest.mark.parametrize("url", list(ENDPOINTS))
def test_any_unicode_in_any_string_field_is_never_a_5xx(make_client, url):
    model, base = ENDPOINTS[url]
    paths = _string_paths(model)
    assert len(paths) > 10
    client = make_client(raise_server_exceptions=False)
    for path, how in paths:  # every field meets each of the audit's strings at least once
        for text in ("\ud800", "a\udfffb", "\x00", "\u202e\n", "%2e%2e/~"):
            _check(_post(client, url, _with(base, path, how, text)))

    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(where=st.sampled_from(paths), text=TEXT)
    def prop(where, text):
        path, how = where
        r = _post(client, url, _with(base, path, how, text))
        _check(r)
        if url == "/v1/runs" and r.status_code == 201:
            _check(client.get(f"/v1/runs/{r.json()['id']}"))

    prop()
    _check(client.get("/v1/runs"))

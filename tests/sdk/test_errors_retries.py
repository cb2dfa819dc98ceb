"""SDK behaviour that needs no server: error mapping, retry policy, idempotency keys, tolerant parsing.
An httpx.MockTransport plays the service (each test's handler is the server)."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import httpx
import pytest

from api import client as sdk
from api.spec import RunSpec
from api.sdk._base import tolerant_validate

NOW = datetime(2026, 1, 1, tzinfo=timezone.utc).isoformat()


def run_body(**over):
    body = {"id": "run_1", "name": "r", "project": "default", "status": "QUEUED", "spec": RunSpec().model_dump(mode="json"),
            "created_at": NOW, "updated_at": NOW}
    body.update(over)
    return body


def error(status, code, message, param=None, headers=None):
    return httpx.Response(status, json={"error": {"code": code, "message": message, "param": param}},
                          headers=headers)


def make_client(handler, **kw):
    c = sdk.Client("http://meshrun.test", transport=httpx.MockTransport(handler), **kw)
    c.sleeps = []
    c._sleep = c.sleeps.append  # record backoff delays instead of sleeping
    return c


@pytest.mark.parametrize("status,cls", [
    (400, sdk.BadRequestError), (401, sdk.AuthenticationError), (403, sdk.PermissionDeniedError),
    (404, sdk.NotFoundError), (409, sdk.ConflictError), (422, sdk.ValidationError), (429, sdk.RateLimitError),
    (500, sdk.ServerError), (503, sdk.ServerError), (418, sdk.APIStatusError),
])
def test_each_status_maps_to_its_class_with_code_message_param(status, cls):
    c = make_client(lambda req: error(status, "some_code", "what to do", "layout.tp"), max_retries=0)
    with pytest.raises(cls) as ei:
        c.runs.get("run_x")
    e = ei.value
    assert type(e) is cls
    assert isinstance(e, sdk.APIStatusError) and isinstance(e, sdk.MeshrunError)
    assert (e.status_code, e.code, e.message, e.param) == (status, "some_code", "what to do", "layout.tp")
    assert "what to do" in str(e) and "layout.tp" in str(e)


def test_non_json_error_body_still_raises_with_status():
    c = make_client(lambda req: httpx.Response(502, text="<html>bad gateway</html>"), max_retries=0)
    with pytest.raises(sdk.ServerError) as ei:
        c.runs.get("x")
    assert ei.value.status_code == 502 and "bad gateway" in ei.value.message


@pytest.mark.parametrize("status", [408, 429, 500, 502, 503, 504])
def test_retries_transient_statuses_then_succeeds(status):
    calls = []

    def handler(req):
        calls.append(req)
        return error(status, "x", "try later") if len(calls) < 3 else httpx.Response(200, json=run_body())

    c = make_client(handler, max_retries=2)
    assert c.runs.get("run_1").id == "run_1"
    assert len(calls) == 3 and len(c.sleeps) == 2
    assert c.sleeps[1] > c.sleeps[0] * 1.2  # exponential backoff (with at most 25% jitter)


@pytest.mark.parametrize("status", [400, 401, 403, 404, 409, 422])
def test_never_retries_client_errors(status):
    calls = []

    def handler(req):
        calls.append(req)
        return error(status, "x", "no")

    c = make_client(handler, max_retries=5)
    with pytest.raises(sdk.APIStatusError):
        c.runs.get("run_1")
    assert len(calls) == 1 and c.sleeps == []


def test_retries_give_up_after_max_retries():
    calls = []
    c = make_client(lambda req: calls.append(req) or error(503, "unavailable", "down"), max_retries=3)
    with pytest.raises(sdk.ServerError):
        c.runs.get("run_1")
    assert len(calls) == 4


def test_429_honours_retry_after_seconds_and_ms():
    answers = [error(429, "rate_limited", "slow down", headers={"Retry-After": "3"}),
               error(429, "rate_limited", "slow down", headers={"retry-after-ms": "250"}),
               httpx.Response(200, json=run_body())]
    c = make_client(lambda req: answers.pop(0), max_retries=2)
    c.runs.get("run_1")
    assert c.sleeps == [3.0, 0.25]


def test_rate_limit_error_after_retries_exhausted():
    c = make_client(lambda req: error(429, "rate_limited", "slow down", headers={"Retry-After": "1"}),
                    max_retries=1)
    with pytest.raises(sdk.RateLimitError) as ei:
        c.runs.list()
    assert ei.value.status_code == 429 and c.sleeps == [1.0]


def test_connection_errors_are_retried_then_raised_as_api_connection_error():
    calls = []

    def handler(req):
        calls.append(req)
        raise httpx.ConnectError("refused", request=req)

    c = make_client(handler, max_retries=2)
    with pytest.raises(sdk.APIConnectionError) as ei:
        c.runs.get("run_1")
    assert len(calls) == 3 and "meshrun.test" in ei.value.message
    assert not isinstance(ei.value, sdk.APITimeoutError)


def test_timeouts_raise_api_timeout_error():
    def handler(req):
        raise httpx.ReadTimeout("slow", request=req)

    c = make_client(handler, max_retries=1)
    with pytest.raises(sdk.APITimeoutError):
        c.runs.get("run_1")
    assert len(c.sleeps) == 1


def test_post_retries_reuse_one_idempotency_key_and_calls_get_distinct_keys():
    keys = []

    def handler(req):
        keys.append(req.headers.get("Idempotency-Key"))
        if len(keys) == 1:
            raise httpx.ReadError("connection reset after the server got the request", request=req)
        return httpx.Response(201, json=run_body())

    c = make_client(handler, max_retries=2)
    c.runs.create({"name": "r"})
    assert len(keys) == 2 and keys[0] and keys[0] == keys[1]
    c.runs.create({"name": "r"})
    assert keys[2] != keys[0]  # a new logical call gets a new key
    c.runs.create({"name": "r"}, idempotency_key="mine-1")
    assert keys[3] == "mine-1"


def test_get_requests_carry_no_idempotency_key_and_auth_header_when_token():
    seen = []
    c = make_client(lambda req: seen.append(req) or httpx.Response(200, json=run_body()), token="msr_abc")
    c.runs.get("run_1")
    assert "Idempotency-Key" not in seen[0].headers
    assert seen[0].headers["Authorization"] == "Bearer msr_abc"
    assert seen[0].headers["User-Agent"].startswith("meshrun-python/")


def test_env_fallback(monkeypatch):
    monkeypatch.setenv("MESHRUN_URL", "http://example.invalid:9/")
    monkeypatch.setenv("MESHRUN_TOKEN", "msr_env")
    c = sdk.Client()
    assert c.base_url == "http://example.invalid:9" and c.token == "msr_env"
    monkeypatch.delenv("MESHRUN_URL")
    monkeypatch.delenv("MESHRUN_TOKEN")
    c = sdk.Client()
    assert c.base_url == "http://127.0.0.1:8000" and c.token is None


def test_responses_tolerate_unknown_fields_also_inside_the_strict_spec():
    body = run_body(new_top_level={"x": 1})
    body["spec"]["layout"]["new_layout_knob"] = 7
    body["spec"]["brand_new_section"] = {"a": 1}
    body["summary"] = {"steps_done": 3, "future_metric": 1.0}
    run = tolerant_validate(sdk.Run, body)
    assert run.spec.layout.dp == 1 and run.summary.steps_done == 3


def test_real_validation_errors_in_responses_are_not_swallowed():
    import pydantic

    with pytest.raises(pydantic.ValidationError):
        tolerant_validate(sdk.Run, run_body(status="NOT_A_STATUS"))


def test_list_sends_filters_and_create_sends_overrides():
    seen = []

    def handler(req):
        seen.append(req)
        if req.method == "GET":
            return httpx.Response(200, json={"items": [run_body()], "total": 1, "limit": 5, "offset": 0})
        return httpx.Response(201, json=run_body())

    c = make_client(handler)
    page = c.runs.list(status=["running", sdk.RunStatus.QUEUED], name="n", limit=5)
    q = seen[0].url.params
    assert q.get_list("status") == ["RUNNING", "QUEUED"] and q["name"] == "n" and q["limit"] == "5"
    assert isinstance(page.items[0], sdk.Run)
    c.runs.create({"name": "r", "layout": {"dp": 2}}, overrides=["layout.tp=2", "train.steps=7", "name=x"])
    sent = json.loads(seen[1].content)
    assert sent == {"name": "x", "layout": {"dp": 2, "tp": 2}, "train": {"steps": 7}}


def test_resume_parses_layout_string():
    seen = []
    c = make_client(lambda req: seen.append(req) or httpx.Response(200, json=run_body()))
    c.runs.resume("run_1", layout="dp=2,tp=1,zero=3", steps=40)
    posts = [r for r in seen if r.method == "POST"]
    assert len(posts) == 1 and json.loads(posts[0].content) == {"layout": {"dp": 2, "tp": 1, "zero_stage": 3},
                                                                "steps": 40}
    assert posts[0].url.path == "/v1/runs/run_1/resume"


def test_bad_override_and_layout_are_validation_errors():
    with pytest.raises(sdk.ValidationError):
        sdk.apply_overrides({}, ["no_equals_sign"])
    with pytest.raises(sdk.ValidationError):
        sdk.parse_layout("dp2")
    assert sdk.parse_layouts("dp=2; tp=2,sp=true") == [{"dp": 2}, {"tp": 2, "sequence_parallel": True}]
    assert sdk.parse_layouts("auto") == "auto"


def test_wait_polls_until_terminal_and_times_out():
    states = iter(["QUEUED", "RUNNING", "RUNNING", "SUCCEEDED"])

    def handler(req):
        if req.url.path.endswith("/metrics"):
            return httpx.Response(200, json={"run_id": "run_1", "items": []})
        return httpx.Response(200, json=run_body(status=next(states)))

    c = make_client(handler)
    assert c.runs.wait("run_1", poll_interval_s=0.001).status == sdk.RunStatus.SUCCEEDED

    c2 = make_client(lambda req: httpx.Response(200, json=run_body(status="RUNNING")))
    with pytest.raises(sdk.WaitTimeoutError):
        c2.runs.wait("run_1", timeout=0.05, poll_interval_s=0.01)


def test_wait_raise_on_failure():
    c = make_client(lambda req: httpx.Response(200, json=run_body(status="FAILED", status_reason="OOM on rank 3")))
    assert c.runs.wait("run_1").status == sdk.RunStatus.FAILED
    with pytest.raises(sdk.RunFailedError, match="OOM on rank 3"):
        c.runs.wait("run_1", raise_on_failure=True)


def test_wait_progress_reports_steps_and_uses_since_step(capsys):
    from rich.console import Console

    statuses = iter(["RUNNING", "RUNNING", "SUCCEEDED"])
    since = []

    def handler(req):
        if req.url.path.endswith("/metrics"):
            s = int(req.url.params.get("since_step", 0))
            since.append(s)
            rows = [{"step": k, "loss": 5.0 - k * 0.1, "tokens_per_s": 1000.0} for k in range(s + 1, min(s + 4, 51))]
            return httpx.Response(200, json={"run_id": "run_1", "items": rows})
        return httpx.Response(200, json=run_body(status=next(statuses)))

    console = Console(record=True, width=200, force_terminal=False)
    c = make_client(handler)
    run = c.runs.wait("run_1", progress=console, poll_interval_s=0.001)
    assert run.status == sdk.RunStatus.SUCCEEDED
    assert since == [0, 3, 6]
    text = console.export_text()
    assert "9/50" in text and "loss 4.1000" in text and "tok/s" in text


# ------------------------------------------------------------------------------- retried cancel / resume
def _state_machine_server(status: str, attempts: int, *, lose_first_answer: bool):
    """A run store behind a MockTransport: cancel/resume change the state (409 when not allowed); with
    ``lose_first_answer`` the first state-changing POST takes effect but its answer is a 503."""
    run = {"status": status, "attempts": attempts}
    posts = []

    def handler(req):
        if req.method == "GET":
            return httpx.Response(200, json=run_body(**run))
        posts.append(req.headers.get("Idempotency-Key"))
        action = req.url.path.rsplit("/", 1)[-1]
        allowed = {"cancel": ("QUEUED", "STARTING", "RUNNING"), "resume": ("FAILED", "CANCELLED")}[action]
        if run["status"] not in allowed:
            return error(409, "conflict", f"run is {run['status']}", "status")
        run["status"] = "CANCELLED" if action == "cancel" else "QUEUED"
        if lose_first_answer and len(posts) == 1:
            return error(503, "unavailable", "proxy lost the answer")
        return httpx.Response(200, json=run_body(**run))

    return handler, posts


def test_retried_cancel_whose_first_attempt_succeeded_returns_the_cancelled_run():
    handler, posts = _state_machine_server("RUNNING", 1, lose_first_answer=True)
    run = make_client(handler, max_retries=2).runs.cancel("run_1")
    assert run.status == "CANCELLED" and len(posts) == 2 and posts[0] == posts[1]


def test_retried_resume_whose_first_attempt_succeeded_returns_the_requeued_run():
    handler, posts = _state_machine_server("FAILED", 1, lose_first_answer=True)
    run = make_client(handler, max_retries=2).runs.resume("run_1", steps=10)
    assert run.status == "QUEUED" and len(posts) == 2


def test_conflicts_without_a_retry_still_raise():
    handler, _ = _state_machine_server("SUCCEEDED", 1, lose_first_answer=False)
    c = make_client(handler, max_retries=2)
    with pytest.raises(sdk.ConflictError):
        c.runs.cancel("run_1")  # a finished run cannot be cancelled: no retry happened, the 409 stands
    with pytest.raises(sdk.ConflictError):
        c.runs.resume("run_1")  # SUCCEEDED is final
    handler, _ = _state_machine_server("RUNNING", 1, lose_first_answer=False)
    with pytest.raises(sdk.ConflictError):
        make_client(handler, max_retries=2).runs.resume("run_1")  # already running before the call


def test_retried_resume_of_a_run_that_was_already_running_still_raises():
    calls = []

    def handler(req):
        if req.method == "GET":
            return httpx.Response(200, json=run_body(status="RUNNING", attempts=1))
        calls.append(req)
        return error(503, "x", "busy") if len(calls) == 1 else error(409, "conflict", "run is RUNNING")

    with pytest.raises(sdk.ConflictError):
        make_client(handler, max_retries=2).runs.resume("run_1")
    assert len(calls) == 2

"""The SDK against a live uvicorn running the real API (SQLite, no scheduler). Worker progress is played
through the store (FakeWorker) so the lifecycle runs in seconds; real training is in tests/cli/test_quickstart.py."""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
import pytest

from api import client as sdk
from api.spec import Layout, RunSpec

from .conftest import FakeWorker

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def uname(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


# --------------------------------------------------------------------------------------------- lifecycle
def test_create_from_yaml_dict_and_model(client):
    a = client.runs.create(EXAMPLES / "dp.yaml", overrides=[f"name={uname()}"])
    b = client.runs.create({"name": uname(), "layout": {"dp": 2}, "train": {"steps": 5}})
    c = client.runs.create(RunSpec(name=uname(), layout=Layout(tp=2)))
    for run in (a, b, c):
        assert isinstance(run, sdk.Run) and isinstance(run, sdk.RunPublic)
        assert run.status == sdk.RunStatus.QUEUED and run.plan is not None
    assert (a.plan.world_size, b.spec.train.steps, c.spec.layout.tp) == (2, 5, 2)
    assert client.runs.get(a.id).id == a.id


def test_full_lifecycle_with_progress_metrics_and_dataframe(api_server, client):
    from rich.console import Console

    run = client.runs.create({"name": uname("life"), "train": {"steps": 12}})
    worker = FakeWorker(api_server, run.id, steps=12).start()
    console = Console(record=True, width=160, force_terminal=False)
    final = run.wait(progress=console, poll_interval_s=0.05, timeout=60)
    worker.join()
    assert final is run and run.status == sdk.RunStatus.SUCCEEDED and run.done
    assert run.summary is not None and run.summary.steps_done == 12
    assert "12/12" in console.export_text()
    rows = run.metrics()
    assert [r.step for r in rows] == list(range(1, 13))
    assert rows[-1].loss == pytest.approx(5.0 / 12)
    assert [r.step for r in client.runs.metrics(run.id, since_step=10)] == [11, 12]
    df = run.metrics_df()
    assert list(df.index) == list(range(1, 13)) and df.loc[12, "tokens_per_s"] == 1012.0
    kinds = [(e.from_status, e.to_status) for e in run.events() if e.kind == "state"]
    assert kinds == [(None, "QUEUED"), ("QUEUED", "STARTING"), ("STARTING", "RUNNING"), ("RUNNING", "SUCCEEDED")]
    assert run.checkpoints() == []


def test_failed_run_wait_returns_it_or_raises(api_server, client):
    run = client.runs.create({"name": uname("fail"), "train": {"steps": 10}})
    FakeWorker(api_server, run.id, steps=10, fail_at=3).start()
    final = client.runs.wait(run.id, poll_interval_s=0.05, timeout=60)
    assert final.status == sdk.RunStatus.FAILED and "step 3" in final.status_reason
    with pytest.raises(sdk.RunFailedError, match="step 3"):
        client.runs.wait(run.id, raise_on_failure=True)


def test_list_filters_and_iter(client):
    name = uname("list")
    ids = [client.runs.create({"name": name}).id for _ in range(3)]
    page = client.runs.list(name=name, limit=2)
    assert page.total == 3 and len(page.items) == 2 and page.items[0].id == ids[-1]  # newest first
    assert [r.id for r in client.runs.iter(name=name, page_size=2)] == ids[::-1]
    client.runs.cancel(ids[0])
    assert [r.id for r in client.runs.list(name=name, status="CANCELLED").items] == [ids[0]]
    assert {r.id for r in client.runs.list(name=name, status=["QUEUED", "CANCELLED"]).items} == set(ids)


def test_cancel_then_conflict(client):
    run = client.runs.create({"name": uname("cancel")})
    assert run.cancel().status == sdk.RunStatus.CANCELLED
    with pytest.raises(sdk.ConflictError) as ei:
        client.runs.cancel(run.id)
    assert ei.value.status_code == 409 and ei.value.param == "status"


# ---------------------------------------------------------------------------------------- error mapping
def test_404_not_found(client):
    with pytest.raises(sdk.NotFoundError) as ei:
        client.runs.get("run-doesnotexist")
    assert ei.value.status_code == 404 and ei.value.code == "not_found" and ei.value.param == "run_id"


@pytest.mark.parametrize("body,param,words", [
    ({"layout": {"tp": 3}}, "layout.tp", "use tp in"),
    ({"layout": {"dpp": 2}}, "layout.dpp", "unknown field"),
    ({"batch": {"global_batch_size": 10, "micro_batch_size": 4}, "layout": {"dp": 1}}, "batch.global_batch_size",
     "multiple"),
    ({"train": {"steps": 0}}, "train.steps", ""),
])
def test_422_carries_param_and_message(client, body, param, words):
    with pytest.raises(sdk.ValidationError) as ei:
        client.runs.create(body)
    assert ei.value.status_code == 422 and ei.value.param == param and words in ei.value.message


def test_422_from_query_validation(client):
    with pytest.raises(sdk.ValidationError) as ei:
        client.runs.list(limit=0)
    assert ei.value.param and "limit" in ei.value.param


def test_503_without_runtime_is_a_server_error(client):
    run = client.runs.create({"name": uname()})
    with pytest.raises(sdk.ServerError) as ei:
        run.logs()
    assert ei.value.status_code == 503 and ei.value.code == "runtime_unavailable"


def test_connection_error_when_nothing_listens():
    from .conftest import free_port

    c = sdk.Client(f"http://127.0.0.1:{free_port()}", max_retries=1)
    c._sleep = lambda s: None
    with pytest.raises(sdk.APIConnectionError, match="meshrun serve"):
        c.runs.list()


def test_401_403_and_project_scoping_with_auth_on(auth_server):
    url, tokens = auth_server.url, auth_server.tokens
    with pytest.raises(sdk.AuthenticationError) as ei:
        sdk.Client(url, token=None, max_retries=0).runs.list()
    assert ei.value.status_code == 401
    with pytest.raises(sdk.AuthenticationError):
        sdk.Client(url, token="msr_not-a-real-token", max_retries=0).runs.list()
    alice, bob = sdk.Client(url, token=tokens["a"], max_retries=0), sdk.Client(url, token=tokens["b"], max_retries=0)
    run = alice.runs.create({"name": uname("auth")})
    assert run.project == "proj-a"
    with pytest.raises(sdk.NotFoundError):  # another project's run does not leak
        bob.runs.get(run.id)
    user_code = {"name": uname(), "model": {"name": "custom", "preset": None, "entrypoint": "mypkg.models:build"}}
    with pytest.raises(sdk.PermissionDeniedError) as ei:
        alice.runs.create(user_code)
    assert ei.value.status_code == 403


def test_429_rate_limited_server(tmp_path):
    from .conftest import run_server

    with run_server(tmp_path, rate_limit_per_minute=30) as srv:  # bursts of 30, then one every 2 s
        c = sdk.Client(srv.url, max_retries=0)
        for _ in range(30):
            c.runs.list(limit=1)
        with pytest.raises(sdk.RateLimitError) as ei:
            c.runs.list()
        assert ei.value.status_code == 429
        assert float(ei.value.response.headers["Retry-After"]) > 0
        # with retries the client sleeps what Retry-After says, then succeeds
        slept = []
        c2 = sdk.Client(srv.url, max_retries=1)
        c2._sleep = lambda s: (slept.append(s), __import__("time").sleep(s))
        c2.runs.list()
        assert len(slept) == 1 and slept[0] >= 1


# --------------------------------------------------------------------------- retries + idempotency keys
class FlakyTransport(httpx.BaseTransport):
    """Forwards to the real server, but for the first ``failures`` POSTs throws the answer away after the server
    has processed the request: ``mode="drop"`` (connection reset) or ``mode="503"`` (a proxy's 503)."""

    def __init__(self, *, failures: int = 1, mode: str = "drop", strip_key: bool = False) -> None:
        self.inner = httpx.HTTPTransport()
        self.failures, self.mode, self.strip_key = failures, mode, strip_key
        self.posts: list[httpx.Request] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if self.strip_key and "Idempotency-Key" in request.headers:
            del request.headers["Idempotency-Key"]
        response = self.inner.handle_request(request)
        if request.method != "POST":
            return response
        self.posts.append(request)
        if len(self.posts) <= self.failures:
            response.read()
            response.close()
            if self.mode == "drop":
                raise httpx.ReadError("connection reset by peer", request=request)
            return httpx.Response(503, json={"error": {"code": "unavailable", "message": "proxy hiccup"}},
                                  request=request)
        return response


@pytest.mark.parametrize("mode", ["drop", "503"])
def test_retried_post_with_same_key_creates_one_run(api_server, mode):
    transport = FlakyTransport(failures=2, mode=mode)
    c = sdk.Client(api_server.url, transport=transport, max_retries=3)
    c._sleep = lambda s: None
    name = uname(f"idem-{mode}")
    run = c.runs.create({"name": name})
    assert len(transport.posts) == 3  # the server saw the submission three times
    keys = {p.headers["Idempotency-Key"] for p in transport.posts}
    assert len(keys) == 1
    listed = sdk.Client(api_server.url).runs.list(name=name)
    assert listed.total == 1 and listed.items[0].id == run.id


def test_without_idempotency_key_the_same_failure_duplicates(api_server):
    # the control experiment: what the key prevents
    transport = FlakyTransport(failures=1, mode="drop", strip_key=True)
    c = sdk.Client(api_server.url, transport=transport, max_retries=2)
    c._sleep = lambda s: None
    name = uname("nokey")
    c.runs.create({"name": name})
    assert sdk.Client(api_server.url).runs.list(name=name).total == 2


def test_explicit_idempotency_key_dedupes_across_clients(api_server):
    key = f"my-job-{uuid.uuid4().hex}"
    body = {"name": uname()}
    a = sdk.Client(api_server.url).runs.create(body, idempotency_key=key)
    b = sdk.Client(api_server.url).runs.create(body, idempotency_key=key)
    assert a.id == b.id
    with pytest.raises(sdk.ConflictError) as ei:  # the same key for a different spec is refused, not merged
        sdk.Client(api_server.url).runs.create({"name": uname()}, idempotency_key=key)
    assert ei.value.param == "Idempotency-Key"


def test_plans_create_keywords_and_file(client):
    resp = client.plans.create(model={"name": "gpt", "preset": "7b"},
                               cluster={"device": "H100", "gpus_per_node": 8, "nodes": 4}, global_batch_size=512,
                               top_k=3)
    assert 1 <= len(resp.candidates) <= 3 and all(c.feasible for c in resp.candidates)
    one = client.plans.create(EXAMPLES / "plan-7b.yaml", layout="dp=4,tp=8,pp=1", top_k=1)
    assert [(c.layout.dp, c.layout.tp) for c in one.candidates] == [(4, 8)]
    with pytest.raises(sdk.ValidationError) as ei:
        client.plans.create(model={"name": "gpt", "preset": "7b"}, global_batch_size=512, layout="tp=3")
    assert ei.value.param and ei.value.param.startswith("layout")


def test_plans_create_prices_and_ranks_by_cost(client):
    kw = dict(model={"name": "gpt", "preset": "125m"}, global_batch_size=64, micro_batch_size=4, top_k=2, steps=100,
              cluster={"device": "H100", "gpus_per_node": 8, "price_per_device_hour": 2.0})
    fast, cheap = client.plans.create(**kw), client.plans.create(**kw, rank_by="cost")
    assert fast.candidates[0].cost.devices == 8 and fast.candidates[0].cost.price_source == "request"
    assert cheap.candidates[0].cost.usd_for_steps < fast.candidates[0].cost.usd_for_steps
    with pytest.raises(sdk.ValidationError) as ei:
        client.plans.create(**{**kw, "cluster": {"device": "H100", "price_per_device_hour": -1}})
    assert ei.value.param == "cluster.price_per_device_hour"


# ------------------------------------------------------------------------------------ YAML 1.2 numbers
def test_exponent_floats_from_set_and_yaml_files_submit(client, tmp_path):
    run = client.runs.create({"name": uname("lr")}, overrides=["optimizer.lr=1e-3", "optimizer.weight_decay=1E-2"])
    assert (run.spec.optimizer.lr, run.spec.optimizer.weight_decay) == (1e-3, 1e-2)
    spec = tmp_path / "lr.yaml"
    spec.write_text(f"name: {uname('lr')}\noptimizer:\n  lr: 3e-4\n  min_lr_ratio: 5e-2\ntrain:\n  steps: 10\n")
    run = client.runs.create(spec)
    assert (run.spec.optimizer.lr, run.spec.optimizer.min_lr_ratio) == (3e-4, 5e-2)
    assert sdk.load_file(spec)["optimizer"]["lr"] == 3e-4


def test_yaml_request_body_reads_exponent_floats(api_server):
    body = f"name: {uname('yaml')}\noptimizer:\n  lr: 2e-4\n".encode()
    r = httpx.post(f"{api_server.url}/v1/runs", content=body, headers={"Content-Type": "application/yaml"})
    assert r.status_code == 201, r.text
    assert r.json()["spec"]["optimizer"]["lr"] == 2e-4


def test_validate_accepts_exactly_what_submit_accepts(client, tmp_path):
    from typer.testing import CliRunner

    from api.cli import app

    runner = CliRunner()
    good = tmp_path / "good.yaml"
    good.write_text(f"name: {uname('v')}\noptimizer:\n  lr: 3e-4\n")
    r = runner.invoke(app, ["validate", str(good), "--set", "optimizer.lr=1e-3"])
    assert r.exit_code == 0, r.output
    assert client.runs.create(good, overrides=["optimizer.lr=1e-3"]).spec.optimizer.lr == 1e-3

    strict = tmp_path / "strict.yaml"  # a quoted number: the server's strict JSON parse refuses it
    strict.write_text(f"name: {uname('v')}\ntrain:\n  steps: '12'\n")
    r = runner.invoke(app, ["validate", str(strict)])
    assert r.exit_code != 0 and "train.steps" in r.output
    with pytest.raises(sdk.ValidationError) as ei:
        client.runs.create(strict)
    assert ei.value.param == "train.steps"

"""The ``meshrun`` CLI through typer's CliRunner and as a subprocess, against a live API server.
Runs progress through FakeWorker (no Ray); the Ray-backed versions are in test_cli_ray.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
from typer.testing import CliRunner

from api.cli import app
from tests.sdk.conftest import free_port, play_when_submitted

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
runner = CliRunner(env={"COLUMNS": "200"})


def uname(prefix: str = "cli") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def cli(url: str, *args: str, **kw):
    return runner.invoke(app, ["--url", url, *args], **kw)


def no_traceback(result) -> None:
    assert "Traceback" not in result.output and "Traceback" not in (result.stderr or "")


# --------------------------------------------------------------------------------------------- submit
def test_submit_prints_id_and_json_parses(api_server):
    name = uname()
    r = cli(api_server.url, "submit", str(EXAMPLES / "dp.yaml"), "--set", f"name={name}", "--set", "train.steps=7")
    assert r.exit_code == 0, r.output
    assert "submitted" in r.stdout and "dp2" in r.stdout and name in r.stdout
    run_id = r.stdout.split("submitted ", 1)[1].split()[0]
    assert f"console: {api_server.url}/runs/{run_id}" in r.stdout  # one click to the run's page
    r = cli(api_server.url, "submit", str(EXAMPLES / "tp-sp.yaml"), "--name", name + "-j", "--json")
    assert r.exit_code == 0, r.output
    run = json.loads(r.stdout)  # nothing but JSON on stdout
    assert run["status"] == "QUEUED" and run["spec"]["layout"]["tp"] == 2 and run["name"] == name + "-j"


def test_submit_wait_success_prints_summary_and_exits_0(api_server):
    name = uname("ok")
    play_when_submitted(api_server, name, steps=6)
    r = cli(api_server.url, "submit", str(EXAMPLES / "dp.yaml"), "--name", name, "--set", "train.steps=6", "--wait",
            "--timeout", "60")
    assert r.exit_code == 0, r.output
    for words in ("SUCCEEDED", "final loss", "tokens/s", "MFU", "peak memory", "6/6"):
        assert words in r.stdout, (words, r.stdout)


def test_submit_wait_failed_run_exits_1(api_server):
    name = uname("bad")
    play_when_submitted(api_server, name, steps=6, fail_at=2)
    r = cli(api_server.url, "submit", str(EXAMPLES / "dp.yaml"), "--name", name, "--wait", "--json")
    assert r.exit_code == 1, r.output
    assert json.loads(r.stdout)["status"] == "FAILED"


def test_submit_wait_cancelled_run_exits_8(api_server):
    import threading
    import time

    from api.client import Client

    name = uname("cx")

    def cancel_soon():
        c = Client(api_server.url)
        for _ in range(200):
            page = c.runs.list(name=name)
            if page.items:
                c.runs.cancel(page.items[0].id)
                return
            time.sleep(0.05)

    threading.Thread(target=cancel_soon, daemon=True).start()
    r = cli(api_server.url, "submit", str(EXAMPLES / "dp.yaml"), "--name", name, "--wait", "--no-progress")
    assert r.exit_code == 8, r.output
    assert "CANCELLED" in r.stdout


# ----------------------------------------------------------------------------------------- reads + json
def test_read_commands_json_parse(api_server):
    name = uname("read")
    play_when_submitted(api_server, name, steps=4).join(timeout=0)
    r = cli(api_server.url, "submit", str(EXAMPLES / "dp.yaml"), "--name", name, "--set", "train.steps=4", "--wait",
            "--json")
    assert r.exit_code == 0, r.output
    run_id = json.loads(r.stdout)["id"]
    outputs = {cmd: cli(api_server.url, *cmd.split(), run_id, "--json") for cmd in ("show", "metrics", "events",
                                                                                  "checkpoints")}
    for cmd, res in outputs.items():
        assert res.exit_code == 0, (cmd, res.output)
    assert json.loads(outputs["show"].stdout)["status"] == "SUCCEEDED"
    assert [m["step"] for m in json.loads(outputs["metrics"].stdout)] == [1, 2, 3, 4]
    assert json.loads(outputs["events"].stdout)[-1]["to_status"] == "SUCCEEDED"
    assert json.loads(outputs["checkpoints"].stdout) == []
    r = cli(api_server.url, "runs", "--name", name, "--json")
    page = json.loads(r.stdout)
    assert page["total"] == 1 and page["items"][0]["id"] == run_id
    r = cli(api_server.url, "health", "--json")
    assert json.loads(r.stdout)["status"] == "ok"
    # the human forms render tables
    r = cli(api_server.url, "runs", "--name", name)
    assert r.exit_code == 0 and run_id in r.stdout and "SUCCEEDED" in r.stdout
    r = cli(api_server.url, "metrics", run_id, "--tail", "2")
    assert r.exit_code == 0 and "loss" in r.stdout
    r = cli(api_server.url, "show", run_id)
    assert r.exit_code == 0 and "final loss" in r.stdout and "attempts" in r.stdout
    assert f"{api_server.url}/runs/{run_id}" in r.stdout


# ---------------------------------------------------------------------------------------- exit codes
def test_not_found_exits_3_with_message_and_no_traceback(api_server):
    r = cli(api_server.url, "show", "run-nope")
    assert r.exit_code == 3
    assert "not found" in r.stderr and "run_id" in r.stderr and r.stdout == ""
    no_traceback(r)


def test_invalid_spec_exits_4_naming_the_field(api_server):
    r = cli(api_server.url, "submit", str(EXAMPLES / "dp.yaml"), "--set", "layout.tp=3")
    assert r.exit_code == 4
    assert "tp=3 does not divide" in r.stderr and "layout.tp" in r.stderr
    no_traceback(r)


def test_usage_errors_exit_2(api_server, tmp_path):
    assert cli(api_server.url, "submit", str(tmp_path / "missing.yaml")).exit_code == 2
    assert cli(api_server.url, "submit", str(EXAMPLES / "dp.yaml"), "--set", "nonsense").exit_code == 2
    assert cli(api_server.url, "resume", "run-x", "--layout", "dp2").exit_code == 2
    assert cli(api_server.url, "plan").exit_code == 2
    assert cli(api_server.url, "submit", str(EXAMPLES / "dp.yaml"), "--bogus-flag").exit_code == 2
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    assert cli(api_server.url, "submit", str(tmp_path / "list.yaml")).exit_code == 4


def test_cancel_twice_exits_5(api_server):
    r = cli(api_server.url, "submit", str(EXAMPLES / "dp.yaml"), "--name", uname(), "--json")
    run_id = json.loads(r.stdout)["id"]
    r = cli(api_server.url, "cancel", run_id)
    assert r.exit_code == 0 and "CANCELLED" in r.stdout
    r = cli(api_server.url, "cancel", run_id)
    assert r.exit_code == 5 and "already CANCELLED" in r.stderr


def test_unreachable_service_exits_7():
    r = runner.invoke(app, ["--url", f"http://127.0.0.1:{free_port()}", "runs"])
    assert r.exit_code == 7 and "could not reach" in r.stderr
    no_traceback(r)


def test_auth_exits_6_and_token_works(auth_server):
    r = cli(auth_server.url, "runs")
    assert r.exit_code == 6 and "MESHRUN_TOKEN" in r.stderr
    r = runner.invoke(app, ["--url", auth_server.url, "--token", auth_server.tokens["a"], "runs", "--json"])
    assert r.exit_code == 0 and "total" in json.loads(r.stdout)
    r = runner.invoke(app, ["runs", "--json"], env={"MESHRUN_URL": auth_server.url,
                                                    "MESHRUN_TOKEN": auth_server.tokens["b"]})
    assert r.exit_code == 0, r.output


# ----------------------------------------------------------------------------------------------- plan
def test_plan_prints_a_table(api_server):
    r = cli(api_server.url, "plan", "--model", "gpt", "--preset", "7b", "--device", "H100", "--gpus-per-node", "8",
            "--nodes", "4", "--global-batch-size", "512", "--top-k", "5")
    assert r.exit_code == 0, r.output
    for words in ("layout", "micro-batch", "GiB", "step s", "tokens/s", "MFU", "feasible", "dp", "yes"):
        assert words in r.stdout, words
    r = cli(api_server.url, "plan", "--model", "gpt", "--preset", "70b", "--device", "L4", "--gpus-per-node", "1",
            "--global-batch-size", "8", "--rejected")
    assert r.exit_code == 0, r.output
    assert "no feasible layout" in r.stderr and "reason" in r.stdout
    r = cli(api_server.url, "plan", str(EXAMPLES / "plan-7b.yaml"), "--json", "--top-k", "3")
    resp = json.loads(r.stdout)
    assert len(resp["candidates"]) == 3 and resp["model"]["n_params"] > 6e9


def test_plan_from_run_spec_keep_layout(api_server):
    r = cli(api_server.url, "plan", str(EXAMPLES / "gpt-3d-demo.yaml"), "--device", "H100", "--gpus-per-node", "8",
            "--keep-layout", "--json")
    assert r.exit_code == 0, r.output
    cands = json.loads(r.stdout)["candidates"]
    assert [(c["layout"]["dp"], c["layout"]["tp"], c["layout"]["pp"]) for c in cands] == [(2, 2, 2)]


# ------------------------------------------------------------------------------------------ local tools
def test_validate_examples_locally():
    r = runner.invoke(app, ["validate", str(EXAMPLES / "gpt-3d-demo.yaml")])
    assert r.exit_code == 0 and "world 8" in r.stdout
    r = runner.invoke(app, ["validate", str(EXAMPLES / "dp.yaml"), "--set", "layout.tp=3"])
    assert r.exit_code == 4 and "layout.tp" in r.stderr


def test_db_upgrade_and_token_create(tmp_path):
    from service.security.tokens import verify_token
    from service.store.db import make_engine, make_sessionmaker, session_scope

    url = f"sqlite:///{tmp_path / 'm.db'}"
    r = runner.invoke(app, ["db", "upgrade", "--database-url", url])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["token", "create", "--project", "team-x", "--can-run-code", "--database-url", url,
                            "--json"])
    assert r.exit_code == 0, r.output
    secret = json.loads(r.stdout)["token"]
    engine = make_engine(url)
    with session_scope(make_sessionmaker(engine)) as s:
        tok = verify_token(s, secret)
        assert tok is not None and tok.project == "team-x" and tok.can_run_code and not tok.admin
    engine.dispose()
    r = runner.invoke(app, ["token", "create", "--project", "bad project!", "--database-url", url])
    assert r.exit_code == 4


# ------------------------------------------------------------------------------------------ subprocess
def _meshrun(*args: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "api.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=env)


def test_subprocess_submit_wait_and_json(api_server):
    name = uname("proc")
    play_when_submitted(api_server, name, steps=5)
    p = _meshrun("--url", api_server.url, "submit", "examples/dp.yaml", "--name", name, "--set", "train.steps=5",
                 "--wait")
    assert p.returncode == 0, p.stderr
    assert "SUCCEEDED" in p.stdout and "final loss" in p.stdout
    p = _meshrun("runs", "--name", name, "--json", env_extra={"MESHRUN_URL": api_server.url})
    assert p.returncode == 0 and json.loads(p.stdout)["items"][0]["status"] == "SUCCEEDED"
    p = _meshrun("--url", api_server.url, "show", "run-missing")
    assert p.returncode == 3 and "Traceback" not in p.stderr


def test_subprocess_failed_run_exit_code(api_server):
    name = uname("procfail")
    play_when_submitted(api_server, name, steps=5, fail_at=1)
    p = _meshrun("--url", api_server.url, "submit", "examples/dp.yaml", "--name", name, "--wait")
    assert p.returncode == 1, (p.stdout, p.stderr)
    assert "FAILED" in p.stdout


def test_serve_prints_the_console_url_and_serves_it(tmp_path):
    port = free_port()
    env = {**os.environ, "MESHRUN_LOG_LEVEL": "WARNING", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "api.cli", "serve", "--no-scheduler", "--port", str(port),
                             "--data-dir", str(tmp_path)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        assert f"meshrun console: http://127.0.0.1:{port}/" in line, line
        deadline = time.monotonic() + 60
        while True:
            try:
                page = httpx.get(f"http://127.0.0.1:{port}/", timeout=5)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline and proc.poll() is None, "the service did not come up"
                time.sleep(0.2)
        assert page.status_code == 200 and "<title>Runs · meshrun</title>" in page.text
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_offline_validate_says_what_the_service_says(api_server, tmp_path):
    import yaml

    body = yaml.safe_load((EXAMPLES / "dp.yaml").read_text())
    body["optimizer"] = {**body.get("optimizer", {}), "lrr": 1e-3}
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(body))
    r = runner.invoke(app, ["validate", str(path)])
    assert r.exit_code == 4
    served = httpx.post(f"{api_server.url}/v1/runs", json=body, timeout=30)
    assert served.status_code == 422
    message = served.json()["error"]["message"]
    assert message.startswith("unknown field 'optimizer.lrr'; remove it or fix its spelling")
    assert " ".join(message.split()) in " ".join(r.stderr.split())


def test_show_includes_the_plan_breakdown(api_server):
    r = cli(api_server.url, "submit", str(EXAMPLES / "dp.yaml"), "--name", uname("show"), "--json")
    run = json.loads(r.stdout)
    r = cli(api_server.url, "show", run["id"])
    assert r.exit_code == 0, r.output
    assert "world 2 = dp 2 (replicate 2 x shard 1) x tp 1 x pp 1" in r.stdout
    if run["plan"].get("predicted"):
        assert "memory/rank" in r.stdout and "step time" in r.stdout and "compute" in r.stdout


def test_doctor_checks_the_install_and_says_what_to_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHRUN_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("MESHRUN_DATABASE_URL", f"sqlite:///{tmp_path / 'm.db'}")
    monkeypatch.setenv("MESHRUN_RAY_NUM_CPUS", "4")
    r = runner.invoke(app, ["doctor", "--json"])
    assert r.exit_code == 0, r.output
    checks = {c["name"]: c for c in json.loads(r.stdout)}
    assert {"python", "torch", "gloo", "ray", "ray dashboard", "database", "cpu slots"} <= set(checks)
    assert checks["database"]["level"] == "ok" and checks["ray dashboard"]["level"] == "ok"
    assert checks["cpu slots"]["level"] == "warn" and "MESHRUN_RAY_NUM_CPUS=9" in checks["cpu slots"]["fix"]
    monkeypatch.setenv("MESHRUN_DATABASE_URL", "postgresql+psycopg://nobody@127.0.0.1:1/none")
    monkeypatch.delenv("MESHRUN_RAY_NUM_CPUS")
    r = runner.invoke(app, ["doctor"])
    assert r.exit_code == 1 and "FAIL" in r.stdout and "MESHRUN_DATABASE_URL" in r.stdout

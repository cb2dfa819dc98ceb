"""``meshrun serve``, ``demo``, ``cluster``, ``health``, ``db``, ``token`` and ``doctor``: the commands that start,
maintain or check the service. Only these import the service package, lazily, inside the command."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import typer
from rich.table import Table

from api.cli._common import (
    DEMO_RAY_CPUS,
    DEMO_SPEC,
    DEMO_SPEC_FILE,
    EXIT_INVALID,
    EXIT_UNAVAILABLE,
    REPO_EXAMPLES,
    _escape,
    _fail,
    _gib,
    _load_or_usage,
    _state,
    _usage,
    app,
    command,
    db_app,
    emit_json,
    err,
    out,
    token_app,
)
from api.cli.runs import _exit_for_run, print_summary
from api.sdk import (
    APIConnectionError,
    Client,
    MeshrunError,
    load_file,
)
from api.sdk._specs import apply_overrides
from api.spec import layout_label


# --------------------------------------------------------------------------------------------- service
@command(app, "serve")
def serve(
    host: Optional[str] = typer.Option(None, help="Listen address (default MESHRUN_HOST or 127.0.0.1)."),
    port: Optional[int] = typer.Option(None, help="Port (default MESHRUN_PORT or 8000)."),
    data_dir: Optional[Path] = typer.Option(None, help="SQLite, checkpoints, Ray temp (MESHRUN_DATA_DIR)."),
    ray_address: Optional[str] = typer.Option(None, help="Existing Ray cluster; unset = start a local head."),
    no_scheduler: bool = typer.Option(False, "--no-scheduler", help="API only (no admission loop, no Ray)."),
) -> None:
    """Run the API service (and, on embedded defaults, its local Ray head) until Ctrl-C. The web console is at
    the printed URL (API docs at /docs)."""
    from service.app.server import console_url
    from service.app.server import serve as _serve
    from service.errors import ServiceError
    from service.settings import Settings

    given: dict[str, Any] = dict(host=host, port=port, data_dir=data_dir, ray_address=ray_address)
    overrides = {k: v for k, v in given.items() if v is not None}
    if no_scheduler:
        overrides["start_scheduler"] = False
    settings = Settings(**overrides)
    url = console_url(settings)
    err().print(f"meshrun console: [bold]{url}/[/]  (API docs {url}/docs)", soft_wrap=True)
    try:
        _serve(settings)
    except ServiceError as e:  # a port that is taken: one line naming the setting, no traceback
        err().print(f"meshrun serve: {e}", soft_wrap=True, markup=False)
        raise typer.Exit(1) from None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(client: Client, proc: subprocess.Popen[bytes] | None, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise APIConnectionError(f"the service exited with code {proc.returncode} while starting")
        try:
            client.health()
            return
        except APIConnectionError:
            time.sleep(0.5)
    raise APIConnectionError(f"the service did not answer /healthz within {timeout_s:.0f}s")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)  # graceful: uvicorn shuts down, the runtime stops its Ray head
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _demo_spec(spec: Path | None) -> dict[str, Any]:
    if spec is not None:
        return _load_or_usage(spec)
    for candidate in (Path.cwd() / "examples" / DEMO_SPEC_FILE, REPO_EXAMPLES / DEMO_SPEC_FILE):
        if candidate.is_file():
            return load_file(candidate)
    return json.loads(json.dumps(DEMO_SPEC))


@command(app, "demo")
def demo(
    ctx: typer.Context,
    spec: Optional[Path] = typer.Option(
        None, "--spec", help="Run spec to submit (default examples/demo.yaml: GPT tiny, dp2 x tp2 on 4 CPU workers)."
    ),
    port: Optional[int] = typer.Option(None, help="Port for the demo service (default: a free one)."),
    data_dir: Optional[Path] = typer.Option(None, help="Service data dir (default MESHRUN_DATA_DIR or ~/.meshrun)."),
    keep_serving: bool = typer.Option(False, "--keep-serving", help="Keep the service up after the run."),
    startup_timeout: float = typer.Option(180.0, help="Seconds to wait for the service (Ray start included)."),
    set_: list[str] = typer.Option([], "--set", help="Override a spec field: key.sub=value (repeatable)."),
) -> None:
    """Start meshrun locally, train a small 2-D parallel GPT with live progress, print the summary.

    Starts the service on embedded defaults (SQLite + a local Ray head) as a subprocess, submits
    examples/demo.yaml (dp2 x tp2), shows live progress, prints the summary (final loss, tokens/s, MFU, peak
    memory), then stops it (or --keep-serving). With --url, or when `meshrun serve` already serves the data
    directory, uses that running service (and leaves it running).
    """
    st = _state(ctx)
    body = _usage(lambda: apply_overrides(_demo_spec(spec), set_))
    console = err()
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    reused = st.url_given
    if st.url_given:
        client = st.client()
    elif (running := _serving(data_dir)) is not None:
        # ``meshrun serve`` already serves this data directory (it owns its Ray head): run the demo on it
        client = Client(running.record.url, st.token, timeout=st.timeout_s)
        reused = True
        console.print(
            f"meshrun is already serving this data directory at {running.record.url}/ (pid {running.record.pid}): "
            "the demo runs on it, and it keeps serving afterwards",
            soft_wrap=True,
        )
    else:
        port = port or _free_port()
        env = dict(os.environ)
        if data_dir is not None:
            env["MESHRUN_DATA_DIR"] = str(data_dir)
        env["MESHRUN_HOST"], env["MESHRUN_PORT"] = "127.0.0.1", str(port)
        if not env.get("MESHRUN_RAY_ADDRESS") and not env.get("MESHRUN_RAY_NUM_CPUS"):
            # Ray CPUs are scheduling slots: advertise enough for the 4-8 tiny workers of the demo specs even
            # on a 2-core laptop (the models are small enough to share cores)
            env["MESHRUN_RAY_NUM_CPUS"] = str(max(os.cpu_count() or 1, DEMO_RAY_CPUS))
        log_path = Path(tempfile.mkstemp(prefix="meshrun-demo-", suffix=".log")[1])
        console.print(f"starting meshrun on http://127.0.0.1:{port} (service log: {log_path}) ...", soft_wrap=True)
        with open(log_path, "wb") as logf:
            proc = subprocess.Popen(
                [sys.executable, "-m", "api.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
                env=env,
                stdout=logf,
                stderr=subprocess.STDOUT,
                cwd=str(REPO_EXAMPLES.parent) if REPO_EXAMPLES.is_dir() else None,
            )
        client = Client(f"http://127.0.0.1:{port}", st.token, timeout=st.timeout_s)
    try:
        with console.status("waiting for the service (starting Ray) ..."):
            try:
                _wait_healthy(client, proc, startup_timeout)
            except APIConnectionError as e:
                if log_path is None:
                    raise
                # one line: why the demo's service did not start (its log has the rest)
                raise APIConnectionError(
                    f"the demo's service did not start: {_start_failure(log_path) or e.message} (log: {log_path})"
                ) from None
        run = client.runs.create(body)
        console.print(
            f"submitted [bold]{run.id}[/] ({run.name}): {layout_label(run.spec.layout)}, {run.spec.train.steps} steps"
        )
        dash = run.dashboard_url
        if dash is None:
            try:
                dash = client.cluster.get().dashboard_url
            except MeshrunError:
                dash = None
        lasts = "" if reused or keep_serving else " (live while the demo runs)"
        if dash:
            console.print(f"Ray dashboard{lasts}: {dash}", soft_wrap=True)
        run = client.runs.wait(run.id, progress=console)
        print_summary(run)
        if reused or keep_serving:
            if not run.dashboard_url:
                try:
                    dash = client.cluster.get().dashboard_url or dash
                except MeshrunError:
                    pass
            if dash:
                out().print(f"[bold]Ray dashboard[/]  {dash}")
        code = _exit_for_run(run)
        if keep_serving and proc is not None:
            console.print(f"meshrun is serving at {client.base_url}; Ctrl-C to stop", soft_wrap=True)
            try:
                proc.wait()
            except KeyboardInterrupt:
                pass
        elif proc is not None:
            console.print(
                "the demo's service (and its Ray dashboard) stops now; keep it with --keep-serving, or run "
                "meshrun serve and then meshrun demo (the demo then uses that service)",
                soft_wrap=True,
            )
        raise typer.Exit(code)
    finally:
        if proc is not None:
            with console.status("stopping the service ..."):
                _stop(proc)


def _serving(data_dir: Path | None) -> Any:
    """The ``meshrun serve`` of the data directory the demo would use, when it is up with a Ray runtime (a
    ``--no-scheduler`` service or an unhealthy one is not reused)."""
    from service.control.service_record import find_running
    from service.settings import Settings

    settings = Settings(data_dir=data_dir) if data_dir is not None else Settings()
    running = find_running(settings.data_dir)
    if running is None or running.record.ray_address is None:
        return None
    if not running.healthy:
        _fail(
            f"the meshrun service of data directory {settings.data_dir} (pid {running.record.pid}, "
            f"{running.record.url}) is not healthy: {running.health.get('reason') or 'degraded'}; fix or stop it, "
            "or give the demo its own: meshrun demo --data-dir DIR (with MESHRUN_RAY_GCS_PORT and "
            "MESHRUN_RAY_DASHBOARD_PORT set to free ports)",
            EXIT_UNAVAILABLE,
        )
    return running


_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception): (.+)$")


def _start_failure(log_path: Path) -> str | None:
    """The message of the last exception in a service log (what made the service exit while starting)."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        m = _EXCEPTION_LINE.match(line.strip())
        if m:
            return m.group(1)
    return None


# ---------------------------------------------------------------------------------------------- cluster
@command(app, "cluster")
def cluster(ctx: typer.Context, as_json: bool = typer.Option(False, "--json")) -> None:
    """Nodes and free resources of the service's Ray cluster."""
    cl = _state(ctx).client().cluster.get()
    if as_json:
        emit_json(cl)
        return
    t = Table(
        title=f"Ray cluster {cl.address or ''}  CPUs {cl.cpus_free:g}/{cl.cpus_total:g} free, "
        f"GPUs {cl.gpus_free:g}/{cl.gpus_total:g} free"
    )
    for col in ("node", "alive", "address", "CPUs", "GPUs", "memory GiB"):
        t.add_column(col)
    for n in cl.nodes:
        t.add_row(
            n.node_id[:12],
            "[green]yes[/]" if n.alive else "[red]no[/]",
            n.address or "-",
            f"{n.cpus:g}",
            f"{n.gpus:g}",
            _gib(n.memory_bytes),
        )
    out().print(t)
    if cl.dashboard_url:
        out().print(f"dashboard: {cl.dashboard_url}")


@command(app, "health")
def health(ctx: typer.Context, as_json: bool = typer.Option(False, "--json")) -> None:
    """Is the service up? (exit 7 if not)."""
    st = _state(ctx)
    data = st.client().health()
    if as_json:
        emit_json(data)
    else:
        out().print(f"[green]ok[/] {st.client().base_url}  {_escape(json.dumps(data))}")


@command(db_app, "upgrade")
def db_upgrade(database_url: Optional[str] = typer.Option(None, help="SQLAlchemy URL (default: settings).")) -> None:
    """Migrate the database to the newest schema."""
    from service.settings import Settings
    from service.store.db import redact_url
    from service.store.migrate import upgrade

    url = database_url or Settings().database_url
    upgrade(url)
    out().print(f"[green]database is at the newest schema[/] ({redact_url(url)})")


@command(token_app, "create")
def token_create(
    project: str = typer.Option(..., help="Project the token can see and submit to."),
    name: str = typer.Option("cli", help="A label for the token."),
    admin: bool = typer.Option(False, "--admin", help="May see and manage every project."),
    can_run_code: bool = typer.Option(False, "--can-run-code", help="May submit runs with user entrypoints."),
    database_url: Optional[str] = typer.Option(None, help="SQLAlchemy URL (default: settings)."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Create an API token (printed once; only its hash is stored)."""
    from service.security import tokens as auth
    from service.settings import Settings

    url = database_url or Settings().database_url
    try:
        secret = _create_token(auth, url, project=project, name=name, admin=admin, can_run_code=can_run_code)
    except ValueError as e:
        _fail(str(e), EXIT_INVALID, param="project" if "project" in str(e) else "name")
    if as_json:
        emit_json({"token": secret, "project": project, "name": name, "admin": admin, "can_run_code": can_run_code})
    else:
        typer.echo(secret)
        err().print(
            f"token for project [bold]{project}[/] created; it is shown only once. Use it as MESHRUN_TOKEN or --token."
        )


def _create_token(auth: Any, url: str, *, project: str, name: str, admin: bool, can_run_code: bool) -> str:
    """``service.security.tokens.create_token`` in a session of the configured database (migrated first)."""
    from service.store.db import make_engine, make_sessionmaker, session_scope
    from service.store.migrate import upgrade

    upgrade(url)
    engine = make_engine(url)
    try:
        with session_scope(make_sessionmaker(engine)) as session:
            return auth.create_token(session, project, name, admin=admin, can_run_code=can_run_code)
    finally:
        engine.dispose()


@command(app, "doctor")
def doctor(as_json: bool = typer.Option(False, "--json")) -> None:
    """Check the install and this machine: torch build (CUDA/NCCL if present), Ray and its Jobs API, the database,
    free ports, CPU slots; each problem with what to fix. Exit code 1 when something must be fixed."""
    from service.control.doctor import run_checks
    from service.settings import Settings

    checks = run_checks(Settings())
    if as_json:
        emit_json([c.__dict__ for c in checks])
    else:
        t = Table(show_header=True, box=None, pad_edge=False)
        for col in ("check", "", "detail", "fix"):
            t.add_column(col)
        mark = {"ok": "[green]ok[/]", "warn": "[yellow]warn[/]", "fail": "[red]FAIL[/]"}
        for c in checks:
            t.add_row(c.name, mark[c.level], _escape(c.detail), _escape(c.fix))
        out().print(t)
    if any(c.level == "fail" for c in checks):
        raise typer.Exit(1)

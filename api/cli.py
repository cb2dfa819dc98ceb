"""``meshrun``: the command line of meshrun (typer + rich). Everything remote goes through the SDK.

Exit codes (stable, for scripts):

    0  success (with --wait: the run/sweep SUCCEEDED)
    1  the run FAILED (with --wait), or an unexpected error
    2  usage error (bad option, missing file, unparsable --set/--layout)
    3  not found (404)
    4  invalid request (400/422: the spec or a parameter; the message names the field)
    5  conflict (409: e.g. cancelling a finished run)
    6  authentication or permission (401/403)
    7  service unavailable (connection refused, timeout, 429 or 5xx after retries)
    8  the run was CANCELLED (with --wait)
    9  --timeout elapsed while waiting

``--json`` on read commands prints one JSON document on stdout and nothing else (progress and errors go to
stderr). Global options: ``--url`` (MESHRUN_URL, default http://127.0.0.1:8000), ``--token`` (MESHRUN_TOKEN).
"""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import typer
from rich.console import Console
from rich.table import Table

from api.sdk import (
    APIConnectionError, APIStatusError, AuthenticationError, BadRequestError, Client, ConflictError, MeshrunError,
    NotFoundError, PermissionDeniedError, RunFailedError, ValidationError, WaitTimeoutError, layout_str,
    load_file, parse_layout, parse_layouts,
)
from api.sdk._specs import apply_overrides

EXIT_OK = 0
EXIT_RUN_FAILED = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_INVALID = 4
EXIT_CONFLICT = 5
EXIT_AUTH = 6
EXIT_UNAVAILABLE = 7
EXIT_CANCELLED = 8
EXIT_WAIT_TIMEOUT = 9

EXIT_CODES_HELP = ("Exit codes: 0 ok; 1 run failed (--wait) or unexpected error; 2 usage; 3 not found; "
                   "4 invalid spec/request (400/422); 5 conflict (409); 6 auth (401/403); 7 service unavailable "
                   "(connection, timeout, 429/5xx); 8 run cancelled (--wait); 9 wait timed out.")

app = typer.Typer(name="meshrun", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  rich_markup_mode="rich",
                  help="Plan, run and sweep distributed-training layouts on Ray.", epilog=EXIT_CODES_HELP)
db_app = typer.Typer(no_args_is_help=True, help="Database maintenance (runs against MESHRUN_DATABASE_URL).")
token_app = typer.Typer(no_args_is_help=True, help="API tokens (written directly to the configured database).")
sweeps_app = typer.Typer(no_args_is_help=True, help="List, show, wait for and cancel sweeps.")
app.add_typer(db_app, name="db")
app.add_typer(token_app, name="token")
app.add_typer(sweeps_app, name="sweeps")

REPO_EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
DEMO_SPEC_FILE = "demo.yaml"
DEMO_RAY_CPUS = 10  # logical CPUs of the demo's own Ray head: the 3-D demo's 8 workers + the job driver
# used when examples/ is not next to the package (installed from a wheel); same as examples/demo.yaml
DEMO_SPEC: dict[str, Any] = {
    "name": "demo-dp2-tp2",
    "model": {"name": "gpt", "preset": "tiny"},
    "data": {"source": "text"},
    "layout": {"dp": 2, "tp": 2, "pp": 1},
    "batch": {"global_batch_size": 16, "micro_batch_size": 4},
    "train": {"steps": 30, "seed": 0},
}


# ------------------------------------------------------------------------------------------------ state
@dataclass
class State:
    url: str | None = None
    token: str | None = None
    timeout_s: float = 30.0
    url_given: bool = False
    _client: Client | None = None

    def client(self) -> Client:
        if self._client is None:
            self._client = Client(self.url, self.token, timeout=self.timeout_s)
        return self._client


def _state(ctx: typer.Context) -> State:
    obj = ctx.find_root().obj
    if not isinstance(obj, State):
        obj = ctx.find_root().obj = State()
    return obj


def out() -> Console:
    return Console(highlight=False, soft_wrap=True)


def err() -> Console:
    return Console(stderr=True, highlight=False)


def emit_json(data: Any) -> None:
    """One JSON document on stdout (models dumped in JSON mode)."""
    if hasattr(data, "model_dump"):
        data = data.model_dump(mode="json")
    elif isinstance(data, list):
        data = [d.model_dump(mode="json") if hasattr(d, "model_dump") else d for d in data]
    typer.echo(json.dumps(data, indent=2, default=str))


def _fail(message: str, code: int, *, param: str | None = None) -> None:
    c = err()
    c.print(f"[bold red]error:[/] [red]{_escape(message)}[/]")
    if param:
        c.print(f"[red]  field: {_escape(param)}[/]")
    raise typer.Exit(code)


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(str(text))


def handle_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn SDK exceptions into a red message (message + field) and a documented exit code; no tracebacks."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except (ValidationError, BadRequestError) as e:
            _fail(e.message, EXIT_INVALID, param=e.param)
        except NotFoundError as e:
            _fail(e.message, EXIT_NOT_FOUND, param=e.param)
        except ConflictError as e:
            _fail(e.message, EXIT_CONFLICT, param=e.param)
        except (AuthenticationError, PermissionDeniedError) as e:
            hint = " (set MESHRUN_TOKEN or --token)" if isinstance(e, AuthenticationError) else ""
            _fail(e.message + hint, EXIT_AUTH, param=e.param)
        except APIStatusError as e:
            code = EXIT_UNAVAILABLE if e.status_code in (408, 429) or e.status_code >= 500 else EXIT_RUN_FAILED
            _fail(f"{e.status_code}: {e.message}", code, param=e.param)
        except APIConnectionError as e:
            _fail(e.message, EXIT_UNAVAILABLE)
        except WaitTimeoutError as e:
            _fail(str(e), EXIT_WAIT_TIMEOUT)
        except RunFailedError as e:
            _fail(str(e), EXIT_RUN_FAILED)
        except MeshrunError as e:
            _fail(str(e), EXIT_RUN_FAILED)
        except FileNotFoundError as e:
            _fail(str(e), EXIT_USAGE)
        except KeyboardInterrupt:
            err().print("[yellow]interrupted[/]")
            raise typer.Exit(130)
        except Exception as e:  # noqa: BLE001 - scripts get an exit code and a message, not a traceback
            if os.environ.get("MESHRUN_DEBUG"):
                raise
            _fail(f"unexpected error: {type(e).__name__}: {e} (set MESHRUN_DEBUG=1 for the traceback)",
                  EXIT_RUN_FAILED)

    return wrapper


def command(typer_app: typer.Typer = app, *args: Any, **kwargs: Any) -> Callable[[Callable[..., Any]], Any]:
    def deco(fn: Callable[..., Any]) -> Any:
        return typer_app.command(*args, **kwargs)(handle_errors(fn))

    return deco


def _version(value: bool) -> None:
    if value:
        from api.sdk._base import SDK_VERSION

        typer.echo(f"meshrun {SDK_VERSION}")
        raise typer.Exit()


@app.callback()
def main(
    ctx: typer.Context,
    url: Optional[str] = typer.Option(None, "--url", envvar="MESHRUN_URL", show_default="http://127.0.0.1:8000",
                                      help="meshrun service URL."),
    token: Optional[str] = typer.Option(None, "--token", envvar="MESHRUN_TOKEN", show_default=False,
                                        help="API token (Bearer)."),
    timeout: float = typer.Option(30.0, "--request-timeout", min=0.1, help="Per-request timeout, seconds."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    ctx.obj = State(url=url, token=token, timeout_s=timeout, url_given=url is not None)


# ------------------------------------------------------------------------------------------- formatting
def _gib(n: float | int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def _num(x: float | None, fmt: str = ".4f") -> str:
    return "-" if x is None else format(x, fmt)


def _rate(x: float | None) -> str:
    if x is None:
        return "-"
    if x >= 1e6:
        return f"{x / 1e6:.2f}M"
    return f"{x / 1e3:.1f}k" if x >= 1e4 else f"{x:,.0f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _ts(dt: Any, *, short: bool = False) -> str:
    if dt is None:
        return "-"
    return dt.astimezone().strftime("%m-%d %H:%M" if short else "%Y-%m-%d %H:%M:%S")


STATUS_STYLE = {"QUEUED": "yellow", "STARTING": "cyan", "RUNNING": "blue", "SUCCEEDED": "green", "FAILED": "red",
                "CANCELLED": "magenta"}


def _status(s: Any) -> str:
    v = getattr(s, "value", s)
    return f"[{STATUS_STYLE.get(str(v), 'white')}]{v}[/]"


def _peak_from_metrics(run: Any) -> int | None:
    try:
        rows = run.metrics()
    except (MeshrunError, AttributeError):
        return None
    peaks = [r.peak_memory_bytes for r in rows if r.peak_memory_bytes]
    return max(peaks) if peaks else None


def print_summary(run: Any, console: Console | None = None) -> None:
    """The end-of-run summary: status, steps, final loss, tokens/s, MFU, peak memory, dashboard URL."""
    c = console or out()
    s = run.summary
    t = Table(show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold")
    t.add_column()
    t.add_row("run", f"{run.id} ({run.name})")
    t.add_row("status", _status(run.status) + (f"  {_escape(run.status_reason)}" if run.status_reason else ""))
    t.add_row("layout", layout_str(run.spec.layout) + (f"  world {run.plan.world_size}" if run.plan else ""))
    if s is not None:
        t.add_row("steps", f"{s.steps_done}/{run.spec.train.steps}")
        t.add_row("final loss", _num(s.final_loss))
        t.add_row("tokens/s", _rate(s.mean_tokens_per_s))
        t.add_row("MFU", _pct(s.mean_mfu))
        if s.peak_memory_bytes_per_rank:
            peak = max(s.peak_memory_bytes_per_rank.values())
            t.add_row("peak memory", f"{_gib(peak)} GiB (max over {len(s.peak_memory_bytes_per_rank)} ranks)")
        elif (peak := _peak_from_metrics(run)) is not None:
            t.add_row("peak memory", f"{_gib(peak)} GiB (max over ranks)")
        if s.wall_time_s is not None:
            t.add_row("wall time", f"{s.wall_time_s:.1f} s")
    if run.dashboard_url:
        t.add_row("dashboard", run.dashboard_url)
    c.print(t)


def _exit_for_run(run: Any) -> int:
    v = getattr(run.status, "value", run.status)
    return {"SUCCEEDED": EXIT_OK, "FAILED": EXIT_RUN_FAILED, "CANCELLED": EXIT_CANCELLED}.get(v, EXIT_OK)


def _load_or_usage(path: Path) -> dict[str, Any]:
    try:
        return load_file(path)
    except FileNotFoundError as e:
        _fail(str(e), EXIT_USAGE)
        raise  # unreachable


def _usage(fn: Callable[[], Any]) -> Any:
    """Run a parser; its ValidationError is a usage error (exit 2)."""
    try:
        return fn()
    except ValidationError as e:
        _fail(e.message, EXIT_USAGE, param=e.param)


# --------------------------------------------------------------------------------------------- service
@command(app, "serve")
def serve(
    host: Optional[str] = typer.Option(None, help="Listen address (default MESHRUN_HOST or 127.0.0.1)."),
    port: Optional[int] = typer.Option(None, help="Port (default MESHRUN_PORT or 8000)."),
    data_dir: Optional[Path] = typer.Option(None, help="SQLite, checkpoints, Ray temp (MESHRUN_DATA_DIR)."),
    ray_address: Optional[str] = typer.Option(None, help="Existing Ray cluster; unset = start a local head."),
    no_scheduler: bool = typer.Option(False, "--no-scheduler", help="API only (no admission loop, no Ray)."),
) -> None:
    """Run the API service (and, on embedded defaults, its local Ray head) until Ctrl-C."""
    from service.settings import Settings

    from api.server import serve as _serve

    overrides = {k: v for k, v in dict(host=host, port=port, data_dir=data_dir, ray_address=ray_address).items()
                 if v is not None}
    if no_scheduler:
        overrides["start_scheduler"] = False
    _serve(Settings(**overrides))


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
    spec: Optional[Path] = typer.Option(None, "--spec", help="Run spec to submit (default examples/demo.yaml: "
                                                             "GPT tiny, dp2 x tp2 on 4 CPU workers)."),
    port: Optional[int] = typer.Option(None, help="Port for the demo service (default: a free one)."),
    data_dir: Optional[Path] = typer.Option(None, help="Service data dir (default MESHRUN_DATA_DIR or "
                                                       "~/.meshrun)."),
    keep_serving: bool = typer.Option(False, "--keep-serving", help="Keep the service up after the run."),
    startup_timeout: float = typer.Option(180.0, help="Seconds to wait for the service (Ray start included)."),
    set_: list[str] = typer.Option([], "--set", help="Override a spec field: key.sub=value (repeatable)."),
) -> None:
    """Start meshrun locally, train a small 2-D parallel GPT with live progress, print the summary.

    Starts the service on embedded defaults (SQLite + a local Ray head) as a subprocess, submits
    examples/demo.yaml (dp2 x tp2), shows live progress, prints the summary (final loss, tokens/s, MFU, peak
    memory) and the Ray dashboard URL, then stops it (or --keep-serving). With --url, uses that running service.
    """
    st = _state(ctx)
    body = _usage(lambda: apply_overrides(_demo_spec(spec), set_))
    console = err()
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    if st.url_given:
        client = st.client()
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
        console.print(f"starting meshrun on http://127.0.0.1:{port} (service log: {log_path}) ...")
        with open(log_path, "wb") as logf:
            proc = subprocess.Popen([sys.executable, "-m", "api.cli", "serve", "--host", "127.0.0.1", "--port",
                                     str(port)], env=env, stdout=logf, stderr=subprocess.STDOUT,
                                    cwd=str(REPO_EXAMPLES.parent) if REPO_EXAMPLES.is_dir() else None)
        client = Client(f"http://127.0.0.1:{port}", st.token, timeout=st.timeout_s)
    try:
        with console.status("waiting for the service (starting Ray) ..."):
            try:
                _wait_healthy(client, proc, startup_timeout)
            except APIConnectionError:
                if log_path is not None:
                    tail = log_path.read_text(errors="replace").splitlines()[-30:]
                    console.print("[red]" + _escape("\n".join(tail)) + "[/]")
                raise
        run = client.runs.create(body)
        console.print(f"submitted [bold]{run.id}[/] ({run.name}): {layout_str(run.spec.layout)}, "
                      f"{run.spec.train.steps} steps")
        if run.dashboard_url is None:
            try:
                dash = client.cluster.get().dashboard_url
            except MeshrunError:
                dash = None
        else:
            dash = run.dashboard_url
        if dash:
            console.print(f"Ray dashboard: {dash}")
        run = client.runs.wait(run.id, progress=console)
        print_summary(run)
        if not run.dashboard_url:
            try:
                dash = client.cluster.get().dashboard_url or dash
            except MeshrunError:
                pass
            if dash:
                out().print(f"[bold]Ray dashboard[/]  {dash}")
        code = _exit_for_run(run)
        if keep_serving and proc is not None:
            console.print(f"meshrun is serving at {client.base_url}; Ctrl-C to stop")
            try:
                proc.wait()
            except KeyboardInterrupt:
                pass
        raise typer.Exit(code)
    finally:
        if proc is not None:
            with console.status("stopping the service ..."):
                _stop(proc)


# ------------------------------------------------------------------------------------------------ runs
@command(app, "submit")
def submit(
    ctx: typer.Context,
    file: Optional[Path] = typer.Argument(None, help="Run spec (YAML/JSON)."),
    set_: list[str] = typer.Option([], "--set", help="Override a field: key.sub=value (repeatable)."),
    name: Optional[str] = typer.Option(None, help="Run name (overrides the spec's)."),
    from_sweep: Optional[str] = typer.Option(None, "--from-sweep", help="Use this sweep's best layout and "
                                                                        "micro-batch (base spec = the sweep's)."),
    wait: bool = typer.Option(False, "--wait", "-w", help="Wait for the run to finish; exit code = outcome."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Live progress bar with --wait."),
    timeout: Optional[float] = typer.Option(None, "--timeout", help="With --wait: give up after this many seconds."),
    idempotency_key: Optional[str] = typer.Option(None, help="Re-submitting with the same key returns the same run."),
    as_json: bool = typer.Option(False, "--json", help="Print the run as JSON (only JSON on stdout)."),
) -> None:
    """Submit a run spec. With --wait, show live progress and the summary; exit 0 only if it SUCCEEDED."""
    st = _state(ctx)
    client = st.client()
    if file is None and from_sweep is None:
        _fail("give a spec FILE or --from-sweep SWEEP_ID", EXIT_USAGE)
    body: dict[str, Any] = _load_or_usage(file) if file is not None else {}
    if from_sweep is not None:
        sweep = client.sweeps.get(from_sweep)
        try:
            best = sweep.best_run_spec()
        except ValueError as e:
            _fail(str(e), EXIT_CONFLICT, param="from_sweep")
        if body:
            body["layout"] = best.layout.model_dump(mode="json")
            body.setdefault("batch", {})["micro_batch_size"] = best.batch.micro_batch_size
        else:
            body = best.model_dump(mode="json")
            body["name"] = f"{best.name}-best"[:128]
    body = _usage(lambda: apply_overrides(body, set_))
    if name:
        body["name"] = name
    run = client.runs.create(body, idempotency_key=idempotency_key)
    if not wait:
        if as_json:
            emit_json(run)
        else:
            out().print(f"submitted [bold]{run.id}[/] ({run.name}) {_status(run.status)}  "
                        f"{layout_str(run.spec.layout)}")
            for w in (run.plan.warnings if run.plan else []):
                err().print(f"[yellow]warning:[/] {_escape(w)}")
            err().print(f"follow it with: meshrun show {run.id} | meshrun logs {run.id} --follow")
        return
    if not as_json:
        err().print(f"submitted [bold]{run.id}[/] ({run.name}) {layout_str(run.spec.layout)}")
    try:
        run = client.runs.wait(run.id, progress=err() if (progress and not as_json) else False, timeout=timeout)
    except KeyboardInterrupt:
        err().print(f"[yellow]stopped waiting; run {run.id} goes on[/] (meshrun cancel {run.id} stops it)")
        raise typer.Exit(130)
    if as_json:
        emit_json(run)
    else:
        print_summary(run)
    raise typer.Exit(_exit_for_run(run))


@command(app, "runs")
def runs(
    ctx: typer.Context,
    status: Optional[list[str]] = typer.Option(None, "--status", "-s", help="Filter by status (repeatable)."),
    name: Optional[str] = typer.Option(None, help="Filter by exact name."),
    sweep: Optional[str] = typer.Option(None, "--sweep", help="Runs of this sweep."),
    limit: int = typer.Option(20, min=1, max=1000),
    offset: int = typer.Option(0, min=0),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """List runs, newest first."""
    page = _state(ctx).client().runs.list(status=status or None, name=name, sweep_id=sweep, limit=limit,
                                          offset=offset)
    if as_json:
        emit_json(page)
        return
    t = Table(title=f"runs {page.offset + 1 if page.items else 0}-{page.offset + len(page.items)} of {page.total}")
    for col in ("id", "name", "status", "layout", "steps", "loss", "tok/s", "created"):
        t.add_column(col, justify="right" if col in ("steps", "loss", "tok/s") else "left",
                     no_wrap=col in ("id", "status"))
    for r in page.items:
        s = r.summary
        t.add_row(r.id, r.name, _status(r.status), layout_str(r.spec.layout),
                  f"{s.steps_done if s else '-'}/{r.spec.train.steps}", _num(s.final_loss if s else None),
                  _rate(s.mean_tokens_per_s if s else None), _ts(r.created_at, short=True))
    out().print(t)


@command(app, "show")
def show(ctx: typer.Context, run_id: str = typer.Argument(..., metavar="ID"),
         as_json: bool = typer.Option(False, "--json")) -> None:
    """Details of one run: status, layout, plan, prediction, summary."""
    run = _state(ctx).client().runs.get(run_id)
    if as_json:
        emit_json(run)
        return
    c = out()
    print_summary(run, c)
    t = Table(show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold")
    t.add_column()
    m = run.spec.model
    t.add_row("model", f"{m.name}/{m.preset}" + (f"  {run.plan.model.n_params:,} params" if run.plan else ""))
    t.add_row("batch", f"global {run.spec.batch.global_batch_size}, micro {run.spec.batch.micro_batch_size}")
    t.add_row("attempts", str(run.attempts))
    if run.plan and run.plan.predicted:
        p = run.plan.predicted
        t.add_row("predicted", f"{_gib(p.memory_bytes.total)} GiB/rank, {p.step_time_s.total:.3f} s/step, "
                               f"{_rate(p.tokens_per_s)} tok/s")
    for w in (run.plan.warnings if run.plan else []):
        t.add_row("warning", f"[yellow]{_escape(w)}[/]")
    t.add_row("created", _ts(run.created_at))
    t.add_row("started", _ts(run.started_at))
    t.add_row("finished", _ts(run.finished_at))
    if run.ray_job_id:
        t.add_row("ray job", run.ray_job_id)
    c.print(t)


@command(app, "metrics")
def metrics(
    ctx: typer.Context, run_id: str = typer.Argument(..., metavar="ID"),
    since_step: int = typer.Option(0, min=0, help="Only steps after this one."),
    attempt: Optional[int] = typer.Option(None, min=1, help="Rows of one attempt (default: latest per step)."),
    tail: Optional[int] = typer.Option(None, min=1, help="Show only the last N rows."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Per-step metrics of a run."""
    rows = _state(ctx).client().runs.metrics(run_id, since_step=since_step, attempt=attempt)
    if tail:
        rows = rows[-tail:]
    if as_json:
        emit_json(rows)
        return
    t = Table(title=f"metrics of {run_id}")
    for col in ("step", "attempt", "loss", "tok/s", "step s", "MFU", "peak GiB", "comm", "grad norm", "lr"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(str(r.step), str(r.attempt), _num(r.loss), _rate(r.tokens_per_s), _num(r.step_time_s, ".3f"),
                  _pct(r.mfu), _gib(r.peak_memory_bytes), _pct(r.comm_fraction), _num(r.grad_norm, ".3f"),
                  _num(r.lr, ".2e"))
    out().print(t)


@command(app, "events")
def events(ctx: typer.Context, run_id: str = typer.Argument(..., metavar="ID"),
           as_json: bool = typer.Option(False, "--json")) -> None:
    """State changes and other events of a run."""
    items = _state(ctx).client().runs.events(run_id)
    if as_json:
        emit_json(items)
        return
    t = Table(title=f"events of {run_id}")
    for col in ("time", "kind", "transition", "reason", "actor"):
        t.add_column(col)
    for e in items:
        tr = f"{e.from_status or ''} -> {e.to_status}" if e.to_status else ""
        t.add_row(_ts(e.time), e.kind, tr, _escape(e.reason or ""), e.actor or "")
    out().print(t)


@command(app, "checkpoints")
def checkpoints(ctx: typer.Context, run_id: str = typer.Argument(..., metavar="ID"),
                as_json: bool = typer.Option(False, "--json")) -> None:
    """Checkpoints written by a run."""
    items = _state(ctx).client().runs.checkpoints(run_id)
    if as_json:
        emit_json(items)
        return
    t = Table(title=f"checkpoints of {run_id}")
    for col in ("attempt", "step", "size", "path", "created"):
        t.add_column(col)
    for ck in items:
        size = "-" if ck.size_bytes is None else f"{ck.size_bytes / 2**20:.1f} MiB"
        t.add_row(str(ck.attempt), str(ck.step), size, ck.path, _ts(ck.created_at))
    out().print(t)


@command(app, "logs")
def logs(
    ctx: typer.Context, run_id: str = typer.Argument(..., metavar="ID"),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new output until the run ends."),
    interval: float = typer.Option(1.0, min=0.1, help="Seconds between polls with --follow."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Driver and worker output of a run (from Ray)."""
    client = _state(ctx).client()
    text = client.runs.logs(run_id)
    if as_json:
        emit_json({"run_id": run_id, "logs": text})
        return
    sys.stdout.write(text)
    sys.stdout.flush()
    if not follow:
        return
    shown = text
    try:
        while True:
            done = client.runs.get(run_id).done
            time.sleep(0 if done else interval)
            text = client.runs.logs(run_id)
            if text != shown:
                sys.stdout.write(text[len(shown):] if text.startswith(shown) else "\n" + text)
                sys.stdout.flush()
                shown = text
            if done:
                return
    except KeyboardInterrupt:
        return


@command(app, "cancel")
def cancel(ctx: typer.Context, run_id: str = typer.Argument(..., metavar="ID"),
           as_json: bool = typer.Option(False, "--json")) -> None:
    """Cancel a queued or running run."""
    run = _state(ctx).client().runs.cancel(run_id)
    if as_json:
        emit_json(run)
    else:
        out().print(f"{run.id} {_status(run.status)}" + (f"  {_escape(run.status_reason)}" if run.status_reason
                                                          else ""))


@command(app, "resume")
def resume(
    ctx: typer.Context, run_id: str = typer.Argument(..., metavar="ID"),
    layout: Optional[str] = typer.Option(None, "--layout", help='New layout, e.g. "dp=2,tp=1" (resharded).'),
    from_file: Optional[Path] = typer.Option(None, "--from-file", help="YAML with layout/batch/steps (or a "
                                                                       "run spec: its layout, batch, train.steps)."),
    steps: Optional[int] = typer.Option(None, min=1, help="New total step count."),
    wait: bool = typer.Option(False, "--wait", "-w"),
    progress: bool = typer.Option(True, "--progress/--no-progress"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Resume a stopped run from its latest checkpoint, optionally on another layout."""
    client = _state(ctx).client()
    new_layout: Any = None
    batch: Any = None
    if from_file is not None:
        data = _load_or_usage(from_file)
        new_layout, batch = data.get("layout"), data.get("batch")
        steps = steps or data.get("steps") or (data.get("train") or {}).get("steps")
    if layout is not None:
        new_layout = _usage(lambda: parse_layout(layout))
    run = client.runs.resume(run_id, layout=new_layout, batch=batch, steps=steps)
    if wait:
        run = client.runs.wait(run.id, progress=err() if (progress and not as_json) else False)
    if as_json:
        emit_json(run)
    elif wait:
        print_summary(run)
    else:
        out().print(f"resumed {run.id} {_status(run.status)}  {layout_str(run.spec.layout)}")
    if wait:
        raise typer.Exit(_exit_for_run(run))


# ------------------------------------------------------------------------------------------------ plans
def plan_table(resp: Any, *, show_rejected: bool = False) -> Table:
    cl = resp.cluster
    title = (f"{resp.model.name} {resp.model.n_params / 1e9:.2f}B params on "
             f"{cl.get('nodes', '?')} x {cl.get('gpus_per_node', '?')} {cl.get('device', '?')}  "
             f"({resp.evaluated} layouts evaluated in {resp.elapsed_s:.2f}s)")
    t = Table(title=title)
    t.caption = "mb: micro-batch size; ckpt: activation checkpointing; GiB: predicted peak memory per GPU"
    for col in ("#", "layout", "mb", "ckpt", "GiB", "step s", "tokens/s", "MFU", "feasible"):
        t.add_column(col, justify="right" if col in ("#", "mb", "GiB", "step s", "tokens/s", "MFU") else "left",
                     no_wrap=col in ("layout", "tokens/s"))
    if show_rejected:
        t.add_column("reason")
    rows = list(resp.candidates) + (list(resp.rejected) if show_rejected else [])
    for i, c in enumerate(rows, 1):
        t.add_row(str(i), layout_str(c.layout), str(c.micro_batch_size), c.activation_checkpointing,
                  _gib(c.memory_bytes.total), f"{c.step_time_s.total:.3f}", _rate(c.tokens_per_s), _pct(c.mfu),
                  "[green]yes[/]" if c.feasible else "[red]no[/]", *([_escape(c.reason or "")] if show_rejected else []))
    return t


@command(app, "plan")
def plan(
    ctx: typer.Context,
    file: Optional[Path] = typer.Argument(None, help="A plan request or a run spec (YAML/JSON)."),
    model: Optional[str] = typer.Option(None, help="Model family: gpt | mlp."),
    preset: Optional[str] = typer.Option(None, help="Preset, e.g. 125m, 7b, 70b."),
    device: Optional[str] = typer.Option(None, help="H100, A100-80GB, H200, L4, cpu, or 'live' (the service's Ray)."),
    gpus_per_node: Optional[int] = typer.Option(None, min=1),
    nodes: Optional[int] = typer.Option(None, min=1),
    global_batch_size: Optional[int] = typer.Option(None, min=1),
    seq_len: Optional[int] = typer.Option(None, min=1),
    precision: Optional[str] = typer.Option(None, help="fp32 | bf16 | fp16 (default bf16)."),
    layout: Optional[str] = typer.Option(None, help='Score only this layout, e.g. "dp=4,tp=8,pp=4".'),
    keep_layout: bool = typer.Option(False, "--keep-layout", help="With a run spec FILE: score its layout only."),
    micro_batch_size: Optional[int] = typer.Option(None, min=1),
    top_k: Optional[int] = typer.Option(None, "--top-k", min=1, help="How many candidates (default 10)."),
    show_rejected: bool = typer.Option(False, "--rejected", help="Also list layouts that do not fit."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Predict memory, step time, tokens/s and MFU of layouts before running anything."""
    body: dict[str, Any] = {}
    if file is not None:
        data = _load_or_usage(file)
        if "global_batch_size" in data or "cluster" in data:
            body = data
        else:  # a run spec
            body = {"model": data.get("model", {}),
                    "global_batch_size": (data.get("batch") or {}).get("global_batch_size", 16)}
            if data.get("precision"):
                body["precision"] = data["precision"]
            if keep_layout:
                body["layout"] = data.get("layout", {})
                if (data.get("batch") or {}).get("micro_batch_size"):
                    body["micro_batch_size"] = data["batch"]["micro_batch_size"]
    elif model is None and preset is None:
        _fail("give a FILE or --model/--preset with --global-batch-size (see meshrun plan --help)", EXIT_USAGE)
    if model is not None or preset is not None:
        m = dict(body.get("model") or {})
        if model is not None:
            m["name"] = model
        if preset is not None:
            m["preset"] = preset
        body["model"] = m
    cluster = dict(body.get("cluster") or {})
    for k, v in (("device", device), ("gpus_per_node", gpus_per_node), ("nodes", nodes)):
        if v is not None:
            cluster[k] = v
    if cluster:
        body["cluster"] = cluster
    if "global_batch_size" not in body and global_batch_size is None:
        _fail("--global-batch-size is required (sequences per optimizer step)", EXIT_USAGE,
              param="global_batch_size")
    for k, v in (("global_batch_size", global_batch_size), ("seq_len", seq_len), ("precision", precision),
                 ("micro_batch_size", micro_batch_size), ("top_k", top_k)):
        if v is not None:
            body[k] = v
    if layout is not None:
        body["layout"] = _usage(lambda: parse_layout(layout))
    resp = _state(ctx).client().plans.create(body)
    if as_json:
        emit_json(resp)
        return
    out().print(plan_table(resp, show_rejected=show_rejected))
    if not resp.candidates:
        err().print("[yellow]no feasible layout; see --rejected for why[/]")


# ----------------------------------------------------------------------------------------------- sweeps
def _sweep_table(sweep: Any) -> Table:
    t = Table(title=f"sweep {sweep.id} ({sweep.name}) {sweep.status}  objective {sweep.objective}")
    for col in ("trial", "run", "layout", "mb", "status", "pred tok/s", "tok/s", "MFU", "peak GiB", "reason"):
        t.add_column(col)
    best_id = sweep.best_trial.id if sweep.best_trial else None
    for tr in sweep.trials:
        mark = " *" if tr.id == best_id else ""
        t.add_row(f"{tr.id}{mark}", tr.run_id or "-", layout_str(tr.layout), str(tr.micro_batch_size), tr.status,
                  _rate(tr.predicted_tokens_per_s), _rate(tr.measured_tokens_per_s), _pct(tr.measured_mfu),
                  _gib(tr.peak_memory_bytes), _escape(tr.reason or ""))
    return t


@command(app, "sweep")
def sweep(
    ctx: typer.Context,
    file: Path = typer.Argument(..., help="A run spec (the base) or a full sweep spec (YAML/JSON)."),
    layouts: Optional[str] = typer.Option(None, help='"auto" or "dp=4; dp=2,tp=2; tp=2,pp=2".'),
    micro_batch_sizes: Optional[str] = typer.Option(None, help='Comma list, e.g. "1,2,4".'),
    max_trials: Optional[int] = typer.Option(None, min=1),
    steps_per_trial: Optional[int] = typer.Option(None, min=2),
    objective: Optional[str] = typer.Option(None, help="tokens_per_s | mfu."),
    name: Optional[str] = typer.Option(None),
    set_: list[str] = typer.Option([], "--set", help="Override a field of the sweep spec: key=value."),
    wait: bool = typer.Option(False, "--wait", "-w"),
    progress: bool = typer.Option(True, "--progress/--no-progress"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Sweep layouts/micro-batches with Ray Tune and report the fastest that fits."""
    data = _load_or_usage(file)
    body: dict[str, Any] = data if "base" in data else {"name": f"{data.get('name', 'run')}-sweep"[:128],
                                                         "base": data}
    search = dict(body.get("search") or {})
    if layouts is not None:
        search["layouts"] = _usage(lambda: parse_layouts(layouts))
    if micro_batch_sizes is not None:
        try:
            search["micro_batch_sizes"] = [int(x) for x in micro_batch_sizes.split(",") if x.strip()]
        except ValueError:
            _fail(f"--micro-batch-sizes must be integers like 1,2,4, got {micro_batch_sizes!r}", EXIT_USAGE)
    if search:
        body["search"] = search
    budget = dict(body.get("budget") or {})
    if max_trials is not None:
        budget["max_trials"] = max_trials
    if steps_per_trial is not None:
        budget["steps_per_trial"] = steps_per_trial
    if budget:
        body["budget"] = budget
    if objective is not None:
        body["objective"] = objective
    if name is not None:
        body["name"] = name
    body = _usage(lambda: apply_overrides(body, set_))
    client = _state(ctx).client()
    sw = client.sweeps.create(body)
    if wait:
        sw = client.sweeps.wait(sw.id, progress=err() if (progress and not as_json) else False)
    if as_json:
        emit_json(sw)
    else:
        out().print(_sweep_table(sw))
        if sw.best_trial is not None:
            out().print(f"best: {layout_str(sw.best_trial.layout)} micro-batch {sw.best_trial.micro_batch_size}; "
                        f"run it with: meshrun submit --from-sweep {sw.id}")
        elif not wait:
            err().print(f"follow it with: meshrun sweeps show {sw.id}")
    if wait:
        raise typer.Exit({"SUCCEEDED": EXIT_OK, "CANCELLED": EXIT_CANCELLED}.get(str(sw.status).upper(),
                                                                                  EXIT_RUN_FAILED))


@command(sweeps_app, "list")
def sweeps_list(ctx: typer.Context, limit: int = typer.Option(20, min=1, max=1000), offset: int = typer.Option(0, min=0),
                as_json: bool = typer.Option(False, "--json")) -> None:
    """List sweeps, newest first."""
    page = _state(ctx).client().sweeps.list(limit=limit, offset=offset)
    if as_json:
        emit_json(page)
        return
    t = Table(title=f"sweeps ({page.total})")
    for col in ("id", "name", "status", "trials", "best", "created"):
        t.add_column(col)
    for s in page.items:
        best = (f"{layout_str(s.best_trial.layout)} mb{s.best_trial.micro_batch_size}" if s.best_trial else "-")
        t.add_row(s.id, s.name, s.status, str(len(s.trials)), best, _ts(s.created_at))
    out().print(t)


@command(sweeps_app, "show")
def sweeps_show(ctx: typer.Context, sweep_id: str = typer.Argument(..., metavar="ID"),
                as_json: bool = typer.Option(False, "--json")) -> None:
    """Trials of a sweep (the best marked *)."""
    sw = _state(ctx).client().sweeps.get(sweep_id)
    if as_json:
        emit_json(sw)
    else:
        out().print(_sweep_table(sw))


@command(sweeps_app, "wait")
def sweeps_wait(ctx: typer.Context, sweep_id: str = typer.Argument(..., metavar="ID"),
                timeout: Optional[float] = typer.Option(None), as_json: bool = typer.Option(False, "--json")) -> None:
    """Wait for a sweep to finish (exit 0 if it SUCCEEDED)."""
    sw = _state(ctx).client().sweeps.wait(sweep_id, progress=False if as_json else err(), timeout=timeout)
    if as_json:
        emit_json(sw)
    else:
        out().print(_sweep_table(sw))
    raise typer.Exit({"SUCCEEDED": EXIT_OK, "CANCELLED": EXIT_CANCELLED}.get(str(sw.status).upper(), EXIT_RUN_FAILED))


@command(sweeps_app, "cancel")
def sweeps_cancel(ctx: typer.Context, sweep_id: str = typer.Argument(..., metavar="ID"),
                  as_json: bool = typer.Option(False, "--json")) -> None:
    """Cancel a sweep and its running trials."""
    sw = _state(ctx).client().sweeps.cancel(sweep_id)
    if as_json:
        emit_json(sw)
    else:
        out().print(f"{sw.id} {sw.status}")


# ---------------------------------------------------------------------------------------------- cluster
@command(app, "cluster")
def cluster(ctx: typer.Context, as_json: bool = typer.Option(False, "--json")) -> None:
    """Nodes and free resources of the service's Ray cluster."""
    cl = _state(ctx).client().cluster.get()
    if as_json:
        emit_json(cl)
        return
    t = Table(title=f"Ray cluster {cl.address or ''}  CPUs {cl.cpus_free:g}/{cl.cpus_total:g} free, "
                    f"GPUs {cl.gpus_free:g}/{cl.gpus_total:g} free")
    for col in ("node", "alive", "address", "CPUs", "GPUs", "memory GiB"):
        t.add_column(col)
    for n in cl.nodes:
        t.add_row(n.node_id[:12], "[green]yes[/]" if n.alive else "[red]no[/]", n.address or "-", f"{n.cpus:g}",
                  f"{n.gpus:g}", _gib(n.memory_bytes))
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


# ------------------------------------------------------------------------------------------ local tools
@command(app, "validate")
def validate(file: Path = typer.Argument(..., help="Run spec (YAML/JSON)."),
             set_: list[str] = typer.Option([], "--set", help="Override a field: key=value."),
             as_json: bool = typer.Option(False, "--json")) -> None:
    """Check a run spec locally (no service needed) and print the resolved plan."""
    import pydantic

    from api.validation import SpecError, build_plan
    from api.yamlio import parse_run_spec

    body = _usage(lambda: apply_overrides(_load_or_usage(file), set_))
    try:
        # the server's parse of a JSON body (what `meshrun submit` sends): valid here means accepted there
        spec = parse_run_spec(body)
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        _fail(f"{first['msg']}", EXIT_INVALID, param=".".join(str(p) for p in first["loc"]))
    except (TypeError, ValueError) as e:  # data JSON cannot carry (a YAML date, NaN)
        _fail(f"{file}: {e}; quote such values", EXIT_INVALID)
    try:
        p = build_plan(spec)
    except SpecError as e:
        for issue in e.issues[1:]:
            err().print(f"[red]error: {_escape(issue.message)}  (field: {issue.param})[/]")
        _fail(e.issues[0].message, EXIT_INVALID, param=e.issues[0].param)
    if as_json:
        emit_json(p)
        return
    out().print(f"[green]valid[/] {spec.name}: {layout_str(spec.layout)}  world {p.world_size}, "
                f"{p.model.n_params:,} params, {p.microbatches_per_step} micro-batches/step, "
                f"{p.tokens_per_step:,} tokens/step")
    for w in p.warnings:
        err().print(f"[yellow]warning:[/] {_escape(w)}")


@command(db_app, "upgrade")
def db_upgrade(database_url: Optional[str] = typer.Option(None, help="SQLAlchemy URL (default: settings).")) -> None:
    """Migrate the database to the newest schema."""
    from service.db import redact_url
    from service.migrate import upgrade
    from service.settings import Settings

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
    from service import auth
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
        err().print(f"token for project [bold]{project}[/] created; it is shown only once. "
                    "Use it as MESHRUN_TOKEN or --token.")


def _create_token(auth: Any, url: str, *, project: str, name: str, admin: bool, can_run_code: bool) -> str:
    """``service.auth.create_token`` in a session of the configured database (migrated first)."""
    from service.db import make_engine, make_sessionmaker, session_scope
    from service.migrate import upgrade

    upgrade(url)
    engine = make_engine(url)
    try:
        with session_scope(make_sessionmaker(engine)) as session:
            return auth.create_token(session, project, name, admin=admin, can_run_code=can_run_code)
    finally:
        engine.dispose()


if __name__ == "__main__":
    app()

"""Shared pieces of the ``meshrun`` CLI: the typer apps, global options, error handling and exit codes,
output helpers.

``meshrun``: the command line of meshrun (typer + rich). Everything remote goes through the SDK.

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
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Optional

import typer
from pydantic import BaseModel
from rich.console import Console

from api.sdk import (
    APIConnectionError,
    APIStatusError,
    AuthenticationError,
    BadRequestError,
    Client,
    ConflictError,
    MeshrunError,
    NotFoundError,
    PermissionDeniedError,
    RunFailedError,
    ValidationError,
    WaitTimeoutError,
    load_file,
)

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

EXIT_CODES_HELP = (
    "Exit codes: 0 ok; 1 run failed (--wait) or unexpected error; 2 usage; 3 not found; "
    "4 invalid spec/request (400/422); 5 conflict (409); 6 auth (401/403); 7 service unavailable "
    "(connection, timeout, 429/5xx); 8 run cancelled (--wait); 9 wait timed out."
)

app = typer.Typer(
    name="meshrun",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    help="Plan, run and sweep distributed-training layouts on Ray.",
    epilog=EXIT_CODES_HELP,
)
db_app = typer.Typer(no_args_is_help=True, help="Database maintenance (runs against MESHRUN_DATABASE_URL).")
token_app = typer.Typer(no_args_is_help=True, help="API tokens (written directly to the configured database).")
sweeps_app = typer.Typer(no_args_is_help=True, help="List, show, wait for and cancel sweeps.")
app.add_typer(db_app, name="db")
app.add_typer(token_app, name="token")
webhook_app = typer.Typer(no_args_is_help=True, help="Webhooks: signed calls on run and sweep events.")
app.add_typer(sweeps_app, name="sweeps")
app.add_typer(webhook_app, name="webhook")

REPO_EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
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
    if isinstance(data, BaseModel):
        data = data.model_dump(mode="json")
    elif isinstance(data, list):
        data = [d.model_dump(mode="json") if isinstance(d, BaseModel) else d for d in data]
    typer.echo(json.dumps(data, indent=2, default=str))


def _fail(message: str, code: int, *, param: str | None = None) -> None:
    c = err()  # soft wrap: one line per message (the terminal wraps it; paths and URLs in it stay whole)
    c.print(f"[bold red]error:[/] [red]{_escape(message)}[/]", soft_wrap=True)
    if param:
        c.print(f"[red]  field: {_escape(param)}[/]", soft_wrap=True)
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
            raise typer.Exit(130) from None
        except Exception as e:
            if os.environ.get("MESHRUN_DEBUG"):
                raise
            _fail(f"unexpected error: {type(e).__name__}: {e} (set MESHRUN_DEBUG=1 for the traceback)", EXIT_RUN_FAILED)

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
    url: Optional[str] = typer.Option(
        None, "--url", envvar="MESHRUN_URL", show_default="http://127.0.0.1:8000", help="meshrun service URL."
    ),
    token: Optional[str] = typer.Option(
        None, "--token", envvar="MESHRUN_TOKEN", show_default=False, help="API token (Bearer)."
    ),
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


def _usd(x: float | None) -> str:
    """US dollars: '$1,234', '$24.00', '$0.000315' (three significant figures below a cent); '-' when unknown."""
    if x is None:
        return "-"
    if x >= 1000:
        return f"${x:,.0f}"
    return f"${x:.2f}" if x >= 0.01 or x == 0 else f"${x:.3g}"


def cost_line(cost: Any) -> str:
    """A run's cost: '$24.00 = 8.00 device-hours (4 devices x 2.0 h) at $3.00/device-hour (request)'."""
    hours = f"{cost.device_hours:.2f} device-hours ({cost.devices} devices x {cost.attempts_wall_s / 3600:.2f} h)"
    if cost.usd is None:
        return f"{hours}; no price known (cluster.price_per_device_hour or MESHRUN_DEVICE_PRICES)"
    return f"{_usd(cost.usd)} = {hours} at {_usd(cost.price_per_device_hour)}/device-hour ({cost.price_source})"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _ts(dt: Any, *, short: bool = False) -> str:
    if dt is None:
        return "-"
    return dt.astimezone().strftime("%m-%d %H:%M" if short else "%Y-%m-%d %H:%M:%S")


STATUS_STYLE = {
    "QUEUED": "yellow",
    "STARTING": "cyan",
    "RUNNING": "blue",
    "SUCCEEDED": "green",
    "FAILED": "red",
    "CANCELLED": "magenta",
    "PREEMPTED": "bright_yellow",
}


def _status(s: Any) -> str:
    v = s.value if isinstance(s, Enum) else s
    return f"[{STATUS_STYLE.get(str(v), 'white')}]{v}[/]"


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

"""The ``meshrun`` command line (typer + rich). Commands talk to the service over HTTP through the SDK; only the
commands in ``api.cli.server`` (``serve``, ``demo``, ``db``, ``token``) reach into the service package, lazily,
inside the command.

One module per command group registers its commands on the shared typer app (``api.cli._common.app``).
"""

from api.cli import observe, plan, runs, server, sweeps, webhooks  # noqa: F401  (registers the commands)
from api.cli._common import app

__all__ = ["app"]

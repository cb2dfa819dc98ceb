"""``python -m api.cli``: the ``meshrun`` command line."""

from api.cli import app

app()

"""The meshrun Python SDK (re-exported from ``api.sdk``): ``from api.client import Client``.

Importing this module loads httpx and pydantic only (never torch or ray)."""

from api.sdk import *  # noqa: F403
from api.sdk import __all__  # noqa: F401

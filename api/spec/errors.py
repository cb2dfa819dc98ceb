"""The one error body of the API: ``{"error": {"code": "...", "message": "...", "param": "layout.tp"}}``."""

from __future__ import annotations

from api.spec._base import _Public


class ErrorDetail(_Public):
    code: str
    message: str
    param: str | None = None


class ErrorBody(_Public):
    error: ErrorDetail

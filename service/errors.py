"""The one error base of the service. Every error the service raises on purpose is a ``ServiceError``: it carries
the HTTP status, a stable ``code``, a message that says what to do and the ``param`` (dotted field) it is about.
``service.app.errors`` maps them onto the API's one error body in one handler; nothing else needs mapping. The
routes' transport errors (``service.app.errors.ApiError``: 401, 413, 429, bad query parameters) are ServiceErrors
too. (The SDK's ``api.sdk.MeshrunError`` is the client side: what a caller of the API catches.)

``api.spec.SpecError`` (a spec that cannot run) lives in the contract because the SDK and the workers raise it
too; the service maps it to 422 beside these.
"""

from __future__ import annotations

from collections.abc import Mapping


class ServiceError(Exception):
    """Base of the service's errors. Subclasses set ``status_code`` and ``code``; instances may override both."""

    status_code: int = 500
    code: str = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        status_code: int | None = None,
        headers: Mapping[str, str] | None = None,
    ):
        Exception.__init__(self, message)  # not super(): ApiError also derives from Starlette's HTTPException
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        if status_code is not None:
            self.status_code = status_code
        self.headers: Mapping[str, str] | None = dict(headers) if headers else None


class NotFound(ServiceError):
    """404: no such resource (or it belongs to another project: nothing leaks)."""

    status_code, code = 404, "not_found"


class Conflict(ServiceError):
    """409: the resource's current state does not allow this."""

    status_code, code = 409, "conflict"


class Forbidden(ServiceError):
    """403: the caller's token may not do this."""

    status_code, code = 403, "forbidden"


class InvalidRequest(ServiceError):
    """422: a value the service refuses; ``param`` names it and the message says what to use instead."""

    status_code, code = 422, "invalid_value"


class Unavailable(ServiceError):
    """503: a backend the request needs (Ray, the database) is down or busy; retry later."""

    status_code, code = 503, "unavailable"

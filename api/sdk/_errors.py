"""Exceptions raised by the meshrun SDK: one class per HTTP status family (openai-python's shape).

MeshrunError
├── APIError                      (anything that came from talking to the service)
│   ├── APIConnectionError        (no HTTP response: refused, reset, DNS)
│   │   └── APITimeoutError       (the request timed out)
│   └── APIStatusError            (the service answered 4xx/5xx; .status_code, .code, .param, .body)
│       ├── BadRequestError           400
│       ├── AuthenticationError       401
│       ├── PermissionDeniedError     403
│       ├── NotFoundError             404
│       ├── ConflictError             409
│       ├── ValidationError           422  (.param names the field, .message says the fix)
│       ├── RateLimitError            429
│       └── ServerError               5xx
├── WaitTimeoutError              (wait(timeout=...) elapsed before the run finished)
└── RunFailedError                (wait(raise_on_failure=True) and the run FAILED or was CANCELLED)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import httpx

from api.spec import RunStatus

if TYPE_CHECKING:  # pragma: no cover
    from .resources import Run

__all__ = [
    "MeshrunError",
    "APIError",
    "APIConnectionError",
    "APITimeoutError",
    "APIStatusError",
    "BadRequestError",
    "AuthenticationError",
    "PermissionDeniedError",
    "NotFoundError",
    "ConflictError",
    "ValidationError",
    "RateLimitError",
    "ServerError",
    "WaitTimeoutError",
    "RunFailedError",
    "status_error_class",
]


class MeshrunError(Exception):
    """Base class of every exception the SDK raises."""


class APIError(MeshrunError):
    message: str
    request: httpx.Request | None
    body: Any
    code: str | None
    param: str | None

    def __init__(
        self,
        message: str,
        *,
        request: httpx.Request | None = None,
        body: Any = None,
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.request = request
        self.body = body
        self.code = code
        self.param = param

    def __str__(self) -> str:
        return f"{self.message} (param: {self.param})" if self.param else self.message


class APIConnectionError(APIError):
    def __init__(
        self, message: str = "could not connect to the meshrun service", *, request: httpx.Request | None = None
    ) -> None:
        super().__init__(message, request=request, code="connection_error")


class APITimeoutError(APIConnectionError):
    def __init__(
        self, message: str = "the request to the meshrun service timed out", *, request: httpx.Request | None = None
    ) -> None:
        super().__init__(message, request=request)
        self.code = "timeout"


class APIStatusError(APIError):
    """The service answered with a 4xx/5xx status. ``code``/``message``/``param`` come from the error body
    ``{"error": {"code", "message", "param"}}``."""

    status_code: int
    response: httpx.Response | None
    _status: int = 0  # the status of each subclass (400, 401, ...)

    def __init__(
        self,
        message: str,
        *,
        response: httpx.Response | None = None,
        body: Any = None,
        code: str | None = None,
        param: str | None = None,
        status_code: int | None = None,
    ) -> None:
        super().__init__(
            message, request=response.request if response is not None else None, body=body, code=code, param=param
        )
        self.response = response
        self.status_code = (
            status_code
            if status_code is not None
            else (response.status_code if response is not None else type(self)._status)
        )

    @property
    def request_id(self) -> str | None:
        return self.response.headers.get("x-request-id") if self.response is not None else None

    def __str__(self) -> str:
        base = f"{self.status_code} {self.code or 'error'}: {self.message}"
        return f"{base} (param: {self.param})" if self.param else base


class BadRequestError(APIStatusError):
    _status = 400


class AuthenticationError(APIStatusError):
    _status = 401


class PermissionDeniedError(APIStatusError):
    _status = 403


class NotFoundError(APIStatusError):
    _status = 404


class ConflictError(APIStatusError):
    _status = 409


class ValidationError(APIStatusError):
    """The request (usually the run spec) is invalid. ``param`` is the dotted field (``layout.tp``) and
    ``message`` says what to use instead. Also raised before sending when a spec file cannot be parsed."""

    _status = 422


class RateLimitError(APIStatusError):
    _status = 429


class ServerError(APIStatusError):
    _status = 500


_BY_STATUS: dict[int, type[APIStatusError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    403: PermissionDeniedError,
    404: NotFoundError,
    409: ConflictError,
    422: ValidationError,
    429: RateLimitError,
}


def status_error_class(status_code: int) -> type[APIStatusError]:
    if status_code >= 500:
        return ServerError
    return _BY_STATUS.get(status_code, APIStatusError)


class WaitTimeoutError(MeshrunError, TimeoutError):
    def __init__(self, message: str, *, run_id: str | None = None, last: Any = None) -> None:
        super().__init__(message)
        self.run_id = run_id
        self.last = last


class RunFailedError(MeshrunError):
    def __init__(self, run: Run) -> None:
        status = RunStatus(run.status).value
        super().__init__(f"run {run.id} {status}: {run.status_reason or 'no reason recorded'}")
        self.run = run

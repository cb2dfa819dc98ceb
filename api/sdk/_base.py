"""HTTP plumbing: one request path with auth, timeouts, error mapping, retries and idempotency keys."""

from __future__ import annotations

import email.utils
import logging
import os
import random
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import httpx
import pydantic

from ._errors import APIConnectionError, APIStatusError, APITimeoutError, status_error_class

log = logging.getLogger("meshrun.client")

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_MAX_RETRIES = 2
INITIAL_RETRY_DELAY_S = 0.5
MAX_RETRY_DELAY_S = 8.0
MAX_RETRY_AFTER_S = 60.0
SDK_VERSION = "0.1.0"

M = TypeVar("M", bound=pydantic.BaseModel)


def _env(name: str) -> str | None:
    v = os.environ.get(name)
    return v if v else None


def tolerant_validate(model: type[M], data: Any) -> M:
    """Validate a server response into ``model``, dropping fields this SDK does not know yet.

    Response models ignore unknown fields already, but they embed request models (``RunSpec``, ``Layout``)
    that forbid them; a newer server that adds a spec field must not break an older SDK. Unknown keys
    reported as ``extra_forbidden`` are removed and validation is retried."""
    for _ in range(32):
        try:
            return model.model_validate(data)
        except pydantic.ValidationError as e:
            extra = [err["loc"] for err in e.errors() if err["type"] == "extra_forbidden"]
            if not extra:
                raise
            for loc in extra:
                _drop(data, loc)
    return model.model_validate(data)


def _drop(data: Any, loc: tuple[Any, ...]) -> None:
    node = data
    for key in loc[:-1]:
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            return
    if isinstance(node, dict):
        node.pop(loc[-1], None)


def _retry_after_s(response: httpx.Response) -> float | None:
    """Seconds the server asked us to wait (``retry-after-ms``, ``Retry-After`` seconds or HTTP date)."""
    ms = response.headers.get("retry-after-ms")
    if ms:
        try:
            return float(ms) / 1000.0
        except ValueError:
            pass
    ra = response.headers.get("retry-after")
    if not ra:
        return None
    try:
        return float(ra)
    except ValueError:
        parsed = email.utils.parsedate_to_datetime(ra) if ra else None
        if parsed is None:
            return None
        return max(0.0, parsed.timestamp() - time.time())


def _req(e: httpx.RequestError) -> httpx.Request | None:
    try:
        return e.request
    except RuntimeError:
        return None


def _should_retry_status(response: httpx.Response) -> bool:
    override = response.headers.get("x-should-retry")
    if override == "true":
        return True
    if override == "false":
        return False
    code = response.status_code
    return code == 408 or code == 429 or code >= 500


def _error_from_response(response: httpx.Response) -> APIStatusError:
    """Map a 4xx/5xx response to its exception class, reading ``{"error": {code, message, param}}``."""
    body: Any
    try:
        body = response.json()
    except ValueError:
        body = response.text
    code = message = param = None
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            code, message, param = err.get("code"), err.get("message"), err.get("param")
        elif isinstance(body.get("detail"), str):  # a plain FastAPI HTTPException
            message = body["detail"]
        elif isinstance(body.get("detail"), list) and body["detail"]:  # FastAPI's default 422 shape
            first = body["detail"][0]
            message = first.get("msg")
            param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        elif isinstance(body.get("reason"), str):  # /healthz of a degraded service: what is down
            message = f"{body.get('status', 'degraded')}: {body['reason']}"
    if not message:
        text = body if isinstance(body, str) and body else response.reason_phrase
        message = f"HTTP {response.status_code}: {text}"[:500]
    cls = status_error_class(response.status_code)
    return cls(str(message), response=response, body=body, code=code, param=param)


class BaseClient:
    """Holds the httpx client and performs every request. Subclassed by ``meshrun.Client``."""

    def __init__(
        self,
        base_url: str | None = None,
        token: str | None = None,
        *,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT_S,
        max_retries: int = DEFAULT_MAX_RETRIES,
        default_headers: Mapping[str, str] | None = None,
        http_client: httpx.Client | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        self.base_url = (base_url or _env("MESHRUN_URL") or DEFAULT_BASE_URL).rstrip("/")
        self.token = token if token is not None else _env("MESHRUN_TOKEN")
        self.timeout = timeout
        self.max_retries = max_retries
        self._default_headers = dict(default_headers or {})
        self._owns_http = http_client is None
        self._http = http_client or httpx.Client(timeout=timeout, transport=transport)
        self._sleep = time.sleep  # replaced in tests

    # ------------------------------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        if self._owns_http:
            self._http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(base_url={self.base_url!r}, auth={'yes' if self.token else 'no'})"

    # ------------------------------------------------------------------------------------------- requests
    def _headers(self, extra: Mapping[str, str] | None) -> dict[str, str]:
        h = {"Accept": "application/json", "User-Agent": f"meshrun-python/{SDK_VERSION}"}
        if self.token:
            h["Authorization"] = f"Bearer {self.token}"
        h.update(self._default_headers)
        if extra:
            h.update(extra)
        return h

    def _retry_delay_s(self, retries_done: int, response: httpx.Response | None) -> float:
        if response is not None:
            ra = _retry_after_s(response)
            if ra is not None and 0 <= ra <= MAX_RETRY_AFTER_S:
                return ra
        delay = min(INITIAL_RETRY_DELAY_S * (2.0**retries_done), MAX_RETRY_DELAY_S)
        return delay * (1.0 - 0.25 * random.random())  # jitter: 75-100% of the backoff

    def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, Any] | None = None,
        json: Any = None,
        idempotency_key: str | None = None,
        timeout: float | httpx.Timeout | None = None,
        max_retries: int | None = None,
        headers: Mapping[str, str] | None = None,
        on_retry: Callable[[], None] | None = None,
        raw: bool = False,
    ) -> Any:
        """Send one logical request (with retries) and return the decoded JSON body (``raw``: the body's bytes as
        sent). ``on_retry`` is called before each retry (callers use it to know that an earlier attempt may have
        taken effect).

        POSTs carry an ``Idempotency-Key`` generated once here and reused by every retry, so a retry after
        a lost response returns the object the first attempt created instead of creating a second one."""
        method = method.upper()
        extra = dict(headers or {})
        if method == "POST":
            extra.setdefault("Idempotency-Key", idempotency_key or f"meshrun-{uuid.uuid4().hex}")
        hdrs = self._headers(extra)
        clean_params = {k: v for k, v in (params or {}).items() if v is not None}
        retries = self.max_retries if max_retries is None else max_retries
        url = f"{self.base_url}{path}"
        attempt = 0
        while True:
            response: httpx.Response | None = None
            try:
                response = self._http.request(
                    method,
                    url,
                    params=clean_params or None,
                    json=json,
                    headers=hdrs,
                    timeout=self.timeout if timeout is None else timeout,
                )
            except httpx.TimeoutException as e:
                if attempt < retries:
                    delay = self._retry_delay_s(attempt, None)
                    log.info("%s %s timed out; retry %d/%d in %.2fs", method, path, attempt + 1, retries, delay)
                    attempt += 1
                    if on_retry is not None:
                        on_retry()
                    self._sleep(delay)
                    continue
                raise APITimeoutError(
                    f"{method} {path} timed out after {retries + 1} attempt(s)", request=_req(e)
                ) from e
            except httpx.TransportError as e:
                if attempt < retries:
                    delay = self._retry_delay_s(attempt, None)
                    log.info("%s %s failed (%s); retry %d/%d in %.2fs", method, path, e, attempt + 1, retries, delay)
                    attempt += 1
                    if on_retry is not None:
                        on_retry()
                    self._sleep(delay)
                    continue
                raise APIConnectionError(
                    request=_req(e),
                    message=f"could not reach the meshrun service at {self.base_url}: {e}. "
                    "Is it running (meshrun serve)? Set MESHRUN_URL or --url.",
                ) from e
            if response.is_success:
                if raw:
                    return response.content
                if response.status_code == 204 or not response.content:
                    return None
                try:
                    return response.json()
                except ValueError:
                    return response.text
            if attempt < retries and _should_retry_status(response):
                delay = self._retry_delay_s(attempt, response)
                log.info(
                    "%s %s -> %d; retry %d/%d in %.2fs", method, path, response.status_code, attempt + 1, retries, delay
                )
                response.close()
                attempt += 1
                if on_retry is not None:
                    on_retry()
                self._sleep(delay)
                continue
            raise _error_from_response(response)

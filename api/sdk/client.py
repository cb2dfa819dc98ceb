"""``meshrun.Client``: the synchronous Python client of the meshrun REST API."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx

from ._base import DEFAULT_MAX_RETRIES, DEFAULT_TIMEOUT_S, BaseClient
from ._webhooks import Webhooks
from .resources import ClusterResource, Plans, Runs, Sweeps


class Client(BaseClient):
    """Client of a meshrun service.

    >>> client = Client()                       # MESHRUN_URL (default http://127.0.0.1:8000), MESHRUN_TOKEN
    >>> run = client.runs.create("examples/dp.yaml")
    >>> run.wait(progress=True).summary

    ``timeout`` is per HTTP request (seconds); ``max_retries`` applies to connection errors, 408, 429 (honouring
    Retry-After) and 5xx, with exponential backoff and jitter. POSTs carry an idempotency key reused by
    their retries, so a retried submission never creates two runs.
    """

    runs: Runs
    plans: Plans
    sweeps: Sweeps
    cluster: ClusterResource
    webhooks: Webhooks

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
        super().__init__(
            base_url,
            token,
            timeout=timeout,
            max_retries=max_retries,
            default_headers=default_headers,
            http_client=http_client,
            transport=transport,
        )
        self.runs = Runs(self)
        self.plans = Plans(self)
        self.sweeps = Sweeps(self)
        self.cluster = ClusterResource(self)
        self.webhooks = Webhooks(self)

    def with_options(self, *, timeout: float | httpx.Timeout | None = None, max_retries: int | None = None) -> Client:
        """A client sharing this one's connection pool with other per-request options."""
        return Client(
            self.base_url,
            self.token,
            timeout=self.timeout if timeout is None else timeout,
            max_retries=self.max_retries if max_retries is None else max_retries,
            default_headers=self._default_headers,
            http_client=self._http,
        )

    def health(self) -> dict[str, Any]:
        """The service's /healthz answer (raises APIConnectionError when it is down)."""
        data = self.request("GET", "/healthz", max_retries=0)
        return data if isinstance(data, dict) else {"status": data}

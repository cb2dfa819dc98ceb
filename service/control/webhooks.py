"""Webhook delivery, from the service process (never from a run's driver or workers).

``WebhookDispatcher(settings, session_factory)`` is started with the app (``settings.webhooks``), on its own thread:
every ``webhook_poll_s`` it turns new events into deliveries (``service.store.webhooks.scan_events``), claims the
due ones and hands each to a small thread pool that POSTs it, signed (``service.security.webhooks.sign``), with a
per-attempt timeout. A slow or dead receiver therefore never slows a request or a run: at worst it occupies one
sender thread for ``webhook_timeout_s``. Every attempt is recorded (``record_attempt``): retries with exponential
backoff up to ``webhook_max_attempts``.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from sqlalchemy.orm import Session, sessionmaker

from service.meta import VERSION
from service.security.webhooks import SIGNATURE_HEADER, TIMESTAMP_HEADER, SealError, sign, unseal, webhook_key
from service.settings import Settings
from service.store import webhooks as hooks
from service.store.db import session_scope

logger = logging.getLogger(__name__)

SENDERS = 4
CLAIM_LIMIT = 20


class WebhookDispatcher:
    def __init__(self, settings: Settings, session_factory: sessionmaker[Session]) -> None:
        self.settings = settings
        self.factory = session_factory
        self._key: bytes | None = None  # read on the first delivery: starting the service writes no key file
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._inflight: set[int] = set()
        self._lock = threading.Lock()
        self._http = httpx.Client(
            timeout=httpx.Timeout(settings.webhook_timeout_s),
            follow_redirects=False,
            headers={"User-Agent": f"meshrun-webhooks/{VERSION}"},
        )

    # ------------------------------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._stop.clear()
        self._pool = ThreadPoolExecutor(max_workers=SENDERS, thread_name_prefix="meshrun-webhook")
        self._thread = threading.Thread(target=self._loop, name="meshrun-webhooks", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self._http.close()

    def wake(self) -> None:
        """Look for new events and due deliveries now (a route that just queued one)."""
        self._wake.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:  # a database hiccup: try again next round
                logger.exception("webhook dispatch failed")
            self._wake.wait(self.settings.webhook_poll_s)
            self._wake.clear()

    # ------------------------------------------------------------------------------------------ one round
    def tick(self) -> int:
        """Queue the deliveries of new events and start sending the due ones; returns how many were started."""
        lease = self.settings.webhook_timeout_s * 2 + 30
        with session_scope(self.factory) as s:
            hooks.scan_events(s)
        with session_scope(self.factory) as s:
            due = hooks.claim_due(s, lease_s=lease, limit=CLAIM_LIMIT)
        started = 0
        for d in due:
            with self._lock:
                if d.delivery_id in self._inflight:
                    continue
                self._inflight.add(d.delivery_id)
            if self._pool is None:
                self._send(d)
            else:
                self._pool.submit(self._send, d)
            started += 1
        return started

    def _send(self, d: hooks.Due) -> None:
        status: int | None = None
        error: str | None = None
        try:
            try:
                if self._key is None:
                    self._key = webhook_key(self.settings)
                secret = unseal(d.secret_sealed, self._key)
            except (SealError, OSError) as e:
                error = str(e)
            else:
                body = hooks.render_body(d.payload, d.payload_format)
                ts = int(time.time())
                headers = {
                    "Content-Type": "application/json",
                    SIGNATURE_HEADER: sign(secret, ts, body),
                    TIMESTAMP_HEADER: str(ts),
                    "X-Meshrun-Event": d.event,
                    "X-Meshrun-Delivery": str(d.delivery_id),
                    "X-Meshrun-Attempt": str(d.attempt),
                }
                try:
                    resp = self._http.post(d.url, content=body, headers=headers)
                    status = resp.status_code
                    if not 200 <= status < 300:
                        error = f"HTTP {status}: {resp.text[:200]}"
                except httpx.HTTPError as e:
                    error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            with session_scope(self.factory) as s:
                hooks.record_attempt(
                    s,
                    delivery_id=d.delivery_id,
                    http_status=status,
                    error=error,
                    max_attempts=self.settings.webhook_max_attempts,
                    retry_base_s=self.settings.webhook_retry_base_s,
                )
        except Exception:
            logger.exception("webhook delivery %s: recording the attempt failed", d.delivery_id)
        finally:
            with self._lock:
                self._inflight.discard(d.delivery_id)
            self._wake.set()  # a retry may be due sooner than the next poll

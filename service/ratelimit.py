"""In-process rate limiting: a token bucket per key (API token name, or client address with auth off).

``limit_per_minute`` requests per minute on average, bursts up to the same number. ``hit(key)`` returns None when
the request may proceed, else the seconds to wait (the API answers 429 with ``Retry-After``). Thread-safe; idle
buckets are pruned so hostile clients cycling keys cannot grow memory without bound. One process only: replicas
behind a load balancer each enforce the limit on their share.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

MAX_BUCKETS = 100_000


class RateLimiter:
    def __init__(self, limit_per_minute: int, *, clock: Callable[[], float] = time.monotonic):
        self.limit = int(limit_per_minute)
        self.rate_per_s = self.limit / 60.0
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, last refill time)
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.limit > 0

    def hit(self, key: str, cost: float = 1.0) -> float | None:
        """Take ``cost`` tokens from ``key``'s bucket. None = allowed; else seconds until it would be."""
        if not self.enabled:
            return None
        now = self._clock()
        with self._lock:
            tokens, last = self._buckets.get(key, (float(self.limit), now))
            tokens = min(float(self.limit), tokens + (now - last) * self.rate_per_s)
            if tokens >= cost:
                self._buckets[key] = (tokens - cost, now)
                return None
            self._buckets[key] = (tokens, now)
            if len(self._buckets) > MAX_BUCKETS:
                self._prune(now)
            return (cost - tokens) / self.rate_per_s

    def peek(self, key: str, cost: float = 1.0) -> float | None:
        """Like ``hit`` without taking anything: None if a request would be allowed now."""
        if not self.enabled:
            return None
        now = self._clock()
        with self._lock:
            if key not in self._buckets:
                return None
            tokens, last = self._buckets[key]
        tokens = min(float(self.limit), tokens + (now - last) * self.rate_per_s)
        return None if tokens >= cost else (cost - tokens) / self.rate_per_s

    def retry_after_header(self, wait_s: float) -> str:
        return str(max(1, math.ceil(wait_s)))

    def _prune(self, now: float) -> None:
        full_after_s = 60.0
        for k, (_, last) in list(self._buckets.items()):
            if now - last > full_after_s:
                del self._buckets[k]

"""In-process rate limiting: a token bucket per key (API token name, or client address with auth off).

``limit_per_minute`` requests per minute on average, bursts up to the same number. ``hit(key)`` returns None when
the request may proceed, else the seconds to wait (the API answers 429 with ``Retry-After``). Thread-safe. Memory
is bounded: at most ``max_buckets`` buckets (default ``MAX_BUCKETS``); inserting one more evicts the least
recently used (an evicted key starts again with a full bucket, which it would have had after a minute idle anyway),
so hostile clients cycling keys cannot grow memory. One process only: replicas behind a load balancer each
enforce the limit on their share.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

MAX_BUCKETS = 100_000


class RateLimiter:
    def __init__(
        self, limit_per_minute: int, *, clock: Callable[[], float] = time.monotonic, max_buckets: int = MAX_BUCKETS
    ):
        if max_buckets < 1:
            raise ValueError(f"max_buckets must be >= 1, got {max_buckets}")
        self.limit = int(limit_per_minute)
        self.rate_per_s = self.limit / 60.0
        self.max_buckets = int(max_buckets)
        self._clock = clock
        # key -> (tokens, last refill time), least recently used first
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()
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
            allowed = tokens >= cost
            self._buckets[key] = (tokens - cost if allowed else tokens, now)
            self._buckets.move_to_end(key)
            while len(self._buckets) > self.max_buckets:
                self._buckets.popitem(last=False)
            return None if allowed else (cost - tokens) / self.rate_per_s

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

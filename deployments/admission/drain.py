"""Retry-After from the observed drain rate; pure (no ray, no asyncio).

A rejected request is told to come back when the requests ahead of it (the queue, and itself) could
have been admitted: each release frees room for about one waiting request, so the wait is
`ahead / releases per second`, the rate measured over the last `window_s`. With no release in the
window there is nothing to go by, and the configured constant is used.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Optional

MIN_RETRY_AFTER_S = 1.0  # Retry-After is whole seconds; 0 would invite an immediate retry storm


class DrainRate:
    """Releases in a sliding window; `per_s` is their rate since the window (or the clock) began."""

    def __init__(self, window_s: float, started_at: float) -> None:
        self.window_s = window_s
        self._started_at = started_at
        self._times: deque[float] = deque()

    def record(self, now: float) -> None:
        self._times.append(now)
        self._prune(now)

    def per_s(self, now: float) -> Optional[float]:
        """Releases per second over the window; None when none happened in it."""
        self._prune(now)
        if not self._times:
            return None
        span_s = min(self.window_s, now - self._started_at)
        return len(self._times) / max(span_s, MIN_RETRY_AFTER_S)

    def _prune(self, now: float) -> None:
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()


def retry_after_s(num_ahead: int, rate_per_s: Optional[float], default_s: float, max_s: float) -> float:
    """Whole seconds until `num_ahead` requests drain at `rate_per_s`, within [1, max_s];
    `default_s` without a rate."""
    if rate_per_s is None or rate_per_s <= 0:
        return default_s
    return float(min(max_s, max(MIN_RETRY_AFTER_S, math.ceil(max(num_ahead, 1) / rate_per_s))))

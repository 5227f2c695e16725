"""`Breaker`: a circuit breaker with exponential backoff, for a store that may be down.

    closed --failure--> open (for `delay` seconds) --delay over--> half-open
    half-open: exactly one caller is let through (the probe); success -> closed, delay reset to
    `base`; failure -> open again, delay doubled up to `cap`.

While open (and while a half-open probe is in flight) `allow()` is False, so callers skip the
store at once instead of each paying a timeout: a dead store costs one timeout per backoff
period, not one per request. One failure opens it: every failure already cost its caller a
timeout. Thread-safe. It does no I/O and knows nothing about Redis (redis_store.py uses it).
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable


class BreakerState(enum.IntEnum):
    """Values exported as the `/metrics` gauge."""

    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


class Breaker:
    """See the module docstring; `clock` is injectable for tests (seconds, monotonic)."""

    def __init__(self, base: float = 0.5, cap: float = 30.0,
                 clock: Callable[[], float] = time.monotonic):
        if not 0 < base <= cap:
            raise ValueError(f"breaker delays must satisfy 0 < base <= cap, got {base}, {cap}")
        self.base, self.cap, self.clock = base, cap, clock
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self.delay = base  # the open period after the next failure
        self._reopen_at = 0.0
        self.opens = 0  # times it went from closed or half-open to open

    @property
    def state(self) -> BreakerState:
        with self._lock:
            return self._state

    def allow(self) -> bool:
        """May the caller use the store now? (True once per half-open period: the probe.)"""
        with self._lock:
            if self._state is BreakerState.CLOSED:
                return True
            if self._state is BreakerState.OPEN and self.clock() >= self._reopen_at:
                self._state = BreakerState.HALF_OPEN
                return True
            return False

    def success(self) -> None:
        with self._lock:
            self._state, self.delay = BreakerState.CLOSED, self.base

    def failure(self) -> None:
        with self._lock:
            if self._state is BreakerState.HALF_OPEN:  # the probe failed: back off further
                self.delay = min(2 * self.delay, self.cap)
            elif self._state is BreakerState.OPEN:  # a call let through before it opened
                return
            self._state = BreakerState.OPEN
            self._reopen_at = self.clock() + self.delay
            self.opens += 1

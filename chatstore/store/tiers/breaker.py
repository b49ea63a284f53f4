"""A circuit breaker for a remote backend (the Redis tier): an outage costs a few short timeouts,
then nothing, instead of one timeout per call.

    closed ──`failures` failures in a row──► open ──`reset_s` later──► half_open
      ▲                                       ▲                          │ one call (the probe)
      └───────────── the probe succeeds ──────┼──── the probe fails ─────┘

While open (and half-open, beside the probe) `allow()` says no at once: the caller answers a
read as a miss and skips a write, without touching the socket. Thread-safe; every method holds a
small lock of its own for a few field updates, never while the caller does I/O.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

BreakerState = Literal["closed", "open", "half_open"]


@dataclass(frozen=True)
class BreakerHealth:
    """What /admin/cache and /metrics show of the remote tier."""

    state: BreakerState
    failures: int  # calls that failed (timeouts, refused connections), in total
    opens: int  # times the breaker opened
    short_circuited: int  # calls refused without I/O while open
    last_error: str | None


class CircuitBreaker:
    def __init__(
        self,
        failures: int = 3,
        reset_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if failures < 1 or reset_s < 0:
            raise ValueError("a breaker needs failures >= 1 and reset_s >= 0")
        self.threshold = failures
        self.reset_s = reset_s
        self._clock = clock
        self._lock = threading.Lock()
        self._state: BreakerState = "closed"
        self._in_a_row = 0
        self._opened_at = 0.0
        self._probing = False
        self._failures = 0
        self._opens = 0
        self._short_circuited = 0
        self._last_error: str | None = None

    def allow(self) -> bool:
        """May the caller talk to the backend now? A True must be answered by exactly one
        `success()` or `failure()` (in half-open it is the probe)."""
        with self._lock:
            if self._state == "closed":
                return True
            if not self._probing and self._clock() - self._opened_at >= self.reset_s:
                self._state = "half_open"
                self._probing = True
                return True
            self._short_circuited += 1
            return False

    def is_open(self) -> bool:
        """Calls would be refused now (no probe is due): the backend counts as absent."""
        with self._lock:
            if self._state == "closed":
                return False
            return self._probing or self._clock() - self._opened_at < self.reset_s

    def success(self) -> None:
        with self._lock:
            self._state = "closed"
            self._in_a_row = 0
            self._probing = False

    def failure(self, error: BaseException | str) -> None:
        with self._lock:
            self._failures += 1
            self._in_a_row += 1
            self._last_error = error if isinstance(error, str) else _describe(error)
            if self._state == "half_open" or (
                self._state == "closed" and self._in_a_row >= self.threshold
            ):
                self._state = "open"
                self._opened_at = self._clock()
                self._probing = False
                self._opens += 1

    def health(self) -> BreakerHealth:
        with self._lock:
            return BreakerHealth(
                self._state, self._failures, self._opens, self._short_circuited, self._last_error
            )


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:200]

"""A circuit breaker for one engine replica: stop sending it work after it fails several
requests in a row, then try it again one request at a time (pure: no threads, a clock
passed in).

The classic three-state machine (M. Nygard, "Release It!", 2007; resilience4j's
``CircuitBreaker``; Envoy's outlier detection calls the open state *ejected*)::

    CLOSED --failure_threshold consecutive failures--> OPEN
    OPEN   --open time elapsed (seen lazily)---------> HALF_OPEN
    HALF_OPEN: one probe request is let through
        probe succeeds --> CLOSED   (failure count and backoff reset)
        probe fails    --> OPEN     (open time doubled, capped at max_open_seconds)

1. Only *consecutive* failures count (Envoy's ``consecutive_5xx``): one success resets the
   count, so a replica with a low, steady error rate is never ejected for it.
2. The open time backs off: ``open_seconds * 2**k`` after ``k`` failed probes, at most
   ``max_open_seconds``. Envoy grows it linearly (``base_ejection_time`` times the number
   of ejections, capped by ``max_ejection_time``); doubling reaches the cap in a few
   re-openings, so a replica that stays broken costs few failed probes.
3. Half-open lets exactly one request through until that request reports, as
   resilience4j with ``permittedNumberOfCallsInHalfOpenState = 1``: a replica that just
   came back is not handed a burst it may fail.
4. ``force_open`` is for the supervisor, which *knows* a replica is down (crashed,
   restarting): it opens at once without waiting for failures and without doubling.

The breaker cannot tell the probe's outcome from a late one of a request sent before it
opened: in half-open any success closes it and any failure re-opens it. Both say how the
replica is doing now, which is what the probe asks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum


class BreakerState(str, Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class BreakerConfig:
    failure_threshold: int = 3  # consecutive failures that open the breaker
    open_seconds: float = 5.0  # first open time; doubles on each failed probe
    max_open_seconds: float = 60.0  # the doubling stops here

    def __post_init__(self) -> None:
        if not isinstance(self.failure_threshold, int) or self.failure_threshold < 1:
            raise ValueError(f"failure_threshold must be an integer >= 1 (consecutive failures "
                             f"before a replica is ejected), got {self.failure_threshold!r}")
        if not self.open_seconds > 0:
            raise ValueError(f"open_seconds must be > 0 (how long an ejected replica gets no "
                             f"requests), got {self.open_seconds!r}")
        if not self.max_open_seconds >= self.open_seconds:
            raise ValueError(f"max_open_seconds ({self.max_open_seconds!r}) must be >= "
                             f"open_seconds ({self.open_seconds!r}): it caps the doubling")


class CircuitBreaker:
    """One replica's breaker. Not thread-safe: its owner (the router) serialises calls."""

    def __init__(self, config: BreakerConfig = BreakerConfig(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._state = BreakerState.CLOSED
        self._opened_at = 0.0
        self._open_for = config.open_seconds  # the current open time, backed off
        self._probing = False  # half-open: the one probe is out and has not reported
        self.consecutive_failures = 0
        self.opened_count = 0  # transitions into OPEN, for /metrics

    @property
    def state(self) -> BreakerState:
        # OPEN ends by time alone; checking on each read needs no timer thread
        if (self._state is BreakerState.OPEN
                and self._clock() - self._opened_at >= self._open_for):
            self._state = BreakerState.HALF_OPEN
            self._probing = False
        return self._state

    @property
    def open_for(self) -> float:
        """Seconds the breaker stays (or stayed) open this time."""
        return self._open_for

    def would_allow(self) -> bool:
        """Whether :meth:`allow` would say yes, without claiming the half-open probe."""
        state = self.state
        return state is BreakerState.CLOSED or (state is BreakerState.HALF_OPEN
                                                and not self._probing)

    def allow(self) -> bool:
        """May a request go to this replica now? In half-open, a yes claims the one probe."""
        if not self.would_allow():
            return False
        if self._state is BreakerState.HALF_OPEN:
            self._probing = True
        return True

    def seconds_until_half_open(self) -> float:
        """0 unless open; then the seconds left before a probe may go."""
        if self.state is not BreakerState.OPEN:
            return 0.0
        return max(0.0, self._opened_at + self._open_for - self._clock())

    def record_success(self) -> None:
        self._state = BreakerState.CLOSED
        self._probing = False
        self.consecutive_failures = 0
        self._open_for = self.config.open_seconds

    def record_failure(self) -> None:
        self.consecutive_failures += 1
        state = self.state
        if state is BreakerState.HALF_OPEN:
            self._open(min(2 * self._open_for, self.config.max_open_seconds))
        elif (state is BreakerState.CLOSED
              and self.consecutive_failures >= self.config.failure_threshold):
            self._open(self._open_for)
        # OPEN: a late failure of a request sent before it opened; the count is enough

    def force_open(self) -> None:
        """The replica is known to be down: open now for the current open time."""
        self._open(self._open_for)

    def _open(self, seconds: float) -> None:
        if self.state is not BreakerState.OPEN:  # an elapsed open period counts anew
            self.opened_count += 1
        self._state = BreakerState.OPEN
        self._opened_at = self._clock()
        self._open_for = seconds
        self._probing = False

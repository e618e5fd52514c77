"""Per-tenant rate limits: token buckets per minute and a budget per UTC day (pure: the
clock is injected, nothing here knows HTTP).

1. A per-minute limit L is a token bucket of capacity L refilled continuously at L/60
   per second: "remaining" is what could be spent now and "reset" the time until the
   bucket is full again (the meaning of OpenAI's ``x-ratelimit-reset-*``). A burst of L
   is allowed; a steady rate above L/60 per second is not.
2. The daily budget counts from 00:00 UTC and clears at the next midnight UTC: a
   calendar day, like a bill. (A rolling 24 h window refilled continuously would be one
   more bucket with a slower rate, not a budget; a rolling log would keep every
   request's stamp for a day.) Unix time has no leap seconds, so ``now // 86400`` is the
   UTC day.
3. Admission takes what a request could use from every limit at once, or from none:
   one request, its prompt tokens, ``max_tokens`` x choices of output, and their sum
   from the day. When the request ends or is aborted, :meth:`RateLimiter.settle` gives
   back what it did not use. A request larger than a limit can never pass
   (``retry_after`` None); any other refusal says how long until it would.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

DAY = 86400.0


@dataclass(frozen=True)
class Kind:
    field: str  # the limit's attribute on the tenant's limits
    what: str  # in refusals, as OpenAI words its own ("tokens per min (TPM)")
    unit: str  # "requests" | "tokens": OpenAI's error type for this limit
    per_day: bool = False


KINDS: dict[str, Kind] = {
    "requests": Kind("requests_per_minute", "requests per min (RPM)", "requests"),
    "input_tokens": Kind("input_tokens_per_minute", "input tokens per min (ITPM)", "tokens"),
    "output_tokens": Kind("output_tokens_per_minute", "output tokens per min (OTPM)",
                          "tokens"),
    "tokens_day": Kind("tokens_per_day", "tokens per day (TPD)", "tokens", per_day=True),
}


@dataclass
class Bucket:
    """``capacity`` per 60 s, refilled continuously; the level may go below zero when a
    request used more than it reserved (it then waits longer to refill)."""

    capacity: int
    level: float
    stamp: float

    def at(self, now: float) -> None:
        # max(): a clock stepped back refills nothing, and the lost span is not refilled
        # twice once the clock catches up
        elapsed = max(now - self.stamp, 0.0)
        self.level = min(float(self.capacity), self.level + elapsed * self.capacity / 60.0)
        self.stamp = max(self.stamp, now)

    def resize(self, capacity: int) -> None:
        """A new limit keeps what was spent: the same usage against the new capacity."""
        self.level = min(float(capacity), self.level + capacity - self.capacity)
        self.capacity = capacity

    def wait(self, need: int, now: float) -> float:
        return max(need - self.level, 0.0) * 60.0 / self.capacity

    def reset(self, now: float) -> float:
        return max(self.capacity - self.level, 0.0) * 60.0 / self.capacity

    def take(self, n: int) -> None:
        self.level -= n

    def give(self, n: int, since: float) -> None:
        self.level = min(float(self.capacity), self.level + n)

    @property
    def remaining(self) -> float:
        return self.level


@dataclass
class DailyBudget:
    """``capacity`` tokens per UTC calendar day."""

    capacity: int
    used: int
    day: int

    def at(self, now: float) -> None:
        today = int(now // DAY)
        if today != self.day:
            self.day, self.used = today, 0

    def resize(self, capacity: int) -> None:
        self.capacity = capacity

    def wait(self, need: int, now: float) -> float:
        return 0.0 if need <= self.remaining else self._to_midnight(now)

    def reset(self, now: float) -> float:
        return self._to_midnight(now) if self.used > 0 else 0.0

    def _to_midnight(self, now: float) -> float:
        return (self.day + 1) * DAY - now

    def take(self, n: int) -> None:
        self.used += n

    def give(self, n: int, since: float) -> None:
        # what a request reserved yesterday is not today's to give back
        if int(since // DAY) == self.day:
            self.used = max(self.used - n, 0)

    @property
    def remaining(self) -> float:
        return float(self.capacity - self.used)


Window = Bucket | DailyBudget


def _new_window(kind: str, capacity: int, now: float) -> Window:
    if KINDS[kind].per_day:
        return DailyBudget(capacity, 0, int(now // DAY))
    return Bucket(capacity, float(capacity), now)


@dataclass(frozen=True)
class Gauge:
    """One limit as headers show it."""

    kind: str
    limit: int
    remaining: int
    reset: float  # seconds until the bucket is full again / the day's usage clears


@dataclass(frozen=True)
class Refusal:
    kind: str
    limit: int
    used: int
    requested: int
    retry_after: float | None  # None: larger than the limit itself, waiting cannot help


@dataclass
class Reservation:
    tenant: str
    taken: dict[str, int]
    at: float
    settled: bool = False


@dataclass(frozen=True)
class Decision:
    gauges: tuple[Gauge, ...]
    reservation: Reservation | None = None
    refusal: Refusal | None = None


@dataclass
class RateLimiter:
    """Every tenant's windows, by tenant name (so a reloaded key file keeps usage).

    Thread-safe; ``limits`` is any object with :data:`KINDS`' attributes (None: no
    limit). A limit changed between calls applies from the next call, usage kept."""

    clock: Callable[[], float] = time.time
    _windows: dict[str, dict[str, Window]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _sync(self, tenant: str, limits, now: float) -> dict[str, Window]:
        windows = self._windows.setdefault(tenant, {})
        for kind, spec in KINDS.items():
            capacity = getattr(limits, spec.field, None)
            if capacity is None:
                windows.pop(kind, None)
                continue
            window = windows.get(kind)
            if window is None:
                window = windows[kind] = _new_window(kind, capacity, now)
            elif window.capacity != capacity:
                window.at(now)
                window.resize(capacity)
            window.at(now)
        return windows

    @staticmethod
    def _gauges(windows: dict[str, Window], now: float) -> tuple[Gauge, ...]:
        return tuple(Gauge(kind, w.capacity, max(math.floor(w.remaining + 1e-9), 0),
                           w.reset(now)) for kind, w in windows.items())

    def status(self, tenant: str, limits) -> tuple[Gauge, ...]:
        with self._lock:
            now = self.clock()
            return self._gauges(self._sync(tenant, limits, now), now)

    def admit(self, tenant: str, limits, need: Mapping[str, int]) -> Decision:
        """Reserve ``need`` (kind -> amount) from every limit, or refuse with the limit
        that binds longest (one that can never pass first)."""
        with self._lock:
            now = self.clock()
            windows = self._sync(tenant, limits, now)
            refusals = []
            for kind, w in windows.items():
                n = need.get(kind, 0)
                if n > w.capacity:
                    refusals.append(Refusal(kind, w.capacity, _used(w), n, None))
                elif n > w.remaining:
                    refusals.append(Refusal(kind, w.capacity, _used(w), n, w.wait(n, now)))
            if refusals:
                worst = max(refusals, key=lambda r: math.inf if r.retry_after is None
                            else r.retry_after)
                return Decision(self._gauges(windows, now), refusal=worst)
            taken = {kind: need.get(kind, 0) for kind in windows}
            for kind, w in windows.items():
                w.take(taken[kind])
            return Decision(self._gauges(windows, now), Reservation(tenant, taken, now))

    def settle(self, reservation: Reservation, used: Mapping[str, int]) -> None:
        """Give back what a reservation did not use (or take what it used beyond it);
        once per reservation."""
        with self._lock:
            if reservation.settled:
                return
            reservation.settled = True
            windows = self._windows.get(reservation.tenant, {})
            now = self.clock()
            for kind, taken in reservation.taken.items():
                window = windows.get(kind)
                if window is not None:  # None: the limit was lifted since
                    window.at(now)
                    window.give(taken - used.get(kind, 0), reservation.at)


def _used(w: Window) -> int:
    return max(math.ceil(w.capacity - w.remaining - 1e-9), 0)

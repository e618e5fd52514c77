"""Over-saturation: is the server falling behind for good, while a level still runs?

Above its capacity an open-loop load has no steady state: the waiting queue grows by
(arrival rate - service rate) requests per second and every new request's TTFT with it.
Running such a level to its end measures nothing more (throughput is the capacity,
latency is whatever the run's length makes it) and leaves a backlog for the next level,
so ``--find-capacity`` stops it and marks it failed (``over_saturated``).

The detector fits a least-squares line to each series over the latest part of the run
(``window_fraction`` of the time elapsed) and calls the level over-saturated when

1. TTFT is over the SLO and growing: at least ``min_over_share`` of the window's TTFTs
   exceed the TTFT scale (the SLO's TTFT bound), the slope of (first-token time, TTFT)
   is positive with t = slope / SE >= ``min_t``, and the fitted TTFT rises by at least
   ``rise_fraction`` of the scale across the window; and
2. a queue grows with it, when one is observed: the requests in flight at the client,
   or the server's ``num_requests_waiting`` gauge, by the same slope test and a rise of at
   least ``min_queue_rise`` requests across the window;

and only after ``max(min_seconds, min_fraction * planned length)`` of the level has run,
so the start-up transient (an empty server filling) is not mistaken for growth.

This follows guidellm's over-saturation detection (``src/guidellm/scheduler/constraints/
saturation.py``: regression slopes of concurrent requests and TTFT over a sliding window,
both positive with a small margin of error, after a minimum duration, with at least
half the TTFTs over a threshold) with two changes, both against false alarms on a
stable but busy server. Consecutive requests share one queue, so their TTFTs are
serially correlated and a plain t-test sees trends in what is a slow random wander
(guidellm caps its n at the seconds elapsed for the same reason): the slope's standard
error here uses the effective sample size n (1 - r1) / (1 + r1), r1 the lag-1
autocorrelation of the residuals (Santer et al. 2000, "Statistical significance of
trends and trend differences in layer-average atmospheric temperature time series",
JGR 105(D6)). And the level must already be losing its SLO in most of the
window (0.9, not guidellm's half). Simulated 20-second runs of M/D/1 queues (Poisson
arrivals, 20 or 100 ms service, 80/90/95 % load, 30 seeds each: 180 runs) with the scale
at their own TTFT percentile P raised, with a half share, 31 / 10 / 1 false alarms at
P = 50 / 75 / 90; with 0.9, 6 / 0 / 0. At 2x overload both caught 20 of 20 runs within
5.1 s (the first check is at 4 s), at 1.3x 19 of 20 (most within 9 s).

When the level has a planned length, its window is at least ``window_fraction *
min_fraction`` (10 %) of it when first judged, so at a steady arrival rate a stop means
at least 9 % of the level's requests already broke the TTFT bound: a level stopped early
would have failed a TTFT bound at p91 or above anyway.

A closed loop (``--by concurrency``) cannot over-saturate: by Little's law its queue
is bounded by the concurrency, the queue condition never holds, and its levels run to
the end. Pure: the caller feeds observations with times in seconds since the level
started; :class:`SaturationWatch` adapts it to the runner's watcher calls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from llmctl.bench.records import RequestRecord
from llmctl.bench.server_metrics import gauges


@dataclass(frozen=True)
class SaturationSettings:
    min_seconds: float = 0.5
    min_fraction: float = 0.2  # of the level's planned length, when it has one
    window_fraction: float = 0.5  # guidellm keeps up to 0.75 of its requests
    min_points: int = 8  # per series (guidellm: 5)
    min_t: float = 4.0
    min_over_share: float = 0.9
    rise_fraction: float = 0.5
    min_queue_rise: float = 2.0
    check_every: float = 0.05  # seconds of run time between two fits


@dataclass(frozen=True)
class Trend:
    n: int
    slope: float  # units per second
    t: float  # slope / its standard error, with n_eff (inf for an exact line)
    rise: float  # slope * the window's time span
    n_eff: float  # n (1 - r1) / (1 + r1), r1 >= 0 the residuals' lag-1 autocorrelation

    def growing(self, min_t: float, min_rise: float) -> bool:
        return self.slope > 0 and self.t >= min_t and self.rise >= min_rise


def trend(times: np.ndarray, values: np.ndarray) -> Trend | None:
    """Least squares of values on times (in time order), its standard error widened for
    autocorrelated residuals; None below 4 points or at one instant."""
    n = len(times)
    if n < 4:
        return None
    x = times - times.mean()
    sxx = float(x @ x)
    if sxx <= 0:
        return None
    y = values - values.mean()
    slope = float(x @ y) / sxx
    residuals = y - slope * x
    ss = float(residuals @ residuals)
    r1 = float(residuals[:-1] @ residuals[1:]) / ss if ss > 0 else 0.0
    n_eff = min(float(n), max(3.0, n * (1 - r1) / (1 + r1))) if r1 > 0 else float(n)
    # Santer et al. 2000: s_e^2 = sum(residuals^2) / (n_eff - 2), s_b = s_e / sqrt(sxx).
    se = math.sqrt(ss / (n_eff - 2) / sxx)
    t = slope / se if se > 0 else (math.inf if slope > 0 else 0.0)
    return Trend(n, slope, t, slope * float(times.max() - times.min()), n_eff)


@dataclass(frozen=True)
class Finding:
    at: float  # seconds into the level
    ttft: Trend
    queue: Trend | None
    queue_name: str | None

    @property
    def reason(self) -> str:
        text = (f"over-saturated at {self.at:.1f} s: TTFT growing {self.ttft.slope * 1000:.0f} "
                f"ms/s (t={min(self.ttft.t, 999):.0f})")
        if self.queue is not None:
            text += f", {self.queue_name} growing {self.queue.slope:.1f}/s"
        return text

    def to_dict(self) -> dict:
        return {"at": self.at, "ttft_slope_ms_per_s": self.ttft.slope * 1000,
                "ttft_t": min(self.ttft.t, 1e6), "queue": self.queue_name,
                "queue_slope_per_s": self.queue.slope if self.queue else None}


class _Series:
    def __init__(self) -> None:
        self.times: list[float] = []
        self.values: list[float] = []

    def add(self, t: float, value: float) -> None:
        self.times.append(t)
        self.values.append(value)

    def since(self, t0: float) -> tuple[np.ndarray, np.ndarray]:
        """Points at or after t0, in time order (TTFTs arrive in completion order)."""
        times = np.asarray(self.times)
        keep = np.flatnonzero(times >= t0)
        keep = keep[np.argsort(times[keep], kind="stable")]
        return times[keep], np.asarray(self.values)[keep]


class SaturationDetector:
    """Feed ``ttft``/``in_flight``/``waiting`` observations; ``check(now)`` returns a
    :class:`Finding` once the level is over-saturated (and keeps returning it)."""

    def __init__(self, ttft_scale: float, planned_seconds: float | None = None,
                 settings: SaturationSettings | None = None) -> None:
        self.scale = ttft_scale  # seconds
        self.settings = settings or SaturationSettings()
        s = self.settings
        self.earliest = max(s.min_seconds, s.min_fraction * (planned_seconds or 0.0))
        self.series = {"ttft": _Series(), "in flight": _Series(), "server queue": _Series()}
        self.finding: Finding | None = None
        self._checked = -math.inf

    def ttft(self, t: float, seconds: float) -> None:
        self.series["ttft"].add(t, seconds)

    def in_flight(self, t: float, count: int) -> None:
        self.series["in flight"].add(t, count)

    def waiting(self, t: float, count: float) -> None:
        self.series["server queue"].add(t, count)

    def check(self, now: float) -> Finding | None:
        s = self.settings
        if self.finding is not None or now < self.earliest or now - self._checked < s.check_every:
            return self.finding
        self._checked = now
        t0 = now * (1.0 - s.window_fraction)
        times, ttfts = self.series["ttft"].since(t0)
        if len(times) < s.min_points or \
                np.count_nonzero(ttfts > self.scale) < s.min_over_share * len(ttfts):
            return None
        ttft = trend(times, ttfts)
        if ttft is None or not ttft.growing(s.min_t, s.rise_fraction * self.scale):
            return None
        queues = []
        for name in ("server queue", "in flight"):
            q_times, q_values = self.series[name].since(t0)
            if len(q_times) >= s.min_points and (q := trend(q_times, q_values)) is not None:
                queues.append((name, q))
        if not queues:
            self.finding = Finding(now, ttft, None, None)  # no queue seen: TTFT alone
        else:
            grown = [(name, q) for name, q in queues if q.growing(s.min_t, s.min_queue_rise)]
            if grown:
                self.finding = Finding(now, ttft, grown[0][1], grown[0][0])
        return self.finding


class SaturationWatch:
    """The runner's watcher (:class:`llmctl.bench.runner.Watcher`) over a detector."""

    def __init__(self, detector: SaturationDetector) -> None:
        self.detector = detector

    def sent(self, t: float, in_flight: int) -> None:
        self.detector.in_flight(t, in_flight)

    def finished(self, t: float, record: RequestRecord, in_flight: int) -> None:
        self.detector.in_flight(t, in_flight)
        if record.success and record.ttft is not None and record.start is not None:
            self.detector.ttft(record.start + record.ttft, record.ttft)

    def scraped(self, t: float, values: dict[str, float]) -> None:
        waiting = gauges(values)["num_requests_waiting"]
        if waiting is not None:
            self.detector.waiting(t, waiting)

    def stop_reason(self, t: float) -> str | None:
        finding = self.detector.check(t)
        return finding.reason if finding else None

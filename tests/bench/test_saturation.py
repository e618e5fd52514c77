"""The over-saturation detector on synthetic series (simulated queues, noise, growth),
its watcher adapter, and the runner stopping a run when a watcher says so."""

import asyncio
import bisect

import numpy as np
import pytest

from llmctl.bench.backends import RequestSettings, get_backend
from llmctl.bench.records import RequestRecord, SampleRequest
from llmctl.bench.runner import Halt, RunPlan, run
from llmctl.bench.saturation import SaturationDetector, SaturationWatch, trend


def md1_events(load: float, service: float, seconds: float, seed: int, base: float = 0.02):
    """A FIFO single-server queue with Poisson arrivals and a fixed service time (M/D/1):
    ("sent", arrival, requests in the system) and ("done", completion, (first token, TTFT))
    in time order. TTFT = the wait for the server + ``base``."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(service / load, int(load / service * seconds)))
    free, departures, events = 0.0, [], []
    for i, a in enumerate(arrivals):
        begin = max(a, free)
        free = begin + service
        # FIFO: departures are sorted; in the system = arrived so far - departed by now.
        events.append((a, "sent", i + 1 - bisect.bisect_right(departures, a)))
        events.append((free, "done", (begin + base, begin - a + base)))
        departures.append(free)
    return sorted(events, key=lambda e: e[0])


def first_alarm(events, scale: float, planned: float):
    detector = SaturationDetector(scale, planned)
    for t, kind, value in events:
        if kind == "sent":
            detector.in_flight(t, value)
        else:
            detector.ttft(*value)
        if (finding := detector.check(t)) is not None:
            return finding
    return None


def test_trend_of_a_line_and_of_a_random_walk():
    t = np.linspace(0, 10, 50)
    line = trend(t, 3.0 + 0.5 * t)
    assert line.slope == pytest.approx(0.5) and line.rise == pytest.approx(5.0)
    assert line.t > 1e6  # residuals of rounding only
    assert trend(t, np.full(50, 2.0)).t == 0.0
    assert trend(t[:3], t[:3]) is None and trend(np.zeros(10), t[:10]) is None
    # A random walk's residuals are autocorrelated: far fewer effective samples.
    walk = np.cumsum(np.random.default_rng(0).normal(size=400))
    assert trend(np.arange(400.0), walk).n_eff < 40
    noise = np.random.default_rng(0).normal(size=400)
    assert trend(np.arange(400.0), noise).n_eff == 400


@pytest.mark.parametrize("load", [0.8, 0.9, 0.95])
def test_a_stable_busy_queue_never_stops(load):
    """M/D/1 below capacity wanders (its TTFTs are serially correlated) but has a steady
    state: no alarm, even with the bound at the level's own 60th-percentile TTFT (40 % of
    its requests miss it: the level fails, but it is not over-saturated). With guidellm's
    share of half the window over the bound, 4 of these 30 runs raise an alarm."""
    for seed in range(10):
        events = md1_events(load, 0.02, 20.0, seed)
        ttfts = [v[1] for _, kind, v in events if kind == "done"]
        assert first_alarm(events, float(np.percentile(ttfts, 60)), 20.0) is None, seed


def test_noisy_steady_level_above_its_bound_never_stops():
    """TTFTs over the bound (the level fails anyway) but flat, with heavy noise: no trend,
    so not over-saturated."""
    for seed in range(20):
        rng = np.random.default_rng(seed)
        detector = SaturationDetector(0.1, 10.0)
        for i, t in enumerate(np.arange(0, 10, 0.02)):
            detector.in_flight(t, rng.poisson(10))
            detector.ttft(t, 0.15 + rng.normal(0, 0.03))
            assert detector.check(t) is None, (seed, i)


@pytest.mark.parametrize("load", [1.5, 2.0])
def test_overload_stops_early(load):
    for seed in range(5):
        finding = first_alarm(md1_events(load, 0.02, 20.0, seed), 0.1, 20.0)
        assert finding is not None and finding.at < 6.0  # of a 20 s level (checks from 4 s)
        assert finding.ttft.slope > 0.2 and finding.queue_name == "in flight"
        assert finding.reason.startswith("over-saturated at")


def test_growth_that_is_small_against_the_bound_or_has_no_queue_is_not_saturation():
    t = np.arange(0, 10, 0.02)
    small = SaturationDetector(0.1, 10.0)  # 10 -> 40 ms against a 100 ms bound
    no_queue = SaturationDetector(0.1, 10.0)  # 0.2 -> 2 s, but the queue stays at 8
    for x in t:
        small.in_flight(x, 2 + x)
        small.ttft(x, 0.01 + 0.003 * x)
        no_queue.in_flight(x, 8)
        no_queue.ttft(x, 0.2 + 0.18 * x)
        assert small.check(x) is None and no_queue.check(x) is None


def test_the_server_queue_alone_can_show_the_growth_and_no_verdict_comes_early():
    detector = SaturationDetector(0.1, planned_seconds=10.0)  # judged from 2 s on
    for x in np.arange(0, 10, 0.05):
        detector.ttft(x, 0.2 + 0.2 * x)
        detector.waiting(x, 3 * x)
        finding = detector.check(x)
        assert (finding is None) == (x < 2.0), x
    assert finding.queue_name == "server queue" and finding.queue.slope == pytest.approx(3)


def test_watch_feeds_first_token_times_and_the_waiting_gauge():
    detector = SaturationDetector(0.1)
    watch = SaturationWatch(detector)
    watch.sent(0.5, 3)
    watch.finished(1.0, RequestRecord(0, 4, 4, start=0.2, ttft=0.3, latency=0.8), 2)
    watch.finished(1.1, RequestRecord(1, 4, 4, start=0.3, error="boom"), 1)
    watch.scraped(1.2, {"vllm:num_requests_waiting": 7.0})
    watch.scraped(1.3, {"vllm:num_requests_running": 1.0})
    assert detector.series["in flight"].values == [3, 2, 1]
    assert detector.series["ttft"].times == [pytest.approx(0.5)]
    assert detector.series["server queue"].values == [7.0]
    assert watch.stop_reason(0.1) is None


class StopAfter:
    """A watcher that stops the run at its n-th send."""

    def __init__(self, n: int) -> None:
        self.n, self.sends, self.finishes = n, 0, 0

    def sent(self, t, in_flight):
        self.sends += 1

    def finished(self, t, record, in_flight):
        self.finishes += 1

    def scraped(self, t, values):
        pass

    def stop_reason(self, t):
        return "enough" if self.sends >= self.n else None


def test_a_watcher_stops_the_run_and_in_flight_requests_are_cancelled(server):
    watcher = StopAfter(5)
    plan = RunPlan([SampleRequest(f"p {i}", 2, 4) for i in range(40)], request_rate=20.0,
                   initial_check=False)

    async def main():
        return await run(plan, get_backend("openai-completions"),
                         RequestSettings(server, "fake-model"), halt=Halt(), watcher=watcher)

    result = asyncio.run(main())
    assert result.stopped == "enough" and not result.interrupted and result.not_sent == 0
    # Sent: exactly the first 5 (the 5th is cancelled before it runs); none recorded as
    # not sent, as a stop is not a dead target.
    assert [r.index for r in result.records] == [0, 1, 2, 3, 4]
    assert result.records[4].error == "cancelled before completion (stopped early: enough)"
    assert all(r.success or r.error.endswith("(stopped early: enough)")
               for r in result.records)
    assert watcher.finishes == 4  # every request that ran, cancelled or not

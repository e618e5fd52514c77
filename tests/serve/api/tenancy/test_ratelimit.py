"""The rate limiter on a fake clock: bucket refill arithmetic, window edges, the UTC-day
budget, all-or-nothing reservations and settling; the header formats."""

from dataclasses import dataclass
from datetime import datetime, timezone

import pytest

from llmctl.serve.api.tenancy.gate import go_duration, rate_limit_headers, refusal_error
from llmctl.serve.api.tenancy.ratelimit import Gauge, RateLimiter


@dataclass
class Limits:
    requests_per_minute: int | None = None
    input_tokens_per_minute: int | None = None
    output_tokens_per_minute: int | None = None
    tokens_per_day: int | None = None


class Clock:
    def __init__(self, t: float = 1_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def need(requests=1, inp=0, out=0):
    return {"requests": requests, "input_tokens": inp, "output_tokens": out,
            "tokens_day": inp + out}


def gauge(decision, kind):
    return next(g for g in decision.gauges if g.kind == kind)


def test_requests_per_minute_refills_one_request_every_60_over_limit_seconds():
    clock = Clock()
    rl = RateLimiter(clock)
    lim = Limits(requests_per_minute=3)
    for remaining in (2, 1, 0):
        d = rl.admit("t", lim, need())
        assert d.refusal is None and gauge(d, "requests").remaining == remaining
    refused = rl.admit("t", lim, need())
    # 3 per minute refill at 0.05 request/s: one request in 20 s
    assert refused.reservation is None
    assert refused.refusal.kind == "requests"
    assert refused.refusal.retry_after == pytest.approx(20.0)
    assert (refused.refusal.limit, refused.refusal.used, refused.refusal.requested) == (3, 3, 1)
    assert gauge(refused, "requests").reset == pytest.approx(60.0)  # empty -> full: 60 s
    clock.t += 19.999  # the edge: not yet
    assert rl.admit("t", lim, need()).refusal.retry_after == pytest.approx(0.001, abs=1e-6)
    clock.t += 0.001
    assert rl.admit("t", lim, need()).refusal is None


def test_a_refused_request_takes_nothing_from_the_other_limits():
    clock = Clock()
    rl = RateLimiter(clock)
    lim = Limits(input_tokens_per_minute=1000, output_tokens_per_minute=100)
    d = rl.admit("t", lim, need(inp=300, out=150))
    assert d.refusal.kind == "output_tokens" and d.refusal.retry_after is None  # 150 > 100
    ok = rl.admit("t", lim, need(inp=300, out=60))
    assert gauge(ok, "input_tokens").remaining == 700  # the refused 300 was never taken
    assert gauge(ok, "output_tokens").remaining == 40


def test_the_longest_wait_is_the_one_reported():
    clock = Clock()
    rl = RateLimiter(clock)
    lim = Limits(requests_per_minute=60, output_tokens_per_minute=600)
    rl.admit("t", lim, need(out=600))
    # requests: 59 left, fine; output: 0 left, 100 tokens at 10/s = 10 s
    d = rl.admit("t", lim, need(out=100))
    assert d.refusal.kind == "output_tokens" and d.refusal.retry_after == pytest.approx(10.0)


def test_settling_gives_back_the_unused_reservation():
    clock = Clock()
    rl = RateLimiter(clock)
    lim = Limits(output_tokens_per_minute=600, tokens_per_day=10_000)
    d = rl.admit("t", lim, need(inp=20, out=500))
    assert gauge(d, "output_tokens").remaining == 100
    assert gauge(d, "tokens_day").remaining == 10_000 - 520
    rl.settle(d.reservation, {"requests": 1, "input_tokens": 20, "output_tokens": 50,
                              "tokens_day": 70})
    status = {g.kind: g for g in rl.status("t", lim)}
    assert status["output_tokens"].remaining == 550
    assert status["tokens_day"].remaining == 10_000 - 70
    # settling twice changes nothing
    rl.settle(d.reservation, {})
    assert {g.kind: g for g in rl.status("t", lim)}["output_tokens"].remaining == 550
    # 560 needs 10 more than the 550 left: 1 s at 10 tokens/s
    assert rl.admit("t", lim, need(out=560)).refusal.retry_after == pytest.approx(1.0)


def test_using_more_than_reserved_is_charged():
    clock = Clock()
    rl = RateLimiter(clock)
    lim = Limits(output_tokens_per_minute=600)
    d = rl.admit("t", lim, need(out=100))
    rl.settle(d.reservation, {"output_tokens": 700})
    (g,) = rl.status("t", lim)
    assert g.remaining == 0 and g.reset == pytest.approx(70.0)  # -100 -> 600 at 10/s


def test_daily_budget_clears_at_midnight_utc():
    midnight = datetime(2025, 3, 2, tzinfo=timezone.utc).timestamp()
    clock = Clock(midnight - 60)  # 23:59:00 UTC
    rl = RateLimiter(clock)
    lim = Limits(tokens_per_day=1000)
    d = rl.admit("t", lim, need(inp=100, out=800))
    refused = rl.admit("t", lim, need(inp=100, out=100))
    assert refused.refusal.kind == "tokens_day"
    assert refused.refusal.retry_after == pytest.approx(60.0)
    assert gauge(refused, "tokens_day").reset == pytest.approx(60.0)
    assert (refused.refusal.used, refused.refusal.requested) == (900, 200)
    clock.t = midnight - 0.001
    assert rl.admit("t", lim, need(inp=100, out=100)).refusal is not None
    clock.t = midnight
    ok = rl.admit("t", lim, need(inp=100, out=100))
    assert ok.refusal is None and gauge(ok, "tokens_day").remaining == 800
    # yesterday's reservation settling today gives nothing back to today
    rl.settle(d.reservation, {"tokens_day": 0})
    assert rl.status("t", lim)[0].remaining == 800
    assert rl.admit("t", lim, need(inp=0, out=2000)).refusal.retry_after is None


def test_a_changed_limit_keeps_the_usage():
    clock = Clock()
    rl = RateLimiter(clock)
    rl.admit("t", Limits(output_tokens_per_minute=100), need(out=60))
    (g,) = rl.status("t", Limits(output_tokens_per_minute=50))
    assert g.limit == 50 and g.remaining == 0  # 60 used of 50: 10 below empty
    assert g.reset == pytest.approx(72.0)  # 60 tokens at 50/60 per s
    (g,) = rl.status("t", Limits(output_tokens_per_minute=200))
    assert g.remaining == 140
    assert rl.status("t", Limits()) == ()  # limits lifted: nothing to show


def test_a_clock_stepping_back_refills_nothing():
    clock = Clock()
    rl = RateLimiter(clock)
    lim = Limits(requests_per_minute=60)
    for _ in range(60):
        rl.admit("t", lim, need())
    clock.t -= 30
    assert rl.admit("t", lim, need()).refusal is not None
    clock.t += 30  # back where it was: still nothing refilled
    assert rl.admit("t", lim, need()).refusal is not None
    clock.t += 1
    assert rl.admit("t", lim, need()).refusal is None


def test_tenants_are_separate():
    rl = RateLimiter(Clock())
    lim = Limits(requests_per_minute=1)
    assert rl.admit("a", lim, need()).refusal is None
    assert rl.admit("a", lim, need()).refusal is not None
    assert rl.admit("b", lim, need()).refusal is None


@pytest.mark.parametrize("seconds,text", [
    (0, "0s"), (0.0004, "0s"), (0.012, "12ms"), (0.9996, "1s"), (1.574, "1.574s"),
    (20, "20s"), (360, "6m0s"), (3723.5, "1h2m3.5s"), (86400, "24h0m0s"),
])
def test_reset_durations_are_written_as_openai_writes_them(seconds, text):
    assert go_duration(seconds) == text


def test_headers_name_every_limit_and_the_tightest_token_limit():
    gauges = (Gauge("requests", 60, 59, 1.0), Gauge("input_tokens", 1000, 900, 6.0),
              Gauge("output_tokens", 500, 120, 45.6), Gauge("tokens_day", 10_000, 9000, 3600))
    h = rate_limit_headers(gauges)
    assert h["x-ratelimit-limit-requests"] == "60"
    assert h["x-ratelimit-remaining-requests"] == "59"
    assert h["x-ratelimit-reset-requests"] == "1s"
    assert h["x-ratelimit-remaining-input-tokens"] == "900"
    assert h["x-ratelimit-reset-tokens-day"] == "1h0m0s"
    # OpenAI's single tokens triple: the per-minute token limit with the fewest left
    assert (h["x-ratelimit-limit-tokens"], h["x-ratelimit-remaining-tokens"],
            h["x-ratelimit-reset-tokens"]) == ("500", "120", "45.6s")
    assert rate_limit_headers((Gauge("requests", 2, 1, 30.0),)).keys() == {
        "x-ratelimit-limit-requests", "x-ratelimit-remaining-requests",
        "x-ratelimit-reset-requests"}


def test_refusals_carry_retry_after_or_say_not_to_retry():
    from llmctl.serve.api.tenancy.ratelimit import Refusal

    exc = refusal_error("acme", Refusal("input_tokens", 1000, 950, 300, 14.96), {"a": "b"})
    assert exc.status == 429 and exc.type == "tokens" and exc.code == "rate_limit_exceeded"
    assert exc.headers == {"a": "b", "retry-after": "15", "retry-after-ms": "14960"}
    assert exc.message == ("Rate limit reached for tenant 'acme' on input tokens per min "
                           "(ITPM): Limit 1000, Used 950, Requested 300. Please try again "
                           "in 14.96s.")
    big = refusal_error("acme", Refusal("output_tokens", 100, 0, 400, None), {})
    assert big.headers == {"x-should-retry": "false"} and "too large" in big.message
    tiny = refusal_error("acme", Refusal("requests", 60, 60, 1, 0.0004), {})
    assert (tiny.type, tiny.headers["retry-after"], tiny.headers["retry-after-ms"]) == (
        "requests", "1", "1")

"""Deadline admission arithmetic and the engine's rate meter (pure, hand-computed)."""

from __future__ import annotations

import pytest

from llmctl.serve.core.admission import RateMeter, ServiceRate, check_deadline, expected_tokens

RATE = ServiceRate(tokens_per_second=1000.0, seconds_per_step=0.01, output_fraction=0.5)


def test_a_request_that_cannot_finish_is_refused_with_the_estimate():
    # wait = 1500 / 1000 = 1.5 s; run = 100 / 1000 + 0.5 * 200 * 0.01 = 1.1 s; 2.6 > 2
    refusal = check_deadline(ahead=1500, prompt_tokens=100, max_tokens=200, left=2.0,
                             rate=RATE)
    assert refusal is not None
    assert (refusal.wait, refusal.run) == pytest.approx((1.5, 1.1))
    assert refusal.retry_after == 1  # ceil(2.6 - 2.0)
    assert "1500 tokens are queued ahead" in refusal.reason()
    assert "1.5 s" in refusal.reason() and "1000 tokens/s" in refusal.reason()


def test_it_fits_when_the_estimate_is_within_the_time_left():
    assert check_deadline(ahead=800, prompt_tokens=100, max_tokens=200, left=2.0,
                          rate=RATE) is None  # 0.8 + 1.1 = 1.9 s


def test_never_refused_without_a_rate_or_with_nothing_ahead():
    assert check_deadline(ahead=1e9, prompt_tokens=100, max_tokens=200, left=0.1,
                          rate=None) is None
    # too long even alone: the client's choice of length, left to its timeout
    assert check_deadline(ahead=0, prompt_tokens=100, max_tokens=10_000, left=0.1,
                          rate=RATE) is None


def test_aging_caps_the_wait_behind_other_classes_not_behind_its_own():
    # 1000 s of another class's queue ahead, but aging starts the request within 1 s
    assert check_deadline(ahead=1e6, prompt_tokens=100, max_tokens=200, left=2.5,
                          rate=RATE, wait_bound=1.0) is None  # 1.0 + 1.1 <= 2.5
    refusal = check_deadline(ahead=1e6, prompt_tokens=100, max_tokens=200, left=2.0,
                             rate=RATE, wait_bound=1.0)
    assert refusal is not None and refusal.wait == 1.0 and refusal.retry_after == 1
    assert "with aging it starts in about 1.0 s" in refusal.reason()
    # its own class's work still goes first: 1.0 + 300 / 1000 s
    assert check_deadline(ahead=1e6, prompt_tokens=100, max_tokens=200, left=2.0,
                          rate=RATE, wait_bound=1.0,
                          ahead_own=300).wait == pytest.approx(1.3)
    # a bound above the queue's own time changes nothing
    assert check_deadline(ahead=800, prompt_tokens=100, max_tokens=200, left=1.85,
                          rate=RATE, wait_bound=60.0).wait == pytest.approx(0.8)


def test_retry_after_counts_the_excess_and_a_past_deadline():
    refusal = check_deadline(ahead=5000, prompt_tokens=0, max_tokens=0, left=-3.0, rate=RATE)
    assert refusal.retry_after == 5  # the queue needs 5 s; the time already past is gone


def test_expected_tokens_scales_only_the_output():
    assert expected_tokens(30, 100, 0.25) == 55


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_rate_meter_uses_saturated_steps_in_its_window_only():
    clock = Clock()
    meter = RateMeter(window=10.0, min_steps=3, clock=clock)
    for _ in range(5):
        meter.record_step(10, 1.0, saturated=False)  # a half-idle engine: not counted
    assert meter.estimate() is None
    for tokens, seconds in ((100, 0.5), (300, 0.5), (200, 1.0)):
        clock.t += 1
        meter.record_step(tokens, seconds, saturated=True)
    rate = meter.estimate()
    assert rate.tokens_per_second == pytest.approx(600 / 2.0)
    assert rate.seconds_per_step == pytest.approx(2.0 / 3)
    assert rate.output_fraction == 1.0  # nothing finished yet: max_tokens as asked
    meter.record_finish(10, 40)
    meter.record_finish(30, 40)
    assert meter.estimate().output_fraction == pytest.approx(0.5)
    clock.t += 8.5  # now 11.5: the first saturated step (t=1) leaves the 10 s window
    assert meter.estimate() is None  # two steps left: below min_steps

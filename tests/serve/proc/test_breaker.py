"""The replica circuit breaker's state machine on a fake clock (times by hand)."""

from __future__ import annotations

import pytest

from llmctl.serve.proc.breaker import BreakerConfig, BreakerState, CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def breaker(**config) -> tuple[CircuitBreaker, Clock]:
    clock = Clock()
    return CircuitBreaker(BreakerConfig(**config), clock), clock


def test_threshold_consecutive_failures_open_it():
    b, _ = breaker()  # threshold 3
    b.record_failure()
    b.record_failure()
    assert b.state is BreakerState.CLOSED and b.allow()
    b.record_failure()
    assert b.state is BreakerState.OPEN
    assert not b.allow()
    assert (b.consecutive_failures, b.opened_count) == (3, 1)


def test_a_success_in_between_resets_the_count():
    b, _ = breaker()
    b.record_failure()
    b.record_failure()
    b.record_success()
    b.record_failure()
    b.record_failure()
    assert b.state is BreakerState.CLOSED
    assert b.consecutive_failures == 2
    b.record_failure()
    assert b.state is BreakerState.OPEN


def open_it(b: CircuitBreaker) -> None:
    for _ in range(b.config.failure_threshold):
        b.record_failure()


def test_open_turns_half_open_after_open_seconds():
    b, clock = breaker(open_seconds=5.0)
    open_it(b)
    clock.t = 4.0
    assert b.state is BreakerState.OPEN
    assert b.seconds_until_half_open() == pytest.approx(1.0)
    clock.t = 5.0
    assert b.state is BreakerState.HALF_OPEN
    assert b.seconds_until_half_open() == 0.0


def test_half_open_lets_exactly_one_probe_through():
    b, clock = breaker()
    open_it(b)
    clock.t = 5.0
    assert b.would_allow()
    assert b.would_allow()  # asking does not claim it
    assert b.allow()
    assert not b.allow()
    assert not b.would_allow()
    clock.t = 100.0  # still waiting for the probe's report, however long
    assert not b.allow()
    assert b.state is BreakerState.HALF_OPEN


def test_probe_success_closes_and_resets():
    b, clock = breaker()
    open_it(b)
    clock.t = 5.0
    assert b.allow()
    b.record_success()
    assert b.state is BreakerState.CLOSED
    assert b.allow() and b.allow()
    assert b.consecutive_failures == 0 and b.open_for == 5.0


def test_probe_failure_reopens_for_twice_as_long():
    b, clock = breaker(open_seconds=5.0)
    open_it(b)  # open over [0, 5)
    clock.t = 5.0
    assert b.allow()
    b.record_failure()  # open over [5, 15)
    assert b.state is BreakerState.OPEN
    assert b.open_for == 10.0 and b.opened_count == 2
    clock.t = 14.9
    assert b.state is BreakerState.OPEN
    clock.t = 15.0
    assert b.state is BreakerState.HALF_OPEN


def test_open_time_doubles_up_to_the_cap_and_a_success_resets_it():
    b, clock = breaker(open_seconds=5.0, max_open_seconds=12.0)
    open_it(b)
    times = []
    for _ in range(4):
        times.append(b.open_for)
        clock.t += b.open_for
        assert b.allow()  # the probe
        b.record_failure()
    assert times == [5.0, 10.0, 12.0, 12.0]
    clock.t += b.open_for
    assert b.allow()
    b.record_success()
    open_it(b)
    assert b.open_for == 5.0


def test_failures_while_open_do_not_extend_it():
    b, clock = breaker()
    open_it(b)
    clock.t = 3.0
    b.record_failure()  # a request sent before it opened, reporting late
    assert b.opened_count == 1
    clock.t = 5.0
    assert b.state is BreakerState.HALF_OPEN


def test_force_open_opens_at_once_without_doubling():
    b, clock = breaker(open_seconds=5.0)
    clock.t = 10.0
    b.force_open()
    assert b.state is BreakerState.OPEN and not b.allow()
    assert b.consecutive_failures == 0 and b.opened_count == 1
    clock.t = 15.0
    assert b.state is BreakerState.HALF_OPEN
    b.force_open()  # down again while half-open: same open time, counted again
    assert b.state is BreakerState.OPEN
    assert b.open_for == 5.0 and b.opened_count == 2
    b.force_open()  # already open: restarts the period, not a new opening
    assert b.opened_count == 2
    b.record_success()  # the supervisor says it is ready
    assert b.state is BreakerState.CLOSED and b.allow()


@pytest.mark.parametrize("config, message", [
    ({"failure_threshold": 0}, "failure_threshold must be an integer >= 1"),
    ({"failure_threshold": 1.5}, "failure_threshold must be an integer >= 1"),
    ({"open_seconds": 0.0}, "open_seconds must be > 0"),
    ({"open_seconds": -1.0}, "open_seconds must be > 0"),
    ({"open_seconds": 10.0, "max_open_seconds": 5.0}, "it caps the doubling"),
])
def test_config_rejects_bad_values(config, message):
    with pytest.raises(ValueError, match=message):
        BreakerConfig(**config)


def test_config_rejects_typos():
    with pytest.raises(TypeError):
        BreakerConfig(failure_treshold=3)

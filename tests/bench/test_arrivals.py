"""Arrival processes: rate, burstiness (coefficient of variation), seeding."""

import itertools
import math

import numpy as np
import pytest

from llmctl.bench.arrivals import offsets, parse_rate
from llmctl.bench.records import SampleRequest
from llmctl.bench.runner import RunPlan, schedule
from llmctl.errors import UsageError

N = 4000


def _gaps(times):
    return np.diff(np.concatenate(([0.0], times)))


def test_poisson_rate_and_cv():
    gaps = _gaps(offsets(N, 10.0, 1.0, np.random.default_rng(1), normalize=False))
    # Mean gap 1/rate; standard error 0.1/sqrt(4000) = 1.6 %, so 5 % is ~3 sigma.
    assert gaps.mean() == pytest.approx(0.1, rel=0.05)
    # Exponential gaps: CV = 1.
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.06)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness_sets_cv(burstiness):
    gaps = _gaps(offsets(N, 5.0, burstiness, np.random.default_rng(2), normalize=False))
    assert gaps.mean() == pytest.approx(0.2, rel=0.08)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.1)


def test_normalised_schedule_ends_at_n_over_rate():
    times = offsets(100, 4.0, 1.0, np.random.default_rng(3))
    assert times[-1] == pytest.approx(25.0)
    assert all(b >= a for a, b in itertools.pairwise(times))


def test_inf_rate_and_inf_burstiness():
    assert offsets(5, math.inf, 1.0, np.random.default_rng(0)) == [0.0] * 5
    assert offsets(4, 2.0, math.inf, np.random.default_rng(0)) == pytest.approx(
        [0.5, 1.0, 1.5, 2.0])


def test_same_seed_same_times_other_seed_other_times():
    a = offsets(50, 3.0, 0.5, np.random.default_rng(7))
    assert a == offsets(50, 3.0, 0.5, np.random.default_rng(7))
    assert a != offsets(50, 3.0, 0.5, np.random.default_rng(8))


def test_run_schedule_is_seeded():
    samples = [SampleRequest(str(i), 1, 1) for i in range(20)]
    first = [t for _, _, t in schedule(RunPlan(samples, request_rate=5.0, seed=3))]
    again = [t for _, _, t in schedule(RunPlan(samples, request_rate=5.0, seed=3))]
    other = [t for _, _, t in schedule(RunPlan(samples, request_rate=5.0, seed=4))]
    assert first == again and first != other


def test_duration_schedule_cycles_samples():
    samples = [SampleRequest(str(i), 1, 1) for i in range(3)]
    stream = schedule(RunPlan(samples, request_rate=100.0, duration=1.0))
    got = [next(stream) for _ in range(7)]
    assert [s.prompt for _, s, _ in got] == ["0", "1", "2", "0", "1", "2", "0"]
    assert [i for i, _, _ in got] == list(range(7))


@pytest.mark.parametrize("bad", ["0", "-1", "abc", "nan"])
def test_bad_rates(bad):
    with pytest.raises(UsageError):
        parse_rate(bad)
    assert parse_rate("inf") == math.inf and parse_rate("2.5") == 2.5

"""The capacity search: on synthetic pass/fail functions (exact probe sequences, the knee
within one resolution step of the threshold, noise, determinism), then ``llmctl bench
--find-capacity`` end to end against a fake server with a known saturation point."""

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from llmctl.bench.capacity import (
    MAX_HALVINGS,
    SearchSpace,
    level_seed,
    parse_resolution,
    search,
)
from llmctl.cli.app import build_app
from llmctl.errors import UsageError

from .conftest import fake_server


@dataclass
class Out:
    passed: bool
    aborted: bool = False


def threshold(limit: float):
    """Passes exactly the levels <= limit; records what it was asked."""
    asked = []

    def measure(level, attempt):
        asked.append((level, attempt))
        return Out(level <= limit)
    measure.asked = asked
    return measure


def rate_space(start=12.0, maximum=1024.0, resolution="10%", confirm=1):
    return SearchSpace("rate", start, maximum, parse_resolution(resolution), confirm)


def test_rate_search_probe_sequence():
    # Capacity 37.5 req/s. Doubling brackets it in [24, 48]; bisection: 36 passes, 42
    # and 39 fail; 39 - 36 = 3 <= 10 % of 36, so 36 is rerun once and is the knee.
    measure = threshold(37.5)
    found = search(rate_space(12), measure)
    assert measure.asked == [(12, 0), (24, 0), (48, 0), (36, 0), (42, 0), (39, 0), (36, 1)]
    assert (found.knee, found.confirmed, found.stop, found.bracket) == (36, True, "resolved",
                                                                         (36, 39))
    assert [p.phase for p in found.probes] == ["bracket"] * 3 + ["bisect"] * 3 + ["confirm"]


@pytest.mark.parametrize("by", ["rate", "concurrency"])
def test_knee_within_one_step_of_the_threshold(by):
    """For every threshold and start: the knee passes, the level one step above it fails
    (it is <= the threshold and within one resolution step of it)."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        limit = float(rng.uniform(1, 900)) if by == "rate" else float(rng.integers(1, 900))
        start = float(rng.choice([1, 3, 16, 100, 700]))
        for resolution in ("10%", "25%", "2"):
            space = SearchSpace(by, start, 1024.0, parse_resolution(resolution), 1)
            found = search(space, threshold(limit))
            if limit < space.minimum:
                assert found.knee is None and found.stop == "none passed"
                continue
            assert found.stop == "resolved" and found.confirmed
            assert found.knee <= limit < found.knee + space.step(found.knee), (limit, start)
            if by == "concurrency":
                assert all(float(p.level).is_integer() for p in found.probes)


def test_concurrency_levels_are_integers_and_end_at_a_step_of_one():
    measure = threshold(3)
    found = search(SearchSpace("concurrency", 1, 64, parse_resolution("10%"), 1), measure)
    assert measure.asked == [(1, 0), (2, 0), (4, 0), (3, 0), (3, 1)]
    assert found.knee == 3 and found.bracket == (3, 4)


def test_failing_start_halves_down_to_a_floor():
    measure = threshold(5)
    found = search(rate_space(40), measure)
    assert [lv for lv, _ in measure.asked][:3] == [40, 20, 10]
    assert found.knee is not None and found.knee <= 5 < found.knee * 1.1
    nothing = threshold(0)
    found = search(rate_space(8), nothing)
    assert [lv for lv, _ in nothing.asked] == [8 / 2 ** k for k in range(MAX_HALVINGS + 1)]
    assert (found.knee, found.stop, found.bracket) == (None, "none passed", (None, 0.25))


def test_the_maximum_passing_is_reported_as_a_lower_bound():
    found = search(rate_space(100, maximum=300), threshold(1e9))
    assert [p.level for p in found.probes] == [100, 200, 300, 300]
    assert (found.knee, found.stop, found.bracket) == (300, "maximum", (300, None))


def test_a_pass_that_fails_its_repeat_is_a_fail():
    """36 passes once by luck, then fails its rerun: the knee drops to a level that passed
    every run (the search bisects again between the last clean pass and 36)."""
    def measure(level, attempt):
        return Out(level <= 33 or (level == 36 and attempt == 0))

    found = search(rate_space(12), measure)
    levels = [(p.level, p.attempt, p.outcome.passed) for p in found.probes]
    assert levels[:7] == [(12, 0, True), (24, 0, True), (48, 0, False), (36, 0, True),
                          (42, 0, False), (39, 0, False), (36, 1, False)]
    # back to [24, 36]: 30 and 33 pass; 36 - 33 <= 10 % of 33, and 33 is confirmed.
    assert levels[7:] == [(30, 0, True), (33, 0, True), (33, 1, True)]
    assert (found.knee, found.confirmed) == (33, True)


def test_noisy_search_is_deterministic_for_a_seed():
    """A server whose pass/fail is noisy near its capacity (40 +- 4): the same seed gives
    the same probes; the knee always passed all its runs and lies below the noise band's
    top."""
    def noisy(seed):
        def measure(level, attempt):
            jitter = np.random.default_rng(level_seed(seed, level, attempt)).normal(0, 2)
            return Out(level <= 40 + jitter)
        return measure

    runs = [[(p.level, p.attempt) for p in search(rate_space(5), noisy(s)).probes]
            for s in (1, 1, 2, 3, 4, 5)]
    assert runs[0] == runs[1]
    assert len({tuple(r) for r in runs[1:]}) > 1  # the seed matters
    for s in range(30):
        found = search(rate_space(5), noisy(s))
        assert found.confirmed and 30 <= found.knee <= 48
        assert all(p.outcome.passed for p in found.probes if p.level == found.knee)


def test_an_aborted_run_ends_the_search_with_the_best_level_so_far():
    def measure(level, attempt):
        return Out(level <= 30, aborted=level == 48)

    found = search(rate_space(12), measure)
    assert [p.level for p in found.probes] == [12, 24, 48]
    assert (found.knee, found.confirmed, found.stop) == (24, False, "aborted")


def test_level_seeds_are_deterministic_and_distinct():
    assert level_seed(0, 36, 0) == level_seed(0, 36, 0)
    seeds = {level_seed(s, lv, a) for s in (0, 1) for lv in (36, 36.5, 37) for a in (0, 1)}
    assert len(seeds) == 12
    assert level_seed(-1, 2.5, 0) >= 0  # a negative --seed still seeds


def test_resolution_and_space_checks():
    assert parse_resolution("10%").step(50) == pytest.approx(5)
    assert parse_resolution("2.5").step(50) == 2.5 and parse_resolution("2").text == "2"
    for bad in ("0%", "100%", "-1", "x", "0"):
        with pytest.raises(UsageError):
            parse_resolution(bad)
    with pytest.raises(UsageError, match="whole numbers"):
        SearchSpace("concurrency", 1.5, 8)
    with pytest.raises(UsageError, match="must be > 0 and <="):
        SearchSpace("rate", 10, 5)
    with pytest.raises(UsageError, match="load dimension"):
        SearchSpace("tokens", 1, 5)

"""Percentile SLO bounds: parsing, the goodput reading of a bound, checks of a level."""

import pytest

from llmctl.bench.metrics import compute_metrics
from llmctl.bench.records import RequestRecord
from llmctl.bench.slo import (
    SloBound,
    attainment,
    check_level,
    misses_allowed,
    parse_bound,
    parse_slo_flags,
    percentiles_needed,
)
from llmctl.errors import UsageError


def test_percentile_bounds_and_their_goodput_slos():
    flags = parse_slo_flags(["p95_ttft_ms<=500,p95_tpot_ms<=100", "p99_ttft<=800"])
    assert flags.bounds == (SloBound("ttft", 500.0, 95.0), SloBound("tpot", 100.0, 95.0),
                            SloBound("ttft", 800.0, 99.0))
    # Per-request goodput SLOs: one limit per metric, the tighter when bounded twice.
    assert flags.per_request == {"ttft_ms": 500.0, "tpot_ms": 100.0}
    assert [b.key for b in flags.bounds] == ["p95_ttft_ms", "p95_tpot_ms", "p99_ttft_ms"]
    assert percentiles_needed(flags.bounds) == [95.0, 99.0]


def test_stat_spellings():
    assert parse_bound("mean_e2el_ms<=2000") == SloBound("e2el", 2000.0, None)
    assert parse_bound("median_tpot_ms <= 40").key == "median_tpot_ms"
    assert parse_bound("p99.9_ttft_ms<=1e3").key == "p99.9_ttft_ms"
    assert parse_bound("p50_ttft_ms<=10").text == "median_ttft_ms<=10"


def test_per_request_form_is_unchanged():
    flags = parse_slo_flags(["ttft_ms=500", "tpot:100"])
    assert flags.per_request == {"ttft_ms": 500.0, "tpot_ms": 100.0} and flags.bounds == ()


@pytest.mark.parametrize("bad, says", [
    ("p95_ttft_ms<500", "not STAT_METRIC_ms<=MILLISECONDS"),
    ("p95_ttft_ms>=500", "upper limits"),
    ("p95_itl_ms<=50", "no per-request 'itl'"),
    ("p0_ttft_ms<=5", "(0, 100]"),
    ("p101_ttft_ms<=5", "(0, 100]"),
    ("p95_ttft_ms<=0", "positive"),
    ("p95_ttft_ms<=abc", "positive"),
    ("p95_ttft_ms<=500,p95_ttft_ms<=400", "twice"),
    ("p95_ttft_ms<=500,ttft_ms=300", "not STAT_METRIC"),
])
def test_malformed_bounds_are_usage_errors_with_an_example(bad, says):
    with pytest.raises(UsageError) as err:
        parse_slo_flags([bad])
    assert err.value.exit_code == 2 and says in err.value.message
    if "twice" not in says:
        assert "p95_ttft_ms<=500,p95_tpot_ms<=100" in err.value.remedy


def test_mixing_the_two_forms_is_refused():
    with pytest.raises(UsageError) as err:
        parse_slo_flags(["ttft_ms=500", "p95_tpot_ms<=100"])
    assert "mixes a per-request SLO ('ttft_ms=500')" in err.value.message


def rec(i, ttft, latency=None, out=4, error=None):
    latency = latency if latency is not None else (ttft or 0) + 0.03
    return RequestRecord(i, 8, 4, start=i * 0.1, ttft=ttft, itl=[0.01] * (out - 1),
                         latency=latency, output_tokens=out, error=error)


def test_attainment_counts_failures_as_misses():
    records = [rec(i, 0.1) for i in range(18)] + [rec(18, 0.7), rec(19, None, error="HTTP 500")]
    assert attainment(records, "ttft", 500) == pytest.approx(18 / 20)
    assert attainment(records, "ttft", 700) == pytest.approx(19 / 20)
    assert attainment([], "ttft", 500) == 0.0


def test_a_level_meets_p95_when_95_percent_of_requests_do():
    bound = SloBound("ttft", 500.0, 95.0)
    ok = [rec(i, 0.1) for i in range(19)] + [rec(19, 0.9)]  # 19/20 = 0.95 meet it
    miss = [rec(i, 0.1) for i in range(18)] + [rec(18, 0.9), rec(19, 0.9)]  # 0.90
    for records, passed in ((ok, True), (miss, False)):
        metrics = compute_metrics(records, 2.0, [95.0])
        [check] = check_level([bound], records, metrics)
        assert check.passed is passed and check.value_ms == metrics["p95_ttft_ms"]
    # The same 19/20 with the 20th failed instead of slow: still exactly 95 %.
    failed = ok[:19] + [rec(19, None, error="boom")]
    [check] = check_level([bound], failed, compute_metrics(failed, 2.0, [95.0]))
    assert check.passed and check.attained == pytest.approx(0.95)


@pytest.mark.parametrize("percentile", [50.0, 90.0, 95.0, 99.0, 99.9])
def test_misses_allowed_is_what_check_level_lets_through(percentile):
    """With ``misses_allowed`` slow requests a level passes; with one more it fails. The
    capacity report's short-level note relies on it (below 20 requests p95 allows none)."""
    bound = SloBound("ttft", 500.0, percentile)
    for n in [1, 2, 5, 10, 19, 20, 21, 39, 40, 99, 100, 101, 999, 1000]:
        allowed = misses_allowed(percentile, n)
        for misses, passed in ((allowed, True), (allowed + 1, False)):
            if misses > n:
                continue
            records = [rec(i, 0.1 if i >= misses else 0.9) for i in range(n)]
            [check] = check_level([bound], records, compute_metrics(records, 2.0, [percentile]))
            assert check.passed is passed, (percentile, n, misses)
    assert [misses_allowed(95.0, n) for n in (5, 19, 20, 39, 40)] == [0, 0, 1, 1, 2]


def test_mean_bound_uses_the_completed_mean():
    records = [rec(0, 0.1), rec(1, 0.3), rec(2, None, error="boom")]
    metrics = compute_metrics(records, 1.0)
    assert metrics["mean_ttft_ms"] == pytest.approx(200.0)
    [low] = check_level([SloBound("ttft", 150.0, None)], records, metrics)
    [high] = check_level([SloBound("ttft", 250.0, None)], records, metrics)
    assert (low.passed, high.passed, high.attained) == (False, True, None)

"""Metric maths against records computed by hand."""

import pytest

from llmctl.bench.metrics import compute_metrics, parse_slos, percentile_key, raw_arrays
from llmctl.bench.records import RequestRecord
from llmctl.errors import UsageError


def rec(i, start, ttft, itl, latency, out, prompt=10, error=None):
    return RequestRecord(i, prompt, 16, start=start, ttft=ttft, itl=list(itl), latency=latency,
                         output_tokens=out, error=error)


@pytest.fixture
def records():
    return [
        rec(0, 0.0, 0.1, [0.05, 0.05, 0.1], 0.3, 4),  # TPOT (0.3 - 0.1) / 3
        rec(1, 0.5, 0.2, [], 0.2, 1),  # one token: no TPOT sample
        rec(2, 1.0, None, [], 0.05, 0),  # zero tokens: no TTFT, still completed
        rec(3, 1.2, None, [], 0.01, None, error="HTTP 500: boom"),
    ]


def test_counts_and_throughput(records):
    m = compute_metrics(records, duration=2.0)
    assert (m["num_requests"], m["completed"], m["failed"]) == (4, 3, 1)
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 5
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(2.5)
    assert m["total_token_throughput"] == pytest.approx(17.5)
    assert m["request_goodput"] is None  # no SLO given


def test_latency_statistics(records):
    m = compute_metrics(records, duration=2.0, percentiles=[50, 99, 99.9])
    # TTFT over [0.1, 0.2] s; linear percentiles as numpy/vLLM.
    assert m["mean_ttft_ms"] == pytest.approx(150.0)
    assert m["median_ttft_ms"] == pytest.approx(150.0)
    assert m["std_ttft_ms"] == pytest.approx(50.0)
    assert m["p99_ttft_ms"] == pytest.approx(199.0)
    assert m["p99.9_ttft_ms"] == pytest.approx(199.9)
    # TPOT only from the 4-token request.
    assert m["mean_tpot_ms"] == pytest.approx(200.0 / 3)
    assert m["std_tpot_ms"] == pytest.approx(0.0)
    # ITL pooled: [50, 50, 100] ms.
    assert m["mean_itl_ms"] == pytest.approx(200.0 / 3)
    assert m["median_itl_ms"] == pytest.approx(50.0)
    # E2E over completed: [300, 200, 50] ms; the failure's 10 ms is not in it.
    assert m["mean_e2el_ms"] == pytest.approx(550.0 / 3)
    assert m["median_e2el_ms"] == pytest.approx(200.0)


def test_peaks(records):
    m = compute_metrics(records, duration=2.0)
    # Second 0 holds A's 4 chunks (0.1..0.3 s) and B's one (0.7 s).
    assert m["max_output_tokens_per_s"] == 5
    # A and B both touch second 0; C alone in second 1.
    assert m["max_concurrent_requests"] == 2
    # ...but they never overlap in time.
    assert m["peak_concurrency"] == 1


@pytest.mark.parametrize("slos,good", [
    ({"ttft_ms": 150}, 2),  # A 100 ok, B 200 no, C: no token -> E2E 50 ok
    ({"tpot_ms": 50}, 2),  # A 66.7 no; B, C count as TPOT 0
    ({"ttft_ms": 150, "tpot_ms": 50}, 1),  # only C meets both
    ({"e2el_ms": 250}, 2),  # A 300 no
    ({"ttft_ms": 1000, "tpot_ms": 1000, "e2el_ms": 1000}, 3),
])
def test_goodput(records, slos, good):
    assert compute_metrics(records, 2.0, slos=slos)["request_goodput"] == pytest.approx(good / 2)


def test_empty_run_gives_zero_rates_and_no_latencies():
    m = compute_metrics([], duration=0.0, slos={"ttft_ms": 1})
    assert (m["completed"], m["failed"], m["request_throughput"]) == (0, 0, 0.0)
    assert m["request_goodput"] == 0.0
    assert m["mean_ttft_ms"] is None and m["p99_e2el_ms"] is None
    assert (m["max_output_tokens_per_s"], m["max_concurrent_requests"]) == (0.0, 0)


def test_all_failed():
    failures = [rec(i, 0.1 * i, None, [], 0.01, None, error="cannot connect") for i in range(3)]
    m = compute_metrics(failures, duration=1.0)
    assert (m["completed"], m["failed"], m["total_output_tokens"]) == (0, 3, 0)
    assert m["median_ttft_ms"] is None and m["output_throughput"] == 0.0


def test_server_usage_input_tokens_win_over_our_count():
    r = rec(0, 0.0, 0.1, [], 0.1, 1, prompt=10)
    r.prompt_tokens_server = 17  # e.g. the chat template's tokens
    assert compute_metrics([r], 1.0)["total_input_tokens"] == 17


def test_raw_arrays(records):
    arrays = raw_arrays(records)
    assert arrays["output_lens"] == [4, 1, 0, 0]
    assert arrays["ttfts"] == [0.1, 0.2, None, None]
    assert arrays["tpots"][0] == pytest.approx(0.2 / 3) and arrays["tpots"][1:] == [None] * 3
    assert arrays["errors"] == ["", "", "", "HTTP 500: boom"]
    assert arrays["itls"][0] == [0.05, 0.05, 0.1]


def test_parse_slos():
    assert parse_slos(["ttft_ms=500", "tpot:100", "e2el=2000"]) == {
        "ttft_ms": 500.0, "tpot_ms": 100.0, "e2el_ms": 2000.0}
    for bad in ("ttft_ms", "foo_ms=1", "ttft_ms=-1", "ttft_ms=abc"):
        with pytest.raises(UsageError):
            parse_slos([bad])


def test_percentile_key():
    assert [percentile_key(p) for p in (50, 99.0, 99.9)] == ["p50", "p99", "p99.9"]

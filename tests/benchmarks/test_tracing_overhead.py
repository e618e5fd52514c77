"""The tracing-overhead benchmark: ratios within a round, its OTLP sink and span count."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from tracing_overhead import OtlpSink, decode_spans, summarize


def _run(rnd, side, tok_s, tpot=10.0):
    return {"round": rnd, "side": side, "result": {"output_throughput": tok_s,
                                                   "median_tpot_ms": tpot,
                                                   "median_ttft_ms": 100.0}}


def test_ratio_is_taken_within_each_round_and_its_median_reported():
    runs = [_run(1, "off", 100.0), _run(1, "on", 95.0, 10.5),
            _run(2, "on", 45.0), _run(2, "off", 50.0),  # a slow round: 0.90 within it
            _run(3, "off", 200.0), _run(3, "on", 198.0),
            _run(4, "off", 100.0), {"round": 4, "side": "on", "error": "did not start"}]
    per_round, summary = summarize(runs, rounds=4)
    assert [p["round"] for p in per_round] == [1, 2, 3]  # round 4 has no pair
    assert [p["output_throughput_on_over_off"] for p in per_round] == \
        pytest.approx([0.95, 0.90, 0.99])
    assert summary["output_throughput_on_over_off"] == pytest.approx(0.95)
    assert summary["overhead_percent"] == pytest.approx(5.0)
    assert summary["median_tpot_on_over_off"] == pytest.approx(1.0)  # 1.05, 1.0, 1.0
    # medians of the raw numbers across rounds are reported, not used for the ratio
    assert summary["off"]["output_throughput"] == 100.0 and summary["on"]["output_throughput"] \
        == 95.0


def test_sink_receives_what_the_otlp_exporter_sends_and_counts_request_spans():
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    sink = OtlpSink()
    try:
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=sink.url)))
        tracer = provider.get_tracer("t")
        ids = []
        for _ in range(3):
            with tracer.start_as_current_span("llm_request") as span:
                ids.append(f"{span.get_span_context().trace_id:032x}")
                tracer.start_span("queue").end()
        provider.shutdown()
        got = decode_spans(sink.take())
    finally:
        sink.close()
    assert got["spans_by_name"] == {"llm_request": 3, "queue": 3}
    assert sorted(got["request_trace_ids"]) == sorted(ids)
    assert sink.take() == []  # taken once

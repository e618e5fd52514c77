"""``llmctl bench`` sends every request with a fresh W3C traceparent and keeps its trace id
in the record and the report's ``trace_ids``, so the records join a tracing server's
traces."""

import re

import httpx
import pytest

from llmctl.bench.tracecontext import new_traceparent

from .conftest import fake_server
from .test_cli import only_report, small, validate

TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-01")


def test_traceparent_is_w3c_and_fresh_each_time():
    headers = [new_traceparent() for _ in range(200)]
    for header, trace_id in headers:
        match = TRACEPARENT.fullmatch(header)
        assert match and match.group(1) == trace_id
        assert int(match.group(1), 16) and int(match.group(2), 16)  # all-zero is invalid
    assert len({trace_id for _, trace_id in headers}) == 200
    # OpenTelemetry's own W3C parser reads the same trace, parent span and sampled flag
    propagation = pytest.importorskip("opentelemetry.trace.propagation.tracecontext")
    from opentelemetry import trace

    header, trace_id = headers[0]
    ctx = trace.get_current_span(
        propagation.TraceContextTextMapPropagator().extract({"traceparent": header})
    ).get_span_context()
    assert ctx.is_valid and ctx.is_remote and ctx.trace_flags.sampled
    assert f"{ctx.trace_id:032x}" == trace_id
    assert f"{ctx.span_id:016x}" == header.split("-")[2]


def test_report_trace_ids_are_the_ones_the_server_received(tiny_llama, tmp_path):
    with fake_server("--ttft-ms", "5", "--itl-ms", "1") as (url, _):
        result = small(url, tiny_llama, tmp_path, "--max-concurrency", 4, "--json")
        assert result.exit_code == 0, result.output
        received = httpx.get(url + "/debug/traceparents").json()
    report = only_report(tmp_path)
    validate(report)
    ids = report["trace_ids"]
    assert len(ids) == report["num_requests"] == 8 and len(set(ids)) == 8
    assert None not in received  # every request, probes and warm-up included, had one
    sent = {TRACEPARENT.fullmatch(h).group(1) for h in received}
    assert len(sent) == len(received)  # each a fresh trace
    assert set(ids) <= sent

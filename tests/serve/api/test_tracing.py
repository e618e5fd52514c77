"""Request spans through a real server on the tiny model, caught by the SDK's in-memory
exporter: a span per request under the client's traceparent, its phases in order and
tiling it, token counts equal to the response's usage, failures with ERROR status."""

from __future__ import annotations

import itertools
import json
import threading
import time

import httpx
import pytest

pytest.importorskip("opentelemetry.sdk", reason="the tracing extra is not installed")

from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from opentelemetry.trace import SpanKind, StatusCode

from llmctl.serve.api.tracing import Attr, setup_tracing
from tests.serve.api.conftest import start_server

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"  # W3C Trace Context's own example ids
PARENT_ID = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def traced(tiny_llama):
    running = start_server(str(tiny_llama), max_num_batched_tokens=128)
    exporter = InMemorySpanExporter()
    running.server.tracing = setup_tracing(None, exporter=exporter)
    yield running, exporter
    running.stop()


@pytest.fixture
def spans(traced):
    _, exporter = traced
    exporter.clear()
    return exporter


def _request_span(exporter, trace_id: int | None = None, timeout: float = 10.0):
    """The one ``llm_request`` span (of ``trace_id``), waiting for it to end."""
    deadline = time.monotonic() + timeout
    while True:
        found = [s for s in exporter.get_finished_spans() if s.name == "llm_request"
                 and (trace_id is None or s.context.trace_id == trace_id)]
        if found or time.monotonic() > deadline:
            assert len(found) == 1, [s.name for s in exporter.get_finished_spans()]
            return found[0]
        time.sleep(0.02)


def _children(exporter, parent):
    return [s for s in exporter.get_finished_spans()
            if s.parent is not None and s.parent.span_id == parent.context.span_id]


def _assert_phases_tile(exporter, root):
    """queue -> prefill -> decode, each starting where the previous ended, inside the
    request's span; the prefill's chunks tile the prefill. Returns (phases, chunks)."""
    phases = sorted(_children(exporter, root), key=lambda s: s.start_time)
    assert [s.name for s in phases] == ["queue", "prefill", "decode"]
    assert root.start_time <= phases[0].start_time
    for a, b in itertools.pairwise(phases):
        assert a.end_time == b.start_time  # in order, no overlap, no gap
    assert phases[-1].end_time <= root.end_time
    assert all(s.start_time <= s.end_time for s in phases)
    chunks = sorted(_children(exporter, phases[1]), key=lambda s: s.start_time)
    assert chunks and all(c.name == "prefill_chunk" for c in chunks)
    assert chunks[0].start_time == phases[1].start_time
    assert chunks[-1].end_time == phases[1].end_time
    for a, b in itertools.pairwise(chunks):
        assert a.end_time == b.start_time
    assert [c.attributes[Attr.CHUNK_INDEX] for c in chunks] == list(range(len(chunks)))
    return phases, chunks


def test_completion_span_under_the_clients_traceparent(traced, spans):
    running, _ = traced
    body = {"prompt": "The file object", "max_tokens": 9, "temperature": 0.5, "top_p": 0.9,
            "ignore_eos": True}
    resp = httpx.post(running.url + "/v1/completions", json=body, timeout=60,
                      headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
    assert resp.status_code == 200
    usage = resp.json()["usage"]
    root = _request_span(spans)
    assert root.kind == SpanKind.SERVER
    assert root.context.trace_id == int(TRACE_ID, 16)  # the client's trace...
    assert root.parent.span_id == int(PARENT_ID, 16)  # ...under the client's span
    assert root.parent.is_remote
    assert root.status.status_code == StatusCode.UNSET
    a = root.attributes
    assert a[Attr.PROMPT_TOKENS] == a[Attr.INPUT_TOKENS] == usage["prompt_tokens"]
    assert a[Attr.COMPLETION_TOKENS] == a[Attr.OUTPUT_TOKENS] == usage["completion_tokens"] == 9
    assert a[Attr.REQUEST_ID] == resp.json()["id"]
    assert a[Attr.OPERATION] == "text_completion"
    assert a[Attr.RESPONSE_MODEL] == "tiny"  # the served name
    assert (a[Attr.MAX_TOKENS], a[Attr.TEMPERATURE], a[Attr.TOP_P], a[Attr.N]) == \
        (9, 0.5, 0.9, 1)
    assert tuple(a[Attr.FINISH_REASONS]) == ("length",)
    assert a[Attr.NUM_PREEMPTIONS] == 0
    assert Attr.TENANT not in a  # not given: not set
    phases, chunks = _assert_phases_tile(spans, root)
    queue, prefill, decode = phases
    # the latency attributes are the phases' lengths (ns in spans, s in attributes)
    assert a[Attr.TIME_IN_QUEUE] == pytest.approx((queue.end_time - queue.start_time) / 1e9,
                                                  abs=2e-6)
    assert a[Attr.TTFT] == pytest.approx((prefill.end_time - queue.start_time) / 1e9, abs=2e-6)
    assert a[Attr.E2E] == pytest.approx((decode.end_time - queue.start_time) / 1e9, abs=2e-6)
    assert len(chunks) == 1 and a[Attr.PREFILL_CHUNKS] == 1
    assert chunks[0].attributes[Attr.PREFILL_TOKENS] == usage["prompt_tokens"]
    engine_id = prefill.attributes[Attr.REQUEST_ID]
    assert engine_id == f"{resp.json()['id']}-0"


def test_long_prompt_prefills_in_chunks(traced, spans):
    running, _ = traced  # max_num_batched_tokens=128: a 300-token prompt takes 3 steps
    prompt = [(7 * i) % 400 + 5 for i in range(300)]
    resp = httpx.post(running.url + "/v1/completions", timeout=60,
                      json={"prompt": prompt, "max_tokens": 3, "ignore_eos": True})
    assert resp.status_code == 200
    root = _request_span(spans)
    _, chunks = _assert_phases_tile(spans, root)
    assert [c.attributes[Attr.PREFILL_TOKENS] for c in chunks] == [128, 128, 44]
    assert root.attributes[Attr.PREFILL_CHUNKS] == 3
    assert root.attributes[Attr.PROMPT_TOKENS] == 300


def test_streaming_chat_span_matches_the_streamed_usage(traced, spans):
    running, _ = traced
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    usage = None
    with httpx.stream("POST", running.url + "/v1/chat/completions", json=body, timeout=60,
                      headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01",
                               "tracestate": "vendor=1"}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
    root = _request_span(spans)
    assert root.context.trace_id == int(TRACE_ID, 16)
    assert root.context.trace_state.get("vendor") == "1"  # tracestate travels with it
    assert root.attributes[Attr.OPERATION] == "chat"
    assert root.attributes[Attr.COMPLETION_TOKENS] == usage["completion_tokens"] == 6
    assert root.attributes[Attr.PROMPT_TOKENS] == usage["prompt_tokens"]
    _assert_phases_tile(spans, root)


def test_without_traceparent_each_request_starts_its_own_trace(traced, spans):
    running, _ = traced
    for _ in range(2):
        resp = httpx.post(running.url + "/v1/completions", timeout=60,
                          json={"prompt": "x", "max_tokens": 2})
        assert resp.status_code == 200
    roots = [s for s in spans.get_finished_spans() if s.name == "llm_request"]
    assert len(roots) == 2 and all(s.parent is None for s in roots)
    assert roots[0].context.trace_id != roots[1].context.trace_id


def test_an_unsampled_traceparent_records_nothing(traced, spans):
    running, _ = traced  # the sampled flag (last field) is 00: the caller decided against
    resp = httpx.post(running.url + "/v1/completions", timeout=60,
                      json={"prompt": "x", "max_tokens": 2},
                      headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-00"})
    assert resp.status_code == 200
    assert spans.get_finished_spans() == ()


def test_several_prompts_are_one_span_with_phases_per_prompt(traced, spans):
    running, _ = traced
    resp = httpx.post(running.url + "/v1/completions", timeout=60,
                      json={"prompt": ["a b", "c d e"], "max_tokens": 4, "n": 2,
                            "ignore_eos": True})
    assert resp.status_code == 200
    root = _request_span(spans)
    usage = resp.json()["usage"]
    assert root.attributes[Attr.COMPLETION_TOKENS] == usage["completion_tokens"] == 16
    assert root.attributes[Attr.PROMPT_TOKENS] == usage["prompt_tokens"]
    assert root.attributes[Attr.NUM_SEQUENCES] == 4
    phases = _children(spans, root)
    ids = {s.attributes[Attr.REQUEST_ID] for s in phases}
    assert ids == {f"{resp.json()['id']}-0", f"{resp.json()['id']}-1"}
    assert sorted(s.name for s in phases) == ["decode"] * 2 + ["prefill"] * 2 + ["queue"] * 2


def test_a_request_that_times_out_has_error_status(traced, spans):
    running, _ = traced
    engine = running.engine.engine
    real, go, steps = engine.step, threading.Event(), []

    def step():  # the engine stalls from its third step on: the request cannot finish
        steps.append(1)
        if len(steps) > 2:
            go.wait(60)
        return real()

    engine.step = step
    running.server.config.settings.request_timeout = 0.5
    try:
        resp = httpx.post(running.url + "/v1/completions", timeout=60,
                          json={"prompt": "x", "max_tokens": 50, "ignore_eos": True})
    finally:
        running.server.config.settings.request_timeout = None
        go.set()
        del engine.step  # back to the class's method
    assert resp.status_code == 408
    root = _request_span(spans)
    assert root.status.status_code == StatusCode.ERROR
    assert "did not finish within" in root.status.description
    assert root.attributes[Attr.ERROR_TYPE] == "408"
    assert root.attributes[Attr.HTTP_STATUS] == 408
    # two steps ran (prefill with the first token, one decode): it got as far as decoding,
    # and its open decode ends with the request
    phases = sorted(_children(spans, root), key=lambda s: s.start_time)
    assert [s.name for s in phases] == ["queue", "prefill", "decode"]
    assert phases[-1].end_time == root.end_time
    assert root.attributes[Attr.COMPLETION_TOKENS] == 2


def test_a_refused_request_has_error_status_and_no_phases(traced, spans, monkeypatch):
    from llmctl.serve.engine.async_engine import QueueFullError

    running, _ = traced

    def full():  # the queue is full at admission: 429 (max_queue 0 would be a 400 now)
        raise QueueFullError("full")

    with monkeypatch.context() as m:
        m.setattr(running.engine, "check_capacity", full)
        resp = httpx.post(running.url + "/v1/completions", timeout=60,
                          json={"prompt": "x", "max_tokens": 2})
    assert resp.status_code == 429
    root = _request_span(spans)
    assert root.status.status_code == StatusCode.ERROR
    assert root.attributes[Attr.HTTP_STATUS] == 429
    assert _children(spans, root) == []  # it never reached the engine
    assert root.attributes[Attr.COMPLETION_TOKENS] == 0


def test_a_client_that_leaves_mid_stream_leaves_an_error_span(traced, spans):
    running, _ = traced
    body = {"prompt": "x", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", running.url + "/v1/completions", json=body, timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                break  # leaving the block closes the connection
    root = _request_span(spans)
    assert root.status.status_code == StatusCode.ERROR
    assert root.attributes[Attr.ERROR_TYPE] == "client_disconnected"
    assert root.attributes[Attr.COMPLETION_TOKENS] < 400
    assert tuple(root.attributes[Attr.FINISH_REASONS]) == ("abort",)  # cut while running


def test_tenant_and_priority_class_from_the_engine_reach_the_span(traced, spans):
    """The engine reports who sent a request (its outputs carry ``tenant`` and
    ``priority_class``); the API layer that sets them is not this test's business, so the
    submission is wrapped to add them."""
    running, _ = traced
    engine = running.engine
    real = engine.submit

    def submit(request_id, ids, params, priority=0, **who):
        return real(request_id, ids, params, priority, tenant="acme",
                    priority_class="interactive")

    engine.submit = submit
    try:
        resp = httpx.post(running.url + "/v1/completions", timeout=60,
                          json={"prompt": "x", "max_tokens": 2, "priority": -1})
    finally:
        del engine.submit
    assert resp.status_code == 200
    a = _request_span(spans).attributes
    assert (a[Attr.TENANT], a[Attr.PRIORITY_CLASS], a[Attr.PRIORITY]) == \
        ("acme", "interactive", -1)

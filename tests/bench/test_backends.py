"""Request functions against the fake server: timings, usage, failures as records."""

import asyncio
import time

import httpx
import pytest

from llmctl.bench.backends import BACKENDS, RequestSettings, get_backend, send_request
from llmctl.bench.launcher import free_port
from llmctl.bench.records import SampleRequest
from llmctl.errors import UsageError

from .conftest import fake_server


def send(url, backend, sample, **settings):
    async def go():
        async with httpx.AsyncClient(timeout=30) as client:
            return await send_request(client, get_backend(backend),
                                      RequestSettings(url, "fake-model", **settings), sample, 0,
                                      time.perf_counter())
    return asyncio.run(go())


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_stream_timings_and_usage(server, backend):
    record = send(server, backend, SampleRequest("one two three", 3, 6), ignore_eos=True)
    assert record.success, record.error
    # 6 text chunks: one TTFT and 5 gaps; the chat role header and finish chunk are not
    # tokens.
    assert record.ttft is not None and len(record.itl) == 5
    assert record.text == "".join(f" tok{i}" for i in range(6))
    assert (record.output_tokens, record.output_tokens_source) == (6, "usage")
    assert record.prompt_tokens_server == 3
    # The fake server sleeps 10 ms before the first token and 2 ms between tokens, so
    # the last text chunk cannot arrive before 20 ms (gaps alone may coalesce on a busy
    # client, their sum cannot).
    assert record.ttft >= 0.010 and record.ttft + sum(record.itl) >= 0.020
    assert record.latency >= record.ttft + sum(record.itl) - 1e-9


def test_eos_without_ignore_eos():
    with fake_server("--ttft-ms", "1", "--itl-ms", "1", "--eos-after", "2") as (url, _):
        short = send(url, "openai-completions", SampleRequest("x", 1, 9))
        forced = send(url, "openai-completions", SampleRequest("x", 1, 9), ignore_eos=True)
    assert short.output_tokens == 2 and forced.output_tokens == 9


def test_failures_are_records_not_exceptions():
    with fake_server("--ttft-ms", "1", "--itl-ms", "1", "--fail-every", "2",
                     "--error-event-every", "3") as (url, _):
        ok = send(url, "openai-completions", SampleRequest("x", 1, 3))  # request 1
        http = send(url, "openai-completions", SampleRequest("x", 1, 3))  # 2: HTTP 500
        event = send(url, "openai-chat", SampleRequest("x", 1, 3))  # 3: error event
    assert ok.success
    assert http.error_kind == "http" and http.error.startswith("HTTP 500")
    assert "injected failure #2" in http.error
    assert event.error_kind == "stream" and "injected stream error #3" in event.error
    refused = send(f"http://127.0.0.1:{free_port()}", "openai-chat", SampleRequest("x", 1, 3))
    assert refused.error_kind == "connect" and not refused.success


def test_server_dying_mid_stream_is_a_failed_record():
    with fake_server("--ttft-ms", "1", "--itl-ms", "5", "--die-after", "1") as (url, proc):
        record = send(url, "openai-completions", SampleRequest("x", 1, 20))
        assert proc.wait(10) == 3
    assert record.error_kind == "stream" and record.ttft is not None


def test_unknown_backend_lists_known():
    with pytest.raises(UsageError) as err:
        get_backend("tgi")
    assert "openai-chat" in err.value.remedy


def test_request_bodies():
    s = RequestSettings("http://x", "m", ignore_eos=True, extra_body={"top_k": 5})
    sample = SampleRequest("question", 3, 7, system="shared prefix")
    chat = BACKENDS["openai-chat"].body(sample, s)
    assert chat["messages"] == [{"role": "system", "content": "shared prefix"},
                                {"role": "user", "content": "question"}]
    assert (chat["max_tokens"], chat["ignore_eos"], chat["top_k"], chat["stream"]) == (
        7, True, 5, True)
    completion = BACKENDS["openai-completions"].body(sample, s)
    assert completion["prompt"] == "shared prefix\n\nquestion"
    assert completion["stream_options"] == {"include_usage": True}
    assert "ignore_eos" not in BACKENDS["openai-completions"].body(sample, RequestSettings("h", "m"))
    assert s.url(BACKENDS["openai-chat"]) == "http://x/v1/chat/completions"

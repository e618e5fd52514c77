"""Request functions: send one streaming request, time it client-side, return a record.

One table (``BACKENDS``) maps a name to the endpoint path, how to build the JSON body
and where the text sits in a streamed chunk. All share one SSE reader:

- the first chunk that carries text -> TTFT; each later one -> an ITL sample
  (chunks with no text -- role headers, finish markers, usage -- are not tokens);
- ``usage`` (asked for with ``stream_options.include_usage``) gives token counts;
- any failure (HTTP status, refused connection, a stream cut short, an error event,
  a timeout) becomes ``record.error``; nothing is raised;
- every request carries a fresh W3C ``traceparent`` (:mod:`llmctl.bench.tracecontext`),
  its trace id kept in ``record.trace_id``, so a tracing server's spans join the record.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from llmctl.bench.conversations import chat_messages
from llmctl.bench.datasets import join_prefix
from llmctl.bench.records import RequestRecord, SampleRequest
from llmctl.bench.tracecontext import new_traceparent
from llmctl.errors import UsageError


@dataclass(frozen=True)
class RequestSettings:
    """What every request of a run shares."""

    base_url: str
    model: str
    path: str | None = None  # overrides the backend's endpoint path
    api_key: str | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    extra_body: dict = field(default_factory=dict)

    def url(self, backend: Backend) -> str:
        return self.base_url.rstrip("/") + (self.path or backend.path)


@dataclass(frozen=True)
class Backend:
    name: str
    path: str
    body: Callable[[SampleRequest, RequestSettings], dict]
    text: Callable[[dict], str | None]  # text carried by one streamed choice


def _common(sample: SampleRequest, s: RequestSettings) -> dict:
    body = {"model": s.model, "max_tokens": sample.output_len, "temperature": s.temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    if s.ignore_eos:
        body["ignore_eos"] = True
    return body


def _completions_body(sample: SampleRequest, s: RequestSettings) -> dict:
    return {**_common(sample, s), "prompt": join_prefix(sample.system, sample.prompt),
            **s.extra_body}


def _chat_body(sample: SampleRequest, s: RequestSettings) -> dict:
    return {**_common(sample, s), "messages": chat_messages(sample), **s.extra_body}


def _chat_text(choice: dict) -> str | None:
    delta = choice.get("delta") or {}
    # Reasoning models stream their thinking in a separate field; it is output too.
    return delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")


BACKENDS: dict[str, Backend] = {b.name: b for b in (
    Backend("openai-completions", "/v1/completions", _completions_body,
            lambda choice: choice.get("text")),
    Backend("openai-chat", "/v1/chat/completions", _chat_body, _chat_text),
)}


def get_backend(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise UsageError(f"unknown backend {name!r}",
                         f"known backends: {', '.join(BACKENDS)}") from None


def _error_text(data: dict) -> str | None:
    err = data.get("error")
    if err is None and data.get("object") == "error":
        err = data
    if err is None:
        return None
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err)


async def send_request(client: httpx.AsyncClient, backend: Backend, settings: RequestSettings,
                       sample: SampleRequest, index: int, origin: float) -> RequestRecord:
    """Send one request; ``origin`` is the measurement's ``perf_counter`` zero."""
    record = RequestRecord(index, sample.prompt_len, sample.output_len,
                           turn=sample.turn if sample.conversation is not None else None)
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    headers["traceparent"], record.trace_id = new_traceparent()
    chunks: list[str] = []
    sent = time.perf_counter()
    record.start = sent - origin
    last = sent
    done = False
    try:
        async with client.stream("POST", settings.url(backend),
                                 json=backend.body(sample, settings), headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                record.error, record.error_kind = f"HTTP {resp.status_code}: {body[:300]}", "http"
                record.latency = time.perf_counter() - sent
                return record
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, ``: ping`` comments, ``event:`` lines
                payload = line[5:].strip()
                if payload == "[DONE]":
                    done = True
                    break
                now = time.perf_counter()
                data = json.loads(payload)
                if (message := _error_text(data)) is not None:
                    record.error, record.error_kind = f"error event: {message}", "stream"
                    break
                for choice in data.get("choices") or ():
                    text = backend.text(choice)
                    if text:
                        if record.ttft is None:
                            record.ttft = now - sent
                        else:
                            record.itl.append(now - last)
                        last = now
                        chunks.append(text)
                        break  # one timestamp per chunk, whatever n is
                if usage := data.get("usage"):
                    record.output_tokens = usage.get("completion_tokens", record.output_tokens)
                    record.prompt_tokens_server = usage.get("prompt_tokens",
                                                            record.prompt_tokens_server)
        record.latency = time.perf_counter() - sent
        if record.error is None and not done:
            record.error, record.error_kind = "the stream ended without [DONE]", "stream"
    except asyncio.CancelledError:
        record.latency = time.perf_counter() - sent
        record.error, record.error_kind = "cancelled before completion (interrupted)", \
            "cancelled"
    except httpx.ConnectError as exc:
        record.error, record.error_kind = f"cannot connect: {exc}", "connect"
    except httpx.TimeoutException as exc:
        record.error, record.error_kind = f"timeout: {type(exc).__name__} {exc}", "timeout"
    except (httpx.HTTPError, ValueError, OSError) as exc:
        # RemoteProtocolError / ReadError when the server dies mid-stream; bad JSON.
        record.error, record.error_kind = f"{type(exc).__name__}: {exc}", "stream"
    if record.latency is None:
        record.latency = time.perf_counter() - sent
    record.text = "".join(chunks)
    if record.output_tokens is not None:
        record.output_tokens_source = "usage"
    return record

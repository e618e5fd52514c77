"""Engine outputs to an HTTP response over time: several engine requests' outputs
interleaved as they arrive, a deadline over them, and server-sent events."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from llmctl.serve.openai import errors
from llmctl.serve.openai.errors import APIError
from llmctl.serve.openai.jobs import Job, response_id
from llmctl.serve.openai.render import chat_chunk, completion_chunk, usage_block
from llmctl.serve.openai.responses import Assembly

log = logging.getLogger("llmctl.serve")


async def merged(engine, jobs: list[Job]) -> AsyncIterator[tuple[Job, Any]]:
    """Outputs of several engine requests (an AsyncEngine's), interleaved as they arrive."""
    if len(jobs) == 1:
        async for out in engine.outputs(jobs[0].request_id, jobs[0].stream):
            yield jobs[0], out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(job: Job) -> None:
        try:
            async for out in engine.outputs(job.request_id, job.stream):
                await queue.put((job, out))
        except BaseException as exc:  # forwarded to the consumer
            await queue.put((job, exc))
        finally:
            await queue.put((job, done))

    tasks = [asyncio.create_task(pump(job)) for job in jobs]
    remaining = len(jobs)
    try:
        while remaining:
            job, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield job, item
    finally:
        for task in tasks:
            task.cancel()


async def timed(iterator, deadline: float | None, timeout: float | None):
    """Iterate with a deadline; raises APIError(408) naming ``timeout`` when it passes."""
    while True:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise errors.timed_out(timeout)
        try:
            item = await asyncio.wait_for(iterator.__anext__(), left)
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            raise errors.timed_out(timeout) from None
        yield item


async def sse_events(assembly: Assembly, updates, include_usage: bool,
                     metrics) -> AsyncIterator[str]:
    """A response's updates as OpenAI's stream chunks, then the usage chunk when asked
    and ``[DONE]``; an error after the headers went is sent in-band."""
    kind, req, jobs = assembly.kind, assembly.req, assembly.jobs
    responses = assembly.responses
    rid = response_id(jobs)
    created = int(time.time())
    model = responses.models.response_model(jobs)
    sent_role: set[int] = set()
    names = responses.token_names(req)
    completion_tokens = 0
    reasoning_tokens = 0 if jobs[0].reasoning is not None else None  # None: no parser
    readers: dict[int, Any] = {}  # chat with tools: each choice's ChoiceTools
    try:
        async for index, upd in updates:
            completion_tokens += len(upd.token_ids)
            if reasoning_tokens is not None:
                reasoning_tokens += upd.reasoning_tokens
            if kind == "chat":
                first = index not in sent_role
                sent_role.add(index)
                calls = None
                if jobs[0].tools.active:
                    reader = readers.setdefault(index, jobs[0].tools.new_choice())
                    text, calls, reason = reader.update(upd.text, upd.finish_reason)
                    upd = dataclasses.replace(upd, text=text, finish_reason=reason)
                if not (first or upd.text or upd.reasoning or calls or upd.finish_reason
                        or upd.logprobs):
                    continue  # all held back (a reasoning tag may be beginning)
                chunk = chat_chunk(rid, created, model, index, upd, first, names, calls)
            else:
                chunk = completion_chunk(rid, created, model, index, upd, names)
            yield sse(chunk)
        if include_usage:
            prompt_tokens = sum(len(j.prompt_ids) for j in jobs)
            object_ = "chat.completion.chunk" if kind == "chat" else "text_completion"
            yield sse({"id": rid, "object": object_, "created": created, "model": model,
                       "choices": [], "usage": usage_block(prompt_tokens, completion_tokens,
                                                           reasoning_tokens)})
        yield "data: [DONE]\n\n"
    except APIError as exc:
        # Headers are gone: report in-band; no [DONE] marks the response incomplete.
        metrics.http_errors.labels(model, str(exc.status)).inc()
        yield sse(exc.body())
    except Exception as exc:
        log.exception("streaming %s failed", rid)
        metrics.http_errors.labels(model, "500").inc()
        yield sse(errors.internal(f"generation failed: {exc}").body())
    finally:
        await updates.aclose()


async def response_events(builder, updates, metrics,
                          on_finished: Callable[[], None]) -> AsyncIterator[str]:
    """A /v1/responses stream: its builder's (:mod:`llmctl.serve.openai.responses_api.build`)
    events, each named on its ``event:`` line as OpenAI sends them; ``on_finished`` once
    the response is complete. An error after the headers went is ``response.failed``."""
    model = builder.skeleton["model"]
    try:
        for event in builder.start():
            yield sse(event, event["type"])
        async for _, upd in updates:
            for event in builder.feed(upd):
                yield sse(event, event["type"])
        for event in builder.finish():
            yield sse(event, event["type"])
        on_finished()
    except Exception as exc:
        if isinstance(exc, APIError):
            metrics.http_errors.labels(model, str(exc.status)).inc()
        else:
            log.exception("streaming %s failed", builder.skeleton["id"])
            metrics.http_errors.labels(model, "500").inc()
            exc = errors.internal(f"generation failed: {exc}")
        # OpenAI's response error codes are a closed set: ours goes in the message
        error = exc.body()["error"]
        code = "rate_limit_exceeded" if exc.status == 429 else "server_error"
        for event in builder.failed({"code": code, "type": error["type"],
                                     "message": f"{error['message']} ({error['code']})"}):
            yield sse(event, event["type"])
    finally:
        await updates.aclose()


def sse(data: dict, event: str | None = None) -> str:
    if event is not None:
        return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"

"""A /v1/messages stream as Anthropic sends it: server-sent events, each named on its
``event:`` line by its ``type`` (``message_start``, ``ping``, ``content_block_start``,
``content_block_delta``, ``content_block_stop``, ``message_delta``, ``message_stop``).
An error after the headers went is an ``error`` event in Anthropic's shape, and no
``message_stop`` follows it."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

from llmctl.serve.openai import errors
from llmctl.serve.openai.errors import APIError
from llmctl.serve.openai.messages_api.build import MessageBuilder
from llmctl.serve.openai.messages_api.errors import anthropic_body

log = logging.getLogger("llmctl.serve")


def event(data: dict) -> str:
    return f"event: {data['type']}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


async def message_events(builder: MessageBuilder, updates, metrics) -> AsyncIterator[str]:
    """``updates`` (the chat path's (index, update) pairs) as the message's events;
    ``metrics``: the server's (its ``http_errors`` count an in-band error)."""
    model = builder.skeleton["model"]
    try:
        for data in builder.start():
            yield event(data)
        async for _, upd in updates:
            for data in builder.feed(upd):
                yield event(data)
        for data in builder.finish():
            yield event(data)
    except Exception as exc:
        if not isinstance(exc, APIError):
            log.exception("streaming %s failed", builder.skeleton["id"])
            exc = errors.internal(f"generation failed: {exc}")
        metrics.http_errors.labels(model, str(exc.status)).inc()
        yield event(anthropic_body(exc))
    finally:
        await updates.aclose()

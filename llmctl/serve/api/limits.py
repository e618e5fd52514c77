"""Request size limits that hold before any work is done on a request.

1. **Body bytes** (:class:`BodyLimit`, an ASGI middleware outside everything else): a
   ``Content-Length`` over ``--max-request-bytes`` is answered 413 from the headers
   alone, without reading a byte of the body; a chunked body is counted while it is read
   and refused the moment it passes the limit. Nothing is buffered or parsed first
   (uvicorn reads and drops what the client still sends after the 413).
2. **Prompt characters** (:func:`llmctl.serve.openai.prompts.max_prompt_chars`): a text
   longer than the context can hold is refused before it is tokenized, which for a
   multi-megabyte prompt is where the time and the memory go.
3. **Off the event loop**: what is left (tokenizing and rendering a chat template for
   inputs of up to that size) runs on a worker thread when the input is large
   (:data:`OFF_LOOP_CHARS`), so ``/health`` and other clients' streams are not held up.

The default body limit (:func:`default_max_request_bytes`) is the largest body a request
the server can accept may need::

    bytes = BYTES_PER_TOKEN * max_model_len * min(MAX_PROMPTS, max_queue) + OVERHEAD

A completions request carries at most ``MAX_PROMPTS`` prompts and is refused when it has
more than ``--max-queue`` (it could never be queued whole), each under ``max_model_len``
tokens. ``BYTES_PER_TOKEN = 16`` bounds one token's share of a JSON body with room to
spare: a token id is at most 8 bytes (``"151935, "``), English text averages ~4 bytes a
token, and text that a client's JSON encoder escapes (``\\uXXXX``, 6 bytes a character;
Python's ``json.dumps`` escapes every non-ASCII character) stays under 16 bytes a token
for CJK (~1.5 characters a token). ``OVERHEAD`` (1 MiB) covers everything else a request
may carry within the documented list limits: 64 stop strings, 1024 stop token ids, 300
logit_bias entries, 128 tool definitions with their JSON schemas, message structure.
The tiny test model (512 tokens, queue 256) gets 3 MiB; an 8k-context model 33 MiB.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from llmctl.serve.openai import errors
from llmctl.serve.openai.messages_api.errors import error_body
from llmctl.serve.openai.protocol import MAX_PROMPTS

BYTES_PER_TOKEN = 16
OVERHEAD = 1 << 20
# inputs (characters) above which tokenizing and template rendering leave the event loop;
# below it a thread hop costs more than the work (~1 ms of tokenizing)
OFF_LOOP_CHARS = 16_384

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]],
                    Callable[[Message], Awaitable[None]]], Awaitable[None]]


def default_max_request_bytes(max_model_len: int, max_queue: int | None) -> int:
    """The formula in the module docstring."""
    prompts = MAX_PROMPTS if max_queue is None else min(MAX_PROMPTS, max_queue)
    return BYTES_PER_TOKEN * max_model_len * prompts + OVERHEAD


def too_large(limit: int, size: int | None = None) -> errors.APIError:
    got = f" ({size} bytes)" if size is not None else ""
    return errors.APIError(
        413, f"the request body{got} is larger than this server accepts ({limit} bytes, "
        "--max-request-bytes); send fewer or shorter prompts", "invalid_request_error",
        code="request_too_large")


class BodyLimit:
    """ASGI middleware: HTTP request bodies over ``limit`` bytes are refused with 413.

    A declared ``Content-Length`` is judged from the headers (the server delivers no more
    than it declares). A chunked body has no length up front: it is read here, at most
    ``limit`` bytes of it, and handed to the app whole (the app reads it whole anyway)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length, chunked = _body_headers(scope)
        if length is not None and length > self.limit:
            await _send_error(send, too_large(self.limit, length), scope)
            return
        if length is not None or not chunked:
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        seen = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self.limit:
                chunks.clear()
                await _send_error(send, too_large(self.limit), scope)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        chunks.clear()
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return whole
            return await receive()  # what follows the body: a disconnect

        await self.app(scope, replay, send)


def _body_headers(scope: Scope) -> tuple[int | None, bool]:
    """(Content-Length, whether the body is chunked)."""
    length, chunked = None, False
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                length = int(value)
            except ValueError:
                pass  # h11 refuses a malformed one before we are called
        elif name == b"transfer-encoding":
            chunked = b"chunked" in value.lower()
    return length, chunked


async def _send_error(send, exc: errors.APIError, scope: Scope) -> None:
    body = json.dumps(error_body(exc, scope.get("path", ""))).encode()
    # No "Connection: close": closing while the client still sends makes its kernel
    # answer with a reset, which can discard the 413 before the client reads it. uvicorn
    # reads and drops the rest of the body instead, then keeps the connection.
    await send({"type": "http.response.start", "status": exc.status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})

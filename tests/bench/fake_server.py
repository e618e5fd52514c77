"""A small OpenAI-compatible streaming server with deterministic token timing.

Run ``python tests/bench/fake_server.py [--port 0] [options]``; it prints ``PORT <n>``
on its first stdout line once it listens on 127.0.0.1. Timing per request:

    TTFT = ttft_ms + prefill_ms_per_token * prompt_words
    gap between tokens = itl_ms + itl_ms_per_running * (requests running - 1)

so with ``--itl-ms-per-running`` it behaves like a server that slows down under load.
With ``--max-running C`` at most C requests generate at once and the rest wait in a FIFO
queue (``num_requests_waiting`` in /metrics; the wait is part of their TTFT): a server
with a known capacity of C / (ttft_ms + (tokens - 1) * itl_ms) requests per second, whose
TTFT grows without bound above it. Its token times are kept on absolute deadlines, so
sleep overshoot does not add up over a request and the capacity stays the computed one.
It can fail every K-th request (HTTP 500), send an error event mid-stream, or die
(``os._exit``) while streaming the N-th request. ``/metrics`` speaks Prometheus text
with vLLM's metric names under a chosen prefix (``llmctl:`` by default); ``/debug/
traceparents`` lists the ``traceparent`` header of every generation request, in order.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import time

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route


class State:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.received = 0
        self.running = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.seen_prefixes: set[str] = set()
        self.max_running = 0
        self.waiting = 0
        self.slots = asyncio.Semaphore(args.max_running) if args.max_running else None
        self.traceparents: list[str | None] = []


def _prompt_of(kind: str, body: dict) -> tuple[str, str | None]:
    if kind == "chat":
        messages = body.get("messages") or []
        system = next((m["content"] for m in messages if m.get("role") == "system"), None)
        user = " ".join(m["content"] for m in messages if m.get("role") == "user")
        return user, system
    prompt = body.get("prompt") or ""
    head, sep, _ = prompt.partition("\n\n")
    return prompt, head if sep else None


def build_app(args: argparse.Namespace) -> Starlette:
    state = State(args)
    prefix = "" if args.metrics_prefix == "none" else args.metrics_prefix

    async def health(request: Request):
        return PlainTextResponse("ok")

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [{"id": args.model, "object": "model"}]})

    async def metrics(request: Request):
        if not prefix:
            return PlainTextResponse("not found", status_code=404)
        lines = [
            f"# TYPE {prefix}num_requests_running gauge",
            f'{prefix}num_requests_running{{model_name="{args.model}"}} {state.running}',
            f"# TYPE {prefix}num_requests_waiting gauge",
            f'{prefix}num_requests_waiting{{model_name="{args.model}"}} {state.waiting}',
            f"# TYPE {prefix}kv_cache_usage_perc gauge",
            (f'{prefix}kv_cache_usage_perc{{model_name="{args.model}"}} '
             f"{min(1.0, state.running / args.kv_slots)}"),
            f"# TYPE {prefix}num_preemptions counter",
            f'{prefix}num_preemptions_total{{model_name="{args.model}"}} 0.0',
            f'{prefix}prompt_tokens_total{{model_name="{args.model}"}} {state.prompt_tokens}',
            (f'{prefix}generation_tokens_total{{model_name="{args.model}"}} '
             f"{state.generation_tokens}"),
            (f'{prefix}prefix_cache_queries_total{{model_name="{args.model}"}} '
             f"{state.prefix_queries}"),
            f'{prefix}prefix_cache_hits_total{{model_name="{args.model}"}} {state.prefix_hits}',
        ]
        return PlainTextResponse("\n".join(lines) + "\n")

    async def generate(request: Request, kind: str):
        body = await request.json()
        state.traceparents.append(request.headers.get("traceparent"))
        state.received += 1
        number = state.received
        if args.fail_every and number % args.fail_every == 0:
            return JSONResponse({"error": {"message": f"injected failure #{number}",
                                           "type": "server_error"}}, status_code=500)
        text, system = _prompt_of(kind, body)
        prompt_words = len(((system or "") + " " + text).split())
        state.prompt_tokens += prompt_words
        state.prefix_queries += prompt_words
        if system is not None:
            if system in state.seen_prefixes:
                state.prefix_hits += len(system.split())
            state.seen_prefixes.add(system)
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        n_out = max_tokens if body.get("ignore_eos") or args.eos_after is None \
            else min(max_tokens, args.eos_after)
        error_at = 1 if args.error_event_every and number % args.error_event_every == 0 \
            else None
        die = args.die_after is not None and number >= args.die_after
        created = int(time.time())
        rid = f"fake-{number}"

        def chunk(delta_text: str | None, finish: str | None = None) -> str:
            if kind == "chat":
                delta = {} if delta_text is None else {"content": delta_text}
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
                obj = "chat.completion.chunk"
            else:
                choice = {"index": 0, "text": delta_text or "", "finish_reason": finish}
                obj = "text_completion"
            return "data: " + json.dumps({"id": rid, "object": obj, "created": created,
                                          "model": args.model, "choices": [choice]}) + "\n\n"

        usage = {"prompt_tokens": prompt_words, "completion_tokens": n_out,
                 "total_tokens": prompt_words + n_out}

        if not body.get("stream"):
            await asyncio.sleep((args.ttft_ms + args.itl_ms * max(0, n_out - 1)) / 1000)
            state.generation_tokens += n_out
            words = "".join(f" tok{i}" for i in range(n_out))
            choice = ({"index": 0, "message": {"role": "assistant", "content": words},
                       "finish_reason": "length"} if kind == "chat"
                      else {"index": 0, "text": words, "finish_reason": "length"})
            return JSONResponse({"id": rid, "object": "completion", "created": created,
                                 "model": args.model, "choices": [choice], "usage": usage})

        async def stream():
            if state.slots is not None:
                state.waiting += 1
                try:
                    await state.slots.acquire()
                finally:
                    state.waiting -= 1
                try:
                    async for part in generate_stream():
                        yield part
                finally:
                    state.slots.release()
            else:
                async for part in generate_stream():
                    yield part

        async def sleep_until(deadline: float) -> None:
            await asyncio.sleep(max(0.0, deadline - time.perf_counter()))

        async def generate_stream():
            state.running += 1
            state.max_running = max(state.max_running, state.running)
            begin = time.perf_counter()
            try:
                if kind == "chat":  # role header first, as vLLM and OpenAI do
                    yield ("data: " + json.dumps({
                        "id": rid, "object": "chat.completion.chunk", "created": created,
                        "model": args.model, "choices": [{"index": 0, "delta": {
                            "role": "assistant", "content": ""}, "finish_reason": None}]})
                        + "\n\n")
                deadline = begin + (args.ttft_ms + args.prefill_ms_per_token * prompt_words) / 1000
                await sleep_until(deadline)
                for i in range(n_out):
                    if i:
                        gap = args.itl_ms + args.itl_ms_per_running * (state.running - 1)
                        deadline += gap / 1000
                        await sleep_until(deadline)
                    state.generation_tokens += 1
                    yield chunk(f" tok{i}")
                    if die:
                        sys.stdout.flush()
                        os._exit(3)
                    if error_at is not None and i + 1 >= error_at:
                        yield "data: " + json.dumps({"error": {
                            "message": f"injected stream error #{number}",
                            "type": "server_error"}}) + "\n\n"
                        return
                yield chunk(None if kind == "chat" else "", "length")
                if (body.get("stream_options") or {}).get("include_usage"):
                    yield "data: " + json.dumps({"id": rid, "object": "chunk", "choices": [],
                                                 "model": args.model, "usage": usage}) + "\n\n"
                yield "data: [DONE]\n\n"
            finally:
                state.running -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def traceparents(request: Request):
        return JSONResponse(state.traceparents)

    async def completions(request: Request):
        return await generate(request, "completion")

    async def chat(request: Request):
        return await generate(request, "chat")

    return Starlette(routes=[
        Route("/health", health),
        Route("/v1/models", models),
        Route("/metrics", metrics),
        Route("/debug/traceparents", traceparents),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
    ])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--model", default="fake-model")
    p.add_argument("--ttft-ms", type=float, default=20.0)
    p.add_argument("--prefill-ms-per-token", type=float, default=0.0)
    p.add_argument("--itl-ms", type=float, default=5.0)
    p.add_argument("--itl-ms-per-running", type=float, default=0.0)
    p.add_argument("--eos-after", type=int, default=None,
                   help="stop after this many tokens unless the request sets ignore_eos")
    p.add_argument("--fail-every", type=int, default=0, help="HTTP 500 on every K-th request")
    p.add_argument("--error-event-every", type=int, default=0,
                   help="an SSE error event after the first token of every K-th request")
    p.add_argument("--die-after", type=int, default=None,
                   help="exit the process while streaming the N-th request")
    p.add_argument("--metrics-prefix", default="llmctl:", help="llmctl: | vllm: | none")
    p.add_argument("--kv-slots", type=int, default=16)
    p.add_argument("--max-running", type=int, default=0,
                   help="generate at most this many requests at once; the rest queue (FIFO)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    args = parse_args(argv)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", args.port))
    sock.listen(1024)
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    config = uvicorn.Config(build_app(args), log_level="warning", lifespan="off",
                            timeout_graceful_shutdown=1)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()

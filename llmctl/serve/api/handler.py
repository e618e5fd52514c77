"""One HTTP request's life in the server: the body parsed and checked against the
tenant, the engine requests submitted (:func:`llmctl.serve.openai.submit.submit_all`),
their outputs sent as a stream or collected into one response, within the request's
deadline, traced and counted. The OpenAI work is the
:class:`~llmctl.serve.openai.frontend.Frontend`'s, shared with ``llmctl batch``."""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from llmctl.serve.api.body import read_body
from llmctl.serve.api.limits import OFF_LOOP_CHARS
from llmctl.serve.api.metrics import ServerMetrics
from llmctl.serve.api.streaming import merged, response_events, sse_events, timed
from llmctl.serve.api.tenancy.gate import Grant, Tenancy
from llmctl.serve.api.tenancy.keys import TenantTable
from llmctl.serve.engine.async_engine import AsyncEngine, EngineDeadError, RequestFailedError
from llmctl.serve.openai import errors
from llmctl.serve.openai.frontend import Frontend
from llmctl.serve.openai.jobs import Job
from llmctl.serve.openai.messages_api.serving import AnthropicMessages
from llmctl.serve.openai.messages_api.stream import message_events
from llmctl.serve.openai.models import ServedModel
from llmctl.serve.openai.prompts import request_chars
from llmctl.serve.openai.responses import Assembly
from llmctl.serve.openai.structured import compiles_grammar
from llmctl.serve.openai.submit import submit_all

log = logging.getLogger("llmctl.serve")


@dataclass
class ServerConfig:
    """What the HTTP layer needs beyond the frontend: the served model, the serve
    settings (:class:`llmctl.serve.launch.startup.ServeSettings`; launch sits above this
    package, so they are read by field) and what was resolved from them at launch."""

    model: ServedModel
    settings: Any  # api_key, auth_file, request_timeout, enable_lora_runtime_updates, ...
    tenants: TenantTable | None = None  # from --auth-file, loaded before the model
    # bodies over this many bytes get 413 before they are read (llmctl.serve.api.limits);
    # None: no limit (launch.assemble.build_server sizes the default from the context)
    max_request_bytes: int | None = None
    peaks: Any = None  # llmctl.perf.peaks.Peaks for /metrics' MFU/MBU gauges; None: unknown


def tenant_of(request: Request):
    """The tenant the auth middleware found for this request (None: no keys)."""
    return getattr(request.state, "tenant", None)


def owner_of(request: Request) -> str | None:
    """Whose stored responses a request may read: its tenant's (None: no keys)."""
    tenant = tenant_of(request)
    return None if tenant is None else tenant.name


class RequestHandler:
    """The server's request handling; the routes (:mod:`llmctl.serve.api.routes`) are
    thin wrappers around it and the frontend."""

    def __init__(self, engine: AsyncEngine, frontend: Frontend, config: ServerConfig,
                 tracing=None) -> None:
        self.engine = engine
        self.frontend = frontend
        self.config = config
        self.tracing = tracing  # llmctl.serve.api.tracing.Tracing; None: off
        name = config.model.model_name
        self.metrics = ServerMetrics(name, engine.stats, config.peaks)
        table = config.tenants
        if table is None and config.settings.api_key:  # the one-key shortcut
            table = TenantTable.single_key(config.settings.api_key)
        self.tenancy = Tenancy(table, self.metrics, frontend.models.served_names,
                               config.settings.auth_file)

    @functools.cached_property
    def messages_api(self) -> AnthropicMessages:
        """/v1/messages (Anthropic's Messages API) over the frontend's chat path."""
        return AnthropicMessages(self.frontend.chat, self.frontend.models)

    # --- parsing -------------------------------------------------------------------
    async def parse(self, request: Request, model_cls):
        """The request body validated as ``model_cls`` (or as the class it picks, given
        the body), its ``model`` one this server serves and the tenant may use."""
        parsed = self.frontend.validate(await read_body(request), model_cls)
        self.tenancy.check_model(tenant_of(request),
                                 parsed.model or self.config.model.model_name)
        return parsed

    async def off_loop(self, fn: Callable[..., Any], req, *args) -> Any:
        """``fn(req, *args)``, on a worker thread when ``req`` brings much text or a
        grammar: the tokenizer (Rust), the chat template (jinja) and the wait on the
        grammar compile pool then happen beside the event loop, which keeps answering
        /health and other clients' streams."""
        if request_chars(req) <= OFF_LOOP_CHARS and not compiles_grammar(req):
            return fn(req, *args)
        import anyio

        return await anyio.to_thread.run_sync(functools.partial(fn, req, *args))

    # --- running -------------------------------------------------------------------
    def check_fits_queue(self, jobs: list[Job], param: str = "prompt") -> None:
        """A request of more prompts than the queue holds could never be queued whole,
        however idle the server: a 400 naming the limit, not a 429 telling it to retry."""
        limit = self.engine.max_queue
        if limit is not None and len(jobs) > limit:
            raise errors.bad_request(
                f"the request has {len(jobs)} prompts; this server queues at most {limit} "
                f"requests (--max-queue {limit}), so it can never take them at once: send "
                f"at most {limit} prompts per request", param)

    def _submit(self, jobs: list[Job], params, priority: int, grant: Grant) -> None:
        """Queue every prompt before answering, so refusals are plain HTTP errors (and
        cost the tenant nothing)."""
        engine = self.engine
        submit_all(jobs, lambda job: engine.submit(job.request_id, job.prompt_ids, params,
                                                   priority, lora=job.lora, **grant.who),
                   engine.abort, self.config.model.model_name, on_refused=grant.refund)

    def _admit(self, kind: str, req, jobs: list[Job], params, http: Request) -> Grant:
        """Trace, admit against the tenant's limits and submit every job (or none)."""
        self.check_fits_queue(jobs)
        if self.tracing is not None:
            trace = self.tracing.begin(http.headers, kind, req, jobs, params,
                                       self.config.model.model_name)
            for job in jobs:
                job.trace = trace
        try:
            # the worst case: every choice of every prompt runs to max_tokens
            grant = self.tenancy.admit(tenant_of(http), sum(len(j.prompt_ids) for j in jobs),
                                       params.max_tokens * params.n * len(jobs))
            self._submit(jobs, params, req.priority, grant)
        except BaseException as exc:  # refused (429) or failed to submit: traced too
            if jobs[0].trace is not None:
                jobs[0].trace.close(exc)
            raise
        return grant

    async def run(self, kind: str, req, jobs: list[Job], params, http: Request,
                  include_usage: bool):
        grant = self._admit(kind, req, jobs, params, http)
        assembly = self.frontend.assembly(kind, req, jobs)
        if req.stream:
            events = sse_events(assembly, self._updates(assembly, grant), include_usage,
                                self.metrics)
            return StreamingResponse(
                events, media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                         **grant.headers})
        return await _respond(self._collect(assembly, grant), http, grant.headers)

    async def respond(self, req, chat_req, history: list, jobs: list[Job], params,
                      http: Request):
        """A /v1/responses request (``chat_req``: the chat request it means): the chat
        path's updates as the Responses stream's events, or as one response object;
        kept for follow-ups once finished."""
        grant = self._admit("chat", chat_req, jobs, params, http)
        serving = self.frontend.responses_api
        builder = serving.builder(req, chat_req, jobs)
        updates = self._updates(self.frontend.assembly("chat", chat_req, jobs), grant)

        def finished() -> None:
            serving.finished(req, history, builder, owner_of(http))

        def result() -> dict:
            finished()
            return builder.response

        events = response_events(builder, updates, self.metrics, finished) if req.stream \
            else None
        return await _built(builder, updates, grant, http, events, result)

    async def messages(self, chat_req, jobs: list[Job], params, http: Request):
        """A /v1/messages request (``chat_req``: the chat request it means): the chat
        path's updates as Anthropic's stream events, or as one message."""
        grant = self._admit("chat", chat_req, jobs, params, http)
        serving = self.messages_api
        assembly = serving.assembly(self.frontend.responses, chat_req, jobs)
        builder = serving.builder(chat_req, jobs, assembly)
        updates = self._updates(assembly, grant)
        events = message_events(builder, updates, self.metrics) if chat_req.stream else None
        return await _built(builder, updates, grant, http, events, lambda: builder.message)

    async def embed(self, req, jobs: list[Job], params, http: Request) -> Response:
        """An embeddings request: its pooling engine requests submitted (all or none),
        their final outputs collected into one body (no stream, no tokens to settle)."""
        self.check_fits_queue(jobs, "input")
        grant = self.tenancy.admit(tenant_of(http), sum(len(j.prompt_ids) for j in jobs), 0)
        self._submit(jobs, params, req.priority, grant)
        assembly = self.frontend.assembly("embedding", req, jobs)
        return await _respond(self._collect_final(assembly, grant), http, grant.headers)

    async def _collect_final(self, assembly, grant: Grant) -> dict:
        """Each job's outputs into ``assembly`` until all finish or the deadline passes;
        counted as finished requests (no tokens generated)."""
        jobs = assembly.jobs
        start = time.monotonic()
        outputs = merged(self.engine, jobs)
        try:
            async for job, out in timed(outputs, self._deadline(),
                                        self.config.settings.request_timeout):
                assembly.collect(job, out)
                if out.finished:
                    self._observe(out, start, None)
        except EngineDeadError as exc:
            raise errors.unavailable(str(exc), exc.retry_after) from None
        except RequestFailedError as exc:
            raise errors.internal(f"embedding failed: {exc}") from None
        finally:
            await outputs.aclose()
            self._abort_unfinished(jobs)
            grant.settle(sum(len(j.prompt_ids) for j in jobs), 0)
        return assembly.body()

    def _deadline(self) -> float | None:
        timeout = self.config.settings.request_timeout
        return None if timeout is None else time.monotonic() + timeout

    async def _updates(self, assembly: Assembly, grant: Grant) -> AsyncIterator[tuple]:
        """Every choice's updates, shaped (echo, prompt only), as (choice index, update),
        until all jobs finish or the deadline passes; records each finished request and,
        however it ends, settles the tenant's grant to the tokens generated (the prompt
        counts whole once submitted: the engine may have prefilled it).
        Engine failures arrive as APIErrors: 503 when the engine is gone, 500 when this
        request's own work failed in it."""
        jobs = assembly.jobs
        start = time.monotonic()
        first_token: dict[str, float] = {}
        generated: dict[str, int] = {}
        outputs = merged(self.engine, jobs)
        trace = jobs[0].trace
        try:
            async for job, out in timed(outputs, self._deadline(),
                                        self.config.settings.request_timeout):
                # token_ids are cumulative: the last output holds each choice's count
                generated[job.request_id] = sum(len(c.token_ids) for c in out.outputs)
                if trace is not None:
                    trace.observe(job.request_id, out)
                for index, upd in assembly.updates(job, out):
                    if upd.token_ids:
                        first_token.setdefault(job.request_id, time.monotonic())
                    yield index, upd
                if out.finished:
                    self._observe(out, start, first_token.get(job.request_id))
        except EngineDeadError as exc:
            raise errors.unavailable(str(exc), exc.retry_after) from None
        except RequestFailedError as exc:
            raise errors.internal(f"generation failed: {exc}") from None
        finally:
            error = sys.exc_info()[1]  # what ends the request early, for its trace
            await outputs.aclose()
            self._abort_unfinished(jobs)
            grant.settle(sum(len(j.prompt_ids) for j in jobs), sum(generated.values()))
            if trace is not None:
                trace.close(error)

    async def _collect(self, assembly: Assembly, grant: Grant) -> dict:
        updates = self._updates(assembly, grant)
        try:
            async for index, upd in updates:
                assembly.add(index, upd)
        finally:
            await updates.aclose()
        return assembly.body()

    def _abort_unfinished(self, jobs: list[Job]) -> None:
        for job in jobs:
            if job.stream is not None and not job.stream.finished:
                self.engine.abort(job.request_id)

    def _observe(self, out, start: float, first: float | None) -> None:
        now = time.monotonic()
        for completion in out.outputs:
            self.metrics.observe_finished(
                reason=completion.finish_reason or "abort",
                prompt_tokens=len(out.prompt_token_ids),
                output_tokens=len(completion.token_ids),
                ttft=None if first is None else first - start, e2e=now - start)


async def _built(builder, updates, grant, http: Request, events, result):
    """A builder fed from the chat path's updates (/v1/responses, /v1/messages): its
    ``events`` streamed as server-sent events when the request streams (else None), or
    every update fed, the builder finished and ``result()`` sent."""
    if events is not None:
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache",
                                          "X-Accel-Buffering": "no", **grant.headers})

    async def whole() -> dict:
        try:
            async for _, upd in updates:
                builder.feed(upd)
        finally:
            await updates.aclose()
        builder.finish()
        return result()

    return await _respond(whole(), http, grant.headers)


async def _respond(body, http: Request, headers: dict[str, str]) -> Response:
    """``body`` (a coroutine) as JSON, or 499 when the client leaves first (the
    coroutine is cancelled, which aborts its engine requests)."""
    task = asyncio.create_task(body)
    watcher = asyncio.create_task(_wait_disconnect(http))
    done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if task not in done:
        task.cancel()
        return Response(status_code=499)
    watcher.cancel()
    return JSONResponse(task.result(), headers=headers)


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return

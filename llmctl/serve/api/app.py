"""The FastAPI application: OpenAI completions and chat, models, health, metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from llmctl.serve.api import errors
from llmctl.serve.api.content_tokens import ContentTokens
from llmctl.serve.api.errors import APIError
from llmctl.serve.api.limits import OFF_LOOP_CHARS, BodyLimit, max_prompt_chars
from llmctl.serve.api.loras import lora_cards, register_lora_routes
from llmctl.serve.api.metrics import ServerMetrics
from llmctl.serve.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    allowed_range,
    tokenize_request_class,
)
from llmctl.serve.api.render import (
    Choice,
    TokenIdNames,
    Update,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    echo_prefix,
    updates_from_output,
    usage_block,
    without_generation,
)
from llmctl.serve.api.tenancy.gate import Grant, Tenancy
from llmctl.serve.api.tenancy.keys import TenantTable
from llmctl.serve.api.tools.request import (
    ToolPlan,
    ToolRequestError,
    plan_tools,
    template_tools,
    warn_if_template_ignores_tools,
)
from llmctl.serve.engine.async_engine import (
    AsyncEngine,
    DeadlineError,
    EngineDeadError,
    QueueFullError,
    RequestFailedError,
)
from llmctl.serve.proc.engine import EngineUnavailableError

log = logging.getLogger("llmctl.serve")


@dataclass
class ServerConfig:
    model_name: str
    max_model_len: int
    vocab_size: int
    api_key: str | None = None  # the one-key shortcut; ``tenants`` wins when both are set
    tenants: TenantTable | None = None  # from --auth-file
    auth_file: str | None = None  # reloaded on SIGHUP
    request_timeout: float | None = None
    extra_model_names: tuple[str, ...] = ()
    created: int = field(default_factory=lambda: int(time.time()))
    peaks: Any = None  # llmctl.perf.peaks.Peaks for /metrics' MFU/MBU gauges; None: unknown
    # tool_choice "auto": the tool_parsers.AUTO_PARSERS name (--enable-auto-tool-choice
    # --tool-call-parser NAME); None: "auto" is refused, as vLLM does
    auto_tool_parser: str | None = None
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter allowed
    # (--enable-lora-runtime-updates): loading reads a server path a client names
    lora_runtime_updates: bool = False
    # bodies over this many bytes get 413 before they are read (llmctl.serve.api.limits);
    # None: no limit (launch.build_server sets the default from the context length)
    max_request_bytes: int | None = None
    # with keys: /metrics answers without one (--metrics-public); it names every tenant
    metrics_public: bool = False
    # chat: special tokens' text inside messages becomes those tokens (the template's
    # ones always do); off by default: message text stays text (llmctl.serve.api.chat_text)
    allow_special_tokens_in_content: bool = False


@dataclass
class _Job:
    """One engine request: a prompt and the choices it feeds."""

    request_id: str
    prompt_ids: list[int]
    choice_offset: int
    stream: Any = None
    echo: str | None = None  # the prompt text, put before each choice's text (echo=true)
    trace: Any = None  # the request's RequestTrace (llmctl.serve.api.tracing) when tracing
    tools: ToolPlan = field(default_factory=ToolPlan)  # chat: how its choices are read
    lora: str | None = None  # the LoRA adapter it runs with (its ``model``); None: base


_RANGE_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal",
                 "finite_number"}


def _first_error(exc: ValidationError, model: type[BaseModel]) -> tuple[str, str | None]:
    """OpenAI's message and ``param`` for the first problem pydantic found."""
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"] if p != "body")
    kind = err["type"]
    if kind == "extra_forbidden":
        return f"unrecognized request argument supplied: {loc}", loc
    if kind == "missing":
        return f"missing required parameter: {loc}", loc
    if kind in _RANGE_ERRORS and (bounds := allowed_range(model, loc)):
        what = "is not a finite number" if kind == "finite_number" else "is out of range"
        return f"{loc}: {err['input']!r} {what}; allowed: {bounds}", loc
    message = str(err["ctx"]["error"]) if kind == "value_error" else err["msg"]
    return (f"{loc}: {message}" if loc else message), loc or None


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def require_object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise errors.bad_request("the request body must be a JSON object")
    return body


def chat_chars(req) -> int:
    """The characters a conversation's messages bring to its rendered template."""
    return sum(len(m.text()) + len(m.name or "") for m in req.messages)


def request_chars(req) -> int:
    """How much text a parsed request asks to tokenize (prompts or messages)."""
    if hasattr(req, "messages"):
        return chat_chars(req)
    prompts = req.prompts() if hasattr(req, "prompts") else [getattr(req, "prompt", "")]
    return sum(len(p) for p in prompts)


def response_id(jobs: list[_Job]) -> str:
    """The response's id: its engine requests' ids without the prompt index."""
    return jobs[0].request_id.rsplit("-", 1)[0]


class Frontend:
    """OpenAI bodies in, engine requests out, and engine outputs back to OpenAI bodies,
    with neither HTTP nor an engine in it: the server and ``llmctl batch``
    (:mod:`llmctl.serve.batch.runner`) share it, so a batch line gets what the HTTP API
    would answer."""

    def __init__(self, tokenizer, config: ServerConfig, grammar_factory=None,
                 lora_names: Callable[[], tuple[str, ...]] = tuple) -> None:
        self.tokenizer = tokenizer
        self.config = config
        self.grammars = grammar_factory
        self.lora_names = lora_names  # the engine's loaded LoRA adapters (they change)

    @property
    def served_names(self) -> tuple[str, ...]:
        return (self.config.model_name, *self.config.extra_model_names)

    def adapter_of(self, model: str | None) -> str | None:
        """The LoRA adapter a request's ``model`` names; None for the base model."""
        return None if model is None or model in self.served_names else model

    def response_model(self, jobs: list[_Job]) -> str:
        """``model`` in responses: the adapter's name when one ran (as vLLM answers)."""
        return jobs[0].lora or self.config.model_name

    # --- parsing -------------------------------------------------------------------
    def validate(self, body: dict, model_cls):
        """``body`` validated as ``model_cls`` (or as the class it picks, given the body),
        its ``model`` one this server serves."""
        if not isinstance(model_cls, type):
            model_cls = model_cls(body)
        try:
            parsed = model_cls.model_validate(body)
        except ValidationError as exc:
            message, param = _first_error(exc, model_cls)
            raise errors.bad_request(message, param) from None
        if parsed.model is not None and parsed.model not in self.served_names \
                and parsed.model not in self.lora_names():
            raise errors.model_not_found(parsed.model, self.config.model_name)
        return parsed

    @functools.cached_property
    def max_prompt_chars(self) -> int | None:
        """Characters above which a text cannot fit the context (limits.max_prompt_chars)."""
        return max_prompt_chars(self.tokenizer, self.config.max_model_len)

    def check_chars(self, chars: int, param: str) -> None:
        """Refuse a text that cannot fit the context before tokenizing it (a 400 in
        microseconds instead of seconds of tokenizing a multi-megabyte prompt)."""
        bound = self.max_prompt_chars
        if bound is not None and chars > bound:
            raise errors.bad_request(
                f"the {param} has {chars} characters, more than this model's context of "
                f"{self.config.max_model_len} tokens can hold (at most {bound}); shorten it",
                param)

    def encode_completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        for prompt in req.prompts():  # all of them before any is tokenized
            if isinstance(prompt, str):
                self.check_chars(len(prompt), "prompt")
        prompts = []
        for prompt in req.prompts():
            if isinstance(prompt, str):
                ids = self._tokenize(prompt)
            else:
                bad = [t for t in prompt if not 0 <= t < self.config.vocab_size]
                if bad:
                    raise errors.bad_request(f"token id {bad[0]} is outside the vocabulary "
                                             f"(0..{self.config.vocab_size - 1})", "prompt")
                ids = list(prompt)
            if not ids:
                raise errors.bad_request("the prompt is empty", "prompt")
            prompts.append(ids)
        return prompts

    def _tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        except (TypeError, ValueError) as exc:  # e.g. a lone surrogate ("\ud800") in JSON
            raise errors.bad_request(f"the prompt cannot be tokenized ({exc}); send valid "
                                     "Unicode text", "prompt") from None

    def echo_text(self, prompt: str | list[int]) -> str:
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)

    def encode_chat(self, req: ChatCompletionRequest | TokenizeChatRequest) -> list[int]:
        """The prompt ids of a conversation: its chat template's text, tokenized without
        special tokens (the template writes them) unless the request asks for more."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise errors.bad_request("this model has no chat template; use /v1/completions")
        self.check_chars(chat_chars(req), "messages")
        messages = [m.for_template() for m in req.messages]
        extra: dict[str, Any] = {"continue_final_message": True} if getattr(
            req, "continue_final_message", False) else {}
        if tools := template_tools(req):
            extra["tools"] = tools
            warn_if_template_ignores_tools(self.tokenizer)

        def render(messages: list[dict]) -> str:
            try:
                return self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=req.add_generation_prompt,
                    tokenize=False, **extra)
            except Exception as exc:  # jinja raises on templates that reject the roles
                raise errors.bad_request(
                    f"the chat template rejected the messages: {exc}") from None

        text = render(messages)
        add_special = getattr(req, "add_special_tokens", False)
        if self.config.allow_special_tokens_in_content:
            return self._tokenize(text, add_special)
        try:
            return self.content_tokens.encode(text, messages, render, add_special)
        except (TypeError, ValueError) as exc:  # as in _tokenize
            raise errors.bad_request(f"the prompt cannot be tokenized ({exc}); send valid "
                                     "Unicode text", "messages") from None

    @functools.cached_property
    def content_tokens(self) -> ContentTokens:
        return ContentTokens(self.tokenizer)

    def tokenize(self, req: TokenizeCompletionRequest | TokenizeChatRequest) -> dict:
        if isinstance(req, TokenizeChatRequest):
            ids = self.encode_chat(req)
        else:
            self.check_chars(len(req.prompt), "prompt")
            ids = self._tokenize(req.prompt, req.add_special_tokens)
        return {"count": len(ids), "max_model_len": self.config.max_model_len, "tokens": ids,
                "token_strs": self.tokenizer.convert_ids_to_tokens(ids)
                if req.return_token_strs else None}

    def detokenize(self, req: DetokenizeRequest) -> dict:
        bad = [t for t in req.tokens if t >= self.config.vocab_size]
        if bad:
            raise errors.bad_request(f"token id {bad[0]} is outside the vocabulary "
                                     f"(0..{self.config.vocab_size - 1})", "tokens")
        return {"prompt": self.tokenizer.decode(req.tokens)}

    def sampling_params(self, req, prompt_len: int, max_tokens: int | None,
                        logprobs: int | None, prompt_logprobs: int | None = None,
                        cap: int | None = None, overrides: dict[str, Any] | None = None):
        """``cap``: the tenant's max_tokens per request, bounding an unset max_tokens;
        ``overrides``: SamplingParams fields set by a feature (a ToolPlan's)."""
        from llmctl.errors import UsageError
        from llmctl.serve.core.sampling_params import SamplingParams

        limit = self.config.max_model_len
        if prompt_len >= limit:
            raise errors.bad_request(
                f"the prompt has {prompt_len} tokens; this model's context is {limit}",
                "messages" if isinstance(req, ChatCompletionRequest) else "prompt")
        if max_tokens is None:
            max_tokens = limit - prompt_len if cap is None else min(cap, limit - prompt_len)
        elif prompt_len + max_tokens > limit:
            raise errors.bad_request(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the "
                f"context length {limit}; lower max_tokens or shorten the prompt", "max_tokens")
        extra: dict[str, Any] = {}
        if req.response_format is not None and req.response_format.type != "text":
            extra["logits_constraint"] = self._grammar(req)
        if prompt_logprobs is not None:
            extra["prompt_logprobs"] = prompt_logprobs
        if bias := req.logit_bias_ids:
            if (top := max(bias)) >= self.config.vocab_size:
                raise errors.bad_request(f"logit_bias: token id {top} is outside the "
                                         f"vocabulary (0..{self.config.vocab_size - 1})",
                                         "logit_bias")
            extra["logit_bias"] = bias
        extra.update(overrides or {})
        try:  # protocol.py has checked every field; this is the engine's own last word
            return SamplingParams(
                n=req.n, max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                top_k=req.top_k, min_p=req.min_p, seed=req.seed, stop=req.stop_list,
                stop_token_ids=req.stop_token_ids or (), ignore_eos=req.ignore_eos,
                presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                repetition_penalty=req.repetition_penalty, logprobs=logprobs, **extra)
        except UsageError as exc:
            raise errors.bad_request(exc.message) from None

    def tool_plan(self, req: ChatCompletionRequest) -> ToolPlan:
        try:
            return plan_tools(req, self.grammars, self.config.auto_tool_parser)
        except ToolRequestError as exc:
            raise errors.bad_request(str(exc), exc.param) from None

    def _grammar(self, req):
        """The request's compiled grammar (a ConstraintFactory); a bad schema is a 400."""
        if self.grammars is None:
            raise errors.bad_request("response_format is not available on this server "
                                     "(llguidance is not installed)", "response_format")
        fmt = req.response_format
        schema = fmt.json_schema.schema_ if fmt.json_schema else None
        try:
            return self.grammars.compiled(fmt.type, schema)
        except ValueError as exc:
            raise errors.bad_request(str(exc), "response_format") from None

    def _shape(self, req, job: _Job, out, upd: Update, first: bool) -> Update:
        """Echo: the prompt (and its log-probs) before a choice's first text; without
        generation (``max_tokens: 0``) the sampled token is dropped."""
        if getattr(req, "prompt_only", False):
            upd = without_generation(upd)
        if job.echo is not None and first:
            upd = echo_prefix(upd, job.echo,
                              out.prompt_logprobs if upd.logprobs is not None else None,
                              out.prompt_token_ids)
        return upd

    def _token_names(self, req):
        return TokenIdNames() if req.return_tokens_as_token_ids else self.tokenizer

    def completion_jobs(self, req: CompletionRequest, prompts: list[list[int]],
                        cap: int | None = None) -> tuple[list[_Job], Any]:
        """One engine request per prompt and their shared sampling parameters."""
        rid = f"cmpl-{uuid.uuid4().hex}"
        # One parameter set for all prompts: checked against the longest, which also
        # bounds an unset max_tokens for every prompt. Echo without generation still
        # samples one token (the engine needs a step to end on; vLLM does the same).
        longest = max(len(ids) for ids in prompts)
        max_tokens = 1 if req.prompt_only else req.max_tokens
        params = self.sampling_params(req, longest, max_tokens, req.logprobs,
                                      req.logprobs if req.echo else None, cap)
        jobs = [_Job(f"{rid}-{i}", ids, i * req.n,
                     echo=self.echo_text(text) if req.echo else None,
                     lora=self.adapter_of(req.model))
                for i, (text, ids) in enumerate(zip(req.prompts(), prompts))]
        return jobs, params

    def chat_jobs(self, req: ChatCompletionRequest, ids: list[int], cap: int | None = None,
                  tools: ToolPlan | None = None) -> tuple[list[_Job], Any]:
        """``tools``: the request's plan when already made (:meth:`tool_plan`)."""
        tools = tools if tools is not None else self.tool_plan(req)
        params = self.sampling_params(req, len(ids), req.token_limit, req.num_logprobs,
                                      cap=cap, overrides=tools.sampling_overrides())
        return [_Job(f"chatcmpl-{uuid.uuid4().hex}-0", ids, 0, tools=tools,
                     lora=self.adapter_of(req.model))], params

    def choice_updates(self, req, job: _Job, out, started: set[int]
                       ) -> Iterator[tuple[int, Update]]:
        """What one engine output adds to each of its choices, shaped, as (choice index,
        update); ``started`` holds the choices that already had an update."""
        for upd in updates_from_output(out):
            index = job.choice_offset + upd.index
            upd = self._shape(req, job, out, upd, index not in started)
            started.add(index)
            yield index, upd

    def response(self, kind: str, req, jobs: list[_Job], choices: dict[int, Choice]) -> dict:
        """The non-streaming response body once every choice is complete."""
        ordered = [choices[i] for i in sorted(choices)]
        if jobs[0].tools.active:  # chat with tools: calls out of each choice's text
            for c in ordered:
                reader = jobs[0].tools.new_choice()
                _, _, c.finish_reason = reader.update(c.text, c.finish_reason or "length")
                c.text, c.tool_calls = reader.content, reader.tool_calls
        prompt_tokens = sum(len(j.prompt_ids) for j in jobs)
        usage = usage_block(prompt_tokens, sum(c.num_tokens for c in ordered))
        created = int(time.time())
        names = self._token_names(req)
        rid = response_id(jobs)
        model = self.response_model(jobs)
        if kind == "chat":
            return chat_response(rid, created, model, ordered, usage, names)
        return completion_response(rid, created, model, ordered, usage, names)


class Server(Frontend):
    """Request handling shared by both endpoints; the routes are thin wrappers."""

    def __init__(self, engine: AsyncEngine, tokenizer, config: ServerConfig,
                 grammar_factory=None, tracing=None) -> None:
        super().__init__(tokenizer, config, grammar_factory, engine.lora_names)
        self.engine = engine
        self.tracing = tracing  # llmctl.serve.api.tracing.Tracing; None: off
        self.metrics = ServerMetrics(config.model_name, engine.stats, config.peaks)
        table = config.tenants
        if table is None and config.api_key:
            table = TenantTable.single_key(config.api_key)
        self.tenancy = Tenancy(table, self.metrics, self.served_names, config.auth_file)

    # --- parsing -------------------------------------------------------------------
    async def parse(self, request: Request, model_cls):
        """The request body validated as ``model_cls`` (or as the class it picks, given
        the body), its ``model`` one this server serves and the tenant may use."""
        parsed = self.validate(await self._body(request), model_cls)
        self.tenancy.check_model(tenant_of(request), parsed.model or self.config.model_name)
        return parsed

    @staticmethod
    async def _body(request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw, parse_constant=_reject_constant)  # no NaN / Infinity
        except (ValueError, UnicodeDecodeError) as exc:
            raise errors.bad_request(f"malformed JSON body: {exc}") from None
        except RecursionError:
            raise errors.bad_request("malformed JSON body: nested too deeply") from None
        return require_object(body)

    async def off_loop(self, fn: Callable[..., Any], req, *args) -> Any:
        """``fn(req, *args)``, on a worker thread when ``req`` brings much text: the
        tokenizer (Rust) and the chat template (jinja) then run beside the event loop,
        which keeps answering /health and other clients' streams."""
        if request_chars(req) <= OFF_LOOP_CHARS:
            return fn(req, *args)
        import anyio

        return await anyio.to_thread.run_sync(functools.partial(fn, req, *args))

    # --- running -------------------------------------------------------------------
    def _submit(self, jobs: list[_Job], params, priority: int, grant: Grant) -> None:
        """Queue every prompt before answering, so refusals are plain HTTP errors (and
        cost the tenant nothing)."""
        from llmctl.errors import LlmctlError
        from llmctl.serve.lora.adapter import LoRANotFoundError

        submitted = []
        try:
            for job in jobs:
                job.stream = self.engine.submit(job.request_id, job.prompt_ids, params, priority,
                                                lora=job.lora, **grant.who)
                submitted.append(job)
        except BaseException as exc:
            for job in submitted:
                self.engine.abort(job.request_id)
            grant.refund()
            if isinstance(exc, QueueFullError):  # it fits an emptier queue: retry helps
                raise errors.overloaded(retry_after=1) from None
            if isinstance(exc, DeadlineError):
                raise errors.deadline_unmeetable(str(exc), exc.retry_after) from None
            if isinstance(exc, (EngineDeadError, EngineUnavailableError)):
                raise errors.unavailable(str(exc), exc.retry_after) from None
            if isinstance(exc, LoRANotFoundError):  # unloaded since the body was checked
                raise errors.model_not_found(jobs[0].lora, self.config.model_name) from None
            if isinstance(exc, LlmctlError):
                raise errors.bad_request(exc.message) from None
            raise

    async def _merged(self, jobs: list[_Job]) -> AsyncIterator[tuple[_Job, Any]]:
        """Outputs of several engine requests, interleaved as they arrive."""
        if len(jobs) == 1:
            async for out in self.engine.outputs(jobs[0].request_id, jobs[0].stream):
                yield jobs[0], out
            return
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(job: _Job) -> None:
            try:
                async for out in self.engine.outputs(job.request_id, job.stream):
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

    def check_fits_queue(self, jobs: list[_Job]) -> None:
        """A request of more prompts than the queue holds could never be queued whole,
        however idle the server: a 400 naming the limit, not a 429 telling it to retry."""
        limit = self.engine.max_queue
        if limit is not None and len(jobs) > limit:
            raise errors.bad_request(
                f"the request has {len(jobs)} prompts; this server queues at most {limit} "
                f"requests (--max-queue {limit}), so it can never take them at once: send "
                f"at most {limit} prompts per request", "prompt")

    async def run(self, kind: str, req, jobs: list[_Job], params, http: Request,
                  include_usage: bool):
        self.check_fits_queue(jobs)
        if self.tracing is not None:
            trace = self.tracing.begin(http.headers, kind, req, jobs, params,
                                       self.config.model_name)
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
        rid = response_id(jobs)
        if req.stream:
            return StreamingResponse(
                self._stream(kind, rid, req, jobs, include_usage, grant),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                         **grant.headers})
        task = asyncio.create_task(self._collect(kind, rid, req, jobs, grant))
        watcher = asyncio.create_task(_wait_disconnect(http))
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task not in done:  # the client left: cancelling aborts the engine requests
            task.cancel()
            return Response(status_code=499)
        watcher.cancel()
        return JSONResponse(task.result(), headers=grant.headers)

    def _deadline(self) -> float | None:
        timeout = self.config.request_timeout
        return None if timeout is None else time.monotonic() + timeout

    async def _timed(self, iterator, deadline):
        """Iterate with a deadline; raises APIError(408) when it passes."""
        while True:
            timeout = None if deadline is None else deadline - time.monotonic()
            if timeout is not None and timeout <= 0:
                raise errors.timed_out(self.config.request_timeout)
            try:
                item = await asyncio.wait_for(iterator.__anext__(), timeout)
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                raise errors.timed_out(self.config.request_timeout) from None
            yield item

    async def _updates(self, req, jobs: list[_Job],
                       grant: Grant) -> AsyncIterator[tuple[int, Update]]:
        """Every choice's updates, shaped (echo, prompt only), as (choice index, update),
        until all jobs finish or the deadline passes; records each finished request and,
        however it ends, settles the tenant's grant to the tokens generated (the prompt
        counts whole once submitted: the engine may have prefilled it).
        Engine failures arrive as APIErrors: 503 when the engine is gone, 500 when this
        request's own work failed in it."""
        start = time.monotonic()
        first_token: dict[str, float] = {}
        started: set[int] = set()
        generated: dict[str, int] = {}
        merged = self._merged(jobs)
        trace = jobs[0].trace
        try:
            async for job, out in self._timed(merged, self._deadline()):
                # token_ids are cumulative: the last output holds each choice's count
                generated[job.request_id] = sum(len(c.token_ids) for c in out.outputs)
                if trace is not None:
                    trace.observe(job.request_id, out)
                for index, upd in self.choice_updates(req, job, out, started):
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
            await merged.aclose()
            self._abort_unfinished(jobs)
            grant.settle(sum(len(j.prompt_ids) for j in jobs), sum(generated.values()))
            if trace is not None:
                trace.close(error)

    async def _collect(self, kind, rid, req, jobs, grant: Grant) -> dict:
        choices: dict[int, Choice] = {}
        updates = self._updates(req, jobs, grant)
        try:
            async for index, upd in updates:
                choices.setdefault(index, Choice(index)).add(upd)
        finally:
            await updates.aclose()
        return self.response(kind, req, jobs, choices)

    async def _stream(self, kind, rid, req, jobs, include_usage,
                      grant: Grant) -> AsyncIterator[str]:
        created = int(time.time())
        model = self.response_model(jobs)
        sent_role: set[int] = set()
        names = self._token_names(req)
        completion_tokens = 0
        readers: dict[int, Any] = {}  # chat with tools: each choice's ChoiceTools
        updates = self._updates(req, jobs, grant)
        try:
            async for index, upd in updates:
                completion_tokens += len(upd.token_ids)
                if kind == "chat":
                    first = index not in sent_role
                    sent_role.add(index)
                    calls = None
                    if jobs[0].tools.active:
                        reader = readers.setdefault(index, jobs[0].tools.new_choice())
                        text, calls, reason = reader.update(upd.text, upd.finish_reason)
                        upd = dataclasses.replace(upd, text=text, finish_reason=reason)
                    chunk = chat_chunk(rid, created, model, index, upd, first, names, calls)
                else:
                    chunk = completion_chunk(rid, created, model, index, upd, names)
                yield _sse(chunk)
            if include_usage:
                prompt_tokens = sum(len(j.prompt_ids) for j in jobs)
                object_ = "chat.completion.chunk" if kind == "chat" else "text_completion"
                yield _sse({"id": rid, "object": object_, "created": created, "model": model,
                            "choices": [], "usage": usage_block(prompt_tokens,
                                                                completion_tokens)})
            yield "data: [DONE]\n\n"
        except APIError as exc:
            # Headers are gone: report in-band; no [DONE] marks the response incomplete.
            self.metrics.http_errors.labels(model, str(exc.status)).inc()
            yield _sse(exc.body())
        except Exception as exc:
            log.exception("streaming %s failed", rid)
            self.metrics.http_errors.labels(model, "500").inc()
            yield _sse(errors.internal(f"generation failed: {exc}").body())
        finally:
            await updates.aclose()

    def _abort_unfinished(self, jobs: list[_Job]) -> None:
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


def tenant_of(request: Request):
    """The tenant the auth middleware found for this request (None: no keys)."""
    return getattr(request.state, "tenant", None)


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def create_app(server: Server, on_shutdown=None) -> FastAPI:
    import contextlib

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        if on_shutdown is not None:
            on_shutdown()

    config = server.config
    # With keys, the schema of every route is for key holders only: /docs, /redoc and
    # /openapi.json are off (they would answer 401 anyway, and are not worth a key).
    keyed = server.tenancy.enabled
    docs: dict[str, Any] = {"docs_url": None, "redoc_url": None, "openapi_url": None} \
        if keyed else {}
    app = FastAPI(title="llmctl", version="1", lifespan=lifespan, **docs)
    app.state.server = server
    # What answers without a key when keys are configured: liveness, for load balancers
    # and orchestrators; /metrics only when asked for (it names every tenant).
    public = {"/health"} | ({"/metrics"} if config.metrics_public else set())

    def _error_response(exc: APIError) -> JSONResponse:
        server.metrics.http_errors.labels(config.model_name, str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return _error_response(exc)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException):
        # starlette's own refusals (unknown path, wrong method), in OpenAI's shape too
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return _error_response(APIError(
            exc.status_code, f"{exc.detail}: {request.method} {request.url.path}", kind,
            headers=exc.headers))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        # A bug, not the client's fault: still OpenAI's JSON, never starlette's plain text.
        # (starlette re-raises after sending this, so uvicorn logs the traceback.)
        return _error_response(errors.internal(
            f"internal server error: {type(exc).__name__}: {exc}"))

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        # every route, unknown paths included (a 401, not a 404 that maps the server)
        if request.url.path not in public:
            try:
                request.state.tenant = server.tenancy.authenticate(
                    request.headers.get("authorization"))
            except APIError as exc:
                return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)
        return await call_next(request)

    @app.get("/health")
    async def health():
        if server.engine.alive:
            return {"status": "ok"}
        return JSONResponse({"status": "unhealthy"}, status_code=503)

    @app.get("/v1/models")
    async def models(request: Request):
        tenant = tenant_of(request)
        names = server.tenancy.allowed_models(tenant)
        data = [{"id": name, "object": "model", "created": config.created, "owned_by": "llmctl",
                 "max_model_len": config.max_model_len, "parent": None} for name in names]
        return {"object": "list", "data": data + lora_cards(server, tenant)}

    register_lora_routes(app, server)

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await server.parse(request, CompletionRequest)
        prompts = await server.off_loop(server.encode_completion_prompts, req)
        cap = server.tenancy.max_tokens_cap(tenant_of(request), req.max_tokens, "max_tokens")
        jobs, params = server.completion_jobs(req, prompts, cap)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await server.run("completion", req, jobs, params, request, include_usage)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await server.off_loop(server.tokenize,
                                     await server.parse(request, tokenize_request_class))

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return server.detokenize(await server.parse(request, DetokenizeRequest))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = await server.parse(request, ChatCompletionRequest)
        tools = server.tool_plan(req)
        ids = await server.off_loop(server.encode_chat, req)
        param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        cap = server.tenancy.max_tokens_cap(tenant_of(request), req.token_limit, param)
        jobs, params = server.chat_jobs(req, ids, cap, tools)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await server.run("chat", req, jobs, params, request, include_usage)

    if config.max_request_bytes is not None:  # outside everything: before any body is read
        app.add_middleware(BodyLimit, limit=config.max_request_bytes)
    return app

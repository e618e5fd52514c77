"""Assemble engine + app + uvicorn from ``llmctl serve`` options.

MODEL is opened by the first model source (:mod:`llmctl.serve.engine.sources`) that claims it:
an engine directory from ``llmctl build-engine`` once :mod:`llmctl.engines` is imported
(it registers itself; the CLI imports it), otherwise a checkpoint on the paged torch
engine. By default it is opened in engine processes (:mod:`llmctl.serve.proc`), so a
crash in the engine ends its requests, not the server; ``engine_process=False`` keeps
the engine in this process (tests that reach into it, debugging).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from llmctl.errors import ConfigError
from llmctl.serve.api.app import create_app
from llmctl.serve.api.handler import RequestHandler, ServerConfig
from llmctl.serve.engine.async_engine import AsyncEngine
from llmctl.serve.launch.pooling import resolve_pooling
from llmctl.serve.launch.startup import (
    ServeSettings,
    default_chat_template_kwargs,
    reasoning_parser,
)
from llmctl.serve.openai.frontend import Frontend
from llmctl.serve.openai.models import ServedModel, vocab_and_grammars

log = logging.getLogger("llmctl.serve")


@dataclass
class ServeOptions:
    """``llmctl serve``'s settings for the built-in engine, with what
    :func:`llmctl.serve.launch.startup.serve` resolved from them before the load."""

    settings: ServeSettings
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # EngineConfig's keywords
    supervision: Any = None  # llmctl.serve.proc.engine.Supervision; None: its defaults
    auto_tool_parser: str | None = None  # tool_choice "auto" (llmctl.serve.openai.tools.parsers)
    # --max-request-bytes in bytes; None: sized from the context (limits.py's formula)
    max_request_bytes: int | None = None

    @property
    def model(self) -> str:
        return self.settings.model


def _build_engine(opts: ServeOptions) -> tuple[Any, str, tuple[str, ...]]:
    """The engine for MODEL, the name /v1/models shows, and aliases clients may send."""
    settings = opts.settings
    if settings.engine_process:
        from llmctl.serve.proc.engine import ProcessEngine, Supervision

        engine = ProcessEngine(opts.model, opts.engine_kwargs, opts.supervision or Supervision(),
                               log_level=settings.log_level).start()
        name, aliases = engine.name, engine.aliases
    else:
        from llmctl.serve.engine.sources import open_model

        opened = open_model(opts.model, opts.engine_kwargs)
        engine, name, aliases = opened.engine, opened.name, opened.aliases
    if settings.served_model_name:
        return engine, settings.served_model_name, ()
    return engine, name, aliases


def build_server(opts: ServeOptions) -> tuple[RequestHandler, AsyncEngine]:
    from llmctl.serve.api.tenancy.keys import TenantTable

    settings = opts.settings
    # read before the model loads: a bad file fails in a second, not after the load
    tenants = TenantTable.load(settings.auth_file) if settings.auth_file else None
    tracing = None
    if settings.otlp_traces_endpoint:  # before the model loads: a missing package fails fast
        from llmctl.serve.api.tracing import setup_tracing

        tracing = setup_tracing(settings.otlp_traces_endpoint)
        log.info("tracing: a span per request to %s", tracing.url)
    engine, name, aliases = _build_engine(opts)
    try:
        return _assemble(opts, engine, name, aliases, tenants, tracing)
    except BaseException:
        # engine processes run from here on: whatever fails next (a reasoning parser
        # refusing the tokenizer, a LoRA name clash) must end them, or `serve` hangs
        # after printing its error
        if hasattr(engine, "close"):
            engine.close()
        raise


def _assemble(opts: ServeOptions, engine, name: str, aliases, tenants, tracing
              ) -> tuple[RequestHandler, AsyncEngine]:
    from llmctl.serve.api.limits import default_max_request_bytes

    settings = opts.settings
    vocab_size, grammars = vocab_and_grammars(engine)
    model = ServedModel(model_name=name, max_model_len=engine.max_model_len,
                        vocab_size=vocab_size, extra_model_names=aliases,
                        hidden_size=getattr(engine.spec, "hidden_size", None))
    config = ServerConfig(model=model, settings=settings, tenants=tenants, peaks=_peaks(),
                          max_request_bytes=opts.max_request_bytes or default_max_request_bytes(
                              engine.max_model_len, settings.max_queue))
    clash = set(getattr(engine, "lora_names", tuple)()) & {name, *aliases}
    if clash:  # a request naming it could not say which one it means
        raise ConfigError(f"LoRA adapter {min(clash)!r} has the base model's name",
                          "give the adapter another name")
    async_engine = AsyncEngine(engine, max_queue=settings.max_queue,
                               request_timeout=settings.request_timeout)
    frontend = Frontend(engine.tokenizer, model, grammars, async_engine.lora_names,
                        auto_tool_parser=opts.auto_tool_parser,
                        allow_special_tokens_in_content=settings.allow_special_tokens_in_content,
                        reasoning_parser=reasoning_parser(settings),
                        default_chat_template_kwargs=default_chat_template_kwargs(settings),
                        pooling=resolve_pooling(settings.pooling, _model_dir(engine)),
                        embed_normalize=settings.embed_normalize,
                        responses_store_size=settings.responses_store_size)
    return RequestHandler(async_engine, frontend, config, tracing), async_engine


def _model_dir(engine):
    """The served model's directory: its target's (in process) or the engine processes'."""
    target = getattr(engine, "target", None)
    return getattr(target, "path", None) if target is not None else getattr(
        engine, "model_dir", None)


def _peaks():
    """The peaks /metrics' MFU/MBU gauges divide by: this GPU from the datasheet table,
    else this CPU's cached ``llmctl hw probe`` (never probed implicitly: it takes time)."""
    from llmctl.perf.hardware import resolve_peaks

    peaks = resolve_peaks()
    if peaks is None:
        log.info("no MFU/MBU gauges: hardware peaks unknown (run `llmctl hw probe`)")
    else:
        log.info("MFU/MBU gauges against %s", peaks.source)
    return peaks


def _shutdown(server: RequestHandler, engine: AsyncEngine) -> None:
    engine.shutdown()
    if server.tracing is not None:  # the last spans leave before the process exits
        server.tracing.shutdown()


def run_server(opts: ServeOptions, ready=None) -> int:
    from llmctl.serve.launch.uvicorn_server import serve_app

    server, engine = build_server(opts)
    engine.start()
    if ready is not None:
        ready(server, engine.stats())
    app = create_app(server, on_shutdown=lambda: _shutdown(server, engine))
    # SIGHUP reloads the key file; without one it keeps its default meaning (hang up)
    on_reload = server.tenancy.reload if opts.settings.auth_file else None
    settings = opts.settings
    return serve_app(app, engine, host=settings.host, port=settings.port,
                     grace_period=settings.grace_period, log_level=settings.log_level,
                     on_reload=on_reload)

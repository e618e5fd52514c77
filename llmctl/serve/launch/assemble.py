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
from llmctl.serve.api.app import Server, ServerConfig, create_app
from llmctl.serve.engine.async_engine import AsyncEngine

log = logging.getLogger("llmctl.serve")


@dataclass
class ServeOptions:
    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    auth_file: str | None = None  # API keys -> tenants and limits (llmctl.serve.api.tenancy.keys)
    max_queue: int | None = 256
    request_timeout: float | None = None
    grace_period: float = 10.0
    log_level: str = "info"
    otlp_traces_endpoint: str | None = None  # OTLP/HTTP collector for request spans; None: off
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    engine_process: bool = True  # the engine in supervised processes (llmctl.serve.proc)
    supervision: Any = None  # llmctl.serve.proc.engine.Supervision; None: its defaults
    auto_tool_parser: str | None = None  # tool_choice "auto" (llmctl.serve.api.tools.parsers)
    lora_runtime_updates: bool = False  # POST /v1/(un)load_lora_adapter (llmctl.serve.api.loras)
    # bodies above this get 413 unread; None: sized from the context (limits.py's formula)
    max_request_bytes: int | None = None
    metrics_public: bool = False  # with keys: /metrics without one
    allow_special_tokens_in_content: bool = False  # chat: special-token text in messages


def _build_engine(opts: ServeOptions) -> tuple[Any, str, tuple[str, ...]]:
    """The engine for MODEL, the name /v1/models shows, and aliases clients may send."""
    if opts.engine_process:
        from llmctl.serve.proc.engine import ProcessEngine, Supervision

        engine = ProcessEngine(opts.model, opts.engine_kwargs, opts.supervision or Supervision(),
                               log_level=opts.log_level).start()
        name, aliases = engine.name, engine.aliases
    else:
        from llmctl.serve.engine.sources import open_model

        opened = open_model(opts.model, opts.engine_kwargs)
        engine, name, aliases = opened.engine, opened.name, opened.aliases
    if opts.served_model_name:
        return engine, opts.served_model_name, ()
    return engine, name, aliases


def build_server(opts: ServeOptions) -> tuple[Server, AsyncEngine]:
    from llmctl.serve.api.limits import default_max_request_bytes
    from llmctl.serve.api.tenancy.keys import TenantTable

    # read before the model loads: a bad file fails in a second, not after the load
    tenants = TenantTable.load(opts.auth_file) if opts.auth_file else None
    tracing = None
    if opts.otlp_traces_endpoint:  # before the model loads: a missing package fails fast
        from llmctl.serve.api.tracing import setup_tracing

        tracing = setup_tracing(opts.otlp_traces_endpoint)
        log.info("tracing: a span per request to %s", tracing.url)
    engine, name, aliases = _build_engine(opts)
    tokenizer = engine.tokenizer
    vocab_size, grammars = vocab_and_grammars(engine)
    config = ServerConfig(model_name=name, max_model_len=engine.max_model_len,
                          vocab_size=vocab_size, api_key=opts.api_key, tenants=tenants,
                          auth_file=opts.auth_file,
                          request_timeout=opts.request_timeout, extra_model_names=aliases,
                          peaks=_peaks(), auto_tool_parser=opts.auto_tool_parser,
                          lora_runtime_updates=opts.lora_runtime_updates,
                          max_request_bytes=opts.max_request_bytes
                          or default_max_request_bytes(engine.max_model_len, opts.max_queue),
                          metrics_public=opts.metrics_public,
                          allow_special_tokens_in_content=opts.allow_special_tokens_in_content)
    clash = set(getattr(engine, "lora_names", tuple)()) & {name, *aliases}
    if clash:  # a request naming it could not say which one it means
        if hasattr(engine, "close"):  # engine processes
            engine.close()
        raise ConfigError(f"LoRA adapter {sorted(clash)[0]!r} has the base model's name",
                          "give the adapter another name")
    async_engine = AsyncEngine(engine, max_queue=opts.max_queue,
                               request_timeout=opts.request_timeout)
    return Server(async_engine, tokenizer, config, grammars, tracing), async_engine


def vocab_and_grammars(engine) -> tuple[int, Any]:
    """The vocabulary token ids are checked against, and the structured-output grammar
    factory (None when llguidance is missing: response_format is then refused)."""
    tokenizer = engine.tokenizer
    # The embedding may be padded beyond the tokenizer; token ids are checked against it.
    vocab_size = max(len(tokenizer), engine.spec.vocab_size)
    grammars = None
    try:
        from llmctl.serve.sample.grammar import GrammarFactory

        grammars = GrammarFactory(tokenizer, vocab_size)
    except Exception as exc:  # noqa: BLE001 - structured output is optional
        log.warning("response_format disabled: %s", exc)
    return vocab_size, grammars


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


def _shutdown(server: Server, engine: AsyncEngine) -> None:
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
    on_reload = server.tenancy.reload if opts.auth_file else None
    return serve_app(app, engine, host=opts.host, port=opts.port,
                     grace_period=opts.grace_period, log_level=opts.log_level,
                     on_reload=on_reload)

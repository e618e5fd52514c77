"""Assemble engine + app + uvicorn from ``llmctl serve`` options.

MODEL is a checkpoint (the paged torch engine) or an engine directory from
``llmctl build-engine`` (ONNX / torch-compile): then the same scheduler and HTTP API
drive the directory's runtime (:mod:`llmctl.engines.serve_engine`), after its manifest
has been checked against this machine.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from llmctl.serve.api.app import Server, ServerConfig, create_app
from llmctl.serve.api.async_engine import AsyncEngine

log = logging.getLogger("llmctl.serve")


@dataclass
class ServeOptions:
    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    max_queue: int | None = 256
    request_timeout: float | None = None
    grace_period: float = 10.0
    log_level: str = "info"
    engine_kwargs: dict[str, Any] = field(default_factory=dict)


def _build_engine(opts: ServeOptions) -> tuple[Any, str, tuple[str, ...]]:
    """The engine for MODEL, the name /v1/models shows, and aliases clients may send."""
    from llmctl.engines.manifest import is_engine_dir

    if not is_engine_dir(opts.model):
        from llmctl.serve.llm_engine import LLMEngine

        engine = LLMEngine.from_args(opts.model, **opts.engine_kwargs)
        return engine, opts.served_model_name or opts.model, ()
    from pathlib import Path

    from llmctl.engines.serve_engine import open_serving_engine

    engine = open_serving_engine(opts.model, **opts.engine_kwargs)
    log.info("%s", engine.describe())
    if opts.served_model_name:
        return engine, opts.served_model_name, ()
    # the directory's name says what was built (e.g. smollm2-onnx-int4); the path as
    # typed is accepted too, as it is for a checkpoint
    name = Path(opts.model).resolve().name
    return engine, name, (opts.model,) if opts.model != name else ()


def build_server(opts: ServeOptions) -> tuple[Server, AsyncEngine]:
    engine, name, aliases = _build_engine(opts)
    tokenizer = engine.tokenizer
    # The embedding may be padded beyond the tokenizer; token ids are checked against it.
    vocab_size = max(len(tokenizer), engine.spec.vocab_size)
    grammars = None
    try:
        from llmctl.serve.api.grammar import GrammarFactory

        grammars = GrammarFactory(tokenizer, vocab_size)
    except Exception as exc:  # noqa: BLE001 - structured output is optional
        log.warning("response_format disabled: %s", exc)
    config = ServerConfig(model_name=name, max_model_len=engine.max_model_len,
                          vocab_size=vocab_size, api_key=opts.api_key,
                          request_timeout=opts.request_timeout, extra_model_names=aliases)
    async_engine = AsyncEngine(engine, max_queue=opts.max_queue)
    return Server(async_engine, tokenizer, config, grammars), async_engine


def run_server(opts: ServeOptions, ready=None) -> int:
    from llmctl.serve.api.server import serve_app

    server, engine = build_server(opts)
    engine.start()
    if ready is not None:
        ready(server, engine.stats())
    app = create_app(server, on_shutdown=engine.shutdown)
    return serve_app(app, engine, host=opts.host, port=opts.port,
                     grace_period=opts.grace_period, log_level=opts.log_level)

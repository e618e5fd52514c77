"""From ``llmctl serve`` settings to a running server.

1. Check the combination: a known engine; an engine directory (from ``llmctl
   build-engine``) runs only on the built-in scheduler, without a draft model; one of
   ``--api-key`` and ``--auth-file``, the latter readable and valid.
2. Hand-off engines (vLLM, TensorRT-LLM) get their own command line, logged with
   secrets redacted; options they cannot honour are refused, never dropped.
3. The built-in engine gets its configuration, with ``--dtype auto`` resolved once
   (:mod:`llmctl.utils.device`) and the choice logged. An engine directory receives only
   the settings given on the command line: defaults are not requests to warn about.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llmctl.errors import UsageError

log = logging.getLogger("llmctl.serve")

ENGINES = ("llmctl", "vllm", "trtllm")


@dataclass
class ServeSettings:
    """What ``llmctl serve`` was asked for (the command line's options, typed): the one
    settings object from the CLI down to the HTTP layer (:class:`~llmctl.serve.launch.
    assemble.ServeOptions` adds what is resolved from it before the load,
    :class:`~llmctl.serve.api.handler.ServerConfig` holds it for the request handler)."""

    model: str
    engine: str = "llmctl"
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    auth_file: str | None = None
    engine_python: str | None = None
    tensor_parallel_size: int = 1
    max_queue: int = 256
    request_timeout: float | None = None
    grace_period: float = 10.0
    log_level: str = "info"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    kv_cache_memory: str = "2GiB"
    block_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    prefix_caching: bool = True
    chunked_prefill: bool = True
    speculative: str | None = None
    draft_model: str | None = None
    num_speculative_tokens: int = 4
    threads: int | None = None
    lm_head: str = "auto"
    gguf_weights: str = "auto"
    bf16_gemm: str = "auto"
    otlp_traces_endpoint: str | None = None
    scheduling_policy: str = "fcfs"
    aging_seconds: float = 30.0
    engine_process: bool = True
    replicas: int = 1
    engine_step_timeout: float = 60.0
    max_rss: str | None = None
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    engine_nice: int = 10
    lora: tuple[str, ...] = ()  # NAME=PATH each
    max_loras: int = 4
    max_lora_rank: int = 64
    enable_lora_runtime_updates: bool = False
    max_request_bytes: str | None = None  # a size ("16MiB", "1000000"); None: from the context
    metrics_public: bool = False
    allow_special_tokens_in_content: bool = False
    reasoning_parser: str | None = None  # a REASONING_PARSERS name (vLLM's flag and names)
    default_chat_template_kwargs: str | None = None  # a JSON object (vLLM's flag)
    pooling: str | None = None  # /v1/embeddings' pooling; None: the model's own, else last
    embed_normalize: bool = True  # L2-normalise embeddings (--no-embed-normalize: off)
    responses_store_size: int = 256  # /v1/responses kept for previous_response_id; 0: none
    # option names (as fields above) the user gave on the command line or in the environment
    given: frozenset[str] = field(default_factory=frozenset)


def check(settings: ServeSettings) -> bool:
    """Refuse impossible combinations; True when MODEL is an engine directory."""
    from llmctl.serve.engine.sources import CheckpointSource, source_for

    engine, model = settings.engine, settings.model
    if engine not in ENGINES:
        raise UsageError(f"unknown engine {engine!r}", f"choose one of: {', '.join(ENGINES)}")
    if settings.api_key and settings.auth_file:
        raise UsageError("--api-key (or $LLMCTL_API_KEY) and --auth-file cannot be combined",
                         "list that key in the auth file (key_sha256: printf %s KEY | "
                         "sha256sum) and drop --api-key, or drop --auth-file")
    if settings.auth_file and engine == "llmctl":  # hand-offs refuse the flag itself
        from llmctl.serve.api.tenancy.keys import TenantTable

        TenantTable.load(settings.auth_file)  # a bad file fails now, not after the load
    # a MODEL that a registered source other than plain checkpoints claims (an engine
    # directory from `llmctl build-engine`) runs only on the built-in engine
    engine_dir = not isinstance(source_for(model), CheckpointSource)
    if engine_dir and engine != "llmctl":
        raise UsageError(f"{model} is an engine directory; --engine {engine} serves "
                         "checkpoints", "serve the engine directory with the built-in "
                         "engine (no --engine), or pass its source checkpoint")
    if engine_dir and settings.kv_cache_dtype != "auto":
        raise UsageError(f"{model} is an engine directory: --kv-cache-dtype does not apply "
                         "(its runtime keeps its own per-sequence cache)",
                         "drop --kv-cache-dtype, or serve the source checkpoint with it")
    if engine_dir and settings.draft_model:
        raise UsageError(f"{model} is an engine directory: a draft model cannot run with it "
                         "(draft models need the paged torch runner)",
                         "use --speculative ngram, or serve the source checkpoint")
    if engine_dir and settings.lora:
        raise UsageError(f"{model} is an engine directory: LoRA adapters run on the paged "
                         "torch runner only", "serve the source checkpoint with --lora")
    if engine == "llmctl":
        supervision(settings)  # --replicas / --max-rss mistakes before anything loads
        loras(settings)  # a malformed --lora, a missing adapter or too high a rank
    auto_tool_parser(settings)
    reasoning_parser(settings)
    default_chat_template_kwargs(settings)
    max_request_bytes(settings)
    if settings.otlp_traces_endpoint and engine == "llmctl":
        from llmctl.serve.api.tracing import otlp_traces_url

        otlp_traces_url(settings.otlp_traces_endpoint)  # a usage error before anything loads
    return engine_dir


def loras(settings: ServeSettings) -> dict[str, str]:
    """``--lora NAME=PATH`` options as EngineConfig's ``loras``, each adapter's directory
    and config checked (not its tensors: the engine reads those at load)."""
    from pathlib import Path

    from llmctl.serve.lora.adapter import AdapterConfig, LoRAError, lora_spec

    out: dict[str, str] = {}
    for value in settings.lora:
        name, path = lora_spec(value)
        if name in out:
            raise LoRAError(f"--lora {name} is given twice", "give each adapter its own name")
        if name == settings.served_model_name or name == settings.model:
            raise LoRAError(f"--lora {name} has the base model's name",
                            "give the adapter another name")
        where = Path(path).expanduser()
        if not where.is_dir():
            raise LoRAError(f"--lora {value}: {path} is not a directory",
                            "pass the directory PEFT's save_pretrained wrote")
        rank = AdapterConfig.read(where).rank
        if rank > settings.max_lora_rank:
            raise LoRAError(f"--lora {name} has rank {rank}, above --max-lora-rank "
                            f"{settings.max_lora_rank}", f"pass --max-lora-rank {rank}")
        out[name] = path
    return out


def max_request_bytes(settings: ServeSettings) -> int | None:
    """``--max-request-bytes`` in bytes; None: the default sized from the context length
    (:func:`llmctl.serve.api.limits.default_max_request_bytes`)."""
    from llmctl.utils.sizes import parse_memory

    value = settings.max_request_bytes
    if value is None:
        return None
    kind, size = parse_memory(value)
    if kind != "bytes" or size < 1024:
        raise UsageError(f"--max-request-bytes {value} is too small for any request",
                         "give a size of at least 1KiB, e.g. --max-request-bytes 16MiB")
    return int(size)


def auto_tool_parser(settings: ServeSettings) -> str | None:
    """The parser for tool_choice "auto", or None (vLLM's flags, and its rule: auto tool
    choice needs a parser; a parser alone leaves "auto" off)."""
    from llmctl.serve.openai.tools.parsers import AUTO_PARSERS

    name = settings.tool_call_parser
    if name is not None and name not in AUTO_PARSERS:
        raise UsageError(f"unknown --tool-call-parser {name!r}",
                         f"choose one of: {', '.join(AUTO_PARSERS)}")
    needed = getattr(AUTO_PARSERS.get(name), "needs_reasoning_parser", None)
    if needed and settings.reasoning_parser not in needed:
        raise UsageError(f"--tool-call-parser {name} reads the calls that --reasoning-parser "
                         f"{needed[0]} passes on; without it no call is ever found",
                         f"add --reasoning-parser {needed[0]}")
    if settings.enable_auto_tool_choice and name is None:
        raise UsageError("--enable-auto-tool-choice needs --tool-call-parser",
                         f"add --tool-call-parser with one of: {', '.join(AUTO_PARSERS)}")
    return name if settings.enable_auto_tool_choice else None


def reasoning_parser(settings: ServeSettings) -> str | None:
    """``--reasoning-parser``, checked against the parsers there are."""
    from llmctl.serve.openai.reasoning.parsers import REASONING_PARSERS

    name = settings.reasoning_parser
    if name is not None and name not in REASONING_PARSERS:
        raise UsageError(f"unknown --reasoning-parser {name!r}; choose one of: "
                         f"{', '.join(REASONING_PARSERS)}", "see `llmctl serve -h`")
    return name


def default_chat_template_kwargs(settings: ServeSettings) -> dict[str, Any]:
    """``--default-chat-template-kwargs`` as a dict (a JSON object, or a usage error)."""
    import json

    text = settings.default_chat_template_kwargs
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"--default-chat-template-kwargs is not valid JSON: {exc}",
                         """give a JSON object, e.g. '{"enable_thinking": false}'""") from None
    if not isinstance(value, dict):
        raise UsageError("--default-chat-template-kwargs must be a JSON object, not "
                         f"{type(value).__name__}",
                         """give a JSON object, e.g. '{"enable_thinking": false}'""")
    return value


def supervision(settings: ServeSettings):
    """How the engine processes are run (:class:`llmctl.serve.proc.engine.Supervision`)."""
    from llmctl.serve.proc.engine import Supervision, split_cpus, usable_cpus
    from llmctl.utils.sizes import parse_memory

    if not settings.engine_process and (settings.replicas > 1 or settings.max_rss
                                        or "engine_nice" in settings.given):
        raise UsageError("--replicas, --max-rss and --engine-nice need engine processes "
                         "(not with --no-engine-process)",
                         "drop --no-engine-process")
    max_rss = None
    if settings.max_rss:
        kind, size = parse_memory(settings.max_rss)
        if kind != "bytes":
            raise UsageError(f"--max-rss {settings.max_rss} is not a size",
                             "give bytes with a unit, e.g. --max-rss 8GiB")
        max_rss = int(size)
    split_cpus(settings.replicas, usable_cpus(), settings.threads)  # enough CPUs for them
    return Supervision(replicas=settings.replicas, step_timeout=settings.engine_step_timeout,
                       max_rss=max_rss, nice=settings.engine_nice)


def handoff_command(settings: ServeSettings) -> list[str]:
    """The hand-off engine's own command line for these settings."""
    from llmctl.models.resolve import resolve_model
    from llmctl.serve.handoff.engines import (
        HANDOFF_ENGINES,
        HandoffOptions,
        kv_scale_note,
        refuse_unsupported,
    )
    from llmctl.utils.device import canonical_dtype

    given = {"--" + name.replace("_", "-"): getattr(settings, name, None)
             for name in settings.given}
    if settings.api_key:  # from the flag or $LLMCTL_API_KEY
        given["--api-key"] = settings.api_key
    refuse_unsupported(settings.engine, given)
    resolved = resolve_model(settings.model)
    opts = HandoffOptions(
        model_path=resolved.path, served_name=settings.served_model_name or settings.model,
        host=settings.host, port=settings.port, api_key=settings.api_key,
        max_model_len=settings.max_model_len, dtype=canonical_dtype(settings.dtype),
        python=settings.engine_python, tensor_parallel_size=settings.tensor_parallel_size,
        otlp_traces_endpoint=settings.otlp_traces_endpoint,
        enable_auto_tool_choice=settings.enable_auto_tool_choice,
        tool_call_parser=settings.tool_call_parser,
        reasoning_parser=settings.reasoning_parser,
        default_chat_template_kwargs=settings.default_chat_template_kwargs,
        kv_cache_dtype=settings.kv_cache_dtype if "kv_cache_dtype" in settings.given else None)
    cmd = HANDOFF_ENGINES[settings.engine](opts)
    if note := kv_scale_note(resolved.path, opts.kv_cache_dtype):
        log.warning("%s", note)
    return cmd


def engine_kwargs(settings: ServeSettings, engine_dir: bool) -> dict[str, Any]:
    """EngineConfig keywords; dtype auto resolved here (checkpoints only) and logged."""
    kwargs: dict[str, Any] = {
        "dtype": settings.dtype, "kv_cache_dtype": settings.kv_cache_dtype,
        "kv_cache_memory": settings.kv_cache_memory,
        "block_size": settings.block_size, "max_model_len": settings.max_model_len,
        "max_num_seqs": settings.max_num_seqs,
        "max_num_batched_tokens": settings.max_num_batched_tokens,
        "enable_prefix_caching": settings.prefix_caching,
        "enable_chunked_prefill": settings.chunked_prefill, "num_threads": settings.threads,
        "lm_head": settings.lm_head, "gguf_weights": settings.gguf_weights,
        "bf16_gemm": settings.bf16_gemm, "scheduling_policy": settings.scheduling_policy,
        "aging_seconds": settings.aging_seconds, "loras": loras(settings),
        "max_loras": settings.max_loras, "max_lora_rank": settings.max_lora_rank}
    if engine_dir:  # what the user did not set is not a request to warn about
        for key, name in (("enable_prefix_caching", "prefix_caching"), ("dtype", "dtype"),
                          ("kv_cache_dtype", "kv_cache_dtype"),
                          ("lm_head", "lm_head"), ("gguf_weights", "gguf_weights"),
                          ("bf16_gemm", "bf16_gemm")):
            if name not in settings.given:
                kwargs.pop(key)
    else:
        from llmctl.models.resolve import checkpoint_dtype
        from llmctl.utils.device import default_device, resolve_dtype

        choice = resolve_dtype(settings.dtype, device=default_device(),
                               model_dtype=lambda: checkpoint_dtype(settings.model))
        log.info("%s", choice.describe())
        kwargs["dtype"] = choice.dtype
    if settings.speculative:
        kwargs["speculative"] = {"method": settings.speculative,
                                 "draft_model": settings.draft_model,
                                 "num_speculative_tokens": settings.num_speculative_tokens}
    return kwargs


def serve(settings: ServeSettings, say: Callable[[str], None] = log.info) -> int:
    """Run the server (or the hand-off engine) in the foreground; its exit code. ``say``
    shows the hand-off command (whatever the log level)."""
    engine_dir = check(settings)
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(levelname)s %(name)s: %(message)s")
    if settings.engine != "llmctl":
        from llmctl.serve.handoff.engines import run_handoff
        from llmctl.utils.cmdline import shown

        cmd = handoff_command(settings)
        say(f"starting: {shown(cmd)}")
        return run_handoff(cmd)
    from llmctl.serve.engine.config import EngineConfig
    from llmctl.serve.launch.assemble import ServeOptions, run_server

    if settings.tool_call_parser and not settings.enable_auto_tool_choice:
        log.warning("--tool-call-parser %s without --enable-auto-tool-choice: tool_choice "
                    '"auto" stays off', settings.tool_call_parser)
    kwargs = engine_kwargs(settings, engine_dir)
    # Checked before anything loads; a pydantic error names the field, which the CLI
    # reports as the option that set it (exit 2).
    EngineConfig(model=settings.model, **kwargs)
    opts = ServeOptions(settings, engine_kwargs=kwargs, supervision=supervision(settings),
                        auto_tool_parser=auto_tool_parser(settings),
                        max_request_bytes=max_request_bytes(settings))
    return run_server(opts)

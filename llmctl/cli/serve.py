"""``llmctl serve``: the built-in engine behind an OpenAI-compatible HTTP API, or a
hand-off to vLLM / TensorRT-LLM for scale beyond one box.

MODEL may also be an engine directory from ``llmctl build-engine`` (ONNX or
torch-compile): the built-in scheduler and API then drive its runtime (see
:mod:`llmctl.engines.serve_engine`)."""

from __future__ import annotations

from typing import Annotated

import typer

from llmctl.cli.errors import guarded
from llmctl.cli.options import DtypeOpt

ENGINES = ("llmctl", "vllm", "trtllm")

ServeModelArg = Annotated[
    str,
    typer.Argument(help="HF checkpoint dir, .gguf file, hub id (org/name), 'smollm2-135m', or "
                        "an engine directory from `llmctl build-engine` (onnx / torch-compile: "
                        "its runtime runs under llmctl's scheduler; prefix caching off, "
                        "--dtype ignored, no --draft-model).", show_default=False),
]


def register(app: typer.Typer) -> None:
    @app.command()
    @guarded
    def serve(
        ctx: typer.Context,
        model: ServeModelArg,
        host: str = typer.Option("127.0.0.1", "--host"),
        port: int = typer.Option(8000, "--port", min=0, max=65535),
        served_model_name: str = typer.Option(None, "--served-model-name",
                                              help="Name clients send as `model`."),
        engine: str = typer.Option("llmctl", "--engine",
                                   help="llmctl (built-in) | vllm | trtllm (hand-off)."),
        engine_python: str = typer.Option(None, "--engine-python",
                                          help="Python of the venv holding vllm/trtllm."),
        tensor_parallel_size: int = typer.Option(1, "--tensor-parallel-size", min=1,
                                                 help="Hand-off engines only."),
        api_key: str = typer.Option(None, "--api-key", envvar="LLMCTL_API_KEY",
                                    help="Require 'Authorization: Bearer KEY' on /v1/*."),
        max_queue: int = typer.Option(256, "--max-queue", min=1,
                                      help="Waiting requests before 429 + Retry-After."),
        request_timeout: float = typer.Option(None, "--request-timeout", min=0.001,
                                              help="Seconds before a request gets 408."),
        grace_period: float = typer.Option(10.0, "--grace-period", min=0.0,
                                           help="Seconds in-flight requests get on SIGTERM."),
        dtype: DtypeOpt = "float32",
        kv_cache_memory: str = typer.Option("2GiB", "--kv-cache-memory",
                                            help="KV budget: '512MiB' or a fraction of free RAM."),
        block_size: int = typer.Option(16, "--block-size", min=1),
        max_model_len: int = typer.Option(None, "--max-model-len", min=1),
        max_num_seqs: int = typer.Option(64, "--max-num-seqs", min=1),
        max_num_batched_tokens: int = typer.Option(512, "--max-num-batched-tokens", min=1),
        prefix_caching: bool = typer.Option(True, "--prefix-caching/--no-prefix-caching"),
        chunked_prefill: bool = typer.Option(True, "--chunked-prefill/--no-chunked-prefill"),
        speculative: str = typer.Option(None, "--speculative",
                                        help="ngram | draft (with --draft-model)."),
        draft_model: str = typer.Option(None, "--draft-model"),
        num_speculative_tokens: int = typer.Option(4, "--num-speculative-tokens", min=1),
        threads: int = typer.Option(None, "--threads", min=1, help="torch threads (engine dirs: runtime threads)."),
        log_level: str = typer.Option("info", "--log-level"),
    ) -> None:
        """Serve a model or a built engine directory over an OpenAI-compatible HTTP API."""
        from llmctl.engines.manifest import is_engine_dir
        from llmctl.errors import UsageError

        if engine not in ENGINES:
            raise UsageError(f"unknown engine {engine!r}", f"choose one of: {', '.join(ENGINES)}")
        engine_dir = is_engine_dir(model)
        if engine_dir and engine != "llmctl":
            raise UsageError(f"{model} is an engine directory; --engine {engine} serves "
                             "checkpoints", "serve the engine directory with the built-in "
                             "engine (no --engine), or pass its source checkpoint")
        if engine_dir and draft_model:
            raise UsageError(f"{model} is an engine directory: a draft model cannot run with it "
                             "(draft models need the paged torch runner)",
                             "use --speculative ngram, or serve the source checkpoint")
        if engine != "llmctl":
            _handoff(engine, model, host, port, served_model_name, api_key, max_model_len,
                     dtype, tensor_parallel_size, engine_python)
            return
        import logging

        from llmctl.serve.api.launch import ServeOptions, run_server

        logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
        engine_kwargs = dict(
            dtype=_canonical_dtype(dtype), kv_cache_memory=kv_cache_memory,
            block_size=block_size, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=prefix_caching,
            enable_chunked_prefill=chunked_prefill, num_threads=threads)
        if engine_dir:  # what the user did not set is not a request to warn about
            for key, param in (("enable_prefix_caching", "prefix_caching"), ("dtype", "dtype")):
                # by name: typer vendors its own click, with its own ParameterSource enum
                source = ctx.get_parameter_source(param)
                if getattr(source, "name", None) not in ("COMMANDLINE", "ENVIRONMENT"):
                    engine_kwargs.pop(key)
        if speculative:
            engine_kwargs["speculative"] = {"method": speculative, "draft_model": draft_model,
                                            "num_speculative_tokens": num_speculative_tokens}
        opts = ServeOptions(model=model, host=host, port=port,
                            served_model_name=served_model_name, api_key=api_key,
                            max_queue=max_queue, request_timeout=request_timeout,
                            grace_period=grace_period, log_level=log_level,
                            engine_kwargs=engine_kwargs)
        raise typer.Exit(run_server(opts))


def _canonical_dtype(name: str) -> str:
    return {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(name, name)


def _handoff(engine, model, host, port, served_model_name, api_key, max_model_len, dtype,
             tensor_parallel_size, engine_python) -> None:
    from llmctl.models.resolve import resolve_model
    from llmctl.serve.api.handoff import HANDOFF_ENGINES, HandoffOptions, run_handoff

    resolved = resolve_model(model)
    opts = HandoffOptions(model_path=resolved.path, served_name=served_model_name or model,
                          host=host, port=port, api_key=api_key, max_model_len=max_model_len,
                          dtype=_canonical_dtype(dtype), python=engine_python,
                          tensor_parallel_size=tensor_parallel_size)
    cmd = HANDOFF_ENGINES[engine](opts)
    typer.echo("starting: " + " ".join(cmd), err=True)
    raise typer.Exit(run_handoff(cmd))

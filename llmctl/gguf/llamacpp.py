"""llama.cpp through its Python bindings (``llama-cpp-python``, an optional extra).

Two uses: its quantizer (``llama_model_quantize``: K-quants, i-quants, importance
matrices, per-tensor overrides, dry runs) and its runtime (load a GGUF, tokenize,
logits for every position, greedy decoding) to check what llmctl exports.

The quantizer speaks through llama.cpp's log, so a callback collects the log while
it runs: the per-tensor ``[ i/ n]`` lines drive the progress bar and the dry-run plan,
and the "falling back" warnings become the fallback report.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from llmctl.errors import GGUFError, MissingDependencyError

INSTALL = "pip install 'llama-cpp-python>=0.3.36'"
Progress = Callable[[int, int], None]

_TENSOR_LINE = re.compile(
    r"\[\s*(\d+)/\s*(\d+)\]\s+(\S+)\s+-\s+\[([^\]]*)\],\s+type =\s+(\S+),\s+(.*)")
_DRY_TARGET = re.compile(r"->\s+[\d.]+ MiB \((\S+)\)")
_FALLBACK = re.compile(
    r"warning: (\S+)\s+- ncols\s+(\d+) not divisible by\s+(\d+) \(required for type\s+(\S+)\)"
    r".*?-> falling back to\s+(\S+)")
_OVERRIDE = re.compile(r"(\S+)\s+- applying manual override: (\S+) -> (\S+)")


def available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def require():
    """Import the bindings, or say how to install them."""
    # llama.cpp's OpenMP threads spin while waiting; on a busy 2-core machine that took
    # decoding from ~22 ms to ~1.2 s per token (shared/FACTS.md). Sleeping waiters cost
    # little when idle. Read once, when the library loads: set before the import.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        import llama_cpp
    except ImportError:
        raise MissingDependencyError(
            "this needs llama.cpp's Python bindings (llama-cpp-python)",
            f"install them: {INSTALL} (builds llama.cpp from source, ~15 min on 2 cores)",
        ) from None
    return llama_cpp


def version() -> str | None:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as _version

    try:
        return _version("llama-cpp-python")
    except PackageNotFoundError:
        return None


@dataclass
class QuantizeLog:
    """What llama.cpp said while quantizing: per-tensor decisions and fallbacks."""

    lines: list[str] = field(default_factory=list)
    tensors: list[dict] = field(default_factory=list)  # name, shape, from, to
    fallbacks: list[dict] = field(default_factory=list)
    overrides: list[dict] = field(default_factory=list)

    def feed(self, line: str, dry_run: bool) -> tuple[int, int] | None:
        self.lines.append(line)
        if m := _FALLBACK.search(line):
            self.fallbacks.append({"tensor": m[1], "columns": int(m[2]), "block": int(m[3]),
                                   "wanted": m[4].upper(), "used": m[5].upper()})
        elif m := _OVERRIDE.search(line):
            self.overrides.append({"tensor": m[1], "from": m[2].upper(), "to": m[3].upper()})
        elif m := _TENSOR_LINE.search(line):
            rest = m[6]
            if dry_run:
                target = _DRY_TARGET.search(rest)
                to = target[1] if target else m[5]
            else:
                conv = re.search(r"converting to (\S+)", rest)
                to = conv[1] if conv else m[5]
            self.tensors.append({"name": m[3], "shape": m[4].strip(), "from": m[5],
                                 "to": to.upper()})
            return int(m[1]), int(m[2])
        return None


@contextlib.contextmanager
def _captured_log(log: QuantizeLog, dry_run: bool, progress: Progress | None) -> Iterator[None]:
    """Route llama.cpp's log into ``log`` for the duration of the block."""
    llama_cpp = require()
    buffer: list[str] = []

    @llama_cpp.llama_log_callback
    def callback(level: int, text: bytes, user_data) -> None:
        buffer.append(text.decode("utf-8", errors="replace"))
        joined = "".join(buffer)
        if "\n" not in joined:
            return
        *complete, rest = joined.split("\n")
        buffer[:] = [rest]
        for line in complete:
            step = log.feed(line, dry_run)
            if step and progress:
                progress(*step)

    llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
    try:
        yield
    finally:
        if buffer and buffer[0]:
            log.feed(buffer[0], dry_run)
        from llama_cpp import _logger

        llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))


def _ggml_type_id(name: str) -> int:
    import gguf

    return int(gguf.GGMLQuantizationType[name.upper()])


def quantize(src: Path, dst: Path, ftype: int, *,
             imatrix: dict[str, np.ndarray] | None = None,
             overrides: list[tuple[str, str]] = (),
             output_type: str | None = None, token_embd_type: str | None = None,
             pure: bool = False, dry_run: bool = False, threads: int | None = None,
             progress: Progress | None = None) -> QuantizeLog:
    """``llama_model_quantize(src -> dst)``; with ``dry_run`` nothing is written.

    ``imatrix`` maps GGUF tensor names to per-column mean squared activations (what
    llama-quantize derives from an imatrix file); ``overrides`` are (regex, ggml type)
    pairs like ``--tensor-type``.
    """
    llama_cpp = require()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = threads or os.cpu_count() or 1
    params.pure = pure
    params.dry_run = dry_run
    if output_type:
        params.output_tensor_type = _ggml_type_id(output_type)
    if token_embd_type:
        params.token_embedding_type = _ggml_type_id(token_embd_type)

    # Both arrays end with a null-name sentinel; every buffer must stay referenced
    # until the call returns (ctypes does not keep them alive).
    keep: list = []
    if overrides:
        rows = (llama_cpp.llama_model_tensor_override * (len(overrides) + 1))()
        for row, (pattern, type_name) in zip(rows, overrides):
            encoded = pattern.encode()
            keep.append(encoded)
            row.pattern = encoded
            row.type = _ggml_type_id(type_name)
        rows[len(overrides)].pattern = None
        keep.append(rows)
        params.tt_overrides = ctypes.cast(rows, ctypes.POINTER(llama_cpp.llama_model_tensor_override))
    if imatrix:
        entries = (llama_cpp.llama_model_imatrix_data * (len(imatrix) + 1))()
        for entry, (name, values) in zip(entries, imatrix.items()):
            array = np.ascontiguousarray(values, dtype=np.float32)
            encoded = name.encode()
            keep.extend([array, encoded])
            entry.name = encoded
            entry.data = array.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            entry.size = array.size
        entries[len(imatrix)].name = None
        keep.append(entries)
        params.imatrix = ctypes.cast(entries, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))

    log = QuantizeLog()
    with _captured_log(log, dry_run, progress):
        status = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(),
                                                ctypes.byref(params))
    del keep
    if status != 0:
        tail = " | ".join(line.strip() for line in log.lines[-6:] if line.strip())
        raise GGUFError(f"llama.cpp could not quantize {Path(src).name}: {tail or status}",
                        "check the type and overrides; very low-bit i-quants need --imatrix")
    return log


def cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return " amx_int8" in f.read()
    except OSError:
        return False


def extra_buffers_safe() -> bool:
    """Whether llama.cpp may repack weights into its extra CPU buffer types.

    On Intel CPUs with AMX (the Xeon these machines run on), llama-cpp-python 0.3.36
    repacks Q4_0/Q4_1/Q8_0/K-quant weights into AMX buffers and then segfaults in the
    first decode; F32/F16 models are unaffected. Without extra buffers the plain CPU
    kernels run. ``LLMCTL_LLAMA_EXTRA_BUFFERS=1`` forces them back on.
    """
    forced = os.environ.get("LLMCTL_LLAMA_EXTRA_BUFFERS")
    if forced is not None:
        return forced == "1"
    return not cpu_has_amx()


@contextlib.contextmanager
def _model_defaults(use_extra_bufts: bool) -> Iterator[None]:
    """The high-level ``Llama`` takes no ``use_extra_bufts`` argument; it starts from
    ``llama_model_default_params()``, so that is where the flag goes."""
    import llama_cpp.llama_cpp as lib

    original = lib.llama_model_default_params

    def defaults():
        params = original()
        params.use_extra_bufts = use_extra_bufts
        return params

    lib.llama_model_default_params = defaults
    try:
        yield
    finally:
        lib.llama_model_default_params = original


class LlamaCppModel:
    """A GGUF loaded in llama.cpp, for checks: tokenize, logits, greedy decoding."""

    def __init__(self, path: Path, *, n_ctx: int = 512, threads: int | None = None,
                 vocab_only: bool = False, n_batch: int = 512, f32_cache: bool = True) -> None:
        llama_cpp = require()
        # llama.cpp keeps K/V in F16 by default; a check against float32 transformers
        # wants F32 there, or the cache's rounding hides what the file itself does.
        cache = {"type_k": 0, "type_v": 0} if f32_cache else {}
        # One thread unless asked: in a process that also runs torch (every check does),
        # llama.cpp's 2-thread decode measured 7x slower than 1 thread on 2 cores
        # (OpenMP pools contending); small check models gain little from a second thread.
        threads = threads or 1
        try:
            with _model_defaults(extra_buffers_safe()):
                self.llm = llama_cpp.Llama(
                    model_path=str(path), n_ctx=n_ctx, n_batch=min(n_batch, n_ctx),
                    n_threads=threads, n_threads_batch=threads, logits_all=not vocab_only,
                    vocab_only=vocab_only, verbose=False, seed=0, **cache)
        except ValueError as exc:
            raise GGUFError(f"llama.cpp cannot load {path}: {exc}",
                            "re-export the file; run with LLMCTL_DEBUG=1 for llama.cpp's log") \
                from None
        self.n_ctx = n_ctx

    def close(self) -> None:
        self.llm.close()

    def __enter__(self) -> LlamaCppModel:  # noqa: PYI034 (no typing.Self on 3.10)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def tokenize(self, text: str, *, add_bos: bool = False, special: bool = True) -> list[int]:
        return self.llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special)

    def detokenize(self, ids: list[int]) -> str:
        return self.llm.detokenize(ids).decode("utf-8", errors="replace")

    def logits(self, ids: list[int]) -> np.ndarray:
        """Logits at every position of ``ids`` (a fresh context: no cache reuse)."""
        if len(ids) > self.n_ctx:
            raise GGUFError(f"{len(ids)} tokens do not fit the context of {self.n_ctx}",
                            "load the model with a larger n_ctx")
        self.llm.reset()
        self.llm._ctx.kv_cache_clear()
        self.llm.eval(ids)
        return np.array(self.llm.scores[: len(ids)], dtype=np.float32, copy=True)

    def greedy(self, ids: list[int], max_new_tokens: int, stop: int | None = None) -> list[int]:
        """Argmax decoding, one token at a time, as transformers' greedy generate."""
        self.llm.reset()
        self.llm._ctx.kv_cache_clear()
        self.llm.eval(ids)
        out: list[int] = []
        for _ in range(max_new_tokens):
            nxt = int(np.argmax(self.llm.scores[self.llm.n_tokens - 1]))
            out.append(nxt)
            if nxt == stop or self.llm.n_tokens + 1 > self.n_ctx:
                break
            self.llm.eval([nxt])
        return out

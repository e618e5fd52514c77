"""Where to compute and in which float type: decided here, once, for every command.

``--dtype auto`` (the default of ``serve``, ``generate`` and ``bench``):

1. on a GPU, the checkpoint's own dtype (``torch_dtype`` in config.json; float32 when it
   states none), except that bfloat16 becomes float16 on a GPU without bfloat16;
2. on a CPU that computes bfloat16 natively (the ``avx512_bf16`` or ``amx_bf16`` flag),
   bfloat16: about twice float32's decode speed, since decode streams the weights and
   bf16 halves them (SmolLM2-135M batch-1 decode: ~80-95 vs ~40-48 tok/s);
3. anywhere else float32: without native bf16 instructions every element is converted
   on the fly and bf16 is not reliably faster (often slower) than float32.

Quantization's calibration forwards (``--calib-dtype auto``) follow the same rule
without a checkpoint: bfloat16 on a GPU or a CPU with native bf16, float32 elsewhere
(an AVX2-only CPU emulates bf16 matmuls: SmolLM2 W4 RTN took over 11 minutes in bf16 and
217 s in float32 on AMD Zen 3).

An explicit ``--dtype`` is used as given. The choice carries its reason so the
start-up log can say why ("dtype auto -> bfloat16 (CPU has AVX512-BF16)").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from llmctl.errors import UsageError
from llmctl.utils.cpu import cpu_flags
from llmctl.utils.dtypes import DTYPE_ALIASES, FLOAT_DTYPES

# /proc/cpuinfo flag -> how the log names it; the first one present wins.
NATIVE_BF16_FLAGS = {"amx_bf16": "AMX-BF16", "avx512_bf16": "AVX512-BF16"}


@dataclass(frozen=True)
class DtypeChoice:
    requested: str
    dtype: str  # one of FLOAT_DTYPES
    reason: str

    def describe(self) -> str:
        if self.requested == "auto":
            return f"dtype auto -> {self.dtype} ({self.reason})"
        return f"dtype {self.dtype} ({self.reason})"


def canonical_dtype(name: str, option: str = "--dtype") -> str:
    """``bf16`` -> ``bfloat16``; ``auto`` stays; anything else is a usage error."""
    value = DTYPE_ALIASES.get(name, name)
    if value != "auto" and value not in FLOAT_DTYPES:
        raise UsageError(f"invalid value for {option}: {name!r}",
                         f"use one of: auto, {', '.join(FLOAT_DTYPES)} (or bf16, fp16, fp32)")
    return value


def native_bf16(flags: frozenset[str] | None = None) -> str | None:
    """The CPU feature that computes bfloat16 natively, or None."""
    flags = cpu_flags() if flags is None else flags
    for flag, name in NATIVE_BF16_FLAGS.items():
        if flag in flags:
            return name
    if not flags:  # no /proc/cpuinfo (not Linux): ask torch's own probe if it has one
        import torch

        probe = getattr(getattr(torch, "cpu", None), "_is_avx512_bf16_supported", None)
        if probe is not None and probe():
            return "AVX512-BF16"
    return None


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def cuda_bf16_supported() -> bool:
    import torch

    return torch.cuda.is_bf16_supported()


def default_device() -> str:
    """What the engines pick for device "auto"."""
    return "cuda" if cuda_available() else "cpu"


def resolve_device(requested: str | None, option: str = "--device") -> str:
    """``cpu``, ``cuda`` or None (auto); asking for CUDA where there is none is a usage
    error here rather than a driver error deep inside a run."""
    if requested in (None, "auto"):
        return default_device()
    if requested == "cuda" and not cuda_available():
        import torch

        build = "a CPU-only torch build" if torch.version.cuda is None else "no visible GPU"
        raise UsageError(f"{option} cuda: CUDA is not available on this machine "
                         f"(torch {torch.__version__}, {build})",
                         f"pass {option} cpu, or leave {option} unset to use a GPU when "
                         "there is one")
    if requested not in ("cpu", "cuda"):
        raise UsageError(f"invalid value for {option}: {requested!r}", "use cpu or cuda")
    return requested


def resolve_dtype(requested: str = "auto", *, device: str = "cpu",
                  model_dtype: Callable[[], str | None] | None = None,
                  flags: frozenset[str] | None = None) -> DtypeChoice:
    """The float type to compute in; ``model_dtype`` is only called on a GPU."""
    requested = canonical_dtype(requested)
    if requested != "auto":
        return DtypeChoice(requested, requested, "as requested")
    if device == "cuda":
        own = model_dtype() if model_dtype else None
        own = DTYPE_ALIASES.get(own, own) if isinstance(own, str) else None
        if own not in FLOAT_DTYPES:
            return DtypeChoice("auto", "float32", "GPU; the checkpoint states no float dtype")
        if own == "bfloat16" and not cuda_bf16_supported():
            return DtypeChoice("auto", "float16", "bfloat16 checkpoint, GPU without bfloat16")
        return DtypeChoice("auto", own, "GPU: the checkpoint's dtype")
    feature = native_bf16(flags)
    if feature:
        return DtypeChoice("auto", "bfloat16", f"CPU has {feature}")
    return DtypeChoice("auto", "float32", "CPU without native bfloat16")


CALIB_DTYPES = ("auto", "bfloat16", "float32")


def resolve_calib_dtype(requested: str = "auto", *, device: str | None = None,
                        flags: frozenset[str] | None = None) -> DtypeChoice:
    """The dtype of quantization's calibration activations (``--calib-dtype``);
    ``device`` None is the pipeline's own pick (CUDA when there is one)."""
    value = DTYPE_ALIASES.get(requested, requested)
    if value not in CALIB_DTYPES:
        raise UsageError(f"invalid value for --calib-dtype: {requested!r}",
                         f"use one of: {', '.join(CALIB_DTYPES)}")
    if value != "auto":
        return DtypeChoice(value, value, "as requested")
    if (device or default_device()) == "cuda":
        return DtypeChoice("auto", "bfloat16", "GPU")
    feature = native_bf16(flags)
    if feature:
        return DtypeChoice("auto", "bfloat16", f"CPU has {feature}")
    return DtypeChoice("auto", "float32", "CPU without native bfloat16")

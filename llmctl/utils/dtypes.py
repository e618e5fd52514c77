"""Every name an element type goes by, in one table.

torch calls it ``bfloat16``, llmctl's options and perf reports also say ``bf16``, a
safetensors header ``BF16`` and a GGUF file ``BF16``. Every package translates through
:data:`DTYPES` rather than a table of its own. torch is imported only when a torch dtype
is asked for, so the CLI can read the names without it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DType:
    name: str  # torch's attribute name, the spelling llmctl reports
    safetensors: str  # in a safetensors header
    bits: int
    short: str | None = None  # llmctl's short spelling (--dtype bf16, perf peaks, precisions)
    gguf: str | None = None  # the GGUF float type llmctl writes it as


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("float32", "F32", 32, "fp32", "F32"),
        DType("bfloat16", "BF16", 16, "bf16", "BF16"),
        DType("float16", "F16", 16, "fp16", "F16"),
        DType("float64", "F64", 64),
        DType("float8_e4m3fn", "F8_E4M3", 8),
        DType("float8_e5m2", "F8_E5M2", 8),
        DType("int64", "I64", 64),
        DType("int32", "I32", 32),
        DType("int16", "I16", 16),
        DType("int8", "I8", 8),
        DType("uint8", "U8", 8),
        DType("bool", "BOOL", 8),
    )
}
SAFETENSORS: dict[str, DType] = {d.safetensors: d for d in DTYPES.values()}

# The float types llmctl computes in (``--dtype``), and the other spellings it accepts.
FLOAT_DTYPES = ("float32", "bfloat16", "float16")
DTYPE_ALIASES = {**{d.short: d.name for d in DTYPES.values() if d.short},
                 "half": "float16", "float": "float32"}


@functools.cache
def torch_dtype(name: str) -> torch.dtype:
    """``bfloat16`` (or an alias: ``bf16``) -> ``torch.bfloat16``; KeyError if unknown."""
    import torch

    return getattr(torch, DTYPES[DTYPE_ALIASES.get(name, name)].name)


def dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.bfloat16`` (or ``"bf16"``) -> ``"bfloat16"``."""
    name = str(dtype).removeprefix("torch.")
    return DTYPE_ALIASES.get(name, name)


def short_name(dtype: torch.dtype | str) -> str | None:
    """``torch.bfloat16``, ``"bfloat16"`` or ``"bf16"`` -> ``"bf16"``; None for a type with
    no short spelling."""
    row = DTYPES.get(dtype_name(dtype))
    return row.short if row else None


def float_bytes(name: str, default: int = 4) -> int:
    """Bytes per element of a compute float type; ``default`` for any other type."""
    return DTYPES[name].bits // 8 if name in FLOAT_DTYPES else default

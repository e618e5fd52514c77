"""GGUF output types ("file types"): who writes each and what llama.cpp calls it.

A file type (``Q4_K_M``) is a recipe for a mixture of tensor types (``Q4_K``,
``Q6_K``, ...). The ids are llama.cpp's ``enum llama_ftype`` (include/llama.h),
written as ``general.file_type``. ``writer`` says which code produces the file:
``llmctl`` (pure Python, :mod:`llmctl.gguf.quants`) or ``llama.cpp`` (its own
quantizer through the ``llama-cpp-python`` bindings).
"""

from __future__ import annotations

from dataclasses import dataclass

from llmctl.errors import UsageError


@dataclass(frozen=True)
class FileType:
    name: str
    ftype: int  # llama_ftype
    writer: str  # "llmctl" | "llama.cpp"
    tensor_type: str  # the ggml type most 2-D weights get
    needs_imatrix: bool = False  # llama.cpp refuses without one (very low-bit i-quants)
    note: str = ""
    expert_type: str | None = None  # the ggml type of the stacked experts ([E, out, in])


FILE_TYPES: dict[str, FileType] = {
    t.name: t
    for t in (
        FileType("F32", 0, "llmctl", "F32", note="32-bit float"),
        FileType("F16", 1, "llmctl", "F16", note="16-bit float"),
        FileType("BF16", 32, "llmctl", "BF16", note="bfloat16"),
        FileType("Q8_0", 7, "llmctl", "Q8_0", note="8.5 bpw, absmax per 32"),
        FileType("Q4_0", 2, "llmctl", "Q4_0", note="4.5 bpw, absmax per 32"),
        FileType("Q4_1", 3, "llmctl", "Q4_1", note="5.0 bpw, min/max per 32"),
        FileType("Q5_0", 8, "llmctl", "Q5_0", note="5.5 bpw, absmax per 32"),
        FileType("Q5_1", 9, "llmctl", "Q5_1", note="6.0 bpw, min/max per 32"),
        # llama-quantize's MXFP4_MOE: 3-D expert stacks MXFP4, every other matrix Q8_0;
        # gpt-oss's MXFP4 experts come through exactly (llmctl.gguf.quants.MXFP4)
        FileType("MXFP4_MOE", 38, "llmctl", "Q8_0", expert_type="MXFP4",
                 note="experts MXFP4 (4.25 bpw), the rest Q8_0"),
        FileType("Q2_K", 10, "llama.cpp", "Q2_K", note="2-bit K-quant mix"),
        FileType("Q2_K_S", 21, "llama.cpp", "Q2_K"),
        FileType("Q3_K_S", 11, "llama.cpp", "Q3_K"),
        FileType("Q3_K_M", 12, "llama.cpp", "Q3_K", note="3-bit K-quant mix"),
        FileType("Q3_K_L", 13, "llama.cpp", "Q3_K"),
        FileType("Q4_K_S", 14, "llama.cpp", "Q4_K"),
        FileType("Q4_K_M", 15, "llama.cpp", "Q4_K", note="4-bit K-quant mix (the usual pick)"),
        FileType("Q5_K_S", 16, "llama.cpp", "Q5_K"),
        FileType("Q5_K_M", 17, "llama.cpp", "Q5_K", note="5-bit K-quant mix"),
        FileType("Q6_K", 18, "llama.cpp", "Q6_K", note="6.56 bpw K-quant"),
        FileType("IQ2_XXS", 19, "llama.cpp", "IQ2_XXS", needs_imatrix=True),
        FileType("IQ2_XS", 20, "llama.cpp", "IQ2_XS", needs_imatrix=True),
        FileType("IQ2_S", 28, "llama.cpp", "IQ2_XS", needs_imatrix=True),
        FileType("IQ2_M", 29, "llama.cpp", "IQ2_S", needs_imatrix=True),
        FileType("IQ1_S", 24, "llama.cpp", "IQ1_S", needs_imatrix=True),
        FileType("IQ1_M", 31, "llama.cpp", "IQ1_M", needs_imatrix=True),
        FileType("IQ3_XXS", 23, "llama.cpp", "IQ3_XXS"),
        FileType("IQ3_XS", 22, "llama.cpp", "IQ3_S"),
        FileType("IQ3_S", 26, "llama.cpp", "IQ3_S"),
        FileType("IQ3_M", 27, "llama.cpp", "IQ3_S"),
        FileType("IQ4_NL", 25, "llama.cpp", "IQ4_NL"),
        FileType("IQ4_XS", 30, "llama.cpp", "IQ4_XS", note="4.25 bpw non-linear"),
    )
}

# Spellings llama-quantize accepts for the same mixture.
ALIASES = {"Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M", "Q3_K": "Q3_K_M"}

FLOAT_TYPES = ("F32", "F16", "BF16")


def file_type(name: str) -> FileType:
    key = name.upper()
    key = ALIASES.get(key, key)
    if key not in FILE_TYPES:
        raise UsageError(f"unknown GGUF type {name!r}",
                         f"choose one of: {', '.join(FILE_TYPES)}")
    return FILE_TYPES[key]


def tensor_type_names() -> list[str]:
    """ggml tensor type names a per-tensor override may name."""
    import gguf

    return [t.name for t in gguf.GGMLQuantizationType]


def check_tensor_type(name: str) -> str:
    key = name.upper()
    known = tensor_type_names()
    if key not in known:
        raise UsageError(f"unknown ggml tensor type {name!r}",
                         f"tensor types: {', '.join(known)}")
    return key

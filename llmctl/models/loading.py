"""Load a resolved checkpoint into transformers objects."""

from __future__ import annotations

from pathlib import Path

_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16", "auto": "auto"}


def torch_dtype(name: str):
    import torch

    from llmctl.errors import UsageError

    try:
        canonical = _DTYPES[name]
    except KeyError:
        raise UsageError(f"unknown dtype {name!r}", f"use one of: {', '.join(_DTYPES)}") from None
    return canonical if canonical == "auto" else getattr(torch, canonical)


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def load_model(path: Path, dtype: str = "float32"):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype(dtype))
    model.eval()
    return model

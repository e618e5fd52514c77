"""Load a resolved checkpoint into transformers objects."""

from __future__ import annotations

from pathlib import Path

from llmctl.utils.dtypes import DTYPE_ALIASES, FLOAT_DTYPES
from llmctl.utils.dtypes import torch_dtype as _torch_dtype


def torch_dtype(name: str):
    """A compute float type's name or alias -> the torch dtype; ``auto`` stays."""
    from llmctl.errors import UsageError

    if name == "auto":
        return name
    if DTYPE_ALIASES.get(name, name) not in FLOAT_DTYPES:
        raise UsageError(f"unknown dtype {name!r}",
                         f"use one of: {', '.join(FLOAT_DTYPES)}, auto (or bf16, fp16, fp32)")
    return _torch_dtype(name)


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

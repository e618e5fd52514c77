"""Fixtures for the GGUF tests: llama.cpp availability and a K-quant-sized tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest

LLAMA_CPP_MISSING = ("llama-cpp-python is not installed (the 'llamacpp' extra: "
                     "pip install 'llama-cpp-python>=0.3.36'); llama.cpp checks skipped")


@pytest.fixture(scope="session")
def llama_cpp():
    """The bindings, or a visible skip where they are not installed."""
    return pytest.importorskip("llama_cpp", reason=LLAMA_CPP_MISSING)


@pytest.fixture(scope="session")
def tiny_llama_256(tmp_path_factory) -> Path:
    """Rows of 256/512 columns: every K-quant applies without fallback."""
    from tests.tiny import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny256") / "tiny-llama-256", seed=3,
                            hidden_size=256, intermediate_size=512, num_attention_heads=4,
                            num_key_value_heads=2)


@pytest.fixture(scope="session")
def tiny_f16_gguf(tiny_llama, tmp_path_factory) -> Path:
    from llmctl.gguf.writer import export_gguf

    return export_gguf(tiny_llama, tmp_path_factory.mktemp("gguf16") / "tiny-f16.gguf", "F16")


# Strings whose tokenization differs between careless implementations: unicode,
# code, whitespace runs, digits, contractions and ChatML-formatted text.
TOKENIZER_STRINGS = [
    "Hello world",
    " leading space and  double  spaces",
    "tabs\tand\nnewlines\n\n\n  indented",
    "def f(x):\n    return x ** 2  # square\n",
    "numbers 3 33 333 3333 1234567 3.14159 1e-5",
    "I've been 'told he's there, 'RE you sure? We'Ve a'lL",
    "naïve café 東京 привет 🚀🦙 😶\u200d🌫️",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "trailing spaces   ",
    "",
]

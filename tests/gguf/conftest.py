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


# Each family's tiny config (tests/data/families) changed where llama.cpp's graph cannot run
# it as it is (llmctl refuses those exports: tests/gguf/test_families.py): Gemma 1/2 tied
# (their graphs use token_embd as the output), Gemma 2's query_pre_attn_scalar = head_dim
# (llama.cpp derives the scale from the head size), Phi-3 without a sliding window
# (llama.cpp ignores Phi-3's).
LLAMA_CPP_VARIANTS: dict[str, dict] = {
    "gemma": {"tie": True}, "gemma2": {"tie": True, "query_pre_attn_scalar": 16},
    "gemma3": {}, "phi3": {"sliding_window": None}, "granite": {}, "olmo2": {},
}


@pytest.fixture(scope="session")
def gguf_family(tmp_path_factory):
    """``make(name, **overrides)``: a tiny family checkpoint (``tests/data/families``,
    ``LLAMA_CPP_VARIANTS[name]``, then ``overrides``) whose norm weights are random too, so a
    norm mapped to the wrong slot or missing Gemma's +1 changes the logits. Built once."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    from tests.tiny import FAMILY_CONFIGS, build_tiny_llama

    root = tmp_path_factory.mktemp("gguf-families")
    built: dict[str, Path] = {}

    def make(name: str, **overrides) -> Path:
        key = json.dumps([name, overrides], sort_keys=True)
        if key in built:
            return built[key]
        config = json.loads((FAMILY_CONFIGS / f"{name}.json").read_text())
        config.update(LLAMA_CPP_VARIANTS[name], **overrides)
        # not named after the family: llama.cpp gives a model whose name has "phi3" in
        # it Phi-3's token attributes, which needs tokens the tiny vocabulary lacks
        out = build_tiny_llama(root / f"m{len(built)}", layers=config.pop("num_hidden_layers"),
                               **config)
        weights = load_file(str(out / "model.safetensors"))
        gen = torch.Generator().manual_seed(len(built))
        base = 0.0 if name.startswith("gemma") else 1.0  # Gemma stores w - 1
        for k, v in weights.items():
            if v.ndim == 1:
                weights[k] = base + 0.2 * torch.randn(v.shape, generator=gen)
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
        built[key] = out
        return out

    return make

"""Fixtures for the eval tests: a perturbed copy of the tiny model, shared caches."""

from __future__ import annotations

from pathlib import Path

import pytest


def perturb_copy(source: Path, out: Path, noise: float, seed: int = 0) -> Path:
    """``source`` with Gaussian noise of std ``noise`` added to every matrix (a stand-in
    for quantization error that keeps the tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 2:
                param.add_(torch.randn_like(param) * noise)
    model.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(source)).save_pretrained(str(out))
    return out


@pytest.fixture(scope="session")
def tiny_perturbed(tiny_llama, tmp_path_factory) -> Path:
    return perturb_copy(tiny_llama, tmp_path_factory.mktemp("tiny") / "tiny-perturbed", 0.03)


@pytest.fixture(scope="session")
def eval_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("eval-cache")

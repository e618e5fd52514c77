"""Fixtures of the gpu tests: the drafts speculative decoding needs (as tests/serve has)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def gpu_near_draft(tiny_llama, tmp_path_factory) -> Path:
    """tiny_llama with noise on its weights: a draft that agrees often, not always."""
    import torch
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("gpu-near-draft") / "near"
    shutil.copytree(tiny_llama, out)
    weights = load_file(str(out / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    noisy = {k: (v + 0.06 * torch.randn(v.shape, generator=gen) if v.ndim == 2 else v)
             for k, v in weights.items()}
    save_file(noisy, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out

"""Shared helpers for the quantization tests: quantize the tiny model once per recipe."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
# Every shipped compressed-tensors recipe (the GGUF ones belong to llmctl.gguf).
SHIPPED = sorted(p.stem for p in RECIPES.glob("*.yaml") if not p.stem.startswith("gguf"))


def run_quantize(model: Path, recipe: str | Path, out: Path, *, samples: int = 8, seq_len: int = 64,
                 **kwargs) -> dict:
    from llmctl.quant.calibration import CalibrationSpec
    from llmctl.quant.pipeline import PipelineOptions
    from llmctl.quant.run import QuantizeRequest, quantize

    options = PipelineOptions(compute_dtype=torch.float32, chunk_tokens=256)
    request = QuantizeRequest(str(model), str(recipe), out,
                              CalibrationSpec(samples=samples, seq_len=seq_len), options, **kwargs)
    return quantize(request)


@pytest.fixture(scope="session")
def quantized_tiny(tiny_llama, tmp_path_factory):
    """recipe name -> (output dir, report), built lazily and cached for the session."""
    cache: dict[str, tuple[Path, dict]] = {}
    root = tmp_path_factory.mktemp("quantized")

    def get(recipe: str) -> tuple[Path, dict]:
        if recipe not in cache:
            out = root / recipe
            cache[recipe] = (out, run_quantize(tiny_llama, RECIPES / f"{recipe}.yaml", out))
        return cache[recipe]

    return get


def write_recipe(path: Path, text: str) -> Path:
    path.write_text(text)
    return path

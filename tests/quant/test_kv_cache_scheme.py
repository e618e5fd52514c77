"""``kv_cache_scheme`` in a recipe: static FP8 K/V scales calibrated with the weights and
written as compressed-tensors (llm-compressor) stores them, which ``llmctl serve
--kv-cache-dtype fp8`` (and vLLM) read."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from tests.quant.conftest import run_quantize, write_recipe

RECIPE = """
quant_stage:
  quant_modifiers:
    QuantizationModifier:
      scheme: W8A16
      targets: [Linear]
      ignore: [lm_head]
      kv_cache_scheme:
        num_bits: 8
        type: float
        strategy: {strategy}
        dynamic: false
        symmetric: true
"""


def _tensors(out) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in out.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safetensors handle)
                if name.endswith(("k_scale", "v_scale")):
                    tensors[name] = f.get_tensor(name)
    return tensors


@pytest.mark.parametrize("strategy", ["tensor", "attn_head"])
def test_scales_are_what_the_engine_measures_on_the_quantized_model(tiny_llama, tmp_path,
                                                                     strategy):
    """The written scales against the serving engine's own calibration of the output
    checkpoint (its quantized weights, dequantized) on the same calibration windows:
    the same K/V, computed by other code (HF-order RoPE there, interleaved pairs here),
    so equal within float32 noise; per layer, the max over heads."""
    from llmctl.models.loading import load_tokenizer
    from llmctl.quant.calibration import CalibrationSpec, build_calibration
    from llmctl.serve.engine.llm import LLM
    from llmctl.serve.model.kv_scales import calibrate_kv_scales

    out = tmp_path / "out"
    recipe = write_recipe(tmp_path / "r.yaml", RECIPE.format(strategy=strategy))
    run_quantize(tiny_llama, recipe, out)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["kv_cache_scheme"]["strategy"] == strategy
    assert config["kv_cache_scheme"]["type"] == "float" and not config["kv_cache_scheme"]["dynamic"]
    tensors = _tensors(out)
    assert sorted(tensors) == sorted(f"model.layers.{i}.self_attn.{kv}_scale"
                                     for i in range(2) for kv in "kv")
    width = 2 if strategy == "attn_head" else 1
    assert all(t.shape == (width,) and t.dtype == torch.float32 for t in tensors.values())
    written = torch.stack([torch.stack([tensors[f"model.layers.{i}.self_attn.{kv}_scale"]
                                        for kv in "kv"]) for i in range(2)])

    engine = LLM(str(out), quant_backend="dequantize", kv_cache_dtype="fp8",
                 kv_cache_memory="4MiB").engine
    granularity = "head" if strategy == "attn_head" else "layer"
    assert engine.target.kv_scales_source == \
        f"the checkpoint's kv_cache_scheme (per {'head' if width == 2 else 'layer'})"
    torch.testing.assert_close(engine.target.kv_scales, written.expand(-1, -1, 2))
    calib = build_calibration(load_tokenizer(tiny_llama), CalibrationSpec(samples=8, seq_len=64))
    measured = calibrate_kv_scales(engine.target.model, calib.ids, granularity)
    torch.testing.assert_close(written.expand(-1, -1, 2), measured, rtol=1e-4, atol=0)


@pytest.mark.parametrize("field,value", [("dynamic", "true"), ("type", "int"),
                                         ("strategy", "token"), ("num_bits", "4")])
def test_other_kv_cache_schemes_are_refused(tiny_llama, tmp_path, field, value):
    from llmctl.errors import ConfigError
    from llmctl.quant.recipe import load_recipe

    text = RECIPE.format(strategy="tensor")
    text = "\n".join(f"        {field}: {value}" if line.strip().startswith(f"{field}:")
                     and line.startswith("        ") else line for line in text.splitlines())
    path = write_recipe(tmp_path / "r.yaml", text)
    with pytest.raises(ConfigError, match="kv_cache_scheme"):
        load_recipe(str(path))

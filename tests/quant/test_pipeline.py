"""Each method's checkpoint loads in transformers and computes what llmctl says it should."""

import json

import pytest
import torch

from tests.quant.conftest import SHIPPED

FORMATS = {
    "w4a16-rtn": "pack-quantized", "w4a16-gptq": "pack-quantized", "w4a16-awq": "pack-quantized",
    "w8a16-gptq": "pack-quantized", "w8a8-int8": "int-quantized",
    "w8a8-fp8-dynamic": "float-quantized", "w8a8-fp8-static": "float-quantized",
    "fp8-weight-only": "naive-quantized", "mixed-attn8-mlp4-gptq": "pack-quantized",
}


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("recipe", SHIPPED)
def test_output_loads_in_transformers_and_matches_llmctl_reference(recipe, quantized_tiny, tiny_llama):
    from transformers import AutoModelForCausalLM

    from llmctl.models.loading import load_model
    from llmctl.quant.reference import load_reference

    out, report = quantized_tiny(recipe)
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    assert qc["quantization_status"] == "compressed"
    assert qc["format"] == FORMATS[recipe] == report["format"]
    loaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    reference = load_reference(out)
    ids = torch.randint(0, 500, (2, 32), generator=torch.Generator().manual_seed(1))
    got, want = _logits(loaded, ids), _logits(reference, ids)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    # and it is a quantized model: near the float one (this random tiny model is far
    # harder to quantize than a trained one), but not equal to it
    base = _logits(load_model(tiny_llama), ids)
    rel = ((got - base).norm() / base.norm()).item()
    assert 0 < rel < 0.5


def test_quantized_size_and_side_files(quantized_tiny, tiny_llama):
    out, _ = quantized_tiny("w4a16-gptq")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                 "recipe.yaml", "llmctl-quant.json", "config.json", "model.safetensors"):
        assert (out / name).is_file(), name
    saved = json.loads((out / "llmctl-quant.json").read_text())
    assert saved["method"] == "gptq"
    assert saved["calibration"]["source"] == "builtin:pydoc-calib"
    assert len(saved["calibration"]["tokens_sha256"]) == 64
    assert saved["metadata"]["versions"]["compressed-tensors"]
    assert len(saved["linears"]) == 14  # 2 layers x 7 linears, lm_head ignored
    assert all(r["gptq_loss"] is not None and r["rel_error"] < 0.5 for r in saved["linears"])
    assert [row["layer"] for row in saved["layers"]] == [0, 1]
    written = sum((out / f).stat().st_size for f in out.glob("*.safetensors"))
    assert written == saved["sizes"]["after_bytes"]
    assert abs(written - saved["plan"]["bytes_after"]) < 16384  # the dry run estimate + headers
    assert written < 0.7 * saved["sizes"]["before_bytes"]


def test_recipe_is_saved_verbatim(quantized_tiny):
    from tests.quant.conftest import RECIPES

    out, _ = quantized_tiny("w8a8-int8")
    assert (out / "recipe.yaml").read_text() == (RECIPES / "w8a8-int8.yaml").read_text()


def test_gptq_output_error_is_below_rtn(quantized_tiny, tiny_llama):
    """RTN is data-free (no per-layer output error to compare): the whole model's logits
    on calibration-like text (the built-in calibration set's tokens) are compared."""
    from llmctl.models.loading import load_model, load_tokenizer
    from llmctl.quant.calibration import CalibrationSpec, build_calibration
    from llmctl.quant.reference import load_reference

    ids = build_calibration(load_tokenizer(tiny_llama), CalibrationSpec(samples=4, seq_len=64,
                                                                         seed=7)).ids
    base = _logits(load_model(tiny_llama), ids)

    def error(recipe: str) -> float:
        got = _logits(load_reference(quantized_tiny(recipe)[0]), ids)
        return ((got - base).norm() / base.norm()).item()

    assert error("w4a16-gptq") < error("w4a16-rtn")


FP8_DYNAMIC_RTN = """quant_stage:
  quant_modifiers:
    QuantizationModifier: {scheme: FP8_DYNAMIC, targets: [Linear], ignore: [lm_head]}
"""


@pytest.mark.parametrize("recipe", ["w4a16-rtn", "fp8-dynamic-rtn"])
def test_round_to_nearest_without_static_scales_reads_no_data(recipe, tiny_llama, monkeypatch,
                                                                 tmp_path):
    """llm-compressor's QuantizationModifier is data-free for these schemes: no tokenizer,
    no calibration forward; each linear's reported error is its weights' own
    ||W_q - W|| / ||W||, and the checkpoint computes what llmctl's reference says."""
    from transformers import AutoModelForCausalLM

    from llmctl.quant import calibration
    from llmctl.quant.reference import load_reference
    from tests.quant.conftest import RECIPES, run_quantize, write_recipe

    def no_data(*args, **kwargs):
        raise AssertionError("a data-free run built a calibration set")

    monkeypatch.setattr(calibration, "build_calibration", no_data)
    path = (RECIPES / f"{recipe}.yaml" if recipe == "w4a16-rtn"
            else write_recipe(tmp_path / "fp8.yaml", FP8_DYNAMIC_RTN))
    out = tmp_path / "out"
    report = run_quantize(tiny_llama, path, out)
    assert report["calibration"]["data_free"] is True
    assert len(report["linears"]) == 14 and report["method"] == "rtn"
    reference = load_reference(out)
    plain = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
    row = next(r for r in report["linears"] if r["name"] == "model.layers.1.mlp.down_proj")
    deq = reference.state_dict()["model.layers.1.mlp.down_proj.weight"]
    w = plain.state_dict()["model.layers.1.mlp.down_proj.weight"]
    assert row["rel_error"] == pytest.approx(((deq - w).norm() / w.norm()).item(), rel=1e-4)
    assert 0 < row["rel_error"] < 0.2


def test_static_scales_and_searches_still_calibrate(tiny_llama):
    from llmctl.quant.pipeline import needs_calibration
    from llmctl.quant.run import prepare
    from tests.quant.conftest import RECIPES

    needs = {r: needs_calibration(prep.plan, prep.recipe)
             for r in ("w4a16-rtn", "w8a8-fp8-static", "w4a16-gptq", "w4a16-awq", "w8a8-int8")
             for prep in [prepare(str(tiny_llama), str(RECIPES / f"{r}.yaml"))]}
    assert needs == {"w4a16-rtn": False, "w8a8-fp8-static": True, "w4a16-gptq": True,
                     "w4a16-awq": True, "w8a8-int8": True}


def test_smoothing_changes_norms_but_not_the_float_function(quantized_tiny, tiny_llama):
    """AWQ folds its scales into the norms: the stored norm weights differ from the input."""
    from safetensors import safe_open

    out, report = quantized_tiny("w4a16-awq")
    assert any(r["smoothing"] and r["smoothing"].startswith("awq") for r in report["linears"])
    with safe_open(str(out / "model.safetensors"), "pt") as q, \
            safe_open(str(tiny_llama / "model.safetensors"), "pt") as f:
        name = "model.layers.0.input_layernorm.weight"
        assert not torch.equal(q.get_tensor(name), f.get_tensor(name))


def test_mixed_precision_resolves_per_module(quantized_tiny):
    out, report = quantized_tiny("mixed-attn8-mlp4-gptq")
    schemes = {r["name"].split(".")[-1]: r["scheme"] for r in report["linears"]}
    assert schemes["q_proj"].startswith("int8") and schemes["o_proj"].startswith("int8")
    assert schemes["up_proj"].startswith("int4") and schemes["down_proj"].startswith("int4")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "lm_head" in qc["ignore"]


def test_static_fp8_activation_scales_are_written(quantized_tiny):
    from safetensors import safe_open

    out, _ = quantized_tiny("w8a8-fp8-static")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        scale = f.get_tensor("model.layers.0.self_attn.q_proj.input_scale")
        weight = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
    assert scale.shape == (1,) and scale.item() > 0
    assert weight.dtype == torch.float8_e4m3fn


def test_lm_head_can_be_quantized_too(tiny_llama, tmp_path):
    from transformers import AutoModelForCausalLM

    from llmctl.quant.reference import load_reference
    from tests.quant.conftest import run_quantize, write_recipe

    recipe = write_recipe(tmp_path / "all.yaml", """
quant_stage:
  quant_modifiers:
    GPTQModifier:
      config_groups:
        g:
          targets: [Linear]
          weights: {num_bits: 8, type: int, strategy: channel, symmetric: true}
""")
    out = tmp_path / "out"
    report = run_quantize(tiny_llama, recipe, out)
    assert report["linears"][-1]["name"] == "lm_head" and report["linears"][-1]["gptq_loss"]
    assert "lm_head" not in json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    ids = torch.randint(0, 500, (1, 16), generator=torch.Generator().manual_seed(2))
    loaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert torch.allclose(_logits(loaded, ids), _logits(load_reference(out), ids), atol=1e-4)


def test_asymmetric_groups_decode_like_compressed_tensors(tiny_llama, tmp_path):
    """Asymmetric int4 (packed zero points): llmctl's decoder agrees with compressed-tensors'
    own decompressor on the written tensors (transformers cannot load these, see plan)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors.torch import load_file

    from llmctl.quant.reference import decode_weight
    from tests.quant.conftest import run_quantize, write_recipe

    recipe = write_recipe(tmp_path / "asym.yaml", """
quant_stage:
  quant_modifiers:
    AWQModifier:
      ignore: [lm_head]
      config_groups:
        g:
          targets: [Linear]
          weights: {num_bits: 4, type: int, strategy: group, group_size: 32, symmetric: false}
""")
    out = tmp_path / "out"
    report = run_quantize(tiny_llama, recipe, out)
    assert any("asymmetric" in w for w in report["warnings"])
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    scheme = qc["config_groups"]["g"]
    tensors = load_file(str(out / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj"
    local = {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + ".")}
    assert local["weight_zero_point"].dtype == torch.int32  # packed along the rows
    theirs = BaseCompressor.get_value_from_registry("pack-quantized").decompress(
        local, QuantizationScheme.model_validate(scheme))["weight"]
    assert torch.allclose(decode_weight(name, tensors, scheme, "pack-quantized"), theirs.float())

"""Quality on the real embedded SmolLM2-135M (slow): held-out perplexity after quantizing
with the built-in calibration set.

- W4 group 64 (576-wide layers reject 128): GPTQ and AWQ both beat round-to-nearest;
- W8A8 int8 and FP8 (dynamic activations, weight-only) stay within 2% of the float model.
"""

import os

import pytest
import torch

from tests.quant.conftest import RECIPES

# Six SmolLM2 quantizations, 5-9 minutes on 2 cores: more than the CI budget leaves, so
# opt-in (`LLMCTL_QUALITY_TESTS=1 make test`); last run and passed on 2026-11-22 (issue #3).
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    os.environ.get("LLMCTL_QUALITY_TESTS") != "1",
    reason="SmolLM2 quantization quality (5-9 min): set LLMCTL_QUALITY_TESTS=1")]

SAMPLES, SEQ_LEN = 32, 256  # calibration tokens: 8k, as in the orientation runs
EVAL_WINDOWS = 6  # x 512 held-out tokens: enough to order the methods, cheap to score

W4_G64 = """quant_stage:
  quant_modifiers:
    {modifier}:
      ignore: [lm_head]
      config_groups:
        group_0:
          targets: [Linear]
          weights: {{num_bits: 4, type: int, strategy: group, group_size: 64, symmetric: true}}
"""


@pytest.fixture(scope="module")
def heldout(smollm2):
    from llmctl.models.loading import load_tokenizer
    from llmctl.quant import quality

    return quality.heldout_windows(load_tokenizer(smollm2), seq_len=512, max_windows=EVAL_WINDOWS)


@pytest.fixture(scope="module")
def float_ppl(smollm2, heldout):
    from llmctl.quant import quality

    return quality.checkpoint_perplexity(smollm2, heldout)


def _quantized_ppl(smollm2, heldout, recipe, out) -> float:
    from llmctl.quant import quality
    from llmctl.quant.calibration import CalibrationSpec
    from llmctl.quant.pipeline import PipelineOptions
    from llmctl.quant.run import QuantizeRequest, quantize

    quantize(QuantizeRequest(str(smollm2), str(recipe), out,
                             CalibrationSpec(samples=SAMPLES, seq_len=SEQ_LEN),
                             PipelineOptions(compute_dtype=torch.bfloat16)))
    return quality.checkpoint_perplexity(out, heldout)


def test_gptq_and_awq_w4_beat_rtn_at_group_64(smollm2, heldout, float_ppl, tmp_path):
    ppl = {}
    for method, modifier in (("rtn", "QuantizationModifier"), ("gptq", "GPTQModifier"),
                             ("awq", "AWQModifier")):
        recipe = tmp_path / f"{method}.yaml"
        recipe.write_text(W4_G64.format(modifier=modifier))
        ppl[method] = _quantized_ppl(smollm2, heldout, recipe, tmp_path / method)
    print(f"held-out ppl: float {float_ppl:.3f} {ppl}")
    assert ppl["gptq"] < ppl["rtn"]
    assert ppl["awq"] < ppl["rtn"]
    assert float_ppl < min(ppl.values())


@pytest.mark.parametrize("recipe", ["w8a8-int8", "w8a8-fp8-dynamic", "fp8-weight-only"])
def test_eight_bit_stays_within_two_percent(recipe, smollm2, heldout, float_ppl, tmp_path):
    ppl = _quantized_ppl(smollm2, heldout, RECIPES / f"{recipe}.yaml", tmp_path / recipe)
    print(f"held-out ppl: float {float_ppl:.3f} {recipe} {ppl:.3f}")
    assert ppl <= 1.02 * float_ppl

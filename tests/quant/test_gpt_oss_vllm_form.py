"""gpt-oss's WNA16 experts written in vLLM's streamed per-expert form
(:mod:`llmctl.quant.vllm_gpt_oss`): the exact names, shapes and dtypes vLLM 0.32's
gpt-oss loader reads, the same codes and scales as the per-linear form (gate and up rows
interleaved), llmctl's engine on it, and the schemes that keep the per-linear form.

vLLM is not in this environment: benchmarks/gpt_oss_quant_in_vllm.py loads these
checkpoints with vLLM's own loader (results/gpt-oss-quant-in-vllm.md).
"""

from __future__ import annotations

import json

import pytest
import torch

from llmctl.quant import vllm_gpt_oss
from llmctl.quant.writer import TensorSpec
from tests.quant.conftest import run_quantize, write_recipe
from tests.quant.test_families import _ids
from tests.quant.test_moe_quant import RECIPES, SEQ, W4_G16, _tensors

NAME = "gpt_oss"
H, I, E, LAYERS = 64, 32, 4, 3  # the tiny gpt-oss (tests/data/families/gpt_oss.json)
STREAMED = ("w13_weight_packed", "w13_weight_scale", "w13_bias",
            "w2_weight_packed", "w2_weight_scale", "w2_bias")
FORM_RECIPES = {
    "w4a16-g16": RECIPES["w4a16-rtn-g16"],
    "w8a16-channel": W4_G16.format(modifier="QuantizationModifier", extra="").replace(
        "num_bits: 4", "num_bits: 8").replace("strategy: group, group_size: 16",
                                              "strategy: channel"),
    "w4a16-asym": RECIPES["w4a16-rtn-g16"].replace("symmetric: true", "symmetric: false"),
    "fp8-dynamic": RECIPES["fp8-dynamic"],
}


@pytest.fixture(scope="module")
def written(tiny_family, tmp_path_factory):
    """(recipe, streamed form allowed) -> (output dir, report), built once each; with the
    form not allowed the writer keeps the per-linear form (what llmctl wrote before)."""
    root = tmp_path_factory.mktemp("gpt-oss-vllm-form")
    built: dict = {}

    def get(recipe: str, allowed: bool = True):
        key = (recipe, allowed)
        if key not in built:
            out = root / f"{recipe}-{allowed}"
            with pytest.MonkeyPatch.context() as patch:
                if not allowed:
                    patch.setattr(vllm_gpt_oss, "streamed", lambda modules: False)
                built[key] = out, run_quantize(
                    tiny_family(NAME), write_recipe(root / f"{recipe}.yaml",
                                                    FORM_RECIPES[recipe]),
                    out, samples=4, seq_len=SEQ)
        return built[key]

    return get


def _experts(tensors: dict) -> dict:
    return {k: v for k, v in tensors.items() if ".mlp.experts." in k}


@pytest.mark.parametrize("recipe, bits, groups", [("w4a16-g16", 4, 16), ("w8a16-channel", 8, None)])
def test_the_experts_are_exactly_vllms_streamed_form(written, recipe, bits, groups):
    """Per layer and expert, these six tensors and nothing else (no weight_shape, no zero
    point, no per-linear name): N-first int32 codes packed along the input, scales and
    biases in the checkpoint's float dtype; config.json still names the per-linear
    modules (vLLM matches ``experts.0.gate_proj`` against its targets); the report keeps
    its per-expert linears."""
    from llmctl.serve.layers.quant_config import QuantConfig

    out, report = written(recipe)
    tensors = _tensors(out)
    dtype = tensors["model.layers.0.mlp.router.bias"].dtype
    want = {}
    for i in range(LAYERS):
        for e in range(E):
            p = f"model.layers.{i}.mlp.experts.{e}"
            want.update({
                f"{p}.w13_weight_packed": (torch.int32, (2 * I, H * bits // 32)),
                f"{p}.w13_weight_scale": (dtype, (2 * I, H // groups if groups else 1)),
                f"{p}.w13_bias": (dtype, (2 * I,)),
                f"{p}.w2_weight_packed": (torch.int32, (H, I * bits // 32)),
                f"{p}.w2_weight_scale": (dtype, (H, I // groups if groups else 1)),
                f"{p}.w2_bias": (dtype, (H,))})
    got = {k: (v.dtype, tuple(v.shape)) for k, v in _experts(tensors).items()}
    assert got == want
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    scheme = QuantConfig(config).scheme_for("model.layers.0.mlp.experts.0.gate_proj")
    assert scheme is not None and scheme.args["num_bits"] == bits
    names = {r["name"] for r in report["linears"]}
    assert "model.layers.2.mlp.experts.3.up_proj" in names
    assert len(report["experts"]["experts"]) == LAYERS * E
    assert any(vllm_gpt_oss.FORM in w and "vLLM 0.32 and llmctl load them" in w
               for w in report["warnings"])


@pytest.mark.parametrize("recipe", ["w4a16-g16", "w8a16-channel"])
def test_w13_deinterleaves_to_the_per_linear_tensors_bit_for_bit(written, recipe):
    """The same quantization written both ways (RTN: deterministic): w13's even rows are
    gate's codes, scales and bias, its odd rows up's, w2 is down's, bit for bit; and the
    whole streamed state dict turned back (``to_per_linear``) equals the per-linear one."""
    streamed = _tensors(written(recipe)[0])
    linear = _tensors(written(recipe, allowed=False)[0])
    assert not any(".w13_" in k for k in linear)
    for i in range(LAYERS):
        for e in range(E):
            p = f"model.layers.{i}.mlp.experts.{e}"
            for tensor in ("weight_packed", "weight_scale", "bias"):
                gate, up = vllm_gpt_oss.deinterleave(streamed[f"{p}.w13_{tensor}"])
                assert torch.equal(gate, linear[f"{p}.gate_proj.{tensor}"])
                assert torch.equal(up, linear[f"{p}.up_proj.{tensor}"])
                assert torch.equal(streamed[f"{p}.w2_{tensor}"], linear[f"{p}.down_proj.{tensor}"])
    back = vllm_gpt_oss.to_per_linear(streamed, 4 if recipe.startswith("w4") else 8)
    assert back.keys() == linear.keys()
    assert all(torch.equal(back[k], linear[k]) for k in linear)


def test_the_engine_reads_both_forms_alike(written):
    """llmctl's engine (the low-bit kernel path and dequantize, float32) gives the same
    logits on the streamed form as on the per-linear form it read before, bit for bit."""
    from llmctl.serve.engine.llm import LLM
    from llmctl.serve.model.scoring import teacher_forced_logits

    ids = _ids(seed=4)[0].tolist()[:8]  # the kernel path scores ~0.3 s a token here
    for backend in ("kernel", "dequantize"):
        logits = []
        for allowed in (True, False):
            llm = LLM(str(written("w4a16-g16", allowed)[0]), dtype="float32",
                      quant_backend=backend, kv_cache_memory="8MiB", block_size=4)
            logits.append(teacher_forced_logits(llm.engine, ids, 1))
        assert torch.equal(logits[0], logits[1]), backend


@pytest.mark.parametrize("recipe, kept", [("w4a16-asym", "weight_zero_point"),
                                          ("fp8-dynamic", "weight")])
def test_other_schemes_keep_the_per_linear_form(written, recipe, kept):
    """Asymmetric int4 and FP8 experts: vLLM 0.32 has no gpt-oss path for them, so they
    keep the per-linear names; the warning says so."""
    out, report = written(recipe)
    tensors = _experts(_tensors(out))
    assert not any(".w13_" in k or ".w2_" in k for k in tensors)
    assert f"model.layers.1.mlp.experts.2.gate_proj.{kept}" in tensors
    assert "model.layers.1.mlp.experts.2.up_proj.bias" in tensors
    assert any(vllm_gpt_oss.PER_LINEAR_FORM in w and "vLLM 0.32 does not load them" in w
               for w in report["warnings"])


def test_specs_and_tensors_transform_alike():
    """The shard plan's names and shapes are what the Interleaver emits, whichever of gate
    and up comes first; weight_shape goes, other tensors pass as they are."""
    p = "model.layers.0.mlp.experts.1"
    gate = {f"{p}.gate_proj.weight_packed": torch.arange(12, dtype=torch.int32).view(3, 4),
            f"{p}.gate_proj.weight_shape": torch.tensor([3, 32]),
            f"{p}.gate_proj.bias": torch.zeros(3)}
    up = {k.replace("gate_proj", "up_proj"): v + 100 for k, v in gate.items()}
    down = {f"{p}.down_proj.weight_packed": torch.ones(5, 1, dtype=torch.int32),
            "model.norm.weight": torch.ones(5)}
    tensors = {**gate, **up, **down}
    specs = vllm_gpt_oss.stream_specs({k: TensorSpec(v.dtype, tuple(v.shape))
                                       for k, v in tensors.items()})
    for order in (list(tensors), list(reversed(tensors))):
        feed = vllm_gpt_oss.Interleaver()
        out = dict(pair for name in order for pair in feed.feed(name, tensors[name]))
        assert not feed.pending
        assert {k: TensorSpec(v.dtype, tuple(v.shape)) for k, v in out.items()} == specs
        w13 = out[f"{p}.w13_weight_packed"]
        assert torch.equal(w13[0::2], gate[f"{p}.gate_proj.weight_packed"])
        assert torch.equal(w13[1::2], up[f"{p}.up_proj.weight_packed"])
    assert list(specs) == [f"{p}.w13_weight_packed", f"{p}.w13_bias", f"{p}.w2_weight_packed",
                           "model.norm.weight"]

"""Per-module schemes, compressed-tensors' matching order, and the group-size rule."""

import json

import pytest

from llmctl.errors import ConfigError
from llmctl.quant.checkpoint import Checkpoint
from llmctl.quant.plan import build_plan, effective_group_size, resolve_target, valid_group_sizes
from llmctl.quant.recipe import parse_recipe


def _recipe(modifier: str, body: dict):
    return parse_recipe({"quant_stage": {"quant_modifiers": {modifier: body}}})


def _group(bits: int, group_size: int | None = None, **extra) -> dict:
    weights = {"num_bits": bits, "type": "int", "symmetric": True,
               "strategy": "group" if group_size else "channel", **extra}
    if group_size:
        weights["group_size"] = group_size
    return weights


def test_valid_group_sizes_are_powers_of_two_dividing_the_width():
    assert valid_group_sizes(576) == [16, 32, 64]
    assert valid_group_sizes(1536) == [16, 32, 64, 128, 256, 512]


def test_smollm2_width_rejects_128_in_strict_mode_naming_layer_and_sizes():
    with pytest.raises(ConfigError) as err:
        effective_group_size("model.layers.0.self_attn.q_proj", 576, 128, strict=True)
    assert "model.layers.0.self_attn.q_proj" in err.value.message
    assert "576" in err.value.message and "128" in err.value.message
    assert "16, 32, 64" in err.value.remedy


def test_largest_valid_size_below_the_request_otherwise():
    assert effective_group_size("x", 576, 128, strict=False) == 64
    assert effective_group_size("x", 1536, 128, strict=False) == 128
    with pytest.raises(ConfigError, match="none at or below"):
        effective_group_size("x", 100, 64, strict=False)  # no power of two >= 16 divides 100


def test_matching_order_exact_then_regex_then_class():
    class G:
        def __init__(self, targets):
            self.targets = targets

    groups = {"by_class": G(["Linear"]), "by_regex": G(["re:.*q_proj$"]),
              "by_name": G(["model.layers.0.self_attn.q_proj"])}
    assert resolve_target("model.layers.0.self_attn.q_proj", "Linear", groups) == "by_name"
    assert resolve_target("model.layers.1.self_attn.q_proj", "Linear", groups) == "by_regex"
    assert resolve_target("model.layers.1.mlp.up_proj", "Linear", groups) == "by_class"


def test_plan_adjusts_group_size_and_names_modules_exactly(tiny_llama):
    plan = build_plan(Checkpoint(tiny_llama), _recipe("GPTQModifier", {
        "scheme": "W4A16", "ignore": ["lm_head"]}))
    q = plan.module("model.layers.0.self_attn.q_proj")
    down = plan.module("model.layers.0.mlp.down_proj")
    assert q.weight.group_size == 64 and q.note == "group 128 -> 64"  # 64 input features
    assert down.weight.group_size == 128  # 128 input features: as requested
    assert plan.groups["group_0_g64"].targets[0] == "model.layers.0.self_attn.q_proj"
    assert plan.groups["group_0"].targets == [m.name for m in plan.quantized
                                              if m.weight.group_size == 128]
    assert any("group size changed" in w for w in plan.warnings)
    assert not plan.module("lm_head").quantized and plan.ignore == ["lm_head"]
    with pytest.raises(ConfigError, match="does not divide"):
        build_plan(Checkpoint(tiny_llama), _recipe("GPTQModifier", {"scheme": "W4A16"}),
                   strict_group_size=True)


def test_mixed_precision_and_ignore(tiny_llama):
    plan = build_plan(Checkpoint(tiny_llama), _recipe("QuantizationModifier", {
        "ignore": ["re:.*layers\\.1\\.mlp\\.down_proj$"],
        "config_groups": {
            "attn": {"targets": ["re:.*self_attn.*"], "weights": _group(8)},
            "mlp": {"targets": ["Linear"], "weights": _group(4, 32)}}}))
    assert plan.module("model.layers.0.self_attn.v_proj").weight.bits == 8
    assert plan.module("model.layers.0.mlp.up_proj").weight.bits == 4
    assert not plan.module("model.layers.1.mlp.down_proj").quantized
    assert plan.module("lm_head").quantized  # not ignored, so "Linear" takes it too
    assert plan.format == "pack-quantized"


def test_expected_size_is_reported(tiny_llama):
    plan = build_plan(Checkpoint(tiny_llama), _recipe("QuantizationModifier", {
        "scheme": "W8A8", "ignore": ["lm_head"]}))
    assert plan.format == "int-quantized"
    q = plan.module("model.layers.0.self_attn.q_proj")
    assert q.bytes_before == 64 * 64 * 4
    assert q.bytes_after == 64 * 64 + 64 * 4  # int8 codes + one fp32 scale per channel
    assert plan.bytes_after < plan.bytes_before
    json.dumps(plan.to_dict())  # serialisable for --json


def test_unsupported_settings_fail_clearly(tiny_llama):
    ckpt = Checkpoint(tiny_llama)
    with pytest.raises(ConfigError, match="actorder: group"):
        build_plan(ckpt, _recipe("GPTQModifier", {"config_groups": {"g": {
            "targets": ["Linear"], "weights": _group(4, 32)}}, "actorder": "group"}))
    with pytest.raises(ConfigError, match="match no linear"):
        build_plan(ckpt, _recipe("GPTQModifier", {"scheme": "W4A16", "targets": ["re:nothing"]}))
    with pytest.raises(ConfigError, match="output activations"):
        build_plan(ckpt, _recipe("QuantizationModifier", {"config_groups": {"g": {
            "targets": ["Linear"], "weights": _group(8),
            "output_activations": {"num_bits": 8, "dynamic": True, "strategy": "token"}}}}))


def test_tied_lm_head_stays_float(tiny_llama_tied):
    plan = build_plan(Checkpoint(tiny_llama_tied), _recipe("QuantizationModifier", {
        "scheme": "W8A8"}))  # per channel: the broad "Linear" target stays in the output
    assert plan.module("lm_head") is None
    assert "lm_head" in plan.ignore
    assert any("tied" in w for w in plan.warnings)

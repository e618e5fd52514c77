"""Recipes: llm-compressor's shape, typos named with the allowed keys, presets resolved."""

import pytest

from llmctl.errors import ConfigError
from llmctl.quant.recipe import load_recipe, parse_recipe, recipe_format
from tests.quant.conftest import RECIPES, SHIPPED


def _wrap(modifiers: dict) -> dict:
    return {"quant_stage": {"quant_modifiers": modifiers}}


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_recipe_validates(name):
    recipe = load_recipe(RECIPES / f"{name}.yaml")
    assert recipe.method in ("rtn", "gptq", "awq")
    groups = recipe.weight_modifier.resolved_groups()
    assert groups and all(g.weights is not None for g in groups.values())


def test_recipes_resolve_by_name():
    assert load_recipe("w4a16-gptq").path.endswith("recipes/w4a16-gptq.yaml")


def test_unknown_recipe_lists_the_shipped_ones():
    with pytest.raises(ConfigError) as err:
        load_recipe("w4a16-gtpq")
    assert "w4a16-gptq" in err.value.remedy


def test_modifier_typo_names_key_and_allowed_keys():
    with pytest.raises(ConfigError) as err:
        parse_recipe(_wrap({"GPTQModifier": {"scheme": "W4A16", "dampening_fracc": 0.1}}))
    assert "'dampening_fracc'" in err.value.message
    assert "quant_stage.quant_modifiers.GPTQModifier" in err.value.message
    assert "dampening_frac" in err.value.remedy and "block_size" in err.value.remedy


def test_nested_scheme_typo_names_the_quantization_args_keys():
    recipe = _wrap({"QuantizationModifier": {"config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bitz": 4}}}}})
    with pytest.raises(ConfigError) as err:
        parse_recipe(recipe)
    assert "'num_bitz'" in err.value.message and "group_0.weights" in err.value.message
    assert "num_bits" in err.value.remedy and "group_size" in err.value.remedy


def test_mapping_typo_in_awq():
    recipe = _wrap({"AWQModifier": {"scheme": "W4A16", "mappings": [
        {"smooth_layer": "re:.*input_layernorm$", "balance_layer": ["re:.*q_proj$"]}]}})
    with pytest.raises(ConfigError) as err:
        parse_recipe(recipe)
    assert "'balance_layer'" in err.value.message
    assert "balance_layers" in err.value.remedy


def test_unknown_modifier_lists_the_known_ones():
    with pytest.raises(ConfigError) as err:
        parse_recipe(_wrap({"GPTQModifer": {"scheme": "W4A16"}}))
    assert "GPTQModifier" in err.value.remedy and "AWQModifier" in err.value.remedy


def test_unknown_preset_lists_supported_ones():
    with pytest.raises(ConfigError) as err:
        parse_recipe(_wrap({"GPTQModifier": {"scheme": "W4A17"}}))
    assert "W4A16" in err.value.message and "FP8_DYNAMIC" in err.value.message


def test_stage_and_group_names_follow_llm_compressor():
    with pytest.raises(ConfigError, match="not a stage"):
        parse_recipe({"quant": {"quant_modifiers": {"GPTQModifier": {"scheme": "W4A16"}}}})
    with pytest.raises(ConfigError, match="not a modifier group"):
        parse_recipe({"quant_stage": {"mods": {"GPTQModifier": {"scheme": "W4A16"}}}})


def test_exactly_one_weight_modifier():
    with pytest.raises(ConfigError, match="exactly one weight modifier"):
        parse_recipe(_wrap({"SmoothQuantModifier": {}}))
    with pytest.raises(ConfigError, match="exactly one weight modifier"):
        parse_recipe(_wrap({"GPTQModifier": {"scheme": "W4A16"},
                            "QuantizationModifier": {"scheme": "W4A16"}}))


def test_scheme_and_config_groups_are_exclusive():
    recipe = parse_recipe(_wrap({"GPTQModifier": {"scheme": "W4A16", "config_groups": {
        "g": {"targets": ["Linear"], "weights": {"num_bits": 4}}}}}))
    with pytest.raises(ConfigError, match="both"):
        recipe.weight_modifier.resolved_groups()


def test_preset_mapping_form_gives_one_group_per_preset():
    recipe = parse_recipe(_wrap({"QuantizationModifier": {
        "scheme": {"W8A16": ["re:.*self_attn.*"], "W4A16": ["re:.*mlp.*"]}}}))
    groups = recipe.weight_modifier.resolved_groups()
    assert [g.weights.num_bits for g in groups.values()] == [8, 4]
    assert groups["group_0"].targets == ["re:.*self_attn.*"]


def test_w8a8_preset_has_dynamic_per_token_int8_activations():
    recipe = parse_recipe(_wrap({"GPTQModifier": {"scheme": "W8A8"}}))
    act = recipe.weight_modifier.resolved_groups()["group_0"].input_activations
    assert act.num_bits == 8 and act.dynamic and str(act.strategy) == "token"


def test_llm_compressor_fields_without_effect_are_accepted():
    recipe = parse_recipe(_wrap({"GPTQModifier": {"scheme": "W4A16", "offload_hessians": True,
                                                  "sequential_targets": ["LlamaDecoderLayer"]}}))
    assert recipe.method == "gptq"


def test_gguf_recipes_are_told_apart(tmp_path):
    path = tmp_path / "g.yaml"
    path.write_text("format: gguf\ntype: Q4_K_M\n")
    assert recipe_format(path) == "gguf"
    assert recipe_format(RECIPES / "w4a16-gptq.yaml") == "compressed-tensors"
    with pytest.raises(ConfigError, match="GGUF recipe"):
        load_recipe(path)


def test_invalid_yaml(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("quant_stage: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_recipe(path)

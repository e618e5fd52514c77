"""GGUF recipes: validated data that refuses typos and unknown types."""

from pathlib import Path

import pytest

from llmctl.errors import ConfigError
from llmctl.gguf.export import resolve_recipe
from llmctl.gguf.recipe import is_gguf_recipe, load_recipe, parse_recipe

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def test_shipped_q4_k_m_recipe_loads():
    recipe = load_recipe(RECIPES / "gguf-q4_k_m.yaml")
    assert recipe.type == "Q4_K_M"
    assert (recipe.output_type, recipe.token_embd_type) == ("Q8_0", "Q8_0")
    assert [(o.pattern, o.type) for o in recipe.overrides] == [(r"attn_v\.weight", "Q6_K")]
    assert recipe.imatrix.calibration == "builtin:pydoc-calib"
    assert recipe.resolved_engine() == "llama.cpp"
    assert is_gguf_recipe(RECIPES / "gguf-q4_k_m.yaml")


@pytest.mark.parametrize("data, message", [
    ({"type": "Q4_K_M", "overides": []}, "overides: Extra inputs are not permitted"),
    ({"type": "Q9_Z"}, "unknown GGUF type 'Q9_Z'"),
    ({"overrides": [{"pattern": "attn_v", "type": "Q7"}]}, "unknown ggml tensor type 'Q7'"),
    ({"overrides": [{"pattern": "attn_v[", "type": "Q8_0"}]}, "not a regular expression"),
    ({"imatrix": {"samples": 0}}, "imatrix.samples"),
    ({"output_type": "Q4_K_M"}, "unknown ggml tensor type 'Q4_K_M'"),  # a file type, not a tensor type
])
def test_bad_recipes_fail_with_the_field_named(data, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        parse_recipe(data)


def test_lowercase_and_alias_types_are_normalised():
    assert parse_recipe({"type": "q4_k"}).type == "Q4_K_M"
    assert parse_recipe({"overrides": [{"pattern": "x", "type": "q6_k"}]}).overrides[0].type == "Q6_K"


@pytest.mark.parametrize("data, engine", [
    ({"type": "Q8_0"}, "llmctl"),
    ({"type": "F16"}, "llmctl"),
    ({"type": "Q4_0", "overrides": [{"pattern": "attn_v", "type": "Q8_0"}]}, "llmctl"),
    ({"type": "Q4_0", "overrides": [{"pattern": "attn_v", "type": "Q6_K"}]}, "llama.cpp"),
    ({"type": "Q4_0", "imatrix": {}}, "llama.cpp"),  # only llama.cpp's quantizer uses one
    ({"type": "Q6_K"}, "llama.cpp"),
    ({"type": "Q8_0", "engine": "llama.cpp"}, "llama.cpp"),
])
def test_engine_follows_the_types_the_recipe_needs(data, engine):
    assert parse_recipe(data).resolved_engine() == engine


def test_command_line_values_win_over_the_recipe():
    recipe = resolve_recipe(RECIPES / "gguf-q4_k_m.yaml", "Q5_K_M", calibration="notes.txt",
                            threads=1)
    assert recipe.type == "Q5_K_M" and recipe.threads == 1
    assert recipe.imatrix.calibration == "notes.txt"
    assert recipe.output_type == "Q8_0"  # untouched fields survive
    assert resolve_recipe(None, "Q4_K_M", imatrix="/x/imatrix.gguf").imatrix.file == "/x/imatrix.gguf"
    assert resolve_recipe(None, "Q4_K_M", imatrix=True).imatrix.file is None
    assert resolve_recipe(None, "Q4_K_M", calibration="a.txt").imatrix is None


def test_not_gguf_recipe(tmp_path):
    path = tmp_path / "w4.yaml"
    path.write_text("quant_stage:\n  quant_modifiers: {}\n")
    assert not is_gguf_recipe(path)
    with pytest.raises(ConfigError, match="no recipe file"):
        load_recipe(tmp_path / "missing.yaml")

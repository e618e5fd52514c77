"""Quantization methods as plug-ins: every modifier has one, the layer streamer names none,
and a method the streamer has never heard of runs through it with the statistics it asks
for."""

import ast
from pathlib import Path

import pytest
import torch

from tests.quant.conftest import RECIPES, run_quantize

QUANT = Path(__file__).resolve().parents[2] / "llmctl" / "quant"
METHOD_WORDS = ("GPTQ", "AWQ", "SmoothQuant", "Modifier", "RoundToNearest", "gptq", "awq",
                "smoothquant")
ALLOWED = {"gptq_loss"}  # the report's field (llmctl-quant.json keeps its name)


def test_every_recipe_modifier_has_a_method():
    from llmctl.quant.methods import METHODS
    from llmctl.quant.recipe import MODIFIERS

    assert set(METHODS) == set(MODIFIERS.values())


@pytest.mark.parametrize("module", ["pipeline.py", "stream.py", "smoothing.py", "stats.py",
                                    "scheme.py", "method.py"])
def test_the_layer_streamer_names_no_method(module):
    """No identifier, import or attribute of the streamer refers to a method by name
    (docstrings and comments may cite the papers)."""
    tree = ast.parse((QUANT / module).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.alias):
            names.add(node.name)
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module or "")
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
    assert not [n for n in names - ALLOWED if any(w in n for w in METHOD_WORDS)]


@pytest.mark.parametrize("recipe, weights, smoother, needs_data, hessians", [
    ("w4a16-rtn", "RoundToNearest", None, False, False),
    ("w8a8-fp8-static", "RoundToNearest", None, False, False),
    ("w4a16-gptq", "GPTQ", None, True, True),
    ("w4a16-awq", "AWQ", "AWQ", True, True),
    ("w8a8-int8", "GPTQ", "SmoothQuant", True, True),
])
def test_a_recipe_s_methods_and_their_roles(recipe, weights, smoother, needs_data, hessians):
    from llmctl.quant.methods import methods_for
    from llmctl.quant.recipe import load_recipe

    methods = methods_for(load_recipe(RECIPES / f"{recipe}.yaml"))
    assert type(methods.weights).__name__ == weights
    assert (type(methods.smoother).__name__ if methods.smoother else None) == smoother
    assert methods.needs_data is needs_data
    assert methods.keeps_hessians is hessians


def test_a_new_method_plugs_in_without_touching_the_streamer(tiny_llama, tmp_path, monkeypatch):
    """A toy method registered for QuantizationModifier: it smooths the q/k/v tap by a
    constant, asks for activation absmax at every quantized tap and rounds to nearest.
    The streamer collects what it asked for, folds the scales and writes the result."""
    from llmctl.quant import methods
    from llmctl.quant.method import Smoothing
    from llmctl.quant.methods.rtn import RoundToNearest
    from llmctl.quant.recipe import QuantizationModifier
    from llmctl.quant.stats import Needs

    seen: dict[str, list] = {"smooth": [], "quantize": []}

    class Toy(RoundToNearest):
        needs_data = True

        def mappings(self, layout=None):
            return [("re:.*input_layernorm$", ["re:.*q_proj$", "re:.*k_proj$", "re:.*v_proj$"])]

        def smoothing_needs(self, targeted, quantized):
            return Needs(absmax=True) if targeted else None

        def smooth(self, job):
            seen["smooth"].append((job.tap, job.kinds, job.stats.absmax is not None))
            return Smoothing(torch.full_like(job.stats.absmax, 2.0), "toy")

        def weight_needs(self, has_moment):
            return Needs(absmax=True)

        def quantize(self, job):
            seen["quantize"].append((job.layer, tuple(job.kinds), job.stats.absmax is not None))
            return super().quantize(job)

    monkeypatch.setitem(methods.METHODS, QuantizationModifier, Toy)
    report = run_quantize(tiny_llama, RECIPES / "w4a16-rtn.yaml", tmp_path / "toy")
    qkv = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    assert seen["smooth"] == [("attn_in", list(qkv), True)] * 2
    assert (0, qkv, True) in seen["quantize"] and (1, ("mlp.down_proj",), True) in seen["quantize"]
    assert all(has for _, _, has in seen["quantize"])
    notes = {r["name"]: r["smoothing"] for r in report["linears"]}
    assert notes["model.layers.0.self_attn.q_proj"] == "toy"
    assert notes["model.layers.0.mlp.up_proj"] is None

    from safetensors import safe_open

    with safe_open(str(tmp_path / "toy" / "model.safetensors"), "pt") as q, \
            safe_open(str(tiny_llama / "model.safetensors"), "pt") as f:
        name = "model.layers.0.input_layernorm.weight"
        assert torch.allclose(q.get_tensor(name).float(), f.get_tensor(name).float() / 2)

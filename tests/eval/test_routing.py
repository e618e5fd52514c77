"""Router agreement (llmctl.eval.routing): a hand-computed case, and an eval of a tiny
Qwen3-MoE against a copy whose second router swaps two experts, where the expected share
follows from the reference's own routes."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from llmctl.eval import routing
from llmctl.eval.runner import EvalConfig, expected_metrics, run_eval
from llmctl.eval.windows import Windowing
from llmctl.gates import evaluate_gates, parse_gate


def test_top_k_sets_and_agreement_by_hand():
    """2 layers, 3 tokens, 4 experts, k = 2. Layer 0: token 0's logits reordered within
    its set (same set), token 1's set {2, 3} against {1, 2} (differs), token 2 the same:
    2/3. Layer 1 identical: 1."""
    ref = [torch.tensor([[4., 3., 0., 0.], [0., 1., 5., 2.], [1., 0., 0., 2.]]),
           torch.tensor([[0., 0., 1., 2.], [3., 0., 0., 1.], [0., 2., 1., 0.]])]
    cand = [torch.tensor([[3., 4., 0., 0.], [0., 3., 5., 2.], [1., 0., 0., 2.]]), ref[1]]
    r, c = routing.top_k_sets(ref, 2), routing.top_k_sets(cand, 2)
    assert r[0].tolist() == [[0, 1], [2, 3], [0, 3]]
    assert c[0].tolist() == [[0, 1], [1, 2], [0, 3]]
    per_layer = routing.agreement(r, c)
    assert per_layer.tolist() == pytest.approx([2 / 3, 1.0])
    assert routing.summary(per_layer) == pytest.approx(
        {"router_agreement_min": 2 / 3, "router_agreement_mean": 5 / 6})
    with pytest.raises(ValueError, match="not the same model layout"):
        routing.agreement(r, c[:1])


def _swap_router_experts(source, out, layer: int, a: int, b: int):
    """A copy of ``source`` whose layer-``layer`` router scores expert ``a`` as ``b`` and
    ``b`` as ``a`` (the experts themselves unchanged)."""
    shutil.copytree(source, out)
    (weights,) = out.glob("*.safetensors")
    tensors = load_file(str(weights))
    name = f"model.layers.{layer}.mlp.gate.weight"
    tensors[name] = tensors[name][[b if i == a else a if i == b else i
                                   for i in range(tensors[name].shape[0])]].contiguous()
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return out


def test_eval_reports_router_agreement_and_gates_on_it(tiny_family, tmp_path, eval_cache):
    """Layer 0 is untouched, so layer 1's input is the reference's and its candidate sets
    are the reference's with experts 0 and 1 exchanged: a token keeps its set exactly when
    it routes to both of them or to neither. That share, from the reference's routes
    alone, is what the eval must report for layer 1 (and 1.0 for layer 0)."""
    ref = tiny_family("qwen3_moe")
    cand = _swap_router_experts(ref, tmp_path / "swapped", layer=1, a=0, b=1)
    config = EvalConfig(candidate=str(cand), reference=str(ref), cache_dir=eval_cache,
                        windowing=Windowing(ctx=64, max_windows=4), dtype="float32")
    assert set(routing.METRICS) <= expected_metrics(config)
    report = run_eval(config)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(ref), dtype=torch.float32)
    from llmctl.eval.runner import prepare_reference

    store = prepare_reference(config, type("UI", (), {"status": lambda *a: None})())[0]
    sets = routing.model_routes(model, store.plan.inputs[:routing.ROUTING_WINDOWS], 2)[1]
    want = float(np.mean((sets == 0).any(-1) == (sets == 1).any(-1)))
    assert 0.0 < want < 1.0  # the case separates the two
    got = report["routing"]
    assert got["per_layer"] == pytest.approx([1.0, want])
    assert got["tokens"] == sets.shape[0] and got["top_k"] == 2
    metrics = report["metrics"]
    assert metrics["router_agreement_min"] == pytest.approx(want)
    assert metrics["router_agreement_mean"] == pytest.approx((1.0 + want) / 2)
    (result,) = evaluate_gates([parse_gate("router_agreement_min>=0.99")], metrics)
    assert not result.passed
    (result,) = evaluate_gates([parse_gate(f"router_agreement_min>={want - 0.01}")], metrics)
    assert result.passed


def test_a_dense_reference_reports_no_routing(tiny_llama, eval_cache):
    config = EvalConfig(candidate=str(tiny_llama), reference=str(tiny_llama),
                        cache_dir=eval_cache, windowing=Windowing(ctx=64, max_windows=2))
    assert not set(routing.METRICS) & expected_metrics(config)
    report = run_eval(config)
    assert report["routing"] == {} and "router_agreement_min" not in report["metrics"]
    assert routing.experts_per_token(tiny_llama) is None
    assert json.loads((tiny_llama / "config.json").read_text())["model_type"] == "llama"

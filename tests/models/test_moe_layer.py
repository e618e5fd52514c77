"""The mixture-of-experts block of :mod:`llmctl.models.layers.moe` against transformers'
own sparse MoE modules (random weights and input, float32) and a hand-computed case."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from llmctl.models.layers.moe import MoeWeights, Routing, moe_block, route
from llmctl.models.spec import ModelArch
from tests.tiny import FAMILY_CONFIGS, MOE_FAMILY_NAMES

pytest.importorskip("transformers")

# the transformers module of each family's sparse block, by model_type
BLOCKS = {"mixtral": ("mixtral", "MixtralSparseMoeBlock"),
          "qwen2_moe": ("qwen2_moe", "Qwen2MoeSparseMoeBlock"),
          "qwen3_moe": ("qwen3_moe", "Qwen3MoeSparseMoeBlock")}


def _hf_block(config: dict, implementation: str):
    import importlib

    from transformers import AutoConfig

    cfg = AutoConfig.for_model(**config)
    cfg._experts_implementation = implementation
    module, cls = BLOCKS[config["model_type"]]
    block = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"),
                    cls)(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.3)
    return block.eval()


def _weights(block, arch: ModelArch) -> MoeWeights:
    shared = getattr(block, "shared_expert", None)
    return MoeWeights(
        router=block.gate.weight.detach(), gate_up=block.experts.gate_up_proj.detach(),
        down=block.experts.down_proj.detach(), routing=Routing.of(arch),
        shared_gate_up=None if shared is None else torch.cat(
            [shared.gate_proj.weight, shared.up_proj.weight]).detach(),
        shared_down=None if shared is None else shared.down_proj.weight.detach(),
        shared_gate=None if shared is None else block.shared_expert_gate.weight.detach())


@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
@pytest.mark.parametrize("norm_topk", [False, True])
@pytest.mark.parametrize("name", MOE_FAMILY_NAMES)
def test_block_equals_transformers(name, norm_topk, implementation):
    """37 random tokens through transformers' block and ours: within 1e-6 (float32), and
    the tokens route to every expert between them."""
    config = json.loads((FAMILY_CONFIGS / f"{name}.json").read_text())
    config |= {"vocab_size": 64, "norm_topk_prob": norm_topk}
    arch = ModelArch.from_config(config)
    block = _hf_block(config, implementation)
    x = torch.randn(37, arch.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = block(x[None])[0]
        got = moe_block(x, _weights(block, arch), arch.hidden_act)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    _, experts = route(F.linear(x, block.gate.weight.detach()), Routing.of(arch))
    assert set(experts.flatten().tolist()) == set(range(arch.num_experts))


def test_two_experts_by_hand():
    """Two experts of width 1 on a 2-d input, top-1 and top-2, computed by hand."""
    silu = torch.nn.functional.silu
    x = torch.tensor([[1.0, 2.0], [-1.0, 0.5]])
    router = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # logits = x
    gate_up = torch.tensor([[[1.0, 0.0], [0.0, 1.0]],    # expert 0: gate x0, up x1
                            [[0.0, 1.0], [1.0, 1.0]]])   # expert 1: gate x1, up x0 + x1
    down = torch.tensor([[[2.0], [0.0]], [[0.0], [3.0]]])  # e0 -> (2h, 0); e1 -> (0, 3h)

    def expert(e: int, v: torch.Tensor) -> torch.Tensor:
        g, u = gate_up[e] @ v
        return down[e][:, 0] * (silu(g) * u)

    for k, normalize in ((1, False), (1, True), (2, False)):
        routing = Routing(2, k, normalize, float32_weights=True)
        got = moe_block(x, MoeWeights(router, gate_up, down, routing))
        for t in range(2):
            p = torch.softmax(x[t], dim=0)
            top = p.argsort(descending=True)[:k]
            w = p[top] / (p[top].sum() if normalize else 1.0)
            want = sum(w[j] * expert(int(top[j]), x[t]) for j in range(k))
            torch.testing.assert_close(got[t], want, atol=1e-6, rtol=0)
    # token 0 (logits 1, 2) picks expert 1 with p = e^2 / (e + e^2)
    weights, experts = route(x @ router.T, Routing(2, 1, False, True))
    assert experts.tolist() == [[1], [1]]
    assert weights[0, 0].item() == pytest.approx(torch.e ** 2 / (torch.e + torch.e ** 2))


def test_dense_layers_by_sparse_step_and_mlp_only_layers():
    """Qwen-MoE's rule: layer i is sparse iff i not in mlp_only_layers and
    (i + 1) % decoder_sparse_step == 0; Mixtral's layers are all sparse."""
    base = {"model_type": "qwen3_moe", "hidden_size": 64, "num_attention_heads": 4,
            "num_hidden_layers": 6, "vocab_size": 64, "num_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": 16, "intermediate_size": 32}
    assert ModelArch.from_config(base).moe_layers == (True,) * 6
    arch = ModelArch.from_config(base | {"decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert arch.moe_layers == (False, True, False, False, False, True)
    mixtral = ModelArch.from_config({**base, "model_type": "mixtral", "num_local_experts": 4,
                                     "mlp_only_layers": [0]})
    assert mixtral.moe_layers == (True,) * 6 and mixtral.norm_topk_prob

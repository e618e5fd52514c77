"""The functional decoder block computes what transformers computes."""

import torch

from llmctl.quant import block
from llmctl.quant.checkpoint import Checkpoint


def _layer_weights(ckpt: Checkpoint, i: int) -> dict:
    prefix = f"model.layers.{i}."
    out = {}
    for name in ckpt.names():
        if name.startswith(prefix):
            key = name[len(prefix):]
            if key.endswith("norm.weight"):
                key = key.removesuffix(".weight")
            out[key] = ckpt.get(name)
    return out


def test_block_by_block_forward_matches_transformers(tiny_llama):
    from transformers import AutoConfig

    from llmctl.models.loading import load_model

    model = load_model(tiny_llama)
    ckpt = Checkpoint(tiny_llama)
    shape = block.BlockShape.from_config(ckpt.text_config)
    ids = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    cos, sin = block.rotary_tables(AutoConfig.from_pretrained(tiny_llama), 24, torch.float32)
    x = ckpt.get("model.embed_tokens.weight")[ids]
    for i in range(ckpt.text_config["num_hidden_layers"]):
        weights = _layer_weights(ckpt, i)
        x = block.forward(x, weights, block.float_linear(weights), shape, cos, sin)
    logits = block.rms_norm(x, ckpt.get("model.norm.weight"), shape.eps) @ ckpt.get("lm_head.weight").t()
    with torch.no_grad():
        expected = model(ids).logits
    assert torch.allclose(logits, expected, atol=1e-4, rtol=1e-4)


def test_rotary_tables_from_any_config_form(tiny_llama):
    # transformers' config object (what the pipeline passes), config.json, or ModelArch
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from llmctl.models.spec import ModelArch

    ckpt = Checkpoint(tiny_llama)
    hf = AutoConfig.from_pretrained(tiny_llama)
    want = LlamaRotaryEmbedding(config=hf)(torch.empty(1, dtype=torch.bfloat16),
                                           torch.arange(16)[None])
    for config in (hf, ckpt.text_config, ModelArch.from_config(ckpt.text_config)):
        cos, sin = block.rotary_tables(config, 16, torch.bfloat16)
        assert torch.equal(cos, want[0]) and torch.equal(sin, want[1])


def test_the_shape_carries_the_family_norm_and_activation(tiny_llama):
    from llmctl.models.layers import RMSNorm

    shape = block.BlockShape.from_config(Checkpoint(tiny_llama).text_config)
    assert shape.norm == RMSNorm(shape.eps) and shape.hidden_act == "silu"
    h = torch.randn(2, 3, 8)
    w = {"mlp.gate_proj.weight": torch.randn(6, 8), "mlp.up_proj.weight": torch.randn(6, 8)}
    linear = block.float_linear(w)
    gate, up = linear("mlp.gate_proj", h), linear("mlp.up_proj", h)
    assert torch.equal(block.mlp_act(h, linear), torch.nn.functional.silu(gate) * up)
    geglu = block.BlockShape(**{**shape.__dict__, "hidden_act": "gelu_pytorch_tanh"})
    want = torch.nn.functional.gelu(gate, approximate="tanh") * up
    assert torch.equal(block.mlp_act(h, linear, geglu), want)
    gemma = block.BlockShape(**{**shape.__dict__, "norm_offset": 1.0})
    x, nw = torch.randn(2, 3, shape.hidden), torch.randn(shape.hidden)
    assert torch.equal(block.attn_input(x, {"input_layernorm": nw}, gemma),
                       block.rms_norm(x, nw, shape.eps, 1.0))


def test_attention_sinks_equal_transformers_eager():
    """``attend`` with sinks (and a sliding window) against gpt-oss's eager attention:
    one more logit per head in every softmax, dropped after it; float32 within 1e-6."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from llmctl.models.layers import attend, repeat_kv, sliding_causal_mask

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 12, 16, generator=gen)
    k, v = (torch.randn(2, 2, 12, 16, generator=gen) for _ in range(2))
    sinks = torch.randn(4, generator=gen) * 2
    mask = sliding_causal_mask(12, 5)
    additive = torch.zeros(12, 12).masked_fill(~mask, float("-inf"))[None, None]
    module = SimpleNamespace(num_key_value_groups=2, sinks=sinks, training=False)
    want, _ = eager_attention_forward(module, q, k, v, additive, scaling=0.25)
    got = attend(q, repeat_kv(k, 2), repeat_kv(v, 2), mask, scale=0.25, sinks=sinks)
    torch.testing.assert_close(got.transpose(1, 2), want, atol=1e-6, rtol=1e-6)
    # a sink of -inf is no sink: SDPA's softmax
    plain = attend(q, repeat_kv(k, 2), repeat_kv(v, 2), mask, scale=0.25)
    none = attend(q, repeat_kv(k, 2), repeat_kv(v, 2), mask, scale=0.25,
                  sinks=torch.full((4,), float("-inf")))
    torch.testing.assert_close(none, plain, atol=1e-6, rtol=1e-6)

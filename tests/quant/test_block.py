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

"""Every family llmctl runs, through the quantizer: the calibration forward against
transformers, the smoothing folds, and each method's checkpoint in transformers and in
llmctl's engine.

The models are the tiny random checkpoints of ``tests/data/families/`` (tests.tiny), each
with its family's features switched on (see tests/serve/model/test_families.py).
"""

from __future__ import annotations

import pytest
import torch

from llmctl.models.spec import ModelArch
from llmctl.quant import block
from llmctl.quant.checkpoint import Checkpoint
from llmctl.quant.stream import LayerStream
from tests.tiny import FAMILY_NAMES

# longer than every window (8, 16) and than Phi-3's LongRoPE switch (32)
SEQ = 40


def _ids(n: int = 2, seq: int = SEQ, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 500, (n, seq), generator=torch.Generator().manual_seed(seed))


def _layer_weights(ckpt: Checkpoint, i: int) -> dict[str, torch.Tensor]:
    prefix = f"model.layers.{i}."
    out = {}
    for name in ckpt.names():
        if name.startswith(prefix):
            key = name[len(prefix):]
            out[key.removesuffix(".weight") if key.endswith("norm.weight") else key] = \
                ckpt.get(name, torch.float32)
    return out


def stream_hidden_states(path, ids: torch.Tensor) -> list[torch.Tensor]:
    """The residual stream after every layer, as the quantizer's calibration pass computes
    it with float weights (embedding, then tap by tap through each layer)."""
    ckpt = Checkpoint(path)
    arch = ModelArch.from_config(ckpt.config)
    stream = LayerStream.for_model(arch, ids.shape[1], 1, torch.float32, "cpu")
    X = block.embed(ckpt.get("model.embed_tokens.weight", torch.float32), ids, arch)
    outs = []
    for i in range(arch.num_layers):
        stream.at(i)
        fw = stream.forward_weights(_layer_weights(ckpt, i))
        linear = stream.linear(fw, {})
        for tap in (*block.TAPS, "out"):
            stream.inputs(tap, X, fw, linear, None, advance=True)
        outs.append(X.clone())
    return outs


def hf_hidden_states(path, ids: torch.Tensor) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    outs: list[torch.Tensor] = []
    for layer in model.model.layers:
        layer.register_forward_hook(
            lambda m, a, out: outs.append((out[0] if isinstance(out, tuple) else out).clone()))
    with torch.inference_mode():
        model(ids)
    return outs


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_calibration_forward_equals_transformers_after_every_layer(tiny_family, name):
    """float32, 2 x 40 tokens: every layer's output within 1e-5 (relative to its scale)."""
    path = tiny_family(name)
    ids = _ids()
    got, want = stream_hidden_states(path, ids), hf_hidden_states(path, ids)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        err = ((g - w).abs().max() / w.abs().max()).item()
        assert err < 1e-5, f"{name} layer {i}: {err:.2e}"

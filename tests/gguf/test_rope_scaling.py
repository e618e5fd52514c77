"""RoPE scaling survives export: llama.cpp's logits equal transformers' with scaled RoPE."""

from __future__ import annotations

import numpy as np
import pytest

ROPE = {
    # Llama 3.1: per-frequency factors, exported as the rope_freqs tensor.
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
               "rope_theta": 10000.0},
    # Position interpolation: llama.cpp's rope.scaling.type = linear.
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
}


@pytest.mark.parametrize("kind", sorted(ROPE))
def test_scaled_rope_logits_match_transformers(llama_cpp, tmp_path, kind):
    from llmctl.gguf.compare import llamacpp_logits, transformers_logits
    from llmctl.gguf.export import quantize_to_gguf
    from llmctl.models.gguf_reader import read_metadata
    from tests.tiny import build_tiny_llama

    model = build_tiny_llama(tmp_path / kind, layers=1, rope_parameters=dict(ROPE[kind]))
    summary = quantize_to_gguf(model, tmp_path / f"{kind}.gguf", "F32")
    meta, tensors = read_metadata(summary["path"])
    if kind == "llama3":
        assert "rope_freqs.weight" in {t.name for t in tensors}
    else:
        assert meta["llama.rope.scaling.type"] == "linear"
        assert meta["llama.rope.scaling.factor"] == 2.0
    ids = [list(range(3, 130))]  # past the original 64 positions
    ref = transformers_logits(model, ids)[0]
    ours = llamacpp_logits(summary["path"], ids)[0]
    np.testing.assert_allclose(ours, ref, atol=2e-5 * np.abs(ref).max(), rtol=0)

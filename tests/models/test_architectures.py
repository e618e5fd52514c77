import numpy as np
import pytest

from llmctl.errors import UnsupportedArchitectureError
from llmctl.models.architectures import (
    architecture_for_gguf,
    expand_tensor_names,
    get_architecture,
    rope_permute,
    rope_unpermute,
)


@pytest.mark.parametrize("n_head", [1, 3, 9])
def test_rope_permutation_is_inverted_exactly(n_head):
    w = np.random.default_rng(0).standard_normal((n_head * 64, 40)).astype(np.float32)
    permuted = rope_permute(w, n_head)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(rope_unpermute(permuted, n_head), w)


def test_rope_permutation_interleaves_halves():
    # One head of dim 4: HF rows [a0 a1 | b0 b1] (halves) -> llama.cpp [a0 b0 a1 b1].
    w = np.arange(4, dtype=np.float32)[:, None]
    assert rope_permute(w, 1)[:, 0].tolist() == [0, 2, 1, 3]


def test_tensor_names_cover_every_block_and_are_unique():
    names = expand_tensor_names(get_architecture("llama"), 3)
    assert names["model.layers.2.mlp.down_proj.weight"] == "blk.2.ffn_down.weight"
    assert len(set(names.values())) == len(names) == 3 + 3 * 9
    qwen3 = expand_tensor_names(get_architecture("qwen3"), 1)
    assert qwen3["model.layers.0.self_attn.k_norm.weight"] == "blk.0.attn_k_norm.weight"


def test_unknown_architectures_name_the_supported_ones():
    with pytest.raises(UnsupportedArchitectureError, match="llama"):
        get_architecture("bert")
    with pytest.raises(UnsupportedArchitectureError, match="qwen2"):
        architecture_for_gguf("mamba")

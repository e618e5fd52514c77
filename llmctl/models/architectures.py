"""The model families llmctl converts, quantizes and runs: the rows of
:data:`llmctl.models.spec.FAMILIES` that name a transformers class, their lookup, their
GGUF tensor names per block and llama.cpp's RoPE row permutation.
"""

from __future__ import annotations

from llmctl.errors import UnsupportedArchitectureError
from llmctl.models.spec import (  # noqa: F401 (re-exported: the tables live in spec)
    FAMILIES,
    LLAMA_TENSORS,
    QK_NORM_TENSORS,
    QKV_BIAS_TENSORS,
    Family,
)

# GGUF metadata key (``{arch}`` = general.architecture) -> HF config field.
GGUF_CONFIG_KEYS: dict[str, str] = {
    "{arch}.block_count": "num_hidden_layers",
    "{arch}.context_length": "max_position_embeddings",
    "{arch}.embedding_length": "hidden_size",
    "{arch}.feed_forward_length": "intermediate_size",
    "{arch}.attention.head_count": "num_attention_heads",
    "{arch}.attention.head_count_kv": "num_key_value_heads",
    "{arch}.attention.key_length": "head_dim",
    "{arch}.rope.freq_base": "rope_theta",
    "{arch}.attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "{arch}.vocab_size": "vocab_size",
}

# A family row that llmctl converts, quantizes and runs (it names a transformers class).
Architecture = Family

ARCHITECTURES: dict[str, Architecture] = {
    t: row for t, row in FAMILIES.items() if row.causal_lm_class is not None}


def get_architecture(model_type: str) -> Architecture:
    try:
        return ARCHITECTURES[model_type]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"model type {model_type!r} is not supported",
            f"llmctl runs {', '.join(sorted(ARCHITECTURES))}; adding a family: "
            "docs/architecture.md, 'Where to add'",
        ) from None


def architecture_for_gguf(gguf_arch: str) -> Architecture:
    """The first row whose llama.cpp name matches (``llama`` maps to Llama itself)."""
    for arch in ARCHITECTURES.values():
        if arch.gguf_arch == gguf_arch:
            return arch
    known = sorted({a.gguf_arch for a in ARCHITECTURES.values()})
    raise UnsupportedArchitectureError(
        f"GGUF architecture {gguf_arch!r} is not supported",
        f"llmctl reads GGUF files of: {', '.join(known)}",
    )


def expand_tensor_names(arch: Architecture, n_blocks: int) -> dict[str, str]:
    """HF name -> GGUF name for every tensor a model with ``n_blocks`` may have."""
    names: dict[str, str] = {}
    for hf, gg in arch.tensors.items():
        if "{bid}" in hf:
            for bid in range(n_blocks):
                names[hf.format(bid=bid)] = gg.format(bid=bid)
        else:
            names[hf] = gg
    return names


def rope_permute(weight, n_head: int):
    """HF (rotate-halves) q/k rows -> llama.cpp (interleaved pairs) layout."""
    rows = weight.shape[0]
    return (
        weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def rope_unpermute(weight, n_head: int):
    """Inverse of :func:`rope_permute`."""
    rows = weight.shape[0]
    return (
        weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )

"""The model families llmctl converts, quantizes and runs: the rows of
:data:`llmctl.models.spec.FAMILIES` that name a transformers class, their lookup, their
GGUF tensor names per block, and what llama.cpp's converter (convert_hf_to_gguf.py) does to
a tensor or a config field of each architecture on the way in, with its inverse on the way
out: the RoPE row permutation, Gemma's +1 on norm weights, the metadata keys past the
shared ones. The writer (:mod:`llmctl.gguf.writer`) and the readers
(:mod:`llmctl.models.gguf_reader`, :mod:`llmctl.serve.model.gguf_weights`) share them.
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

# Per llama.cpp architecture: GGUF metadata key -> HF config field, past the shared keys
# above (convert_hf_to_gguf.py's set_gguf_parameters; the names llama-arch.cpp reads).
GGUF_ARCH_KEYS: dict[str, dict[str, str]] = {
    "gemma2": {"{arch}.attn_logit_softcapping": "attn_logit_softcapping",
               "{arch}.final_logit_softcapping": "final_logit_softcapping",
               "{arch}.attention.sliding_window": "sliding_window"},
    "gemma3": {"{arch}.attention.sliding_window": "sliding_window"},
    "gpt-oss": {"{arch}.attention.sliding_window": "sliding_window"},
    "granite": {"{arch}.embedding_scale": "embedding_multiplier",
                "{arch}.residual_scale": "residual_multiplier",
                "{arch}.attention.scale": "attention_multiplier",
                "{arch}.logit_scale": "logits_scaling"},
    "phi3": {"{arch}.attention.sliding_window": "sliding_window",
             "{arch}.rope.scaling.original_context_length": "original_max_position_embeddings"},
}
# the fields above that are token counts (uint32); the others are float32
GGUF_INT_FIELDS = {"sliding_window", "original_max_position_embeddings"}

# llama.cpp's Gemma graphs scale by the stored norm weight: its converter adds the 1 that
# transformers' Gemma RMSNorm adds at run time (every ``*norm.weight``, q/k norms too)
NORM_SHIFT: dict[str, float] = {"gemma": 1.0, "gemma2": 1.0, "gemma3": 1.0}


# A family row that llmctl converts, quantizes and runs (it names a transformers class).
Architecture = Family

ARCHITECTURES: dict[str, Architecture] = {
    t: row for t, row in FAMILIES.items() if row.causal_lm_class is not None}


def get_architecture(model_type: str, *, refuse_moe: str | None = None) -> Architecture:
    """The row of ``model_type``. ``refuse_moe``: the name of a command that does not
    handle mixtures of experts yet (the engine, quantize and GGUF export do; the build
    targets and the importance matrix do not): such a row is refused in one line rather
    than failing midway."""
    try:
        row = ARCHITECTURES[model_type]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"model type {model_type!r} is not supported",
            f"llmctl runs {', '.join(sorted(ARCHITECTURES))}; adding a family: "
            "docs/architecture.md, 'Where to add'",
        ) from None
    if refuse_moe and row.moe is not None:
        dense = sorted(t for t, a in ARCHITECTURES.items() if a.moe is None)
        raise UnsupportedArchitectureError(
            f"{refuse_moe} does not handle mixture-of-experts models ({model_type}) yet",
            f"`llmctl serve` / `generate` run it as it is; {refuse_moe} takes: "
            + ", ".join(dense))
    return row


def architecture_for_gguf(gguf_arch: str, *, experts: bool = False) -> Architecture:
    """The first row whose llama.cpp name matches, dense or with experts as the file's
    ``expert_count`` says (``llama`` maps to Llama itself, and to Mixtral with experts)."""
    for arch in ARCHITECTURES.values():
        if arch.gguf_arch == gguf_arch and (arch.moe is not None) == experts:
            return arch
    known = sorted({a.gguf_arch + (" with experts" if a.moe else "")
                    for a in ARCHITECTURES.values() if a.gguf_arch})
    kind = f"{gguf_arch!r} with experts" if experts else repr(gguf_arch)
    raise UnsupportedArchitectureError(
        f"GGUF architecture {kind} is not supported",
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


def _rotated_heads(arch: Architecture, hf_name: str, n_head: int, n_kv: int) -> int | None:
    if not arch.rope_permute:
        return None
    if hf_name.endswith("q_proj.weight"):
        return n_head
    return n_kv if hf_name.endswith("k_proj.weight") else None


def to_gguf(arch: Architecture, hf_name: str, array, n_head: int, n_kv: int):
    """An HF tensor as llama.cpp's converter stores it (float32 in, float32 out)."""
    heads = _rotated_heads(arch, hf_name, n_head, n_kv)
    if heads:
        array = rope_permute(array, heads)
    shift = NORM_SHIFT.get(arch.gguf_arch)
    if shift and hf_name.endswith("norm.weight"):
        array = array + array.dtype.type(shift)
    return array


def from_gguf(arch: Architecture, hf_name: str, array, n_head: int, n_kv: int):
    """Inverse of :func:`to_gguf`. Gemma's norms come back within 2**-24 of the original:
    ``(w + 1) - 1`` in float32 is exact only where ``w + 1`` was."""
    heads = _rotated_heads(arch, hf_name, n_head, n_kv)
    if heads:
        array = rope_unpermute(array, heads)
    shift = NORM_SHIFT.get(arch.gguf_arch)
    if shift and hf_name.endswith("norm.weight"):
        array = array - array.dtype.type(shift)
    return array

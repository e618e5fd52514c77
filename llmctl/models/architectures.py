"""The model families llmctl supports, as data.

One row per Hugging Face ``model_type``: the transformers classes, the llama.cpp
architecture name, and the tensors each block carries beyond the Llama core. Adding
a Llama-like family is adding a row here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmctl.errors import UnsupportedArchitectureError

# HF parameter name -> GGUF tensor name, shared by every Llama-family model.
# ``{bid}`` is the decoder block index (gguf-py's tensor_mapping uses the same idea).
LLAMA_TENSORS: dict[str, str] = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.{bid}.input_layernorm.weight": "blk.{bid}.attn_norm.weight",
    "model.layers.{bid}.self_attn.q_proj.weight": "blk.{bid}.attn_q.weight",
    "model.layers.{bid}.self_attn.k_proj.weight": "blk.{bid}.attn_k.weight",
    "model.layers.{bid}.self_attn.v_proj.weight": "blk.{bid}.attn_v.weight",
    "model.layers.{bid}.self_attn.o_proj.weight": "blk.{bid}.attn_output.weight",
    "model.layers.{bid}.post_attention_layernorm.weight": "blk.{bid}.ffn_norm.weight",
    "model.layers.{bid}.mlp.gate_proj.weight": "blk.{bid}.ffn_gate.weight",
    "model.layers.{bid}.mlp.up_proj.weight": "blk.{bid}.ffn_up.weight",
    "model.layers.{bid}.mlp.down_proj.weight": "blk.{bid}.ffn_down.weight",
}

QKV_BIAS_TENSORS: dict[str, str] = {
    "model.layers.{bid}.self_attn.q_proj.bias": "blk.{bid}.attn_q.bias",
    "model.layers.{bid}.self_attn.k_proj.bias": "blk.{bid}.attn_k.bias",
    "model.layers.{bid}.self_attn.v_proj.bias": "blk.{bid}.attn_v.bias",
}

QK_NORM_TENSORS: dict[str, str] = {
    "model.layers.{bid}.self_attn.q_norm.weight": "blk.{bid}.attn_q_norm.weight",
    "model.layers.{bid}.self_attn.k_norm.weight": "blk.{bid}.attn_k_norm.weight",
}

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


@dataclass(frozen=True)
class Architecture:
    model_type: str
    causal_lm_class: str
    gguf_arch: str
    # llama.cpp's "llama" graph applies RoPE to interleaved pairs, HF to halves, so
    # its converter permutes q/k rows; NEOX-style families (qwen) are stored as is.
    rope_permute: bool
    tensors: dict[str, str] = field(default_factory=lambda: dict(LLAMA_TENSORS))


ARCHITECTURES: dict[str, Architecture] = {
    a.model_type: a
    for a in (
        Architecture("llama", "LlamaForCausalLM", "llama", rope_permute=True),
        Architecture("mistral", "MistralForCausalLM", "llama", rope_permute=True),
        Architecture(
            "qwen2",
            "Qwen2ForCausalLM",
            "qwen2",
            rope_permute=False,
            tensors={**LLAMA_TENSORS, **QKV_BIAS_TENSORS},
        ),
        Architecture(
            "qwen3",
            "Qwen3ForCausalLM",
            "qwen3",
            rope_permute=False,
            tensors={**LLAMA_TENSORS, **QK_NORM_TENSORS},
        ),
    )
}


def get_architecture(model_type: str) -> Architecture:
    try:
        return ARCHITECTURES[model_type]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"model type {model_type!r} is not supported",
            f"llmctl supports the Llama family: {', '.join(sorted(ARCHITECTURES))}",
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

"""Mixtures of experts in GGUF, as llama.cpp's converter writes them and its graphs read
them. The tensor names, both ways, are :mod:`llmctl.models.gguf_experts`'s (the readers
share them); here is what only the writer does.

- Keys: ``expert_count``, ``expert_used_count``, ``expert_feed_forward_length`` (one
  expert's width; Mixtral's is ``feed_forward_length``), and
  ``expert_shared_feed_forward_length``.

What the graphs fix rather than read, refused when a model differs
(:func:`problems`): llama.cpp's ``llama`` graph (Mixtral) and ``qwen3moe`` renormalise the
top-k routing weights, ``qwen2moe`` does not (``build_moe_ffn``'s ``norm_w``); none has
dense layers among the MoE ones (Qwen's ``mlp_only_layers``/``decoder_sparse_step``);
``gpt-oss`` routes top-k then softmax and clamps its SwiGLU with alpha 1.702 and limit 7.0
(``LLM_FFN_SWIGLU_OAI_MOE``'s constants, not read from the file).
"""

from __future__ import annotations

from llmctl.models.gguf_experts import RENORMALIZES, ROUTING, SWIGLU_OAI
from llmctl.models.spec import ModelArch


def problems(arch: str, spec: ModelArch) -> list[str]:
    """What llama.cpp's ``arch`` graph computes differently for this MoE model."""
    out = []
    if not all(spec.moe_layers):
        dense = [i for i, sparse in enumerate(spec.moe_layers) if not sparse]
        out.append(f"its graph has no dense layers among the experts (layers {dense})")
    if spec.norm_topk_prob != RENORMALIZES[arch]:
        out.append("its graph " + ("renormalises" if RENORMALIZES[arch] else "does not "
                                   "renormalise") + " the top-k routing weights "
                   f"(norm_topk_prob {spec.norm_topk_prob})")
    routing = ROUTING.get(arch, "softmax_topk")
    if spec.family.moe.routing != routing:
        out.append(f"its graph routes {routing}, the model {spec.family.moe.routing}")
    if spec.expert_act == "clamped_swiglu":
        for key, fixed in SWIGLU_OAI.items():
            value = getattr(spec, key)
            if value != fixed:
                out.append(f"its graph fixes {key} at {fixed}, the model's is {value} "
                           "(config.json)")
    return out


def write_metadata(writer, arch: str, spec: ModelArch) -> None:
    writer.add_expert_count(spec.num_experts)
    writer.add_expert_used_count(spec.experts_per_token)
    if arch != "llama":  # the llama graph reads feed_forward_length for its experts
        writer.add_expert_feed_forward_length(spec.expert_intermediate_size)
    if spec.shared_expert_intermediate_size:
        writer.add_expert_shared_feed_forward_length(spec.shared_expert_intermediate_size)

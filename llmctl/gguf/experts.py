"""Mixtures of experts in GGUF, as llama.cpp's converter writes them and its graphs read
them.

- Each MoE layer's experts are stacked into one tensor per projection, ``[E, out, in]``
  rows first (ggml: ``{in, out, E}``): ``ffn_gate_exps``, ``ffn_up_exps``,
  ``ffn_down_exps``, from the checkpoint's per-expert tensors (what transformers'
  ``save_pretrained`` writes) in expert order.
- The router is ``ffn_gate_inp``; Qwen2-MoE's shared expert ``ffn_{gate,up,down}_shexp``
  and its sigmoid gate ``ffn_gate_inp_shexp`` (``[1, hidden]`` as stored: ggml's
  ``{hidden, 1}`` is the ``{n_embd}`` its loader asks for).
- Keys: ``expert_count``, ``expert_used_count``, ``expert_feed_forward_length`` (one
  expert's width; Mixtral's is ``feed_forward_length``), and
  ``expert_shared_feed_forward_length``.

What the graphs fix rather than read, refused when a model differs
(:func:`problems`): llama.cpp's ``llama`` graph (Mixtral) and ``qwen3moe`` renormalise the
top-k routing weights, ``qwen2moe`` does not (``build_moe_ffn``'s ``norm_w``); none has
dense layers among the MoE ones (Qwen's ``mlp_only_layers``/``decoder_sparse_step``).
"""

from __future__ import annotations

from llmctl.models.spec import Family, ModelArch

# llama.cpp graph -> whether it renormalises the top-k routing weights to sum 1
RENORMALIZES = {"llama": True, "qwen3moe": True, "qwen2moe": False}
_STACKED = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")  # the layout's gate, up, down
_SHARED = ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")


def single_names(row: Family, n_blocks: int) -> dict[str, str]:
    """HF -> GGUF names of the MoE tensors stored one to one: router, shared expert."""
    moe, out = row.moe, {}
    for bid in range(n_blocks):
        hf, gg = f"model.layers.{bid}.", f"blk.{bid}."
        out[f"{hf}{moe.router}.weight"] = f"{gg}ffn_gate_inp.weight"
        if moe.shared:
            for name, gguf_name in zip(moe.shared, _SHARED, strict=True):
                out[f"{hf}{name}.weight"] = f"{gg}{gguf_name}.weight"
        if moe.shared_gate:
            out[f"{hf}{moe.shared_gate}.weight"] = f"{gg}ffn_gate_inp_shexp.weight"
    return out


def stacked_names(row: Family, n_blocks: int, n_experts: int
                  ) -> dict[str, tuple[str, ...]]:
    """GGUF name -> the per-expert HF tensors stacked into it, in expert order."""
    out = {}
    for bid in range(n_blocks):
        for name, gguf_name in zip(row.moe.experts, _STACKED, strict=True):
            out[f"blk.{bid}.{gguf_name}.weight"] = tuple(
                f"model.layers.{bid}.{name.format(e=e)}.weight" for e in range(n_experts))
    return out


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
    return out


def write_metadata(writer, arch: str, spec: ModelArch) -> None:
    writer.add_expert_count(spec.num_experts)
    writer.add_expert_used_count(spec.experts_per_token)
    if arch != "llama":  # the llama graph reads feed_forward_length for its experts
        writer.add_expert_feed_forward_length(spec.expert_intermediate_size)
    if spec.shared_expert_intermediate_size:
        writer.add_expert_shared_feed_forward_length(spec.shared_expert_intermediate_size)

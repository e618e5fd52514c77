"""Mixtures of experts in GGUF terms, both ways: which GGUF tensor holds which Hugging
Face tensor, and which metadata key holds which config field. The writer
(:mod:`llmctl.gguf.experts`) and the readers (:mod:`llmctl.models.gguf_reader`,
:mod:`llmctl.serve.model.gguf_weights`) share these tables.

- Each MoE layer's experts are stacked into one tensor per projection, ``[E, out, in]``
  rows first (ggml: ``{in, out, E}``): ``ffn_gate_exps``, ``ffn_up_exps``,
  ``ffn_down_exps``, from the per-expert tensors in expert order; expert ``e`` of a stack
  is its ``[e]`` slice.
- The router is ``ffn_gate_inp``; Qwen2-MoE's shared expert ``ffn_{gate,up,down}_shexp``
  and its sigmoid gate ``ffn_gate_inp_shexp`` (``[1, hidden]``), one to one.
- What llama.cpp's graphs fix rather than read: whether the top-k routing weights are
  renormalised (``llama`` for Mixtral and ``qwen3moe`` do, ``qwen2moe`` does not), and
  that every layer is sparse. A file read back gets those as config fields.
"""

from __future__ import annotations

from typing import Any

from llmctl.models.spec import Family

# llama.cpp graph -> whether it renormalises the top-k routing weights to sum 1
RENORMALIZES = {"llama": True, "qwen3moe": True, "qwen2moe": False}
STACKED = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")  # the layout's gate, up, down
SHARED = ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")


def single_names(row: Family, n_blocks: int) -> dict[str, str]:
    """HF -> GGUF names of the MoE tensors stored one to one: router, shared expert."""
    moe, out = row.moe, {}
    for bid in range(n_blocks):
        hf, gg = f"model.layers.{bid}.", f"blk.{bid}."
        out[f"{hf}{moe.router}.weight"] = f"{gg}ffn_gate_inp.weight"
        if moe.shared:
            for name, gguf_name in zip(moe.shared, SHARED, strict=True):
                out[f"{hf}{name}.weight"] = f"{gg}{gguf_name}.weight"
        if moe.shared_gate:
            out[f"{hf}{moe.shared_gate}.weight"] = f"{gg}ffn_gate_inp_shexp.weight"
    return out


def stacked_names(row: Family, n_blocks: int, n_experts: int) -> dict[str, tuple[str, ...]]:
    """GGUF name -> the per-expert HF tensors stacked into it, in expert order."""
    out = {}
    for bid in range(n_blocks):
        for name, gguf_name in zip(row.moe.experts, STACKED, strict=True):
            out[f"blk.{bid}.{gguf_name}.weight"] = tuple(
                f"model.layers.{bid}.{name.format(e=e)}.weight" for e in range(n_experts))
    return out


def config_fields(row: Family, gguf_arch: str, field) -> dict[str, Any]:
    """The config.json fields of a MoE file's metadata (``field(key)`` reads one key, None
    when absent): expert count and width, experts per token, the shared expert's width,
    and what the graph fixes (renormalisation, every layer sparse, no sliding window)."""
    moe = row.moe
    # every name the family's configs use for the count (transformers 5 writes Qwen3-MoE's
    # as num_local_experts, 4.x as num_experts)
    out: dict[str, Any] = dict.fromkeys(moe.experts_key, int(field(f"{gguf_arch}.expert_count")))
    out["num_experts_per_tok"] = int(field(f"{gguf_arch}.expert_used_count"))
    width = field(f"{gguf_arch}.expert_feed_forward_length")
    if width is not None:  # Mixtral's experts are feed_forward_length wide (already read)
        out[moe.expert_width_key] = int(width)
    shared = field(f"{gguf_arch}.expert_shared_feed_forward_length")
    if moe.shared is not None:
        out["shared_expert_intermediate_size"] = int(shared or 0)
    if isinstance(moe.renormalize, str):
        out[moe.renormalize] = RENORMALIZES[gguf_arch]
    if moe.dense_layers:
        out.update(decoder_sparse_step=1, mlp_only_layers=[])
    if row.windows == "every_layer":
        out["sliding_window"] = None
    return out

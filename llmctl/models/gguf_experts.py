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
- gpt-oss (``MoeLayout.gpt_oss_experts``) keeps its experts fused: ``gate_up_proj [E, H,
  2I]`` and ``down_proj [E, I, H]`` stored ``x @ W``, with ``_bias`` tensors ``[E, 2I]``,
  ``[E, H]``, gate and up interleaved (gate = output feature ``2j``, up = ``2j + 1``).
  llama.cpp's converter de-interleaves them (:class:`Cut`): rows first, ``ffn_gate_exps``
  is gate_up's even output features, ``ffn_up_exps`` its odd ones, ``ffn_down_exps`` all of
  down's; each with a ``.bias`` cut the same way. The router has a bias
  (``ffn_gate_inp.bias``).
- What llama.cpp's graphs fix rather than read: whether the top-k routing weights are
  renormalised (``llama`` for Mixtral and ``qwen3moe`` do, ``qwen2moe`` does not), the
  routing order (``gpt-oss``: the top k logits, then a softmax over them), gpt-oss's
  SwiGLU constants, and that every layer is sparse. A file read back gets those as config
  fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from llmctl.models.spec import Family

# llama.cpp graph -> whether it renormalises the top-k routing weights to sum 1 (gpt-oss's
# softmax over the k already sums to 1: nothing to renormalise)
RENORMALIZES = {"llama": True, "qwen3moe": True, "qwen2moe": False, "gpt-oss": False}
# llama.cpp graph -> how router logits become the k weights (MoeLayout.routing): gpt-oss's
# LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT, the others' softmax over all experts
ROUTING = {"gpt-oss": "topk_softmax"}
# the constants of LLM_FFN_SWIGLU_OAI_MOE, which build_moe_ffn fixes (llama-graph.cpp:
# "TODO: move to hparams?") rather than reads: gpt-oss's config fields at their defaults
SWIGLU_OAI = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}
STACKED = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")  # the layout's gate, up, down
SHARED = ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")


@dataclass(frozen=True)
class Cut:
    """A GGUF tensor cut out of a fused HF one: output features ``part::parts`` of
    ``source`` seen rows first (weights ``[E, out, in]``, biases ``[E, out]``: the output
    features are axis 1 of both). ``x_at_w``: ``source`` is a float weight stored ``x @ W``
    (``[E, in, out]``), transposed on the way (MXFP4 ``_blocks`` are rows first already)."""

    source: str
    part: int = 0
    parts: int = 1
    x_at_w: bool = False

    def take(self, rows_first):
        """The part's output features (a numpy array or a torch tensor, rows first)."""
        return rows_first[:, self.part::self.parts]

    def shape(self, rows_first: tuple[int, ...]) -> tuple[int, ...]:
        return (rows_first[0], rows_first[1] // self.parts, *rows_first[2:])


def join(cuts: list[tuple[Cut, np.ndarray]]) -> np.ndarray:
    """The inverse of :meth:`Cut.take` for every cut of one source: the fused tensor as
    the checkpoint stores it (each part's output features back in their interleaved
    places, a weight transposed back to ``x @ W``)."""
    first_cut, first = cuts[0]
    out = np.empty((first.shape[0], first.shape[1] * first_cut.parts, *first.shape[2:]),
                   dtype=np.float32)
    for cut, array in cuts:
        out[:, cut.part::cut.parts] = array
    return np.ascontiguousarray(out.swapaxes(1, 2)) if first_cut.x_at_w else out


def cut_names(row: Family, n_blocks: int) -> dict[str, Cut]:
    """GGUF name -> its :class:`Cut` of gpt-oss's fused experts (empty for the per-expert
    layouts: :func:`stacked_names`)."""
    if not row.moe.gpt_oss_experts:
        return {}
    gate_up, down = row.moe.fused
    wanted = ((STACKED[0], gate_up, 0, 2), (STACKED[1], gate_up, 1, 2), (STACKED[2], down, 0, 1))
    out = {}
    for bid in range(n_blocks):
        for gguf_name, fused, part, parts in wanted:
            source = f"model.layers.{bid}.{fused}"
            out[f"blk.{bid}.{gguf_name}.weight"] = Cut(source, part, parts, x_at_w=True)
            out[f"blk.{bid}.{gguf_name}.bias"] = Cut(f"{source}_bias", part, parts)
    return out


def single_names(row: Family, n_blocks: int) -> dict[str, str]:
    """HF -> GGUF names of the MoE tensors stored one to one: router (and its bias),
    shared expert."""
    moe, out = row.moe, {}
    for bid in range(n_blocks):
        hf, gg = f"model.layers.{bid}.", f"blk.{bid}."
        out[f"{hf}{moe.router}.weight"] = f"{gg}ffn_gate_inp.weight"
        if moe.router_bias:
            out[f"{hf}{moe.router}.bias"] = f"{gg}ffn_gate_inp.bias"
        if moe.shared:
            for name, gguf_name in zip(moe.shared, SHARED, strict=True):
                out[f"{hf}{name}.weight"] = f"{gg}{gguf_name}.weight"
        if moe.shared_gate:
            out[f"{hf}{moe.shared_gate}.weight"] = f"{gg}ffn_gate_inp_shexp.weight"
    return out


def stacked_names(row: Family, n_blocks: int, n_experts: int) -> dict[str, tuple[str, ...]]:
    """GGUF name -> the per-expert HF tensors stacked into it, in expert order (empty for
    gpt-oss's fused experts: :func:`cut_names`)."""
    if row.moe.gpt_oss_experts:
        return {}
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
    if moe.gpt_oss_experts:
        out.update(SWIGLU_OAI)
    return out

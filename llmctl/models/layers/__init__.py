"""The layer building blocks every forward of llmctl shares: the engine's
(:mod:`llmctl.serve.model.decoder`, whose native kernels stay its own fast paths), the
quantizer's block forward (:mod:`llmctl.quant.block`) and the static decoder
(:mod:`llmctl.engines.static_decoder`).

- :mod:`.norm`: RMSNorm, transformers' order and torch's fused op; the family's weight
  offset as data.
- :mod:`.rope`: inverse frequencies per ``rope_type``, cos/sin and complex tables,
  partial rotary, the rotation in the halves and the interleaved-pairs layouts.
- :mod:`.attention`: q/k norm, grouped-query expansion, masks, score scale and
  soft-capping.
- :mod:`.mlp`: the gated MLP's activation by name (SwiGLU, GeGLU).
- :mod:`.moe`: the sparse mixture-of-experts block: routing, grouped experts, weighted
  combine, shared expert (Mixtral, Qwen2-MoE, Qwen3-MoE); gpt-oss's top-k-then-softmax
  routing, biased experts and clamped SwiGLU (``EXPERT_ACTS``).
- :mod:`.registry`: the lookup by name that refuses an unknown variant with the known ones.

A family that computes something new adds a function or an entry here and a field in
its row of :data:`llmctl.models.spec.FAMILIES`; the forwards read both. Plain torch
functions over tensors, not ``nn.Module``s: the engine's CPU decode step cannot afford
a module call per op.
"""

from llmctl.models.layers.attention import attend, qk_norm, repeat_kv, sliding_causal_mask
from llmctl.models.layers.mlp import ACTIVATIONS, activation, fused_gated, gated
from llmctl.models.layers.moe import MoeWeights, Routing, grouped_experts, route, sparse_moe
from llmctl.models.layers.norm import RMSNorm, add_rms_norm, fused_rms_norm, rms_norm
from llmctl.models.layers.rope import (
    ROPE_TYPES,
    RoPE,
    inv_freq,
    rope_cos_sin,
    rope_freqs,
    rotary_dim,
    rotate_halves,
    rotate_pairs,
)

__all__ = [
    "ACTIVATIONS", "ROPE_TYPES", "MoeWeights", "RMSNorm", "RoPE", "Routing", "activation",
    "add_rms_norm", "attend", "fused_gated", "fused_rms_norm", "gated", "grouped_experts",
    "inv_freq", "qk_norm", "repeat_kv", "rms_norm", "rope_cos_sin", "rope_freqs",
    "rotary_dim", "rotate_halves", "rotate_pairs", "route", "sliding_causal_mask", "sparse_moe",
]

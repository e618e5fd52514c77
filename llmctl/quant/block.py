"""A Llama-family decoder block as plain functions over a dict of tensors.

Quantization needs the block's intermediate activations (the inputs of each linear) and
must swap weights mid-block, so the block is written out stage by stage instead of
running transformers' module: ``attn_input -> attention -> (o_proj) -> mlp_input ->
mlp_act -> (down_proj)``. Linears are applied through a callback so the caller decides
which weight (float, smoothed, quantized) and which activation quantizer each one uses.

Covers llama / mistral (dense attention; Mistral's sliding window is honoured),
qwen2 (q/k/v biases) and qwen3 (per-head q/k RMSNorm); the shape is a view of
:class:`llmctl.models.spec.ModelArch`. Each stage is a shared building block of
:mod:`llmctl.models.layers`: RMSNorm in transformers' op order (calibration sees what
transformers computes, in bfloat16 too), RoPE per ``rope_type`` in the halves layout,
the gated MLP's activation by the config's name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmctl.models.layers import (
    RMSNorm,
    RoPE,
    activation,
    attend,
    gated,
    qk_norm,
    repeat_kv,
    rotate_halves,
    sliding_causal_mask,
)
from llmctl.models.layers import rms_norm as rms_norm  # noqa: PLC0414 (block.rms_norm)
from llmctl.models.spec import ModelArch

# name of a linear -> the activation that feeds it (its "tap")
TAPS = ("attn_in", "attn_out", "mlp_in", "mlp_act")
LINEAR_TAP: dict[str, str] = {
    "self_attn.q_proj": "attn_in",
    "self_attn.k_proj": "attn_in",
    "self_attn.v_proj": "attn_in",
    "self_attn.o_proj": "attn_out",
    "mlp.gate_proj": "mlp_in",
    "mlp.up_proj": "mlp_in",
    "mlp.down_proj": "mlp_act",
}
# The op whose output is each tap (what smoothing scales fold into).
TAP_SOURCE = {"attn_in": "input_layernorm", "attn_out": "self_attn.v_proj",
              "mlp_in": "post_attention_layernorm", "mlp_act": "mlp.up_proj"}
NORMS = ("input_layernorm", "post_attention_layernorm")
QK_NORMS = ("self_attn.q_norm", "self_attn.k_norm")

Linear = Callable[[str, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class BlockShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    sliding_window: int | None
    norm_offset: float = 0.0  # the family's RMSNorm weight offset (Gemma: 1)
    hidden_act: str = "silu"  # the gated MLP's activation, by config.json's name

    @property
    def norm(self) -> RMSNorm:
        return RMSNorm(self.eps, self.norm_offset)

    @classmethod
    def from_config(cls, config: dict) -> BlockShape:
        return cls.from_arch(ModelArch.from_config(config))

    @classmethod
    def from_arch(cls, arch: ModelArch) -> BlockShape:
        # one window for every block: the family's windows as transformers reads them,
        # when every layer has one (a model mixing full and windowed layers attends fully)
        return cls(hidden=arch.hidden_size, heads=arch.num_heads, kv_heads=arch.num_kv_heads,
                   head_dim=arch.head_dim, eps=arch.rms_norm_eps, sliding_window=arch.kv_window,
                   norm_offset=arch.family.norm_offset, hidden_act=arch.hidden_act)


def rotary_tables(config, seq_len: int, dtype: torch.dtype, device=None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape (1, seq_len, rotary_dim) in ``dtype``: the shared RoPE of the
    model's ``config`` (a :class:`ModelArch`, config.json's dict or transformers' config
    object), computed in float32 as transformers' rotary embedding computes them."""
    if not isinstance(config, ModelArch):
        config = ModelArch.from_config(config if isinstance(config, dict) else config.to_dict())
    cos, sin = RoPE.of(config).cos_sin(seq_len, device)
    return cos[None].to(dtype), sin[None].to(dtype)


def attention(h: torch.Tensor, weights: dict[str, torch.Tensor], linear: Linear,
              shape: BlockShape, cos: torch.Tensor, sin: torch.Tensor,
              observe_kv: Callable[[torch.Tensor, torch.Tensor], None] | None = None
              ) -> torch.Tensor:
    """Self-attention output *before* o_proj, (batch, seq, heads * head_dim);
    ``observe_kv(k, v)`` sees the post-RoPE keys and the values, (batch, kv_heads, seq,
    head_dim), as a KV cache would store them."""
    b, t, _ = h.shape
    q = linear("self_attn.q_proj", h).view(b, t, shape.heads, shape.head_dim)
    k = linear("self_attn.k_proj", h).view(b, t, shape.kv_heads, shape.head_dim)
    v = linear("self_attn.v_proj", h).view(b, t, shape.kv_heads, shape.head_dim)
    if "self_attn.q_norm" in weights:  # qwen3: RMSNorm over each head's vector
        q, k = qk_norm(q, k, weights["self_attn.q_norm"], weights["self_attn.k_norm"],
                       shape.norm)
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    c, s = cos[:, None, :t], sin[:, None, :t]
    q, k = rotate_halves(q, c, s), rotate_halves(k, c, s)
    if observe_kv is not None:
        observe_kv(k, v)
    group = shape.heads // shape.kv_heads
    k, v = repeat_kv(k, group), repeat_kv(v, group)
    if shape.sliding_window and t > shape.sliding_window:
        out = attend(q, k, v, sliding_causal_mask(t, shape.sliding_window, h.device))
    else:
        out = attend(q, k, v, causal=True)
    return out.transpose(1, 2).reshape(b, t, shape.heads * shape.head_dim)


def attn_input(x: torch.Tensor, weights: dict[str, torch.Tensor], shape: BlockShape) -> torch.Tensor:
    return shape.norm(x, weights["input_layernorm"])


def mlp_input(x: torch.Tensor, weights: dict[str, torch.Tensor], shape: BlockShape) -> torch.Tensor:
    return shape.norm(x, weights["post_attention_layernorm"])


def mlp_act(h: torch.Tensor, linear: Linear, shape: BlockShape | None = None) -> torch.Tensor:
    """The gated MLP's activation, the input of down_proj: ``act(gate) * up`` with the
    activation ``shape`` names (None: silu, SwiGLU)."""
    act = activation(shape.hidden_act if shape is not None else "silu")
    return gated(act, linear("mlp.gate_proj", h), linear("mlp.up_proj", h))


def float_linear(weights: dict[str, torch.Tensor]) -> Linear:
    """The callback for an unquantized block: ``x W^T + b`` from ``weights``."""

    def apply(name: str, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weights[f"{name}.weight"], weights.get(f"{name}.bias"))

    return apply


def forward(x: torch.Tensor, weights: dict[str, torch.Tensor], linear: Linear,
            shape: BlockShape, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The whole block (used by tests and the reference path)."""
    a = attention(attn_input(x, weights, shape), weights, linear, shape, cos, sin)
    x = x + linear("self_attn.o_proj", a)
    return x + linear("mlp.down_proj", mlp_act(mlp_input(x, weights, shape), linear, shape))

"""A Llama-family decoder block as plain functions over a dict of tensors.

Quantization needs the block's intermediate activations (the inputs of each linear) and
must swap weights mid-block, so the block is written out stage by stage instead of
running transformers' module: ``attn_input -> attention -> (o_proj) -> mlp_input ->
mlp_act -> (down_proj)``. Linears are applied through a callback so the caller decides
which weight (float, smoothed, quantized) and which activation quantizer each one uses.

Covers llama / mistral (dense attention; Mistral's sliding window is honoured),
qwen2 (q/k/v biases) and qwen3 (per-head q/k RMSNorm); the shape is a view of
:class:`llmctl.models.spec.ModelArch`. RoPE cos/sin come from
transformers' own rotary class, so every ``rope_type`` it knows is right.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

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

    @classmethod
    def from_config(cls, config: dict) -> BlockShape:
        return cls.from_arch(ModelArch.from_config(config))

    @classmethod
    def from_arch(cls, arch: ModelArch) -> BlockShape:
        # one window for every block: the family's windows as transformers reads them,
        # when every layer has one (a model mixing full and windowed layers attends fully)
        return cls(hidden=arch.hidden_size, heads=arch.num_heads, kv_heads=arch.num_kv_heads,
                   head_dim=arch.head_dim, eps=arch.rms_norm_eps, sliding_window=arch.kv_window)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As transformers: normalise in float32, cast back, then scale."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(x.dtype) * xf.to(x.dtype)


def rotary_tables(hf_config, seq_len: int, dtype: torch.dtype, device=None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape (1, seq_len, head_dim) from transformers' rotary embedding."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(config=hf_config).to(device)
    positions = torch.arange(seq_len, device=device).unsqueeze(0)
    probe = torch.empty(1, dtype=dtype, device=device)
    return rotary(probe, positions)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


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
        q = rms_norm(q, weights["self_attn.q_norm"], shape.eps)
        k = rms_norm(k, weights["self_attn.k_norm"], shape.eps)
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    c, s = cos[:, None, :t], sin[:, None, :t]
    q, k = _rotate(q, c, s), _rotate(k, c, s)
    if observe_kv is not None:
        observe_kv(k, v)
    if shape.kv_heads != shape.heads:
        rep = shape.heads // shape.kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    if shape.sliding_window and t > shape.sliding_window:
        i = torch.arange(t, device=h.device)
        allowed = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < shape.sliding_window)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.transpose(1, 2).reshape(b, t, shape.heads * shape.head_dim)


def attn_input(x: torch.Tensor, weights: dict[str, torch.Tensor], shape: BlockShape) -> torch.Tensor:
    return rms_norm(x, weights["input_layernorm"], shape.eps)


def mlp_input(x: torch.Tensor, weights: dict[str, torch.Tensor], shape: BlockShape) -> torch.Tensor:
    return rms_norm(x, weights["post_attention_layernorm"], shape.eps)


def mlp_act(h: torch.Tensor, linear: Linear) -> torch.Tensor:
    """SwiGLU activation: the input of down_proj."""
    return F.silu(linear("mlp.gate_proj", h)) * linear("mlp.up_proj", h)


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
    return x + linear("mlp.down_proj", mlp_act(mlp_input(x, weights, shape), linear))

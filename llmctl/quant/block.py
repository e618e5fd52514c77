"""A decoder block of any family llmctl runs, as plain functions over a dict of tensors.

Quantization needs the block's intermediate activations (the inputs of each linear) and
must swap weights mid-block, so the block is written out stage by stage instead of
running transformers' module, one "tap" (a linear's input) at a time::

    attn_in  = pre-norm(x) or x                  -> q, k, v   (Phi-3: qkv_proj)
    attn_out = attention(q/k-norm, RoPE, scale, soft-cap, window, sinks)   -> o_proj
    x       += rm * post-norm(o_proj(attn_out))
    mlp_in   = pre-norm(x) or x                  -> gate, up  (Phi-3: gate_up_proj)
    mlp_act  = act(gate) * up                    -> down_proj
    x       += rm * post-norm(down_proj(mlp_act))

Linears are applied through a callback so the caller decides which weight (float,
smoothed, quantized) and which activation quantizer each one uses. What a family
computes is data on :class:`BlockShape`, a view of :class:`llmctl.models.spec.ModelArch`:
the norms by slot (``spec.NORM_LAYOUTS``: Llama's pre-norms, Gemma 2/3's sandwich, OLMo
2's post-norms), Gemma's ``(1 + w)`` weights, q/k RMSNorm per head (qwen3, gemma3) or over
the whole projection (olmo2), the score scale and soft-cap, each layer's window and RoPE
table (Gemma 3's sliding layers rotate with their own), partial rotary, Granite's
residual multiplier, and Phi-3's fused projections (quantized as the single linears the
checkpoint has). Each stage is a shared building block of :mod:`llmctl.models.layers`.
A mixture-of-experts layer (``BlockShape.moe``) runs its MLP through :mod:`moe_block`:
its taps are per expert (``BlockShape.groups``), the router is read in float. gpt-oss's
attention sinks (a logit per head in each softmax) are read in float too, never
quantized, and its fused experts arrive as per-expert linears (:mod:`fused_experts`).

:data:`SMOOTHING_SOURCES` says, for every layout, where a tap's smoothing scales can be
folded: the one table AWQ and SmoothQuant read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from llmctl.models.layers import (
    RMSNorm,
    RoPE,
    activation,
    attend,
    gated,
    repeat_kv,
    rotate_halves,
    sliding_causal_mask,
)
from llmctl.models.layers import rms_norm as rms_norm  # noqa: PLC0414 (block.rms_norm)
from llmctl.models.spec import FUSED_PARTS, NORM_LAYOUTS, ModelArch
from llmctl.quant.moe_block import MoeShape, moe_forward

TAPS = ("attn_in", "attn_out", "mlp_in", "mlp_act")
# tap -> the linears it feeds, stored separately (most families) or fused (Phi-3)
TAP_LINEARS: dict[str, dict[str, tuple[str, ...]]] = {
    "split": {"attn_in": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
              "attn_out": ("self_attn.o_proj",),
              "mlp_in": ("mlp.gate_proj", "mlp.up_proj"),
              "mlp_act": ("mlp.down_proj",)},
    "fused": {"attn_in": ("self_attn.qkv_proj",), "attn_out": ("self_attn.o_proj",),
              "mlp_in": ("mlp.gate_up_proj",), "mlp_act": ("mlp.down_proj",)},
}
# Where each tap's smoothing scales fold (x -> x / s at the source, W -> W diag(s) in the
# tap's linears), by norm layout: ("norm", slot) is the pre-norm in that slot of
# spec.NORM_LAYOUTS (its weight absorbs s; Gemma's (1 + w) as (1 + w') = (1 + w) / s);
# ("rows", part) the linear whose output the tap is, linearly: v_proj for o_proj (the
# attention output is linear in v), up_proj for down_proj (act(gate) * up is linear in
# up, SwiGLU and GeGLU alike); a fused checkpoint's rows of that part (Phi-3's v rows of
# qkv_proj, up rows of gate_up_proj). A layout without a pre-norm in a slot has no
# entry: a post-norm (OLMo 2; Gemma's post_attention / post_feedforward norms) normalises
# a branch's output and cannot absorb the next linear's input scales.
SMOOTHING_SOURCES: dict[str, dict[str, tuple[str, str]]] = {
    "pre": {"attn_in": ("norm", "input"), "attn_out": ("rows", "self_attn.v_proj"),
            "mlp_in": ("norm", "mlp_in"), "mlp_act": ("rows", "mlp.up_proj")},
    "sandwich": {"attn_in": ("norm", "input"), "attn_out": ("rows", "self_attn.v_proj"),
                 "mlp_in": ("norm", "mlp_in"), "mlp_act": ("rows", "mlp.up_proj")},
    "post": {"attn_out": ("rows", "self_attn.v_proj"), "mlp_act": ("rows", "mlp.up_proj")},
}
QK_NORMS = ("self_attn.q_norm", "self_attn.k_norm")
SINKS = "self_attn.sinks"

Linear = Callable[[str, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Source:
    """Where a tap's smoothing scales fold: a norm's weight, or rows of a linear."""

    module: str  # without the layer prefix
    norm: bool
    rows: slice | None = None  # of a linear's output (None: all)


@dataclass(frozen=True)
class BlockShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    sliding_window: int | None  # this layer's window (from_arch: the model's KV window)
    norm_offset: float = 0.0  # the family's RMSNorm weight offset (Gemma: 1)
    hidden_act: str = "silu"  # the gated MLP's activation, by config.json's name
    intermediate: int = 0
    layout: str = "pre"  # spec.NORM_LAYOUTS key
    qk_norm: str | None = None  # "head" / "projection" / None
    scale: float | None = None  # q . k times this (None: 1/sqrt(head_dim))
    softcap: float | None = None
    residual_multiplier: float = 1.0
    fused: bool = False  # q/k/v and gate/up stored fused (Phi-3)
    local_rope: bool = False  # this layer rotates with the sliding layers' table
    layer_windows: tuple[int | None, ...] = field(default=(), compare=False)
    has_local_rope: bool = False  # the model has a second table (Gemma 3)
    model_type: str = ""
    moe: MoeShape | None = None  # this layer's mixture of experts (None: the dense MLP)
    layer_moe: tuple[MoeShape | None, ...] = field(default=(), compare=False)
    sinks: bool = False  # a learned logit per head in the softmax (gpt-oss's self_attn.sinks)

    @property
    def norm(self) -> RMSNorm:
        return RMSNorm(self.eps, self.norm_offset)

    @property
    def norms(self) -> dict[str, str]:
        """slot -> the checkpoint's norm name (spec.NORM_LAYOUTS)."""
        return NORM_LAYOUTS[self.layout]

    @property
    def linears(self) -> dict[str, tuple[str, ...]]:
        """tap -> the linears it feeds, in the checkpoint's own names (a mixture of
        experts: every expert's and the shared expert's; never the router)."""
        taps = TAP_LINEARS["fused" if self.fused else "split"]
        if self.moe is None:
            return taps
        return {**taps, **{tap: tuple(k for _, kinds in self.moe.groups(tap) for k in kinds)
                           for tap in ("mlp_in", "mlp_act")}}

    def groups(self, tap: str) -> list[tuple[str, tuple[str, ...]]]:
        """The linears of ``tap`` by input: one group on a dense tap; per expert (and the
        shared expert) on a mixture of experts' taps, each with its own statistics."""
        if self.moe is not None and tap in ("mlp_in", "mlp_act"):
            return self.moe.groups(tap)
        return [(tap, self.linears[tap])]

    @property
    def full_precision(self) -> tuple[str, ...]:
        """Modules the forward reads but nothing quantizes (the router, the shared
        expert's sigmoid gate, the attention sinks): read in float, written back as they
        were."""
        sinks = (SINKS,) if self.sinks else ()
        return sinks + (() if self.moe is None else self.moe.full_precision)

    @property
    def linear_names(self) -> tuple[str, ...]:
        return tuple(k for tap in TAPS for k in self.linears[tap])

    def tap_dim(self, tap: str, group: str | None = None) -> int:
        if self.moe is not None and tap == "mlp_act" and group is not None:
            return self.moe.act_dim(group)
        return {"attn_in": self.hidden, "mlp_in": self.hidden,
                "attn_out": self.heads * self.head_dim, "mlp_act": self.intermediate}[tap]

    def source(self, tap: str) -> Source | None:
        """Where ``tap``'s smoothing scales fold (:data:`SMOOTHING_SOURCES`), or None."""
        entry = SMOOTHING_SOURCES[self.layout].get(tap)
        if entry is None:
            return None
        kind, name = entry
        if kind == "norm":
            norm = self.norms.get(name)
            return None if norm is None else Source(norm, True)
        for whole, parts in FUSED_PARTS.items():
            if self.fused and name in parts:
                rows = self.part_rows(whole)
                start = sum(rows[: parts.index(name)])
                return Source(whole, False, slice(start, start + rows[parts.index(name)]))
        return Source(name, False)

    def part_rows(self, fused: str) -> tuple[int, ...]:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {"self_attn.qkv_proj": (q, kv, kv),
                "mlp.gate_up_proj": (self.intermediate,) * 2}[fused]

    def at(self, layer: int) -> BlockShape:
        """The shape of decoder layer ``layer``: its window and RoPE table."""
        shape = self if not self.layer_moe else replace(self, moe=self.layer_moe[layer])
        if not self.layer_windows:
            return shape
        window = self.layer_windows[layer]
        return replace(shape, sliding_window=window,
                       local_rope=self.has_local_rope and window is not None)

    @classmethod
    def from_config(cls, config: dict) -> BlockShape:
        return cls.from_arch(ModelArch.from_config(config))

    @classmethod
    def from_arch(cls, arch: ModelArch) -> BlockShape:
        # the model-wide shape carries the windows of every layer; ``at(i)`` picks one
        fam = arch.family
        layer_moe = MoeShape.per_layer(arch)
        return cls(hidden=arch.hidden_size, heads=arch.num_heads, kv_heads=arch.num_kv_heads,
                   head_dim=arch.head_dim, eps=arch.rms_norm_eps, sliding_window=arch.kv_window,
                   norm_offset=fam.norm_offset, hidden_act=arch.hidden_act,
                   intermediate=arch.intermediate_size, layout=fam.norms,
                   qk_norm=fam.qk_norm_over if arch.qk_norm else None,
                   scale=arch.attention_scale or None, softcap=arch.attn_softcap,
                   residual_multiplier=arch.residual_multiplier,
                   fused="self_attn.qkv_proj" in fam.fused,
                   layer_windows=arch.layer_windows, has_local_rope=arch.local_rope is not None,
                   model_type=arch.model_type, moe=layer_moe[0] if layer_moe else None,
                   layer_moe=layer_moe, sinks=arch.attn_sinks)


def rotary_tables(config, seq_len: int, dtype: torch.dtype, device=None, *, local: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape (1, seq_len, rotary_dim) in ``dtype``: the RoPE of the model's
    ``config`` (a :class:`ModelArch`, config.json's dict or transformers' config object),
    computed in float32 as transformers' rotary embedding computes them; ``local``: the
    sliding layers' own table (Gemma 3)."""
    if not isinstance(config, ModelArch):
        config = ModelArch.from_config(config if isinstance(config, dict) else config.to_dict())
    rope = RoPE.of(config)
    if local and config.local_rope is not None:
        rope = replace(rope, params=config.local_rope)
    cos, sin = rope.cos_sin(seq_len, device)
    return cos[None].to(dtype), sin[None].to(dtype)


def embed(table: torch.Tensor, ids: torch.Tensor, arch: ModelArch) -> torch.Tensor:
    """The embeddings of ``ids`` as layer 0 sees them: times Gemma's sqrt(hidden) (rounded
    to the table's dtype, as its transformers code does) or Granite's multiplier."""
    x = table[ids]
    if arch.embedding_multiplier != 1.0:
        x = x * torch.tensor(arch.embedding_multiplier, dtype=x.dtype, device=x.device)
    return x


def _norm(x: torch.Tensor, weights: dict[str, torch.Tensor], shape: BlockShape,
          slot: str) -> torch.Tensor:
    """The norm in ``slot`` of the layout applied to ``x``; ``x`` itself where none."""
    name = shape.norms.get(slot)
    return x if name is None else shape.norm(x, weights[name])


def _split(linear: Linear, shape: BlockShape, tap: str, h: torch.Tensor) -> list[torch.Tensor]:
    """The outputs of the projections ``tap`` feeds, a fused one's split into its parts."""
    names = shape.linears[tap]
    if not shape.fused:
        return [linear(n, h) for n in names]
    return list(linear(names[0], h).split(list(shape.part_rows(names[0])), dim=-1))


def _qk_norm(q: torch.Tensor, k: torch.Tensor, weights: dict[str, torch.Tensor],
             shape: BlockShape) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k, ``(b, t, n * d)``: RMS-normed per head or over the whole projection."""
    if shape.qk_norm is None:
        return q, k
    qw, kw = weights["self_attn.q_norm"], weights["self_attn.k_norm"]
    if shape.qk_norm == "projection":  # olmo2
        return shape.norm(q, qw), shape.norm(k, kw)
    b, t, _ = q.shape
    q = shape.norm(q.reshape(b, t, -1, shape.head_dim), qw)
    k = shape.norm(k.reshape(b, t, -1, shape.head_dim), kw)
    return q.reshape(b, t, -1), k.reshape(b, t, -1)


def attention(h: torch.Tensor, weights: dict[str, torch.Tensor], linear: Linear,
              shape: BlockShape, cos: torch.Tensor, sin: torch.Tensor,
              observe_kv: Callable[[torch.Tensor, torch.Tensor], None] | None = None
              ) -> torch.Tensor:
    """Self-attention output *before* o_proj, (batch, seq, heads * head_dim);
    ``observe_kv(k, v)`` sees the post-RoPE keys and the values, (batch, kv_heads, seq,
    head_dim), as a KV cache would store them. ``cos``/``sin``: this layer's table."""
    b, t, _ = h.shape
    q, k, v = _split(linear, shape, "attn_in", h)
    q, k = _qk_norm(q, k, weights, shape)
    q = q.reshape(b, t, shape.heads, shape.head_dim).transpose(1, 2)
    k = k.reshape(b, t, shape.kv_heads, shape.head_dim).transpose(1, 2)
    v = v.reshape(b, t, shape.kv_heads, shape.head_dim).transpose(1, 2)
    c, s = cos[:, None, :t], sin[:, None, :t]
    q, k = rotate_halves(q, c, s), rotate_halves(k, c, s)
    if observe_kv is not None:
        observe_kv(k, v)
    group = shape.heads // shape.kv_heads
    k, v = repeat_kv(k, group), repeat_kv(v, group)
    hooks = {"scale": shape.scale, "softcap": shape.softcap,
             "sinks": weights[SINKS] if shape.sinks else None}
    if shape.sliding_window and t > shape.sliding_window:
        out = attend(q, k, v, sliding_causal_mask(t, shape.sliding_window, h.device), **hooks)
    else:
        out = attend(q, k, v, causal=True, **hooks)
    return out.transpose(1, 2).reshape(b, t, shape.heads * shape.head_dim)


def attn_input(x: torch.Tensor, weights: dict[str, torch.Tensor], shape: BlockShape) -> torch.Tensor:
    return _norm(x, weights, shape, "input")


def mlp_input(x: torch.Tensor, weights: dict[str, torch.Tensor], shape: BlockShape) -> torch.Tensor:
    return _norm(x, weights, shape, "mlp_in")


def mlp_act(h: torch.Tensor, linear: Linear, shape: BlockShape | None = None) -> torch.Tensor:
    """The gated MLP's activation, the input of down_proj: ``act(gate) * up`` with the
    activation ``shape`` names (None: silu, SwiGLU)."""
    act = activation(shape.hidden_act if shape is not None else "silu")
    if shape is None or not shape.fused:
        return gated(act, linear("mlp.gate_proj", h), linear("mlp.up_proj", h))
    gate, up = _split(linear, shape, "mlp_in", h)
    return gated(act, gate, up)


def attn_branch(a: torch.Tensor, weights: dict[str, torch.Tensor], linear: Linear,
                shape: BlockShape) -> torch.Tensor:
    """What attention adds to the residual stream: o_proj, its post-norm, the multiplier."""
    return _residual(_norm(linear("self_attn.o_proj", a), weights, shape, "attn_out"), shape)


def mlp_branch(act: torch.Tensor, weights: dict[str, torch.Tensor], linear: Linear,
               shape: BlockShape) -> torch.Tensor:
    """What the MLP adds to the residual stream: down_proj, its post-norm, the multiplier."""
    return _residual(_norm(linear("mlp.down_proj", act), weights, shape, "mlp_out"), shape)


def moe_branch(h: torch.Tensor, weights: dict[str, torch.Tensor], linear: Linear,
               shape: BlockShape) -> torch.Tensor:
    """What a mixture of experts adds to the residual stream, from the post-attention
    norm's output ``h`` (``moe_block``: real routing, the experts through ``linear``)."""
    y = moe_forward(h, weights, linear, shape.moe)
    return _residual(_norm(y, weights, shape, "mlp_out"), shape)


def _residual(y: torch.Tensor, shape: BlockShape) -> torch.Tensor:
    rm = shape.residual_multiplier
    return y if rm == 1.0 else y * rm


def float_linear(weights: dict[str, torch.Tensor]) -> Linear:
    """The callback for an unquantized block: ``x W^T + b`` from ``weights``."""

    def apply(name: str, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weights[f"{name}.weight"], weights.get(f"{name}.bias"))

    return apply


def forward(x: torch.Tensor, weights: dict[str, torch.Tensor], linear: Linear,
            shape: BlockShape, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The whole block (used by tests and the reference path); ``shape`` the layer's."""
    a = attention(attn_input(x, weights, shape), weights, linear, shape, cos, sin)
    x = x + attn_branch(a, weights, linear, shape)
    if shape.moe is not None:
        return x + moe_branch(mlp_input(x, weights, shape), weights, linear, shape)
    act = mlp_act(mlp_input(x, weights, shape), linear, shape)
    return x + mlp_branch(act, weights, linear, shape)

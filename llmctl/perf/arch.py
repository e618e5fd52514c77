"""The shape of a decoder-only transformer, read from a Hugging Face ``config.json``.

:class:`ArchSpec` holds what the FLOP and byte counts of :mod:`llmctl.perf.costs` need:
the widths, the head counts (GQA-aware), the gated MLP or the mixture of experts, and the
names of every linear layer (so a quantization config's ``ignore`` list can be matched the
way compressed-tensors matches it). Pure data, no torch.

Supported families are the rows of :data:`llmctl.models.spec.FAMILIES` (a mixture of
experts is a row with a MoE layout); config.json is read there, by
:class:`llmctl.models.spec.ModelArch`, and :meth:`ArchSpec.from_arch` is a view of it.
Every decoder here has a gated MLP (SwiGLU / GeGLU: gate, up and down projections);
attention is multi-head or grouped-query with separate q/k/v/o.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmctl.errors import ConfigError, UnsupportedArchitectureError
from llmctl.models.spec import FAMILIES, Family, ModelArch, MoeLayout, text_config

_WINDOW_NOTE = ("sliding-window layers hold and attend at most their window's tokens: KV "
                "per token is the average over a sequence of the planned context")

# The family table is the model layer's; a mixture of experts is a row with a MoE layout.
MoeFamily = MoeLayout
MOE_FAMILIES: dict[str, MoeLayout] = {t: f.moe for t, f in FAMILIES.items() if f.moe}

# Config keys whose presence means an architecture these counts do not describe.
UNSUPPORTED_KEYS: dict[str, str] = {
    "kv_lora_rank": "multi-head latent attention (DeepSeek-V2/V3)",
}
_EXPERT_KEYS = ("num_local_experts", "num_experts")


@dataclass(frozen=True)
class Linear:
    """One linear layer of a decoder block: ``name`` under ``model.layers.{i}.`` (``{e}``
    for an expert's index), ``copies`` stored (experts), ``active`` of them per token."""

    name: str
    out_features: int
    in_features: int
    copies: int = 1
    active: float = 1.0

    @property
    def params(self) -> int:
        return self.out_features * self.in_features * self.copies

    @property
    def active_params(self) -> float:
        return self.out_features * self.in_features * self.active


@dataclass(frozen=True)
class ArchSpec:
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # the dense MLP's width (0 for a MoE without dense layers)
    vocab_size: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    num_experts: int = 0  # 0: a dense MLP
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    max_position_embeddings: int | None = None
    # per layer: its sliding window (it holds and attends at most that many tokens) or None;
    # () when no layer has one
    layer_windows: tuple[int | None, ...] = ()
    # per layer of a MoE model: a mixture of experts (True) or the dense MLP (Qwen2/3-MoE's
    # mlp_only_layers, decoder_sparse_step); () when every layer is the same
    moe_layers: tuple[bool, ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "vocab_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"config field {name} must be positive, got "
                                  f"{getattr(self, name)}", "fix config.json")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads {self.num_heads} is not a multiple of "
                              f"num_key_value_heads {self.num_kv_heads}", "fix config.json")
        if self.is_moe and not 0 < self.experts_per_token <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok {self.experts_per_token} must be in 1.."
                              f"{self.num_experts}", "fix config.json")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def family(self) -> Family:
        return FAMILIES[self.model_type]

    @property
    def q_width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_tokens(self, context: int) -> int:
        """Tokens held in K/V over all layers for one sequence of ``context`` tokens:
        ``sum_l min(context, W_l)`` (a layer without a window holds all of them)."""
        windows = self.layer_windows or (None,) * self.num_layers
        return sum(context if w is None else min(context, w) for w in windows)

    def attended_keys(self, prompt_len: int, cached: int = 0) -> int:
        """Keys attended over all layers by the tokens at positions ``cached ..
        prompt_len - 1`` (the token at ``p`` attends ``min(p + 1, W_l)`` in layer ``l``)."""
        def keys(n: int, w: int | None) -> int:  # sum_{q=1..n} min(q, w)
            if w is None or n <= w:
                return n * (n + 1) // 2
            return w * (w + 1) // 2 + (n - w) * w

        windows = self.layer_windows or (None,) * self.num_layers
        return sum(keys(prompt_len, w) - keys(cached, w) for w in windows)

    def layer_is_moe(self, layer: int) -> bool:
        """Whether block ``layer``'s MLP is the mixture of experts."""
        return self.is_moe and (not self.moe_layers or self.moe_layers[layer])

    @property
    def moe_layer_count(self) -> int:
        return sum(self.layer_is_moe(i) for i in range(self.num_layers))

    def layer_linears(self, layer: int = 0) -> tuple[Linear, ...]:
        """Every linear layer of decoder block ``layer``."""
        h = self.hidden_size
        out = [Linear("self_attn.q_proj", self.q_width, h),
               Linear("self_attn.k_proj", self.kv_width, h),
               Linear("self_attn.v_proj", self.kv_width, h),
               Linear("self_attn.o_proj", h, self.q_width)]
        if not self.layer_is_moe(layer):
            i = self.intermediate_size
            return (*out, Linear("mlp.gate_proj", i, h), Linear("mlp.up_proj", i, h),
                    Linear("mlp.down_proj", h, i))
        moe = MOE_FAMILIES[self.model_type]
        e, k, w = self.num_experts, self.experts_per_token, self.expert_intermediate_size
        gate, up, down = moe.experts
        out += [Linear(moe.router, e, h),
                Linear(gate, w, h, e, k), Linear(up, w, h, e, k), Linear(down, h, w, e, k)]
        s = self.shared_expert_intermediate_size
        if s and moe.shared:
            sg, su, sd = moe.shared
            out += [Linear(sg, s, h), Linear(su, s, h), Linear(sd, h, s)]
            if moe.shared_gate:
                out.append(Linear(moe.shared_gate, 1, h))
        return tuple(out)

    def vector_params_per_layer(self) -> int:
        """Norm weights and biases of one block: stored, never a matrix product."""
        fam = self.family
        n = fam.norms_per_layer * self.hidden_size
        if fam.qk_norm:  # one vector per head's width, or over the whole projections (OLMo 2)
            n += 2 * self.head_dim if fam.qk_norm_over == "head" else self.q_width + self.kv_width
        if self.attention_bias or fam.qkv_bias is True:  # True: whatever the config says
            n += self.q_width + 2 * self.kv_width
        return n

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> ArchSpec:
        """From a ``config.json`` dict (a multimodal config's ``text_config`` is used)."""
        cfg = text_config(cfg)
        model_type = cfg.get("model_type")
        if model_type is None:
            raise ConfigError("config.json has no 'model_type'",
                              "pass the config of a decoder-only model: "
                              + ", ".join(sorted(FAMILIES)))
        if model_type not in FAMILIES:
            raise UnsupportedArchitectureError(
                f"model type {model_type!r} is not one llmctl can cost",
                f"llmctl knows {', '.join(sorted(FAMILIES))}; adding a family: "
                "docs/architecture.md, 'Where to add'")
        for key, what in UNSUPPORTED_KEYS.items():
            if cfg.get(key):
                raise ConfigError(f"config field {key!r}: {what} is not modelled",
                                  "llmctl plan costs dense and simple-MoE decoders")

        if model_type not in MOE_FAMILIES:
            for key in _EXPERT_KEYS:
                if (cfg.get(key) or 0) > 1:
                    raise ConfigError(f"config field {key!r} on a {model_type} model: experts "
                                      "in a dense family's config are not modelled",
                                      "MoE families: " + ", ".join(MOE_FAMILIES))
        return cls.from_arch(ModelArch.from_config(cfg))

    @classmethod
    def from_arch(cls, arch: ModelArch) -> ArchSpec:
        notes = []
        if any(arch.layer_windows):
            notes.append(_WINDOW_NOTE)
        return cls(
            model_type=arch.model_type, hidden_size=arch.hidden_size,
            num_layers=arch.num_layers, num_heads=arch.num_heads,
            num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim,
            intermediate_size=(0 if arch.family.moe and all(arch.moe_layers)
                               else arch.intermediate_size),
            vocab_size=arch.vocab_size, tie_word_embeddings=arch.tie_word_embeddings,
            attention_bias=arch.attention_bias, num_experts=arch.num_experts,
            experts_per_token=arch.experts_per_token,
            expert_intermediate_size=arch.expert_intermediate_size,
            shared_expert_intermediate_size=arch.shared_expert_intermediate_size,
            max_position_embeddings=arch.max_position_embeddings,
            layer_windows=arch.layer_windows if any(arch.layer_windows) else (),
            moe_layers=() if all(arch.moe_layers) else arch.moe_layers,
            notes=tuple(notes))

"""The shape of a decoder-only transformer, read from a Hugging Face ``config.json``.

:class:`ArchSpec` holds what the FLOP and byte counts of :mod:`llmctl.perf.costs` need:
the widths, the head counts (GQA-aware), the gated MLP or the mixture of experts, and the
names of every linear layer (so a quantization config's ``ignore`` list can be matched the
way compressed-tensors matches it). Pure data, no torch.

Supported families are rows of :data:`FAMILIES`; a mixture of experts adds a row of
:data:`MOE_FAMILIES`. Every decoder here has a gated MLP (SwiGLU / GeGLU: gate, up and
down projections); attention is multi-head or grouped-query with separate q/k/v/o.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmctl.errors import ConfigError


@dataclass(frozen=True)
class Family:
    """What a ``model_type`` implies beyond its config fields."""

    qkv_bias: bool = False  # q/k/v projections carry a bias whatever the config says (Qwen2)
    norms_per_layer: int = 2  # RMSNorm vectors per block (Gemma 2/3 also norm after each)
    qk_norm: bool = False  # a head_dim-wide norm on q and on k (Qwen3, Gemma 3)
    # transformers writes config.json as a diff from the class defaults, so a field equal
    # to its default is absent: these are the defaults of the config classes
    tied_default: bool = False
    head_dim_default: int | None = None  # None: hidden_size / num_attention_heads
    notes: tuple[str, ...] = ()


_WINDOW_NOTE = ("sliding-window layers are counted as full attention: KV memory and "
                "attention FLOPs are upper bounds beyond the window")

FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(),
    "granite": Family(),
    "phi3": Family(),  # fused qkv / gate_up in the checkpoint: the same products
    "qwen2": Family(qkv_bias=True),
    "qwen3": Family(qk_norm=True),
    "gemma": Family(tied_default=True, head_dim_default=256),
    "gemma2": Family(norms_per_layer=4, tied_default=True, head_dim_default=256,
                     notes=(_WINDOW_NOTE,)),
    "gemma3_text": Family(norms_per_layer=4, qk_norm=True, tied_default=True,
                          head_dim_default=256, notes=(_WINDOW_NOTE,)),
    "mixtral": Family(),
    "qwen2_moe": Family(qkv_bias=True),
    "qwen3_moe": Family(qk_norm=True),
}


@dataclass(frozen=True)
class MoeFamily:
    """Config keys and module names of one mixture-of-experts layout."""

    experts_key: str
    expert_width_key: str  # the intermediate size of one expert
    router: str  # module names under ``model.layers.{i}.``
    experts: tuple[str, str, str]  # gate, up, down of expert {e}
    shared: tuple[str, str, str] | None = None  # an always-on shared expert, if any
    shared_gate: str | None = None


MOE_FAMILIES: dict[str, MoeFamily] = {
    "mixtral": MoeFamily(
        "num_local_experts", "intermediate_size", "block_sparse_moe.gate",
        ("block_sparse_moe.experts.{e}.w1", "block_sparse_moe.experts.{e}.w3",
         "block_sparse_moe.experts.{e}.w2")),
    "qwen2_moe": MoeFamily(
        "num_experts", "moe_intermediate_size", "mlp.gate",
        ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj", "mlp.experts.{e}.down_proj"),
        shared=("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj",
                "mlp.shared_expert.down_proj"),
        shared_gate="mlp.shared_expert_gate"),
    "qwen3_moe": MoeFamily(
        "num_experts", "moe_intermediate_size", "mlp.gate",
        ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj", "mlp.experts.{e}.down_proj")),
}

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
    intermediate_size: int  # the dense MLP's width (0 for a mixture of experts)
    vocab_size: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    num_experts: int = 0  # 0: a dense MLP
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    max_position_embeddings: int | None = None
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

    def layer_linears(self) -> tuple[Linear, ...]:
        """Every linear layer of one decoder block (the same in every block)."""
        h = self.hidden_size
        out = [Linear("self_attn.q_proj", self.q_width, h),
               Linear("self_attn.k_proj", self.kv_width, h),
               Linear("self_attn.v_proj", self.kv_width, h),
               Linear("self_attn.o_proj", h, self.q_width)]
        if not self.is_moe:
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
        n = fam.norms_per_layer * self.hidden_size + (2 * self.head_dim if fam.qk_norm else 0)
        if self.attention_bias or fam.qkv_bias:
            n += self.q_width + 2 * self.kv_width
        return n

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> ArchSpec:
        """From a ``config.json`` dict (a multimodal config's ``text_config`` is used)."""
        if "hidden_size" not in cfg and isinstance(cfg.get("text_config"), dict):
            cfg = cfg["text_config"]
        model_type = cfg.get("model_type")
        if model_type is None:
            raise ConfigError("config.json has no 'model_type'",
                              "pass the config of a decoder-only model: "
                              + ", ".join(sorted(FAMILIES)))
        if model_type not in FAMILIES:
            raise ConfigError(f"config field model_type {model_type!r} is not one llmctl can "
                              "cost", "known: " + ", ".join(sorted(FAMILIES)))
        for key, what in UNSUPPORTED_KEYS.items():
            if cfg.get(key):
                raise ConfigError(f"config field {key!r}: {what} is not modelled",
                                  "llmctl plan costs dense and simple-MoE decoders")

        def need(key: str) -> Any:
            value = cfg.get(key)
            if value is None:
                raise ConfigError(f"config.json of a {model_type} model has no {key!r}",
                                  "add it or pass a complete config.json")
            return value

        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        fam = FAMILIES[model_type]
        head_dim = int(cfg.get("head_dim") or fam.head_dim_default or hidden // heads)
        moe = MOE_FAMILIES.get(model_type)
        experts = per_token = expert_width = shared = 0
        dense_width = 0
        if moe is not None:
            experts, per_token = int(need(moe.experts_key)), int(need("num_experts_per_tok"))
            expert_width = int(need(moe.expert_width_key))
            shared = int(cfg.get("shared_expert_intermediate_size") or 0) if moe.shared else 0
            if int(cfg.get("decoder_sparse_step") or 1) != 1 or cfg.get("mlp_only_layers"):
                raise ConfigError(
                    "config fields decoder_sparse_step/mlp_only_layers: dense and MoE blocks "
                    "mixed in one model are not modelled", "use a model whose every block is MoE")
        else:
            for key in _EXPERT_KEYS:
                if (cfg.get(key) or 0) > 1:
                    raise ConfigError(f"config field {key!r} on a {model_type} model: experts "
                                      "in a dense family's config are not modelled",
                                      "MoE families: " + ", ".join(MOE_FAMILIES))
            dense_width = int(need("intermediate_size"))
        notes = list(fam.notes)
        window = cfg.get("sliding_window")
        if window and cfg.get("use_sliding_window", True) and _WINDOW_NOTE not in notes:
            notes.append(_WINDOW_NOTE)
        return cls(
            model_type=model_type, hidden_size=hidden,
            num_layers=int(need("num_hidden_layers")), num_heads=heads, num_kv_heads=kv_heads,
            head_dim=head_dim, intermediate_size=dense_width, vocab_size=int(need("vocab_size")),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", fam.tied_default)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            num_experts=experts, experts_per_token=per_token,
            expert_intermediate_size=expert_width, shared_expert_intermediate_size=shared,
            max_position_embeddings=cfg.get("max_position_embeddings"), notes=tuple(notes))

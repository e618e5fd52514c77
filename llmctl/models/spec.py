"""One description of a model: the family table as data, and config.json read once.

:data:`FAMILIES` has one row per Hugging Face ``model_type``: what the type implies beyond
its config fields (transformers class, llama.cpp name and tensor names, biases, QK-norm,
how its sliding windows are read, the defaults transformers leaves out of config.json).
:class:`ModelArch` is a checkpoint's architecture, read from ``config.json`` by
:meth:`ModelArch.from_config` and nowhere else: the engine's ``ModelSpec``, the cost
model's ``ArchSpec``, the quantizer's ``BlockShape`` and ``llmctl info`` are views of it.

Adding a Llama-like family is a row here. Pure data and dict reading: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmctl.errors import ConfigError, UnsupportedArchitectureError
from llmctl.models.windows import WINDOW_RULES

# HF parameter name -> GGUF tensor name, shared by every Llama-family model.
# ``{bid}`` is the decoder block index (gguf-py's tensor_mapping uses the same idea).
LLAMA_TENSORS: dict[str, str] = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.{bid}.input_layernorm.weight": "blk.{bid}.attn_norm.weight",
    "model.layers.{bid}.self_attn.q_proj.weight": "blk.{bid}.attn_q.weight",
    "model.layers.{bid}.self_attn.k_proj.weight": "blk.{bid}.attn_k.weight",
    "model.layers.{bid}.self_attn.v_proj.weight": "blk.{bid}.attn_v.weight",
    "model.layers.{bid}.self_attn.o_proj.weight": "blk.{bid}.attn_output.weight",
    "model.layers.{bid}.post_attention_layernorm.weight": "blk.{bid}.ffn_norm.weight",
    "model.layers.{bid}.mlp.gate_proj.weight": "blk.{bid}.ffn_gate.weight",
    "model.layers.{bid}.mlp.up_proj.weight": "blk.{bid}.ffn_up.weight",
    "model.layers.{bid}.mlp.down_proj.weight": "blk.{bid}.ffn_down.weight",
}

QKV_BIAS_TENSORS: dict[str, str] = {
    "model.layers.{bid}.self_attn.q_proj.bias": "blk.{bid}.attn_q.bias",
    "model.layers.{bid}.self_attn.k_proj.bias": "blk.{bid}.attn_k.bias",
    "model.layers.{bid}.self_attn.v_proj.bias": "blk.{bid}.attn_v.bias",
}

QK_NORM_TENSORS: dict[str, str] = {
    "model.layers.{bid}.self_attn.q_norm.weight": "blk.{bid}.attn_q_norm.weight",
    "model.layers.{bid}.self_attn.k_norm.weight": "blk.{bid}.attn_k_norm.weight",
}

# the block's norms after attention and after the MLP (llama.cpp's ATTN_POST_NORM,
# FFN_POST_NORM), in Gemma 2/3's sandwich and OLMo 2's post layouts
_POST_NORM_TENSORS: dict[str, str] = {
    "model.layers.{bid}.post_attention_layernorm.weight": "blk.{bid}.post_attention_norm.weight",
    "model.layers.{bid}.post_feedforward_layernorm.weight": "blk.{bid}.post_ffw_norm.weight",
}

# Gemma 2/3: Llama's names, the MLP's pre-norm is pre_feedforward_layernorm
GEMMA2_TENSORS: dict[str, str] = {
    **{k: v for k, v in LLAMA_TENSORS.items() if "post_attention_layernorm" not in k},
    "model.layers.{bid}.pre_feedforward_layernorm.weight": "blk.{bid}.ffn_norm.weight",
    **_POST_NORM_TENSORS,
}

# OLMo 2: no pre-norms; q/k norms over the whole projection
OLMO2_TENSORS: dict[str, str] = {
    **{k: v for k, v in LLAMA_TENSORS.items()
       if "input_layernorm" not in k and "post_attention_layernorm" not in k},
    **QK_NORM_TENSORS, **_POST_NORM_TENSORS,
}

# Phi-3 keeps its fused projections fused in GGUF: attn_qkv (q, k, v rows) and ffn_up
# (gate rows, then up rows), split by llama.cpp's graph
PHI3_TENSORS: dict[str, str] = {
    **{k: v for k, v in LLAMA_TENSORS.items() if "_proj" not in k or "o_proj" in k
       or "down_proj" in k},
    "model.layers.{bid}.self_attn.qkv_proj.weight": "blk.{bid}.attn_qkv.weight",
    "model.layers.{bid}.mlp.gate_up_proj.weight": "blk.{bid}.ffn_up.weight",
}

# gpt-oss: Llama's attention names with q/k/v/o biases and the sinks; its norm before the
# experts is llama.cpp's ATTN_POST_NORM (the openai-moe graph's attn_post_norm); router and
# experts: llmctl.models.gguf_experts
GPT_OSS_TENSORS: dict[str, str] = {
    **{k: v for k, v in LLAMA_TENSORS.items()
       if ".mlp." not in k and "post_attention_layernorm" not in k},
    **QKV_BIAS_TENSORS,
    "model.layers.{bid}.self_attn.o_proj.bias": "blk.{bid}.attn_output.bias",
    "model.layers.{bid}.self_attn.sinks": "blk.{bid}.attn_sinks.weight",
    "model.layers.{bid}.post_attention_layernorm.weight": "blk.{bid}.post_attention_norm.weight",
}


@dataclass(frozen=True)
class MoeLayout:
    """Config keys and module names of one mixture-of-experts layout."""

    experts_key: tuple[str, ...]  # the config key of the expert count, the first present
    expert_width_key: str  # the intermediate size of one expert
    router: str  # module names under ``model.layers.{i}.``
    experts: tuple[str, str, str]  # gate, up, down of expert {e}
    shared: tuple[str, str, str] | None = None  # an always-on shared expert, if any
    shared_gate: str | None = None
    # renormalise the top-k probabilities to sum 1: always (Mixtral) or the config key
    # that says so (Qwen: norm_topk_prob)
    renormalize: bool | str = True
    # the routing weights stay float32 (Mixtral) or are cast to the router logits' dtype
    # (Qwen); the same numbers in float32, a different rounding in bfloat16
    float32_weights: bool = False
    # whether config.json's decoder_sparse_step / mlp_only_layers make some layers dense
    dense_layers: bool = False
    # transformers 5's fused 3-D form of the experts ([E, 2I, H] gate then up rows;
    # [E, H, I]), which other writers may leave on disk; save_pretrained writes `experts`
    fused: tuple[str, str] = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
    # how router logits become the k weights (llmctl.models.layers.moe.route):
    # "softmax_topk" (a softmax over all E, then its k largest: Mixtral, Qwen) or
    # "topk_softmax" (the k largest logits, then a softmax over those k: gpt-oss)
    routing: str = "softmax_topk"
    router_bias: bool = False  # the router is a Linear with a bias (gpt-oss)
    # gpt-oss: the experts only in the fused form, stored as x @ W ([E, H, 2I], [E, I, H]),
    # with biases (`{fused}_bias`), gate/up columns interleaved (gate = [..., ::2]), the
    # clamped SwiGLU (EXPERT_ACTS), and as bf16/float32 tensors or MXFP4 `{fused}_blocks` /
    # `{fused}_scales` (llmctl.quant.mxfp4)
    gpt_oss_experts: bool = False

    @property
    def expert_act(self) -> str | None:
        """The experts' activation when it is not the family's gated MLP: a name in
        :data:`llmctl.models.layers.moe.EXPERT_ACTS` (None: ``hidden_act`` over
        ``[gate rows | up rows]``)."""
        return "clamped_swiglu" if self.gpt_oss_experts else None


@dataclass(frozen=True)
class Family:
    """What a ``model_type`` implies beyond its config fields.

    A feature is a bool, or the config key that switches it on (``"attention_bias"``).
    ``windows`` names the rule of :data:`llmctl.models.windows.WINDOW_RULES` that reads the sliding windows.
    A row without ``causal_lm_class`` is known to the cost model only: llmctl neither
    converts nor runs it.
    """

    model_type: str
    causal_lm_class: str | None = None
    gguf_arch: str | None = None
    # llama.cpp's "llama" graph applies RoPE to interleaved pairs, HF to halves, so
    # its converter permutes q/k rows; NEOX-style families (qwen) are stored as is.
    rope_permute: bool = False
    tensors: dict[str, str] = field(default_factory=dict, hash=False)
    qkv_bias: bool | str = "attention_bias"
    o_bias: bool | str = "attention_bias"
    qk_norm: bool = False  # an RMSNorm over q and over k before RoPE
    # ... over each head (qwen3, gemma3: "head") or over the whole projection (olmo2)
    qk_norm_over: str = "head"
    windows: str = "none"
    # where the block's RMSNorms sit (NORM_LAYOUTS): before each branch ("pre": Llama),
    # before and after each ("sandwich": Gemma 2/3), after each ("post": OLMo 2)
    norms: str = "pre"
    # Gemma stores RMSNorm weights as w - 1 and scales by (1 + w): llmctl.models.layers.norm
    norm_offset: float = 0.0
    # Gemma multiplies the embeddings by sqrt(hidden_size) (rounded to the model's dtype);
    # other families by config.json's embedding_multiplier (Granite), default 1
    embed_sqrt_hidden: bool = False
    # the attention score scale's rule (ATTENTION_SCALES)
    attention_scale: str = "head_dim"
    # Gemma 3: sliding layers rotate with their own RoPE (rope_parameters by layer type)
    local_rope: bool = False
    # the config class's defaults that config.json leaves out when equal (see below)
    config_defaults: dict[str, Any] = field(default_factory=dict, hash=False)
    # the gated MLP's activation (llmctl.models.layers.mlp.ACTIVATIONS): the config key
    # that names it (Gemma 2/3: hidden_activation) and the config class's default
    act_key: str = "hidden_act"
    act_default: str = "silu"
    # transformers writes config.json as a diff from the class defaults, so a field equal
    # to its default is absent: these are the defaults of the config classes
    tied_default: bool = False
    head_dim_default: int | None = None  # None: hidden_size / num_attention_heads
    fused: tuple[str, ...] = ()  # projections stored fused in the checkpoint
    moe: MoeLayout | None = None
    # a learned logit per query head in each softmax's denominator ("attention sinks",
    # gpt-oss: self_attn.sinks); every attention path of the engine computes it
    attn_sinks: bool = False

    @property
    def norms_per_layer(self) -> int:
        """RMSNorm vectors per block (q/k norms aside)."""
        return len(NORM_LAYOUTS[self.norms])

    @property
    def fused_parts(self) -> dict[str, tuple[str, ...]]:
        """Each projection stored fused in the checkpoint -> the projections it holds."""
        return {name: FUSED_PARTS[name] for name in self.fused}


# norm layout -> the block's RMSNorms: the forwards' slot -> the checkpoint's module name.
# Slots: ``input`` before attention, ``attn_out`` on attention's output before the
# residual add, ``mlp_in`` before the MLP, ``mlp_out`` on the MLP's output. (Llama's
# "post_attention_layernorm" is the norm before its MLP; Gemma's and OLMo 2's is after
# attention.)
NORM_LAYOUTS: dict[str, dict[str, str]] = {
    "pre": {"input": "input_layernorm", "mlp_in": "post_attention_layernorm"},
    "sandwich": {"input": "input_layernorm", "attn_out": "post_attention_layernorm",
                 "mlp_in": "pre_feedforward_layernorm",
                 "mlp_out": "post_feedforward_layernorm"},
    "post": {"attn_out": "post_attention_layernorm", "mlp_out": "post_feedforward_layernorm"},
}

# a checkpoint's fused projection -> the projections it holds, rows in this order
FUSED_PARTS: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}

# transformers' config classes, for the fields their config.json leaves out when equal to
# the class default (save_pretrained writes a diff): read as if present
_GEMMA2_DEFAULTS = {"query_pre_attn_scalar": 256, "sliding_window": 4096,
                    "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
                    "max_position_embeddings": 8192}
_GEMMA3_DEFAULTS = {"query_pre_attn_scalar": 256, "sliding_window": 4096,
                    "max_position_embeddings": 131072, "sliding_window_pattern": 6,
                    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0}


# Qwen2MoeConfig / Qwen3MoeConfig defaults (a diffed config.json leaves them out)
_QWEN_MOE_DEFAULTS = {"norm_topk_prob": False, "decoder_sparse_step": 1,
                      "mlp_only_layers": [], "max_position_embeddings": 32768}
_QWEN2_MOE_DEFAULTS = _QWEN_MOE_DEFAULTS | {"qkv_bias": True,
                                           "shared_expert_intermediate_size": 5632}

# GptOssConfig's defaults (a diffed config.json leaves them out); its RoPE default is YaRN
_GPT_OSS_DEFAULTS = {
    "num_hidden_layers": 36, "num_local_experts": 128, "vocab_size": 201088,
    "hidden_size": 2880, "intermediate_size": 2880, "head_dim": 64,
    "num_attention_heads": 64, "num_key_value_heads": 8, "sliding_window": 128,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "num_experts_per_tok": 4,
    "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "attention_bias": True,
    "rope_theta": 150000.0,
    # under the old key so that a stated rope_parameters or rope_scaling wins
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                     "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 4096}}

_QWEN_MOE_EXPERTS = ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj",
                     "mlp.experts.{e}.down_proj")

FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", "LlamaForCausalLM", "llama", rope_permute=True,
           tensors=LLAMA_TENSORS),
    Family("mistral", "MistralForCausalLM", "llama", rope_permute=True,
           tensors=LLAMA_TENSORS, qkv_bias=False, o_bias=False, windows="every_layer"),
    Family("qwen2", "Qwen2ForCausalLM", "qwen2", tensors={**LLAMA_TENSORS, **QKV_BIAS_TENSORS},
           qkv_bias=True, o_bias=False, windows="layer_types"),
    Family("qwen3", "Qwen3ForCausalLM", "qwen3", tensors={**LLAMA_TENSORS, **QK_NORM_TENSORS},
           qk_norm=True, windows="layer_types", head_dim_default=128),
    Family("granite", "GraniteForCausalLM", "granite", rope_permute=True,
           tensors=LLAMA_TENSORS, attention_scale="attention_multiplier"),
    Family("phi3", "Phi3ForCausalLM", "phi3", tensors=PHI3_TENSORS, windows="every_layer",
           qkv_bias=False, o_bias=False, fused=("self_attn.qkv_proj", "mlp.gate_up_proj"),
           config_defaults={"rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
                            "original_max_position_embeddings": 4096}),
    Family("olmo2", "Olmo2ForCausalLM", "olmo2", tensors=OLMO2_TENSORS, qk_norm=True,
           qk_norm_over="projection", norms="post", config_defaults={"rms_norm_eps": 1e-5}),
    Family("gemma", "GemmaForCausalLM", "gemma", tensors=LLAMA_TENSORS, tied_default=True,
           head_dim_default=256, norm_offset=1.0, embed_sqrt_hidden=True,
           act_default="gelu_pytorch_tanh", config_defaults={"max_position_embeddings": 8192}),
    Family("gemma2", "Gemma2ForCausalLM", "gemma2", tensors=GEMMA2_TENSORS, norms="sandwich",
           tied_default=True, head_dim_default=256, windows="alternating", norm_offset=1.0,
           embed_sqrt_hidden=True, attention_scale="query_pre_attn_scalar",
           act_key="hidden_activation", act_default="gelu_pytorch_tanh",
           config_defaults=_GEMMA2_DEFAULTS | {"sliding_window_pattern": 2}),
    Family("gemma3_text", "Gemma3ForCausalLM", "gemma3",
           tensors={**GEMMA2_TENSORS, **QK_NORM_TENSORS}, norms="sandwich", qk_norm=True,
           tied_default=True, head_dim_default=256, windows="alternating", norm_offset=1.0,
           embed_sqrt_hidden=True, attention_scale="query_pre_attn_scalar", local_rope=True,
           act_key="hidden_activation", act_default="gelu_pytorch_tanh",
           config_defaults=_GEMMA3_DEFAULTS),
    # mixtures of experts (llmctl.models.layers.moe): the engine, quantize (per expert) and
    # GGUF export (llmctl.gguf.experts) take them; the build targets refuse them
    # (get_architecture). llama.cpp runs Mixtral as its "llama" graph with experts.
    Family("mixtral", "MixtralForCausalLM", "llama", rope_permute=True, tensors=LLAMA_TENSORS,
           windows="every_layer", qkv_bias=False, o_bias=False,
           moe=MoeLayout(("num_local_experts",), "intermediate_size", "block_sparse_moe.gate",
                         ("block_sparse_moe.experts.{e}.w1", "block_sparse_moe.experts.{e}.w3",
                          "block_sparse_moe.experts.{e}.w2"), float32_weights=True),
           config_defaults={"max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                            "rope_theta": 1_000_000.0}),
    Family("qwen2_moe", "Qwen2MoeForCausalLM", "qwen2moe",
           tensors={**LLAMA_TENSORS, **QKV_BIAS_TENSORS}, qkv_bias="qkv_bias", o_bias=False,
           windows="layer_types", config_defaults=_QWEN2_MOE_DEFAULTS, moe=MoeLayout(
               ("num_experts",), "moe_intermediate_size", "mlp.gate", _QWEN_MOE_EXPERTS,
               shared=("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj",
                       "mlp.shared_expert.down_proj"),
               shared_gate="mlp.shared_expert_gate", renormalize="norm_topk_prob",
               dense_layers=True)),
    # transformers 5 writes Qwen3-MoE's expert count as num_local_experts
    Family("qwen3_moe", "Qwen3MoeForCausalLM", "qwen3moe",
           tensors={**LLAMA_TENSORS, **QK_NORM_TENSORS}, qk_norm=True, windows="layer_types",
           config_defaults=_QWEN_MOE_DEFAULTS, moe=MoeLayout(
               ("num_experts", "num_local_experts"), "moe_intermediate_size", "mlp.gate",
               _QWEN_MOE_EXPERTS, renormalize="norm_topk_prob", dense_layers=True)),
    # gpt-oss: attention sinks and q/k/v/o biases, sliding (window 128) and full layers
    # alternating by layer_types, YaRN RoPE; experts routed top-k then softmax, with
    # biases and the clamped SwiGLU, on disk in MXFP4 or float. The engine runs it (sinks
    # in its native attention kernels too), quantize takes it per expert
    # (llmctl.quant.fused_experts) and GGUF export writes it (llama.cpp's "gpt-oss" graph);
    # the build targets refuse it as every mixture of experts.
    Family("gpt_oss", "GptOssForCausalLM", "gpt-oss", tensors=GPT_OSS_TENSORS,
           windows="alternating", attn_sinks=True,
           head_dim_default=64, config_defaults=_GPT_OSS_DEFAULTS,
           moe=MoeLayout(("num_local_experts", "num_experts"), "intermediate_size",
                         "mlp.router", _QWEN_MOE_EXPERTS, renormalize=False,
                         routing="topk_softmax", router_bias=True, gpt_oss_experts=True)),
)}


def family(model_type: str) -> Family:
    """The row of ``model_type``; an unknown type raises with the known ones."""
    row = FAMILIES.get(model_type)
    if row is None:
        raise UnsupportedArchitectureError(
            f"model type {model_type!r} is not in llmctl's family table",
            f"known: {', '.join(sorted(FAMILIES))}; adding a family: docs/architecture.md, "
            "'Where to add'")
    return row


# the attention score scale: q . k times this (transformers' ``self.scaling``)
ATTENTION_SCALES = {
    "head_dim": lambda cfg, head_dim: head_dim ** -0.5,
    "query_pre_attn_scalar": lambda cfg, head_dim: float(cfg["query_pre_attn_scalar"]) ** -0.5,
    "attention_multiplier": lambda cfg, head_dim: float(cfg.get("attention_multiplier", 1.0)),
}

# RoPE types whose tables depend on where the original context ends
_ORIGINAL_CONTEXT = ("llama3", "yarn", "longrope")


def rope_settings(config: dict, layer_type: str = "full_attention") -> dict:
    """The RoPE settings of an HF config.json, old (``rope_scaling``) or new layout (one
    dict, or one per layer type as Gemma 3 writes them: ``layer_type``'s):
    ``rope_theta`` (default 10000) and ``rope_type`` (default "default") always set."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    elif layer_type == "sliding_attention":
        # Gemma 3's old layout: the local layers rotate at rope_local_base_freq, unscaled
        return {"rope_type": "default",
                "rope_theta": float(config.get("rope_local_base_freq", 10000.0))}
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    if params["rope_type"] in _ORIGINAL_CONTEXT:
        # transformers: a top-level original_max_position_embeddings (Phi-3's) wins, else
        # the one in the RoPE dict, else max_position_embeddings
        original = config.get("original_max_position_embeddings") \
            or params.get("original_max_position_embeddings") \
            or config.get("max_position_embeddings")
        if original:
            params["original_max_position_embeddings"] = int(original)
    return params


def partial_rotary(config: dict) -> float:
    """The share of each head that RoPE rotates (1.0: all of it)."""
    return float(config.get("partial_rotary_factor",
                            rope_settings(config).get("partial_rotary_factor", 1.0)))


def _feature(config: dict, value: bool | str) -> bool:
    return bool(config.get(value, False)) if isinstance(value, str) else value


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The decoder's config: a multimodal config's ``text_config``, else the config."""
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


@dataclass(frozen=True)
class ModelArch:
    """A checkpoint's architecture, as its config.json (and family row) describe it."""

    family: Family
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # the dense MLP's width (0 when absent: a mixture of experts)
    vocab_size: int
    max_position_embeddings: int | None
    rope: dict = field(hash=False)  # rope_settings(): theta, type and scaling fields
    rope_theta: float | None  # as config.json states it (None: unstated)
    partial_rotary_factor: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool  # the config's own switch, whatever the family implies
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    # per layer: the sliding window W (the query at p sees keys p - W + 1 .. p) or None;
    # () where the family's windows are not read (see WINDOW_RULES)
    layer_windows: tuple[int | None, ...] = ()
    hidden_act: str = "silu"  # the gated MLP's activation, config.json's name for it
    attention_scale: float = 0.0  # q . k times this (ATTENTION_SCALES)
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_softcap: float | None = None  # the same on the logits (Gemma 2)
    embedding_multiplier: float = 1.0  # the embeddings times this (Gemma, Granite)
    residual_multiplier: float = 1.0  # each branch's output times this (Granite)
    logits_scaling: float = 1.0  # the logits divided by this (Granite)
    # the RoPE of the sliding-window layers where it differs from ``rope`` (Gemma 3)
    local_rope: dict | None = field(default=None, hash=False)
    num_experts: int = 0  # 0: a dense MLP
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False  # the top-k routing weights renormalised to sum 1
    # per layer: a mixture of experts (True) or the dense MLP; () for a dense model
    moe_layers: tuple[bool, ...] = ()
    attn_sinks: bool = False  # a learned per-head logit in the softmax (Family.attn_sinks)
    # the experts' activation where it is not hidden_act's gated MLP (MoeLayout.expert_act)
    # and its constants: gpt-oss's clamped SwiGLU, swiglu_alpha and swiglu_limit
    expert_act: str | None = None
    swiglu_alpha: float = 0.0
    swiglu_limit: float = 0.0

    @property
    def model_type(self) -> str:
        return self.family.model_type

    @property
    def kv_window(self) -> int | None:
        """The largest window when every layer has one; None when any attends fully."""
        windows = self.layer_windows
        if not windows or any(w is None for w in windows):
            return None
        return max(windows)

    def part_rows(self, fused: str) -> tuple[int, ...]:
        """The output rows of each projection a fused one holds (:data:`FUSED_PARTS`)."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {"self_attn.qkv_proj": (q, kv, kv),
                "mlp.gate_up_proj": (self.intermediate_size,) * 2}[fused]

    @classmethod
    def from_config(cls, config: dict[str, Any], *, known_only: bool = True) -> ModelArch:
        """Read ``config.json`` (a multimodal one's ``text_config``). ``known_only=False``
        reads a type outside the table with a neutral row (for reports such as ``info``)."""
        cfg = text_config(config)
        model_type = cfg.get("model_type") or config.get("model_type") or ""
        if model_type in FAMILIES:  # what transformers reads when config.json omits it
            cfg = FAMILIES[model_type].config_defaults | cfg
        if known_only:
            if not model_type:
                raise ConfigError("config.json has no 'model_type'",
                                  "pass the config of a decoder-only model: "
                                  + ", ".join(sorted(FAMILIES)))
            row = family(model_type)
        else:
            row = FAMILIES.get(model_type) or Family(model_type, windows="unknown")

        def need(*keys: str) -> Any:
            value = next((cfg[k] for k in keys if cfg.get(k) is not None), None)
            if value is None:
                raise ConfigError(f"config.json of a {model_type} model has no "
                                  f"{' or '.join(map(repr, keys))}",
                                  "add it or pass a complete config.json")
            return value

        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        layers = int(need("num_hidden_layers"))
        moe = row.moe
        experts = per_token = expert_width = shared = 0
        moe_layers: tuple[bool, ...] = ()
        if moe is not None:
            experts, per_token = int(need(*moe.experts_key)), int(need("num_experts_per_tok"))
            expert_width = int(need(moe.expert_width_key))
            shared = int(cfg.get("shared_expert_intermediate_size") or 0) if moe.shared else 0
            width = int(cfg.get("intermediate_size") or 0)
            moe_layers = _sparse_layers(cfg, moe, layers, experts)
        else:
            width = int(need("intermediate_size")) if known_only \
                else int(cfg.get("intermediate_size") or 0)
        stated_rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope = rope_settings(cfg)
        head_dim = int(cfg.get("head_dim") or row.head_dim_default or hidden // heads)
        return cls(
            family=row, hidden_size=hidden, num_layers=layers, num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            # the one head_dim rule: stated, else the family's default, else hidden / heads
            head_dim=head_dim,
            intermediate_size=width, vocab_size=int(need("vocab_size")),
            max_position_embeddings=cfg.get("max_position_embeddings"),
            rope=rope, rope_theta=stated_rope.get("rope_theta", cfg.get("rope_theta")),
            partial_rotary_factor=partial_rotary(cfg),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", row.tied_default)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            qkv_bias=_feature(cfg, row.qkv_bias), o_bias=_feature(cfg, row.o_bias),
            mlp_bias=bool(cfg.get("mlp_bias", False)), qk_norm=row.qk_norm,
            layer_windows=WINDOW_RULES[row.windows](cfg, layers),
            hidden_act=str(cfg.get(row.act_key) or row.act_default),
            **_scalings(cfg, row, hidden, head_dim),
            num_experts=experts, experts_per_token=per_token,
            expert_intermediate_size=expert_width, shared_expert_intermediate_size=shared,
            norm_topk_prob=moe is not None and _feature(cfg, moe.renormalize),
            moe_layers=moe_layers, attn_sinks=row.attn_sinks,
            **_expert_act(cfg, moe))


def _expert_act(cfg: dict, moe: MoeLayout | None) -> dict[str, Any]:
    act = moe.expert_act if moe is not None else None
    if act != "clamped_swiglu":
        return {"expert_act": act}
    return {"expert_act": act, "swiglu_alpha": float(cfg["swiglu_alpha"]),
            "swiglu_limit": float(cfg["swiglu_limit"])}


def _sparse_layers(cfg: dict, moe: MoeLayout, layers: int, experts: int) -> tuple[bool, ...]:
    """Per layer, whether it is a mixture of experts: transformers' Qwen-MoE rule (not in
    ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``); every layer where the
    family has no dense layers (Mixtral)."""
    if not moe.dense_layers:
        return (experts > 0,) * layers
    step, dense = int(cfg.get("decoder_sparse_step") or 1), set(cfg.get("mlp_only_layers") or ())
    return tuple(experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(layers))


def _scalings(cfg: dict, row: Family, hidden: int, head_dim: int) -> dict[str, Any]:
    """The multipliers, soft-caps and per-layer RoPE a family reads from config.json."""
    def number(key: str, default: float | None) -> float | None:
        value = cfg.get(key, default)
        return None if value is None else float(value)

    return {
        "attention_scale": ATTENTION_SCALES[row.attention_scale](cfg, head_dim),
        "attn_softcap": number("attn_logit_softcapping", None) or None,
        "final_softcap": number("final_logit_softcapping", None) or None,
        "embedding_multiplier": hidden ** 0.5 if row.embed_sqrt_hidden
        else number("embedding_multiplier", 1.0),
        "residual_multiplier": number("residual_multiplier", 1.0),
        "logits_scaling": number("logits_scaling", 1.0),
        "local_rope": rope_settings(cfg, "sliding_attention") if row.local_rope else None,
    }

"""The family table and the one config.json reader, against transformers' own parsing.

For every row of :data:`FAMILIES`, transformers builds a tiny config of that
``model_type`` and writes it as ``save_pretrained`` does (a diff from the class
defaults); :class:`ModelArch` must read from that JSON what transformers' config object
holds.
"""

from __future__ import annotations

import json

import pytest

from llmctl.errors import ConfigError, UnsupportedArchitectureError
from llmctl.models.architectures import ARCHITECTURES
from llmctl.models.spec import FAMILIES, ModelArch

pytest.importorskip("transformers")

SMALL = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "bos_token_id": 1,
         "eos_token_id": 2, "pad_token_id": 2}
MOE = {"mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
       "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                     "shared_expert_intermediate_size": 48},
       "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
       "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2}}


def hf_config(model_type: str, **overrides):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**SMALL, **MOE.get(model_type, {}),
                                               **overrides})


def as_saved(config) -> dict:
    """config.json as save_pretrained writes it, less any field equal to the class
    default (older writers and hand-written configs leave those out)."""
    saved = json.loads(config.to_json_string(use_diff=True))
    default = type(config)()
    for key in ("head_dim", "tie_word_embeddings"):
        if key in saved and getattr(default, key, None) == saved[key]:
            del saved[key]
    return saved


def hf_rope_theta(config) -> float | None:
    params = getattr(config, "rope_parameters", None) or {}
    return params.get("rope_theta", getattr(config, "rope_theta", None))


def hf_windows(config, rule: str) -> tuple[int | None, ...]:
    """Per layer, the window transformers' attention masks with (None: full)."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None) or None
    if rule == "every_layer" or (rule == "layer_types"
                                  and not getattr(config, "layer_types", None)):
        return (window,) * n
    if rule == "layer_types":
        return tuple(window if t == "sliding_attention" else None for t in config.layer_types)
    return (None,) * n


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
@pytest.mark.parametrize("tie", [False, True])
def test_fields_match_transformers(model_type, tie):
    config = hf_config(model_type, tie_word_embeddings=tie)
    arch = ModelArch.from_config(as_saved(config))
    assert arch.model_type == model_type
    assert arch.hidden_size == config.hidden_size
    assert arch.num_layers == config.num_hidden_layers
    assert arch.num_heads == config.num_attention_heads
    assert arch.num_kv_heads == config.num_key_value_heads
    assert arch.head_dim == (getattr(config, "head_dim", None)
                             or config.hidden_size // config.num_attention_heads)
    assert arch.vocab_size == config.vocab_size
    assert arch.rms_norm_eps == config.rms_norm_eps
    assert arch.tie_word_embeddings == config.tie_word_embeddings == tie
    assert arch.max_position_embeddings == config.max_position_embeddings
    if "rope_theta" in (getattr(config, "rope_parameters", None) or {"rope_theta": 0}):
        assert arch.rope["rope_theta"] == arch.rope_theta == hf_rope_theta(config)
    if arch.family.moe:
        assert arch.num_experts == 4 and arch.experts_per_token == 2
    else:
        assert arch.intermediate_size == config.intermediate_size
    if arch.family.windows in ("none", "every_layer", "layer_types"):
        assert arch.layer_windows == hf_windows(config, arch.family.windows)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_mlp_activation_and_norm_offset_match_transformers(model_type):
    # the activation transformers' MLP looks up (Gemma 2/3 by hidden_activation), as
    # saved, stated, or left to the class default; the (1 + w) norms of Gemma
    import inspect

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from llmctl.models.layers import ACTIVATIONS

    config = hf_config(model_type)
    key = FAMILIES[model_type].act_key
    arch = ModelArch.from_config(as_saved(config))
    assert arch.hidden_act == getattr(config, key) and arch.hidden_act in ACTIVATIONS
    # (a stated value other than the default; Gemma's config reads a legacy "gelu" as
    # gelu_pytorch_tanh, which its row would need an alias for)
    other = "silu" if arch.hidden_act != "silu" else "gelu"
    stated = ModelArch.from_config(as_saved(hf_config(model_type, **{key: other})))
    assert stated.hidden_act == getattr(hf_config(model_type, **{key: other}), key) == other
    module = inspect.getmodule(getattr(__import__("transformers"),
                                       MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]))
    norm = next(v for k, v in vars(module).items() if k.endswith("RMSNorm"))
    assert ("1.0 + self.weight" in inspect.getsource(norm)) == bool(arch.family.norm_offset)


def test_family_defaults_fill_what_a_diffed_config_leaves_out():
    # Gemma's class defaults: head_dim 256 (not hidden / heads) and tied embeddings
    saved = as_saved(hf_config("gemma", tie_word_embeddings=True))
    assert "head_dim" not in saved and "tie_word_embeddings" not in saved
    arch = ModelArch.from_config(saved)
    assert arch.head_dim == 256 and arch.tie_word_embeddings


@pytest.mark.parametrize("model_type", ["mistral", "qwen2", "qwen3"])
def test_sliding_windows_match_transformers(model_type):
    extra = {} if model_type == "mistral" else {"use_sliding_window": True,
                                                "max_window_layers": 1}
    config = hf_config(model_type, sliding_window=16, **extra)
    saved = as_saved(config)
    rule = FAMILIES[model_type].windows
    expected = hf_windows(config, rule)
    assert any(expected)
    assert ModelArch.from_config(saved).layer_windows == expected
    if rule == "layer_types":  # an older config: layer_types derived from max_window_layers
        saved.pop("layer_types", None)
        assert ModelArch.from_config(saved).layer_windows == expected


def test_llama_ignores_a_sliding_window_as_transformers_does():
    saved = as_saved(hf_config("llama")) | {"sliding_window": 16}
    arch = ModelArch.from_config(saved)
    assert arch.layer_windows == (None,) * 3 and arch.kv_window is None


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_biases_and_qk_norm_match_the_transformers_modules(model_type):
    import torch
    from transformers import AutoModelForCausalLM

    for bias in (False, True):
        config = hf_config(model_type, num_hidden_layers=1, attention_bias=bias)
        arch = ModelArch.from_config(as_saved(config))
        with torch.device("meta"):
            names = set(dict(AutoModelForCausalLM.from_config(config).named_parameters()))
        layer = "model.layers.0.self_attn."
        assert arch.qkv_bias == (layer + "q_proj.bias" in names)
        assert arch.o_bias == (layer + "o_proj.bias" in names)
        assert arch.qk_norm == (layer + "q_norm.weight" in names)
        assert arch.mlp_bias == ("model.layers.0.mlp.gate_proj.bias" in names)


def test_runnable_rows_name_their_transformers_class():
    import transformers

    for model_type, row in ARCHITECTURES.items():
        assert hf_config(model_type).architectures in (None, [row.causal_lm_class])
        assert hasattr(transformers, row.causal_lm_class)


def test_a_multimodal_config_is_read_through_its_text_config():
    text = as_saved(hf_config("qwen3"))
    arch = ModelArch.from_config({"model_type": "qwen3_vl", "text_config": text})
    assert arch.model_type == "qwen3" and arch.num_kv_heads == 2


def test_unknown_types_and_missing_fields_say_what_is_known():
    with pytest.raises(UnsupportedArchitectureError, match="llama"):
        ModelArch.from_config({"model_type": "gpt2", **SMALL})
    with pytest.raises(ConfigError, match="no 'vocab_size'"):
        ModelArch.from_config({"model_type": "llama", **SMALL} | {"vocab_size": None})
    report = ModelArch.from_config({"model_type": "gpt_neox", **SMALL}, known_only=False)
    assert report.head_dim == 16 and report.layer_windows == ()


# --- the families' config classes: what config.json omits is read as transformers reads it
NEW_FAMILIES = ["gemma", "gemma2", "gemma3_text", "phi3", "granite", "olmo2"]


@pytest.mark.parametrize("model_type", NEW_FAMILIES)
def test_a_diff_config_reads_as_the_transformers_config(model_type):
    """save_pretrained writes config.json as a diff from the class defaults: a config at
    every default keeps only the sizes. What ModelArch reads from it equals what the
    transformers config object holds (windows per layer, soft-caps, scales, norms)."""
    import json

    from transformers import AutoConfig

    sizes = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=7,
                 num_attention_heads=4, num_key_value_heads=2)
    cfg = AutoConfig.for_model(model_type, **sizes)
    arch = ModelArch.from_config(json.loads(cfg.to_json_string(use_diff=True)))
    head_dim = getattr(cfg, "head_dim", None) or 16
    assert arch.head_dim == head_dim
    assert arch.rms_norm_eps == cfg.rms_norm_eps
    assert arch.tie_word_embeddings == cfg.tie_word_embeddings
    assert arch.max_position_embeddings == cfg.max_position_embeddings
    assert arch.hidden_act == getattr(cfg, "hidden_activation", None) or cfg.hidden_act
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * 7
    assert arch.layer_windows == tuple(window if t == "sliding_attention" else None
                                       for t in types)
    assert arch.attn_softcap == getattr(cfg, "attn_logit_softcapping", None)
    assert arch.final_softcap == getattr(cfg, "final_logit_softcapping", None)
    scalar = getattr(cfg, "query_pre_attn_scalar", None)
    scale = (scalar ** -0.5 if scalar else getattr(cfg, "attention_multiplier", None)
             or head_dim ** -0.5)
    assert arch.attention_scale == pytest.approx(scale, rel=1e-12)
    assert arch.embedding_multiplier == pytest.approx(
        64 ** 0.5 if model_type.startswith("gemma") else getattr(cfg, "embedding_multiplier", 1.0))

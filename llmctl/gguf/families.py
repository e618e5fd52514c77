"""Per-architecture rules of the GGUF export, as llama.cpp's converter and runtime have them.

Three things past the shared keys and tensor names (:mod:`llmctl.models.architectures`):

1. :func:`check_exportable`: what llama.cpp's graph for the arch cannot compute. It
   derives some values instead of reading them (Gemma 2/3's attention scale from the
   head size, Gemma 2's soft-caps always on, the Gemma graphs' output tied to the
   embeddings, GeLU or SiLU by arch): a model that differs is refused with one line
   naming the arch, rather than written as a file llama.cpp runs differently.
   :func:`export_warnings`: what it computes differently in a way its converter accepts
   too (YaRN's rounded correction range): written, with a warning.
2. :func:`write_arch_metadata`: the arch's own keys (soft-caps, windows and which layers
   use them, Granite's multipliers, partial rotary, LongRoPE's attention factor).
3. :func:`generated_tensors`: tensors computed from the config (Llama 3.1's
   ``rope_freqs``, Phi-3's ``rope_factors_long``/``_short``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from llmctl.errors import UnsupportedArchitectureError
from llmctl.gguf import experts
from llmctl.models.architectures import GGUF_ARCH_KEYS, GGUF_INT_FIELDS
from llmctl.models.layers.rope import rotary_dim
from llmctl.models.spec import ModelArch, text_config

GEMMAS = ("gemma", "gemma2", "gemma3")
# the gated MLP's activations each llama.cpp graph stands for: ggml_gelu is the tanh form
# read through an fp16 table, as near to exact GeLU as to the tanh form (~1e-3), and
# llama.cpp's converter writes Gemma's "gelu" configs to the same graph
_ACTIVATION = {arch: ("gelu_pytorch_tanh", "gelu", "gelu_new") for arch in GEMMAS}
# RoPE types the writer expresses per arch (llama3 through rope_freqs; longrope: Phi-3's)
_ROPE_TYPES = {"phi3": ("default", "longrope"), "gemma3": ("default", "linear")}
_DEFAULT_ROPE_TYPES = ("default", "linear", "yarn", "llama3")
# archs whose graph takes token_embd as the output (no output.weight read)
_TIED = ("gemma", "gemma2")
# archs whose graph reads which layers are sliding as a per-layer array (load_swa_pattern)
_SWA_PATTERN = ("gemma2", "gemma3", "gpt-oss")
# layers of the Gemma that llama.cpp scales by 1/sqrt(hidden / heads): its 27B models
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def export_config(config: dict[str, Any]) -> dict[str, Any]:
    """The decoder's config.json with the fields transformers' config class fills in."""
    cfg = text_config(config)
    row = ModelArch.from_config(config).family
    return row.config_defaults | cfg


def llama_cpp_attention_scale(arch: str, spec: ModelArch) -> float:
    """The q . k scale llama.cpp's graph uses (Gemma 2/3: derived from the sizes)."""
    if arch in _GEMMA_27B_LAYERS and spec.num_layers == _GEMMA_27B_LAYERS[arch]:
        return (spec.hidden_size // spec.num_heads) ** -0.5
    if arch == "granite":
        return spec.attention_scale
    return spec.head_dim ** -0.5


def _problems(arch: str, spec: ModelArch) -> list[str]:
    out = []
    acts = _ACTIVATION.get(arch, ("silu",))
    if spec.hidden_act not in acts:
        out.append(f"its graph applies {acts[0]}, the model {spec.hidden_act}")
    if arch in _TIED and not spec.tie_word_embeddings:
        out.append("its graph uses token_embd as the output, the model has its own lm_head")
    if not math.isclose(spec.attention_scale, llama_cpp_attention_scale(arch, spec),
                        rel_tol=1e-6):
        out.append(f"its graph scales q.k by {llama_cpp_attention_scale(arch, spec):.6g}, "
                   f"the model by {spec.attention_scale:.6g} (query_pre_attn_scalar)")
    if arch == "gemma2" and not (spec.attn_softcap and spec.final_softcap):
        out.append("its graph always soft-caps attention and logits, the model does not")
    if arch not in ("gemma2",) and spec.attn_softcap:
        out.append("its graph has no attention soft-capping")
    if arch not in ("gemma2",) and spec.final_softcap:
        out.append("its graph has no final logit soft-capping")
    rope = str(spec.rope["rope_type"]).lower()
    if rope not in _ROPE_TYPES.get(arch, _DEFAULT_ROPE_TYPES):
        out.append(f"it does not read RoPE type {rope!r}")
    if rope == "yarn":
        out += _yarn_problems(spec.rope)
    if spec.local_rope is not None and spec.local_rope["rope_type"] != "default":
        out.append("its sliding-window layers take no RoPE scaling")
    if spec.partial_rotary_factor != 1.0 and arch != "phi3":
        out.append("partial rotary is written for phi3 only")
    windows = {w for w in spec.layer_windows if w is not None}
    if len(windows) > 1:
        out.append(f"it takes one sliding window, the model has {sorted(windows)}")
    if arch == "phi3" and windows and (spec.max_position_embeddings or 0) > min(windows):
        # llama.cpp: "Phi SWA is currently disabled" (ggml-org/llama.cpp#13676)
        out.append(f"it ignores Phi-3's sliding window ({min(windows)} tokens, within the "
                   f"context of {spec.max_position_embeddings})")
    return out


def _yarn_problems(params: dict) -> list[str]:
    """YaRN as llama.cpp computes it: between betas 32 and 1 (its defaults, which
    llama-cpp-python passes whatever the file says)."""
    out = []
    for key, fixed in (("beta_fast", 32.0), ("beta_slow", 1.0)):
        if float(params.get(key) or fixed) != fixed:
            out.append(f"its YaRN takes {key} {fixed:g}, the model's is {params[key]}")
    return out


def export_warnings(config: dict[str, Any]) -> list[str]:
    """What llama.cpp computes differently but every llama.cpp user of the model accepts:
    written, with a warning. YaRN's correction range is rounded to whole dimensions
    (ggml_rope_yarn_corr_dims: floor/ceil, always) where the config says ``truncate:
    false`` (gpt-oss's own config): the few dimensions inside the ramp get slightly
    different frequencies, a phase error that grows with the position (measured ~0.9 rad
    at position 4096 in one dimension pair of gpt-oss-20b). llama.cpp's converter writes
    these models all the same, so a refusal would only stop the user doing what it does."""
    spec = ModelArch.from_config(config)
    rope = spec.rope or {}
    if str(rope.get("rope_type", "")).lower() == "yarn" and not rope.get("truncate", True):
        return [("llama.cpp rounds YaRN's correction range to whole dimensions; the model's "
                 "rope_parameters has truncate: false, so a few rotary dimensions turn at "
                 "slightly different rates than in transformers (set truncate: true in "
                 "config.json to export the rounded model without this warning)")]
    return []


def check_exportable(config: dict[str, Any]) -> None:
    """Refuse (one line naming the arch) what llama.cpp's graph cannot compute."""
    spec = ModelArch.from_config(config)
    arch = spec.family.gguf_arch
    if arch is None:
        raise UnsupportedArchitectureError(
            f"GGUF export does not handle {spec.model_type} models: llama.cpp has no graph "
            "for them", "`llmctl serve` / `generate` run it from the HF checkpoint")
    problems = _problems(arch, spec)
    if spec.family.moe is not None:
        problems += experts.problems(arch, spec)
    if problems:
        raise UnsupportedArchitectureError(
            f"llama.cpp's {arch} graph cannot run this {spec.model_type} model: "
            + "; ".join(problems),
            "llmctl serves it from the HF checkpoint; GGUF export is refused rather than "
            "written as a file llama.cpp would run differently")


def write_arch_metadata(writer, config: dict[str, Any]) -> None:
    """The keys of the arch beyond the shared ones (GGUF_ARCH_KEYS and the RoPE shape)."""
    cfg, spec = export_config(config), ModelArch.from_config(config)
    arch = spec.family.gguf_arch
    for key, field in GGUF_ARCH_KEYS.get(arch, {}).items():
        value = cfg.get(field)
        if value is None:
            continue
        full = key.format(arch=arch)
        if field in GGUF_INT_FIELDS:
            writer.add_uint32(full, int(value))
        else:
            writer.add_float32(full, float(value))
    writer.add_rope_dimension_count(rotary_dim(spec.head_dim, spec.partial_rotary_factor))
    if spec.family.moe is not None:
        experts.write_metadata(writer, arch, spec)
    if arch in _SWA_PATTERN and spec.layer_windows:
        # which layers attend through the window, per layer (llama.cpp's load_swa_pattern
        # reads the array before any period)
        writer.add_sliding_window_pattern([w is not None for w in spec.layer_windows])
    if spec.local_rope is not None:
        writer.add_rope_freq_base_swa(float(spec.local_rope["rope_theta"]))
    if spec.rope["rope_type"] == "longrope":
        original = int(spec.rope["original_max_position_embeddings"])
        scale = spec.max_position_embeddings / original
        # transformers' and llama.cpp's LongRoPE attention factor
        factor = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        writer.add_rope_scaling_attn_factors(factor)  # the factors: generated_tensors


def llama3_rope_freqs(spec: ModelArch) -> np.ndarray:
    """Llama 3.1's frequency-dependent RoPE scaling, as the ``rope_freqs`` tensor llama.cpp
    divides its frequencies by (transformers' ``_compute_llama3_parameters``)."""
    params = spec.rope
    base, dim = params["rope_theta"], spec.head_dim
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor = params.get("factor", 8.0)
    low, high = params.get("low_freq_factor", 1.0), params.get("high_freq_factor", 4.0)
    old_ctx = params.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / freqs
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < old_ctx / high, 1.0, np.where(wavelen > old_ctx / low, factor, mid))
    return out.astype(np.float32)


def generated_tensors(config: dict[str, Any]) -> dict[str, np.ndarray]:
    """Tensors computed from the config: ``rope_freqs`` (llama3), ``rope_factors_*``."""
    spec = ModelArch.from_config(config)
    kind = str(spec.rope["rope_type"]).lower()
    if kind == "llama3":
        return {"rope_freqs.weight": llama3_rope_freqs(spec)}
    if kind == "longrope":
        half = rotary_dim(spec.head_dim, spec.partial_rotary_factor) // 2
        out = {}
        for which in ("long", "short"):
            factors = np.asarray(spec.rope[f"{which}_factor"], dtype=np.float32)
            if factors.shape != (half,):
                raise UnsupportedArchitectureError(
                    f"phi3: {which}_factor has {factors.size} values, the rotary half "
                    f"{half}", "fix the checkpoint's rope_parameters")
            out[f"rope_factors_{which}.weight"] = factors
        return out
    return {}

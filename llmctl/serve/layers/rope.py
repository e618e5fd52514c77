"""Rotary position embeddings: inverse frequencies per ``rope_type``, and their cos/sin.

One function per scaling scheme the Llama-family configs use, registered by the name
HF configs give in ``rope_parameters`` / ``rope_scaling`` (``rope_type`` or ``type``).
Each returns ``(inv_freq [head_dim/2], attention_factor)``; the attention factor
multiplies cos and sin (YaRN's "mscale").

- default: ``inv_freq_i = base^(-2i/d)`` (Su et al. 2021).
- linear (position interpolation, Chen et al. 2023): ``inv_freq / factor``.
- llama3: wavelengths beyond ``orig_len / low_freq_factor`` are divided by ``factor``,
  below ``orig_len / high_freq_factor`` kept, and blended in between.
- yarn (Peng et al. 2023): per-dimension blend of interpolated and extrapolated
  frequencies over the ramp between the dimensions that rotate ``beta_fast`` and
  ``beta_slow`` times over the original context, and ``mscale = 0.1 ln(factor) + 1``.
- dynamic (NTK): identical to default up to ``max_position_embeddings``; the engine
  caps the context there.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from llmctl.errors import UnsupportedArchitectureError
from llmctl.models.spec import ModelArch, partial_rotary, rope_settings


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _default(params: dict, dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    return _base_inv_freq(params["rope_theta"], dim), 1.0


def _linear(params: dict, dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    return _base_inv_freq(params["rope_theta"], dim) / params["factor"], 1.0


def _llama3(params: dict, dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    inv_freq = _base_inv_freq(params["rope_theta"], dim)
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params.get("original_max_position_embeddings", max_pos)
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled), 1.0


def _yarn(params: dict, dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    base = params["rope_theta"]
    old_len = params.get("original_max_position_embeddings", max_pos)
    factor = params.get("factor") or max_pos / old_len

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = (mscale(factor, m) / mscale(factor, m_all) if m and m_all
                            else mscale(factor))
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        # the dimension whose wavelength fits `rotations` times in the original context
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolate = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention_factor)


ROPE_TYPES: dict[str, Callable[[dict, int, int], tuple[torch.Tensor, float]]] = {
    "default": _default,
    "linear": _linear,
    "llama3": _llama3,
    "yarn": _yarn,
    "dynamic": _default,
}


def rope_parameters(config: dict) -> dict:
    """The RoPE settings of an HF config.json, old (``rope_scaling``) or new layout."""
    _check_full_rotary(partial_rotary(config))
    return rope_settings(config)


def check_rope(arch: ModelArch) -> None:
    """Refuse what the engine's RoPE does not compute."""
    _check_full_rotary(arch.partial_rotary_factor)


def _check_full_rotary(factor: float) -> None:
    if factor != 1.0:
        raise UnsupportedArchitectureError("partial rotary embeddings are not supported",
                                           "use a model that rotates the whole head")


def _inv_freq(params: dict, head_dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    kind = params["rope_type"]
    try:
        fn = ROPE_TYPES[kind]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"RoPE type {kind!r} is not supported",
            f"the engine implements: {', '.join(ROPE_TYPES)}") from None
    return fn(params, head_dim, max_pos)


def rope_cos_sin(params: dict, head_dim: int, max_pos: int, max_len: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables ``[max_len, head_dim]`` in HF's halves layout (float32)."""
    inv_freq, attention_factor = _inv_freq(params, head_dim, max_pos)
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq.float())
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos() * attention_factor, emb.sin() * attention_factor


def rope_freqs(params: dict, head_dim: int, max_pos: int, max_len: int) -> torch.Tensor:
    """Rotations ``[max_len, head_dim / 2]`` (complex64): ``a * e^{i p theta_j}``, with
    ``a`` the attention factor."""
    inv_freq, attention_factor = _inv_freq(params, head_dim, max_pos)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq.float())
    return torch.polar(torch.full_like(angles, attention_factor), angles)


def interleave_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Reorder q/k projection rows from HF's halves layout to interleaved pairs.

    HF rotates dimension ``i`` of a head with ``i + d/2``; after this permutation the
    pair sits at ``(2i, 2i + 1)`` and RoPE is one complex multiplication. Attention only
    needs ``q . k``, which is unchanged when q and k share the permutation; V is not
    touched. (llama.cpp's converter applies the same permutation for the same reason.)
    """
    from llmctl.models.architectures import rope_permute

    return rope_permute(weight, num_heads)


def apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, d]`` (interleaved pairs) by ``freqs [T, 1, d/2]``."""
    t, h, d = x.shape
    pairs = torch.view_as_complex(x.float().reshape(t, h, d // 2, 2))
    return torch.view_as_real(pairs * freqs).view(t, h, d).to(x.dtype)

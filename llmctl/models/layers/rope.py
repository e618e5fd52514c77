"""Rotary position embeddings: inverse frequencies per ``rope_type``, their tables, and
the rotation in both layouts.

One function per scaling scheme, registered by the name HF configs give in
``rope_parameters`` / ``rope_scaling`` (``rope_type`` or ``type``). Each returns
``(inv_freq [rotary_dim/2], attention_factor)``; the attention factor multiplies cos and
sin (YaRN's "mscale"). A new scheme is one function and one entry in :data:`ROPE_TYPES`.

- default: ``inv_freq_i = base^(-2i/d)`` (Su et al. 2021).
- linear (position interpolation, Chen et al. 2023): ``inv_freq / factor``.
- llama3: wavelengths beyond ``orig_len / low_freq_factor`` are divided by ``factor``,
  below ``orig_len / high_freq_factor`` kept, and blended in between.
- yarn (Peng et al. 2023): per-dimension blend of interpolated and extrapolated
  frequencies over the ramp between the dimensions that rotate ``beta_fast`` and
  ``beta_slow`` times over the original context, and ``mscale = 0.1 ln(factor) + 1``.
- dynamic (NTK): identical to default up to ``max_position_embeddings``; the runtimes
  cap the context there.
- longrope (Phi-3, Ding et al. 2024): ``inv_freq_i = 1 / (f_i base^(2i/d))`` with the
  per-dimension ``short_factor`` for a context up to ``original_max_position_embeddings``
  and ``long_factor`` for a longer one (:data:`SWITCHED`), attention factor
  ``sqrt(1 + ln(factor) / ln(original))``, ``factor = max_pos / original``.

Partial rotary (``partial_rotary_factor``): only the first ``rotary_dim`` dimensions of
each head rotate, the rest pass through; the tables are ``rotary_dim`` wide.

Two layouts of a head's rotated dimensions: transformers' *halves* (dimension ``i``
pairs with ``i + d/2``: :func:`rotate_halves`, with cos/sin tables) and *interleaved
pairs* (``(2i, 2i + 1)``: :func:`rotate_pairs`, one complex multiplication; the engine
permutes q/k weight rows into it, as llama.cpp's converter does). Both give the same
``q . k``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from llmctl.errors import UnsupportedArchitectureError
from llmctl.models.layers.registry import lookup
from llmctl.models.spec import ModelArch


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


def _longrope_factor(params: dict, max_pos: int) -> tuple[float, int]:
    original = params["original_max_position_embeddings"]
    # Phi-3: the ratio of the two contexts, not rope_scaling's "factor", unless stated
    return params.get("factor") or max_pos / original, original


def _longrope_freq(params: dict, dim: int, factors: list[float]) -> torch.Tensor:
    ext = torch.tensor(factors, dtype=torch.float32)
    if ext.numel() != dim // 2:
        raise UnsupportedArchitectureError(
            f"LongRoPE factors have {ext.numel()} entries, the rotated dimensions {dim // 2}",
            "fix rope_scaling's short_factor / long_factor in config.json")
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext * params["rope_theta"] ** shape)


def _longrope(params: dict, dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    factor, original = _longrope_factor(params, max_pos)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else \
            math.sqrt(1 + math.log(factor) / math.log(original))
    return _longrope_freq(params, dim, params["short_factor"]), float(attention_factor)


def _longrope_long(params: dict, dim: int, max_pos: int) -> tuple[torch.Tensor, int]:
    _, original = _longrope_factor(params, max_pos)
    return _longrope_freq(params, dim, params["long_factor"]), original


ROPE_TYPES: dict[str, Callable[[dict, int, int], tuple[torch.Tensor, float]]] = {
    "longrope": _longrope,
    "default": _default,
    "linear": _linear,
    "llama3": _llama3,
    "yarn": _yarn,
    "dynamic": _default,
}



# RoPE types with a second set of frequencies for contexts past a length:
# type -> (params, dim, max_pos) -> (inv_freq, the longest context of the first set)
SWITCHED: dict[str, Callable[[dict, int, int], tuple[torch.Tensor, int]]] = {
    "longrope": _longrope_long,
}


def rotary_dim(head_dim: int, partial_rotary_factor: float = 1.0) -> int:
    """How many dimensions of each head rotate (transformers' ``int(d * factor)``)."""
    return int(head_dim * partial_rotary_factor)


def inv_freq(params: dict, dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq [dim/2], attention_factor)`` of ``params`` (see :func:`rope_settings
    <llmctl.models.spec.rope_settings>`) over ``dim`` rotated dimensions."""
    return lookup(ROPE_TYPES, params["rope_type"], "RoPE type")(params, dim, max_pos)


def _angles(params: dict, dim: int, max_pos: int, max_len: int, device=None
            ) -> tuple[torch.Tensor, float]:
    # inv_freq on the CPU, the angles (and their cos/sin) where they are used: as
    # transformers' rotary module does once moved to a device
    inv, attention_factor = inv_freq(params, dim, max_pos)
    switch = SWITCHED.get(params["rope_type"])
    if switch is not None:
        # The second set of frequencies for a table reaching past position `at`, for all
        # of its positions. transformers picks the set by a sequence's length (longer
        # than `at`: the long one) and, in generate, recomputes the cache with it when a
        # sequence crosses; one table for the whole context is llama.cpp's and vLLM's
        # choice (no cache to re-rotate), and equals transformers' forward over a
        # sequence of `max_len` tokens.
        second, at = switch(params, dim, max_pos)
        if max_len > at:
            inv = second
    positions = torch.arange(max_len, dtype=torch.float32, device=device)
    return torch.outer(positions, inv.float().to(device)), attention_factor


def rope_cos_sin(params: dict, head_dim: int, max_pos: int, max_len: int, *,
                 partial: float = 1.0, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables ``[max_len, rotary_dim]`` in the halves layout (float32)."""
    angles, attention_factor = _angles(params, rotary_dim(head_dim, partial), max_pos,
                                       max_len, device)
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos() * attention_factor, emb.sin() * attention_factor


def rope_freqs(params: dict, head_dim: int, max_pos: int, max_len: int, *,
               partial: float = 1.0) -> torch.Tensor:
    """Rotations ``[max_len, rotary_dim / 2]`` (complex64) for the interleaved layout:
    ``a * e^{i p theta_j}``, with ``a`` the attention factor."""
    angles, attention_factor = _angles(params, rotary_dim(head_dim, partial), max_pos,
                                       max_len)
    return torch.polar(torch.full_like(angles, attention_factor), angles)


@dataclass(frozen=True)
class RoPE:
    """A model's rotary embedding: what its tables are computed from."""

    params: dict = field(hash=False)  # rope_settings(): rope_type, rope_theta, scaling
    head_dim: int
    max_position_embeddings: int
    partial_rotary_factor: float = 1.0

    @classmethod
    def of(cls, arch: ModelArch) -> RoPE:
        # 2048 when config.json states no context: the engine's default as well
        return cls(arch.rope, arch.head_dim, arch.max_position_embeddings or 2048,
                   arch.partial_rotary_factor)

    def cos_sin(self, max_len: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(self.params, self.head_dim, self.max_position_embeddings,
                            max_len, partial=self.partial_rotary_factor, device=device)

    def freqs(self, max_len: int) -> torch.Tensor:
        return rope_freqs(self.params, self.head_dim, self.max_position_embeddings, max_len,
                          partial=self.partial_rotary_factor)


def rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``x * cos + rotate_half(x) * sin`` over the last dimension (the
    head's), with cos/sin broadcast to ``x``; a table narrower than the head rotates the
    first ``rotary_dim`` dimensions (partial rotary) and passes the rest through."""
    rot = cos.shape[-1]
    if rot != x.shape[-1]:
        return torch.cat([rotate_halves(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)
    half = rot // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rotate_pairs(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, d]`` (interleaved pairs) by ``freqs [T, 1, rotary_dim/2]``
    (complex), in float32 and cast back; dimensions past ``rotary_dim`` pass through."""
    t, h, d = x.shape
    rot = 2 * freqs.shape[-1]
    if rot != d:
        return torch.cat([rotate_pairs(x[..., :rot], freqs), x[..., rot:]], dim=-1)
    pairs = torch.view_as_complex(x.float().reshape(t, h, d // 2, 2))
    return torch.view_as_real(pairs * freqs).view(t, h, d).to(x.dtype)


def interleave_rows(weight: torch.Tensor, num_heads: int, rotated: int | None = None
                    ) -> torch.Tensor:
    """Reorder q/k projection rows from HF's halves layout to interleaved pairs.

    HF rotates dimension ``i`` of a head with ``i + r/2`` (``r``: the ``rotated``
    dimensions, all of the head by default); after this permutation the pair sits at
    ``(2i, 2i + 1)`` and RoPE is one complex multiplication. Attention only needs
    ``q . k``, which is unchanged when q and k share the permutation; V is not touched.
    (llama.cpp's converter applies the same permutation for the same reason.) With
    partial rotary the dimensions past ``r`` keep their place.
    """
    from llmctl.models.architectures import rope_permute  # the GGUF writer's, shared

    head = weight.shape[0] // num_heads
    if rotated is None or rotated == head:
        return rope_permute(weight, num_heads)
    rest = weight.shape[1:]
    per_head = weight.reshape(num_heads, head, *rest)
    turned = rope_permute(per_head[:, :rotated].reshape(num_heads * rotated, *rest), num_heads)
    return torch.cat([turned.reshape(num_heads, rotated, *rest), per_head[:, rotated:]],
                     dim=1).reshape(weight.shape)

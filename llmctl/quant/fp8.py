"""FP8 E4M3 ("fn": no infinities, max 448) quantization, and its emulation.

E4M3 keeps 3 mantissa bits: a normal value is ``1.mmm * 2^e`` with ``e`` in [-6, 8],
so between ``2^e`` and ``2^(e+1)`` the spacing is ``2^(e-3)``; below ``2^-6`` the
subnormals are spaced ``2^-9``. Rounding is to nearest, ties to even, saturating at
±448 (scales are chosen so that nothing exceeds it).

On CPUs there are no FP8 matmuls: llmctl stores FP8 codes and scales exactly as an
FP8 GPU kernel reads them, and *emulates* the arithmetic by quantize-dequantize in
float32 (both for calibration and for the dequantized reference).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmctl.quant.division import div_const

E4M3_MAX = 448.0
# KV-cache scales (a recipe's kv_cache_scheme; llmctl.serve.model.kv_scales when the checkpoint
# has none): twice the calibrated absmax over 448. E4M3's relative precision is the same
# from 2^-6 to 448, so the headroom costs nothing until values fall below 2^-6 s, while a
# K/V value past the calibrated range would saturate.
KV_HEADROOM = 2.0
_MIN_KV_SCALE = 1e-8  # a head that only saw zeros must not divide by zero


@dataclass(frozen=True)
class FP8Grid:
    """FP8 E4M3 weights with one scale per output channel or per tensor."""

    per_channel: bool = True


def round_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Nearest E4M3 value (ties to even, subnormals included), saturated at +-448, as
    float32. torch's cast rounds exactly so but turns values past 448 into NaN, hence the
    clamp; a frexp/ldexp emulation of the same rounding took 3.3x as long per GPTQ column
    (~8 torch calls), and GPTQ rounds one column at a time."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()


def scale_for(amax: torch.Tensor) -> torch.Tensor:
    """Scale mapping ``amax`` onto the largest E4M3 magnitude."""
    scale = div_const(amax.float(), E4M3_MAX)
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def weight_scale(w: torch.Tensor, per_channel: bool) -> torch.Tensor:
    """``(rows, 1)`` per output channel or ``(1,)`` per tensor."""
    if per_channel:
        return scale_for(w.abs().amax(dim=1, keepdim=True))
    return scale_for(w.abs().amax().reshape(1))


def rtn_quantize(w: torch.Tensor, grid: FP8Grid) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest FP8 codes and their scale."""
    scale = weight_scale(w, grid.per_channel)
    return quantize(w, scale), scale


def quantize(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP8 codes (``torch.float8_e4m3fn``) of ``w / scale``."""
    scaled = w.float() / scale.float()
    return round_to_e4m3(scaled).to(torch.float8_e4m3fn)  # exact: already on the grid


def dequantize(q: torch.Tensor, scale: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale.float()).to(dtype)


def fake_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (round_to_e4m3(x.float() / scale.float()) * scale.float()).to(x.dtype)


def fake_quantize_per_token(x: torch.Tensor) -> torch.Tensor:
    """Dynamic per-token FP8 activations: one scale per row of the last dimension."""
    flat = x.reshape(-1, x.shape[-1]).float()
    scale = scale_for(flat.abs().amax(dim=1, keepdim=True))
    return fake_quantize(flat, scale).reshape(x.shape).to(x.dtype)


def fake_quantize_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Static per-tensor FP8 activations with a calibrated scale."""
    return fake_quantize(x, scale.reshape(()))


def kv_cache_scales(amax: torch.Tensor) -> torch.Tensor:
    """Static E4M3 scales for K/V whose calibrated absolute maximum is ``amax``."""
    return div_const(KV_HEADROOM * amax.float(), E4M3_MAX).clamp(min=_MIN_KV_SCALE)

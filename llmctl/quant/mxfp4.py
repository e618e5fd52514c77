"""MXFP4 (OCP microscaling FP4): the form gpt-oss checkpoints store their experts in.

A block of 32 values shares one E8M0 scale (a uint8 ``s``: the power of two ``2^(s -
127)``); each value is an FP4 E2M1 code (1 sign, 2 exponent, 1 mantissa bit), two codes
per byte, the even element in the low nibble and the odd one in the high nibble::

    code 0..7  ->  +0, 0.5, 1, 1.5, 2, 3, 4, 6;   code 8..15  ->  the same, negative
    value = FP4_VALUES[code] * 2^(scale - 127)

On disk (gpt-oss's safetensors): ``{name}_blocks [..., rows, K / 32, 16]`` uint8 and
``{name}_scales [..., rows, K / 32]`` uint8, ``rows`` the output features of a linear and
``K`` its inputs: :func:`dequantize` returns ``[..., rows, K]``, the ``F.linear`` layout.
transformers' ``convert_moe_packed_tensors`` (transformers/integrations/mxfp4.py) returns
the same values transposed (``[E, K, rows]``, its experts compute ``x @ W``); the decoding
is the same table lookup and ``torch.ldexp`` in the target dtype, so bit for bit the same
numbers (tests/quant/test_mxfp4.py). :func:`quantize` is the inverse for tests and tools
(round to the nearest code under the block's scale ``2^(floor(log2 amax) - 2)``).

:func:`nibble_codes` gives the 4-bit codes as they are and the scale ``2^(s - 128)`` of
:data:`FP4_TIMES_2`: the engine's low-bit kernels read them in place, looking each
nibble up in that table, and hold the scale as its E8M0 byte again (0.5 bytes per weight
and 1 per block of 32: 0.53, MXFP4's own size).
:func:`int8_codes` gives the same numbers as integers with a scale per block, for the
engine's int8 kernel (the path before the codebook one, kept as a reference): every
E2M1 value is a multiple of 1/2, so ``2 * value`` is one of the integers 0, 1, 2, 3, 4,
6, 8, 12 (and negatives) and ``value * 2^(s - 127) = (2 * value) * 2^(s - 128)``,
exactly: there the codes are MXFP4 held as int8 (1 byte per weight and a float32 scale
per 32: 1.125 bytes against MXFP4's 0.53 and bf16's 2). Both share that scale
(:func:`half_scales`): every scale is a power of two float32 holds exactly, ``2^-128``
for ``s = 0`` and ``2^-127`` for ``s = 1`` (subnormals: float32's reach ``2^-149``, and
each ``q * scale`` is a multiple of the scale, so exact) up to ``2^127`` for ``s = 255``
(NaN in the MX spec; transformers' ``torch.ldexp`` decodes it as the power ``2^128``,
exactly, and so does this): where ``q * scale`` overflows to inf, ``value * 2^(s - 127)``
does too. The one difference is the sign of zero: code 8 (``-0``) becomes the integer
0, so it decodes to ``+0.0`` (equal as a number).
"""

from __future__ import annotations

import torch

# E2M1 code -> value (transformers' FP4_VALUES, the OCP MX spec's table)
FP4_VALUES = (+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0_BIAS = 127
BLOCK = 32  # values per scale
FP4_MAX_EXP = 2  # the largest code, 6 = 1.5 * 2^2


# twice each E2M1 value (FP4_VALUES): integers, -0 becoming 0
FP4_TIMES_2 = tuple(int(2 * v) for v in FP4_VALUES)


def _check(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] * 2 != BLOCK:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales "
                         f"{tuple(scales.shape)} (expected [..., G, 16] and [..., G])")


def dequantize(blocks: torch.Tensor, scales: torch.Tensor,
               dtype: torch.dtype = torch.bfloat16, *,
               rows_per_chunk: int = 1 << 20) -> torch.Tensor:
    """``blocks [..., G, 16]`` uint8 and ``scales [..., G]`` uint8 -> ``[..., G * 32]``
    values in ``dtype`` (module doc), ``rows_per_chunk`` blocks of 32 at a time (bounded
    temporaries: the index tensors are 4 bytes per value)."""
    _check(blocks, scales)
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    rows = blocks.reshape(-1, BLOCK // 2).to(torch.uint8)
    exps = (scales.to(torch.int32) - E8M0_BIAS).reshape(-1, 1)
    out = torch.empty(rows.shape[0], BLOCK, dtype=dtype, device=blocks.device)
    for r0 in range(0, rows.shape[0], rows_per_chunk):
        r1 = min(r0 + rows_per_chunk, rows.shape[0])
        sub, blk = out[r0:r1], rows[r0:r1]
        sub[:, 0::2] = lut[(blk & 0x0F).to(torch.int)]  # the even element: the low nibble
        sub[:, 1::2] = lut[(blk >> 4).to(torch.int)]
        torch.ldexp(sub, exps[r0:r1], out=sub)
    return out.view(*scales.shape[:-1], scales.shape[-1] * BLOCK)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [..., K]`` (K a multiple of 32) -> ``(blocks [..., K/32, 16], scales [...,
    K/32])``: per block the scale ``2^(floor(log2 amax) - 2)`` (the largest value lands in
    [4, 8)), each value the nearest code (ties to the lower code index)."""
    if weight.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 needs a multiple of {BLOCK} inputs, got {weight.shape[-1]}")
    x = weight.float().reshape(*weight.shape[:-1], -1, BLOCK)
    amax = x.abs().amax(-1)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp(min=2.0 ** -126))),
                      torch.zeros_like(amax)) - FP4_MAX_EXP
    exp = exp.clamp(-E8M0_BIAS, 254 - E8M0_BIAS)
    scaled = x / torch.pow(2.0, exp).unsqueeze(-1)
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = (scaled.unsqueeze(-1) - lut).abs().argmin(-1).to(torch.uint8)  # [..., G, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exp + E8M0_BIAS).to(torch.uint8)


def int8_codes(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``blocks [..., G, 16]`` and ``scales [..., G]`` uint8 -> ``(q [..., G * 32]`` int8,
    ``scale [..., G]`` float32``)`` with ``q * scale`` (per block of 32) the MXFP4 values,
    exactly (module doc): ``q = 2 * value``, ``scale = 0.5 * 2^(s - 127)``, the power of
    two computed as :func:`dequantize` (and transformers) compute it, ``torch.ldexp`` in
    float32."""
    _check(blocks, scales)
    lut = torch.tensor(FP4_TIMES_2, dtype=torch.int8, device=blocks.device)
    pairs = blocks.to(torch.uint8)
    q = torch.empty(*pairs.shape[:-1], BLOCK, dtype=torch.int8, device=blocks.device)
    q[..., 0::2] = lut[(pairs & 0x0F).to(torch.int)]  # the even element: the low nibble
    q[..., 1::2] = lut[(pairs >> 4).to(torch.int)]
    return q.view(*scales.shape[:-1], scales.shape[-1] * BLOCK), half_scales(scales)


def half_scales(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 ``scales`` uint8 -> float32 ``0.5 * 2^(s - 127) = 2^(s - 128)``, the scale of
    :data:`FP4_TIMES_2` codes (module doc: exact for every ``s``, 2^-128 a subnormal)."""
    half = torch.full(scales.shape, 0.5, dtype=torch.float32, device=scales.device)
    return torch.ldexp(half, scales.to(torch.int32) - E8M0_BIAS)


def nibble_codes(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``blocks [..., G, 16]`` and ``scales [..., G]`` uint8 -> ``(e [..., G * 32]`` uint8
    E2M1 codes 0..15, ``scale [..., G]`` float32``)``: ``FP4_TIMES_2[e] * scale`` are the
    MXFP4 values, exactly, as for :func:`int8_codes`, but the code stays the 4-bit
    index the low-bit kernels look up in place (one byte each here, for their packers)."""
    _check(blocks, scales)
    pairs = blocks.to(torch.uint8)
    e = torch.stack([pairs & 0x0F, pairs >> 4], dim=-1)  # the even element: the low nibble
    return e.view(*scales.shape[:-1], scales.shape[-1] * BLOCK), half_scales(scales)

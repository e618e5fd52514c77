"""Dense bit packing of b-bit integer codes into int32 words (compressed-tensors layout).

Codes ``q`` in ``[-2^(b-1), 2^(b-1))`` are offset to unsigned ``u = q + 2^(b-1)`` and
laid out little-endian along the packed dimension: element ``i`` of a run of 32 occupies
bits ``[i*b, i*b + b)`` of the run's ``b`` words, spilling into the next word when it
crosses a 32-bit boundary. For b = 4 that is 8 codes per word, element ``i`` at bit
``4*(i % 8)`` of word ``i // 8``:

    word 0: | u7 | u6 | u5 | u4 | u3 | u2 | u1 | u0 |   (u0 in the low nibble)

Rows are padded with zero codes to a multiple of 32 elements and the result is cut to
``ceil(n * b / 32)`` words, so nothing is wasted.
"""

from __future__ import annotations

import math

import numpy as np
import torch

_MASK32 = (1 << 32) - 1


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """Low 32 bits of non-negative int64 words, reinterpreted as signed int32."""
    words = words & _MASK32
    return torch.where(words >= (1 << 31), words - (1 << 32), words).to(torch.int32)


def _layout(bits: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    start = torch.arange(32, device=device, dtype=torch.int64) * bits
    return start // 32, start % 32  # word index and bit offset of each of 32 elements


def pack_int32(q: torch.Tensor, bits: int, dim: int = 1) -> torch.Tensor:
    """Pack a 2-D int8 tensor of ``bits``-bit codes along ``dim`` (1: columns, 0: rows)."""
    if q.dtype != torch.int8 or q.ndim != 2:
        raise ValueError("pack_int32 expects a 2-D int8 tensor of codes")
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in [1, 8], got {bits}")
    if 32 % bits == 0:  # codes never straddle words: OR the shifted codes of each word
        # numpy's uint32 wraps where torch has no unsigned 32-bit arithmetic (int64 there
        # costs 4x the memory traffic: it was most of the writer's time)
        u = (q.cpu().numpy().astype(np.int16) + (1 << (bits - 1))).astype(np.uint32)
        if dim == 0:
            u = u.T
        rows, n = u.shape
        per_word = 32 // bits
        u = np.pad(u, ((0, 0), (0, -n % per_word))).reshape(rows, -1, per_word)
        u <<= np.arange(per_word, dtype=np.uint32) * bits
        packed = np.bitwise_or.reduce(u, axis=-1).view(np.int32)
        packed = np.ascontiguousarray(packed.T if dim == 0 else packed)
        return torch.from_numpy(packed).to(q.device)
    u = q.to(torch.int64) + (1 << (bits - 1))
    if dim == 0:
        u = u.t()
    rows, n = u.shape
    padded = math.ceil(n / 32) * 32
    u = torch.nn.functional.pad(u, (0, padded - n)).reshape(rows, padded // 32, 32)
    word, offset = _layout(bits, u.device)
    out = torch.zeros(rows, padded // 32, bits + 1, dtype=torch.int64, device=u.device)
    # Bits never overlap, so adding the shifted codes is the same as OR-ing them.
    out.index_add_(2, word, u << offset)
    spill = offset + bits > 32
    out.index_add_(2, word[spill] + 1, u[..., spill] >> (32 - offset[spill]))
    packed = _to_int32(out[..., :bits].reshape(rows, -1)[:, : math.ceil(n * bits / 32)])
    return packed.t().contiguous() if dim == 0 else packed.contiguous()


def unpack_int32(packed: torch.Tensor, bits: int, shape: tuple[int, int],
                 dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`pack_int32`: int8 codes of the given (unpacked) ``shape``."""
    if dim == 0:
        packed = packed.t()
        shape = (shape[1], shape[0])
    n = shape[1]
    groups = math.ceil(n / 32)
    words = packed.to(torch.int64) & _MASK32
    words = torch.nn.functional.pad(words, (0, groups * bits + 1 - words.shape[1]))
    word, offset = _layout(bits, packed.device)
    idx = (torch.arange(groups, device=packed.device)[:, None] * bits + word[None, :]).reshape(-1)
    off = offset.repeat(groups)
    lo = words[:, idx] >> off
    hi = words[:, idx + 1] << (32 - off)
    u = (lo | hi) & ((1 << bits) - 1)
    q = (u[:, :n] - (1 << (bits - 1))).to(torch.int8)
    return q.t().contiguous() if dim == 0 else q

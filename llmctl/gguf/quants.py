"""GGML's legacy block quantizers (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) and BF16, as pure numpy.

Tensors in, bytes out: each function takes a float32 array whose last dimension is a
multiple of 32 and returns uint8 rows laid out exactly as ggml stores them, so the
result is bit-identical to gguf-py's reference ``gguf.quants.quantize`` (itself
checked against ggml-quants.c). Tests compare both on random and edge-case data.

Why not call gguf-py directly: its quantizers allocate several full-size temporaries
per 16-row group and run on one core; these work on row chunks (bounded memory) and
spread the chunks over threads (numpy releases the GIL in its ufuncs).

Block layouts (32 weights per block, little-endian, ``d``/``m`` are float16):

    Q8_0  | d | q[32] int8                       x = d * q          34 bytes
    Q4_0  | d | nibbles[16]                      x = d * (q - 8)    18 bytes
    Q4_1  | d | m | nibbles[16]                  x = d * q + m      20 bytes
    Q5_0  | d | qh u32 | nibbles[16]             x = d * (q - 16)   22 bytes
    Q5_1  | d | m | qh u32 | nibbles[16]         x = d * q + m      24 bytes

``nibbles[j]`` holds q[j] in its low and q[j + 16] in its high four bits; bit j of
``qh`` is bit 4 of q[j].
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from llmctl.errors import UsageError

BLOCK = 32
_F32 = np.float32


def _round_away(x: np.ndarray) -> np.ndarray:
    """roundf(): halves away from zero (np.round rounds them to even)."""
    a = np.abs(x)
    floored = np.floor(a)
    return np.copysign(floored + np.floor(2 * (a - floored)), x)


def _safe_inverse(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d == 0, _F32(0), _F32(1) / d).astype(_F32)


def _signed_absmax(blocks: np.ndarray) -> np.ndarray:
    """The element of largest magnitude, with its sign (first one on ties, as ggml)."""
    idx = np.abs(blocks).argmax(axis=-1)[..., None]
    return np.take_along_axis(blocks, idx, axis=-1)


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """q[..., 32] in 0..15 (or 0..31: bit 4 dropped) -> [..., 16] bytes."""
    return (q[..., :16] & np.uint8(0x0F)) | (q[..., 16:] << np.uint8(4))


def _pack_high_bits(q: np.ndarray) -> np.ndarray:
    """Bit 4 of each of the 32 values -> one little-endian uint32 (as 4 bytes)."""
    return np.packbits((q >> np.uint8(4)) & np.uint8(1), axis=-1, bitorder="little")


def _q8_0(blocks: np.ndarray) -> np.ndarray:
    d = (np.abs(blocks).max(axis=-1, keepdims=True) / _F32(127)).astype(_F32)
    q = _round_away(blocks * _safe_inverse(d)).astype(np.int8).view(np.uint8)
    return np.concatenate([_f16_bytes(d), q], axis=-1)


def _q4_0(blocks: np.ndarray) -> np.ndarray:
    # d = max / -8 maps the extreme value to q = 0 and leaves 15 for the other side.
    d = (_signed_absmax(blocks) / _F32(-8)).astype(_F32)
    q = np.trunc(blocks * _safe_inverse(d) + _F32(8.5)).clip(0, 15).astype(np.uint8)
    return np.concatenate([_f16_bytes(d), _pack_nibbles(q)], axis=-1)


def _q4_1(blocks: np.ndarray) -> np.ndarray:
    lo = blocks.min(axis=-1, keepdims=True)
    d = ((blocks.max(axis=-1, keepdims=True) - lo) / _F32(15)).astype(_F32)
    q = np.trunc((blocks - lo) * _safe_inverse(d) + _F32(0.5)).clip(0, 15).astype(np.uint8)
    return np.concatenate([_f16_bytes(d), _f16_bytes(lo), _pack_nibbles(q)], axis=-1)


def _q5_0(blocks: np.ndarray) -> np.ndarray:
    d = (_signed_absmax(blocks) / _F32(-16)).astype(_F32)
    q = np.trunc(blocks * _safe_inverse(d) + _F32(16.5)).clip(0, 31).astype(np.uint8)
    return np.concatenate([_f16_bytes(d), _pack_high_bits(q), _pack_nibbles(q)], axis=-1)


def _q5_1(blocks: np.ndarray) -> np.ndarray:
    lo = blocks.min(axis=-1, keepdims=True)
    d = ((blocks.max(axis=-1, keepdims=True) - lo) / _F32(31)).astype(_F32)
    q = np.trunc((blocks - lo) * _safe_inverse(d) + _F32(0.5)).clip(0, 31).astype(np.uint8)
    return np.concatenate([_f16_bytes(d), _f16_bytes(lo), _pack_high_bits(q),
                           _pack_nibbles(q)], axis=-1)


def _bf16(values: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 with round-to-nearest-even and NaNs kept quiet (ggml_compute_fp32_to_bf16).

    uint32 arithmetic suffices: only NaN bit patterns can wrap, and those are replaced.
    """
    n = values.view(np.uint32)
    rounded = (n + (np.uint32(0x7FFF) + ((n >> 16) & np.uint32(1)))) >> 16
    nan = (n & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    if nan.any():
        rounded = np.where(nan, (n >> 16) | np.uint32(64), rounded)
    return rounded.astype(np.uint16).view(np.uint8)


@dataclass(frozen=True)
class BlockQuant:
    name: str
    block_size: int
    type_size: int  # bytes per block
    quantize_blocks: Callable[[np.ndarray], np.ndarray]  # [n, block] f32 -> [n, type_size] u8

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.type_size / self.block_size


# gguf-py's constants.GGML_QUANT_SIZES gives the same (block, bytes) pairs.
QUANTS: dict[str, BlockQuant] = {
    q.name: q
    for q in (
        BlockQuant("Q8_0", BLOCK, 2 + 32, _q8_0),
        BlockQuant("Q4_0", BLOCK, 2 + 16, _q4_0),
        BlockQuant("Q4_1", BLOCK, 2 + 2 + 16, _q4_1),
        BlockQuant("Q5_0", BLOCK, 2 + 4 + 16, _q5_0),
        BlockQuant("Q5_1", BLOCK, 2 + 2 + 4 + 16, _q5_1),
        BlockQuant("BF16", 1, 2, _bf16),
    )
}

# Rows per work item: 4096 x 576 floats is ~9 MB in, a few temporaries of that size.
_CHUNK_ELEMENTS = 1 << 21


def quantize(array: np.ndarray, type_name: str, threads: int | None = None) -> np.ndarray:
    """Quantize ``array`` (any float dtype, ``[..., K]`` with K % block == 0) to ggml bytes.

    Returns uint8 of shape ``[..., K // block * type_size]``, the layout gguf-py's
    ``GGUFWriter.add_tensor(..., raw_dtype=...)`` expects.
    """
    quant = QUANTS.get(type_name)
    if quant is None:
        raise UsageError(f"llmctl has no block quantizer for {type_name!r}",
                         f"llmctl quantizes to: {', '.join(QUANTS)}; K-quants go through llama.cpp")
    array = np.ascontiguousarray(array, dtype=_F32)
    if array.ndim == 0 or array.shape[-1] % quant.block_size:
        raise UsageError(
            f"cannot quantize a tensor of shape {array.shape} to {type_name}: rows must be a "
            f"multiple of {quant.block_size}",
            "keep this tensor in F16/F32 or pick a type with a smaller block",
        )
    row = array.shape[-1]
    rows = array.reshape(-1, row)
    out_row = row // quant.block_size * quant.type_size
    out = np.empty((rows.shape[0], out_row), dtype=np.uint8)
    step = max(1, _CHUNK_ELEMENTS // row)

    def work(start: int) -> None:
        chunk = rows[start:start + step]
        blocks = chunk.reshape(-1, quant.block_size)
        out[start:start + step] = quant.quantize_blocks(blocks).reshape(chunk.shape[0], out_row)

    starts = range(0, rows.shape[0], step)
    threads = threads or min(len(starts), os.cpu_count() or 1)
    if threads <= 1:
        for start in starts:
            work(start)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(work, starts))
    return out.reshape(*array.shape[:-1], out_row)


def quantized_nbytes(shape: tuple[int, ...], type_name: str) -> int:
    """Bytes a tensor of ``shape`` (PyTorch order) takes in ``type_name``."""
    import gguf

    block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    n = 1
    for d in shape:
        n *= d
    return n // block * type_size

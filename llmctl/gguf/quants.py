"""GGML's legacy block types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), MXFP4 and BF16, both ways, as pure numpy.

One class per GGUF tensor type, registered in :data:`QUANTS` under the type's name, as
gguf-py's ``quants.py`` does. ``encode`` takes float32 blocks and returns uint8 rows laid
out exactly as ggml stores them, bit-identical to gguf-py's reference
``gguf.quants.quantize`` (itself checked against ggml-quants.c); ``dequantize`` reads them
back to float32 as gguf-py does. The legacy types also give their integer ``codes`` with a
per-block scale and offset, which the engine runs as they are on its low-bit kernel
(:mod:`llmctl.serve.model.gguf_weights`). Tests compare every direction with gguf-py.

Why not call gguf-py directly: its quantizers allocate several full-size temporaries
per 16-row group and run on one core; :func:`quantize` works on row chunks (bounded
memory) and spreads the chunks over threads (numpy releases the GIL in its ufuncs).

Block layouts (32 weights per block, little-endian, ``d``/``m`` are float16), and the
codes each decodes to (``x = d * q + z``):

    Q8_0  | d | q[32] int8                       x = d * q          z: none   34 bytes
    Q4_0  | d | nibbles[16]                      x = d * (q - 8)    z = -8 d  18 bytes
    Q4_1  | d | m | nibbles[16]                  x = d * q + m      z = m     20 bytes
    Q5_0  | d | qh u32 | nibbles[16]             x = d * (q - 16)   z = -16 d 22 bytes
    Q5_1  | d | m | qh u32 | nibbles[16]         x = d * q + m      z = m     24 bytes

``nibbles[j]`` holds q[j] in its low and q[j + 16] in its high four bits; bit j of
``qh`` is bit 4 of q[j].
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import ClassVar

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


def _f16(raw: np.ndarray) -> np.ndarray:
    """Two bytes per block -> the float16 they hold, as float32 (one per block)."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """q[..., 32] in 0..15 (or 0..31: bit 4 dropped) -> [..., 16] bytes."""
    return (q[..., :16] & np.uint8(0x0F)) | (q[..., 16:] << np.uint8(4))


def _unpack_nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> q[..., 32] in 0..15."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _pack_high_bits(q: np.ndarray) -> np.ndarray:
    """Bit 4 of each of the 32 values -> one little-endian uint32 (as 4 bytes)."""
    return np.packbits((q >> np.uint8(4)) & np.uint8(1), axis=-1, bitorder="little")


def _unpack_high_bits(qh: np.ndarray) -> np.ndarray:
    """[..., 4] bytes (a little-endian uint32) -> bit 4 of each of the 32 values."""
    return np.unpackbits(qh, axis=-1, bitorder="little") << np.uint8(4)


# (codes q, scale d, offset z or None) per block: x = d * q + z
Codes = tuple[np.ndarray, np.ndarray, np.ndarray | None]

QUANTS: dict[str, type[Quant]] = {}


class Quant:
    """A GGUF tensor type llmctl writes: ``block_size`` weights in ``type_size`` bytes.

    Subclasses register under their GGUF type name (``class Q8_0(LegacyBlock,
    qtype="Q8_0", ...)``); gguf-py's ``GGML_QUANT_SIZES`` gives the same sizes.
    """

    name: ClassVar[str]
    block_size: ClassVar[int]
    type_size: ClassVar[int]
    bits_per_weight: ClassVar[float]

    def __init_subclass__(cls, qtype: str | None = None, *, block_size: int = BLOCK,
                          type_size: int = 0, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if qtype is None:  # an abstract family (LegacyBlock)
            return
        cls.name, cls.block_size, cls.type_size = qtype, block_size, type_size
        cls.bits_per_weight = 8 * type_size / block_size
        QUANTS[qtype] = cls

    @staticmethod
    def encode(blocks: np.ndarray) -> np.ndarray:
        """[n, block_size] float32 -> [n, type_size] uint8."""
        raise NotImplementedError

    @classmethod
    def dequantize(cls, blocks: np.ndarray) -> np.ndarray:
        """[..., type_size] uint8 -> [..., block_size] float32."""
        raise NotImplementedError


class LegacyBlock(Quant):
    """32 weights, an fp16 scale ``d`` (an fp16 minimum ``m`` too for the ``_1`` types) and
    ``bits``-bit codes: ``x = d * q + z`` (see the module table)."""

    bits: ClassVar[int]

    def __init_subclass__(cls, qtype: str | None = None, *, bits: int = 0, **kwargs) -> None:
        super().__init_subclass__(qtype, **kwargs)
        cls.bits = bits

    @staticmethod
    def codes(blocks: np.ndarray) -> Codes:
        """[..., blocks, type_size] uint8 -> (q [..., blocks, 32] uint8 or int8,
        d [..., blocks] float32, z [..., blocks] float32 or None)."""
        raise NotImplementedError

    @classmethod
    def dequantize(cls, blocks: np.ndarray) -> np.ndarray:
        q, d, z = cls.codes(blocks)
        x = q.astype(_F32) * d[..., None]
        return x if z is None else x + z[..., None]


class Q8_0(LegacyBlock, qtype="Q8_0", bits=8, type_size=2 + 32):
    @staticmethod
    def encode(blocks: np.ndarray) -> np.ndarray:
        d = (np.abs(blocks).max(axis=-1, keepdims=True) / _F32(127)).astype(_F32)
        q = _round_away(blocks * _safe_inverse(d)).astype(np.int8).view(np.uint8)
        return np.concatenate([_f16_bytes(d), q], axis=-1)

    @staticmethod
    def codes(blocks: np.ndarray) -> Codes:
        return np.ascontiguousarray(blocks[..., 2:34]).view(np.int8), _f16(blocks[..., 0:2]), None


class Q4_0(LegacyBlock, qtype="Q4_0", bits=4, type_size=2 + 16):
    @staticmethod
    def encode(blocks: np.ndarray) -> np.ndarray:
        # d = max / -8 maps the extreme value to q = 0 and leaves 15 for the other side.
        d = (_signed_absmax(blocks) / _F32(-8)).astype(_F32)
        q = np.trunc(blocks * _safe_inverse(d) + _F32(8.5)).clip(0, 15).astype(np.uint8)
        return np.concatenate([_f16_bytes(d), _pack_nibbles(q)], axis=-1)

    @staticmethod
    def codes(blocks: np.ndarray) -> Codes:
        d = _f16(blocks[..., 0:2])
        return _unpack_nibbles(blocks[..., 2:18]), d, -8.0 * d


class Q4_1(LegacyBlock, qtype="Q4_1", bits=4, type_size=2 + 2 + 16):
    @staticmethod
    def encode(blocks: np.ndarray) -> np.ndarray:
        lo = blocks.min(axis=-1, keepdims=True)
        d = ((blocks.max(axis=-1, keepdims=True) - lo) / _F32(15)).astype(_F32)
        q = np.trunc((blocks - lo) * _safe_inverse(d) + _F32(0.5)).clip(0, 15).astype(np.uint8)
        return np.concatenate([_f16_bytes(d), _f16_bytes(lo), _pack_nibbles(q)], axis=-1)

    @staticmethod
    def codes(blocks: np.ndarray) -> Codes:
        return _unpack_nibbles(blocks[..., 4:20]), _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])


class Q5_0(LegacyBlock, qtype="Q5_0", bits=5, type_size=2 + 4 + 16):
    @staticmethod
    def encode(blocks: np.ndarray) -> np.ndarray:
        d = (_signed_absmax(blocks) / _F32(-16)).astype(_F32)
        q = np.trunc(blocks * _safe_inverse(d) + _F32(16.5)).clip(0, 31).astype(np.uint8)
        return np.concatenate([_f16_bytes(d), _pack_high_bits(q), _pack_nibbles(q)], axis=-1)

    @staticmethod
    def codes(blocks: np.ndarray) -> Codes:
        d = _f16(blocks[..., 0:2])
        q = _unpack_nibbles(blocks[..., 6:22]) | _unpack_high_bits(blocks[..., 2:6])
        return q, d, -16.0 * d


class Q5_1(LegacyBlock, qtype="Q5_1", bits=5, type_size=2 + 2 + 4 + 16):
    @staticmethod
    def encode(blocks: np.ndarray) -> np.ndarray:
        lo = blocks.min(axis=-1, keepdims=True)
        d = ((blocks.max(axis=-1, keepdims=True) - lo) / _F32(31)).astype(_F32)
        q = np.trunc((blocks - lo) * _safe_inverse(d) + _F32(0.5)).clip(0, 31).astype(np.uint8)
        return np.concatenate([_f16_bytes(d), _f16_bytes(lo), _pack_high_bits(q),
                               _pack_nibbles(q)], axis=-1)

    @staticmethod
    def codes(blocks: np.ndarray) -> Codes:
        q = _unpack_nibbles(blocks[..., 8:24]) | _unpack_high_bits(blocks[..., 4:8])
        return q, _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])


class BF16(Quant, qtype="BF16", block_size=1, type_size=2):
    @staticmethod
    def encode(blocks: np.ndarray) -> np.ndarray:
        """fp32 -> bf16 with round-to-nearest-even and NaNs kept quiet
        (ggml_compute_fp32_to_bf16).

        uint32 arithmetic suffices: only NaN bit patterns can wrap, and those are replaced.
        """
        n = blocks.view(np.uint32)
        rounded = (n + (np.uint32(0x7FFF) + ((n >> 16) & np.uint32(1)))) >> 16
        nan = (n & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
        if nan.any():
            rounded = np.where(nan, (n >> 16) | np.uint32(64), rounded)
        return rounded.astype(np.uint16).view(np.uint8)

    @classmethod
    def dequantize(cls, blocks: np.ndarray) -> np.ndarray:
        return (np.ascontiguousarray(blocks).view(np.uint16).astype(np.uint32) << 16).view(_F32)


# Rows per work item: 4096 x 576 floats is ~9 MB in, a few temporaries of that size.
_CHUNK_ELEMENTS = 1 << 21


class MXFP4(Quant, qtype="MXFP4", type_size=1 + 16):
    """OCP MXFP4 as ggml stores it: ``| e | nibbles[16] |``, ``e`` an E8M0 exponent and
    the E2M1 codes read doubled (:data:`MXFP4_VALUES`) against ``2^(e - 128)``, the same
    numbers and the same ``e`` byte as :mod:`llmctl.quant.mxfp4` (gpt-oss's checkpoints).
    ``nibbles[j]`` holds code j low and code j + 16 high. The scale puts the block's
    largest magnitude in [4, 8) (``e = floor(log2 amax) + 125``), each value the nearest
    code (the first on ties): a block already on that grid (decoded MXFP4) comes back
    exactly."""

    @staticmethod
    def half_scale(e: np.ndarray) -> np.ndarray:
        """``2^(e - 128)`` built from its float32 bits (ggml_e8m0_to_fp32_half; subnormal
        for e < 2)."""
        return np.where(e < 2, np.uint32(0x00200000) << np.uint32(e),
                        np.uint32(e - 1) << np.uint32(23)).view(_F32)

    @staticmethod
    def encode(blocks: np.ndarray) -> np.ndarray:
        amax = np.abs(blocks).max(axis=-1, keepdims=True)
        with np.errstate(divide="ignore"):
            e = np.where(amax > 0, np.floor(np.log2(amax)) - 2 + 127, 0).astype(np.uint8)
        d = MXFP4.half_scale(e)
        codes = np.empty(blocks.shape, dtype=np.uint8)
        for s in range(0, len(blocks), _MXFP4_SEARCH):  # 16 candidates a value: bounded
            part = slice(s, s + _MXFP4_SEARCH)
            errs = np.abs(d[part, :, None] * MXFP4_VALUES - blocks[part, :, None])
            codes[part] = errs.argmin(axis=-1)
        return np.concatenate([e, codes[:, :16] | (codes[:, 16:] << np.uint8(4))], axis=-1)

    @classmethod
    def dequantize(cls, blocks: np.ndarray) -> np.ndarray:
        e, qs = blocks[..., :1], blocks[..., 1:]
        codes = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)
        return cls.half_scale(e) * MXFP4_VALUES[codes]


# the E2M1 codes doubled (ggml's kvalues_mxfp4): integers, against a half scale
MXFP4_VALUES = np.array((0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12), dtype=_F32)
_MXFP4_SEARCH = 4096  # blocks per nearest-code search (4096 x 32 x 16 float32: 8 MiB)


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
        out[start:start + step] = quant.encode(blocks).reshape(chunk.shape[0], out_row)

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

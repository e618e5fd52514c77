"""8-bit KV cache: the formats, and the quantize / dequantize maths in torch.

int8 (symmetric, one scale per token, KV head and K-or-V; llama.cpp's ``q8_0`` K/V cache
keeps one per 32 values, vLLM's int8 proposals one per token and head)::

    s = max_i |x_i| / 127          over the head_dim values x of one token's K (or V) head
    c_i = round(x_i / s)           in -127 .. 127 (round half to even; s = 0 -> c = 0)
    x_i ~ c_i * s                  error <= s / 2 per value

The codes live in the cache tensor (int8, same shape as a float cache) and the scales in a
parallel float32 tensor ``[layers, 2, blocks, block_size, kv_heads]`` addressed by the same
block ids and slots, so the block tables, prefix caching, copy-on-write forks and
preemption (recompute) need no change: whatever moves a block's K/V moves its scales.
A scale is computed when the token's K/V are written (from those values alone) and never
changes, so a block shared by several sequences reads the same everywhere.

fp8 (E4M3, vLLM's ``--kv-cache-dtype fp8``) with static scales, one per layer, K or V
and KV head (a per-layer scale is the same value for every head), from the checkpoint's
``kv_cache_scheme`` or calibrated (:mod:`llmctl.serve.model.kv_scales`)::

    c = e4m3(clamp(x / s, -448, 448))   round to nearest even; 3 mantissa bits, so a
    x ~ e4m3(c) * s                    relative error <= 2^-4 (normals, |x / s| >= 2^-6)

The codes are stored as uint8 (torch has no CPU indexing for ``float8_e4m3fn``) and
viewed as ``float8_e4m3fn`` to convert; the scales are ``[layers, 2, kv_heads]``
float32, so a block holds only codes (2x the tokens of bf16) and nothing moves with it.
A value beyond the calibrated range saturates at 448 s: the calibration's headroom
(:data:`llmctl.quant.fp8.KV_HEADROOM`) is what keeps that rare.

The native kernels (:file:`csrc/rope_kv.cpp`, :file:`csrc/paged_attention.cpp`,
:file:`csrc/fp8.h`) do the same arithmetic in the same order: these functions are the
reference they are tested against and the torch path (``LLMCTL_CPU_KERNELS=0``) itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmctl.quant.fp8 import E4M3_MAX

INT8_MAX = 127


@dataclass(frozen=True)
class KVFormat:
    """How one ``--kv-cache-dtype`` stores K/V: the cache tensor's dtype, the bytes of
    scale kept per (token, KV head, K or V) next to it, or static scales per layer, K or
    V and KV head (fp8)."""

    name: str
    storage: torch.dtype
    scale_bytes: int = 0
    static_scales: bool = False

    @property
    def quantized(self) -> bool:
        return self.scale_bytes > 0 or self.static_scales

    def describe(self) -> str:
        if self.static_scales:
            return f"{self.name}, static scales per layer and KV head"
        return (f"{self.name}, a float32 scale per token and KV head" if self.quantized
                else self.name)


# --kv-cache-dtype values other than "auto" (= the model's dtype)
KV_FORMATS: dict[str, KVFormat] = {
    "float32": KVFormat("float32", torch.float32),
    "bfloat16": KVFormat("bfloat16", torch.bfloat16),
    "float16": KVFormat("float16", torch.float16),
    "int8": KVFormat("int8", torch.int8, scale_bytes=4),
    "fp8": KVFormat("fp8", torch.uint8, static_scales=True),  # E4M3 codes
}


def kv_format(name: str, model_dtype: torch.dtype) -> KVFormat:
    if name == "auto":
        return next(f for f in KV_FORMATS.values() if f.storage == model_dtype)
    return KV_FORMATS[name]


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., d]`` -> codes ``int8 [..., d]`` and scales ``float32 [...]``."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / INT8_MAX
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(xf / divisor.unsqueeze(-1)).clamp_(-INT8_MAX, INT8_MAX)
    return codes.to(torch.int8), scale


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
                    ) -> torch.Tensor:
    """``codes [..., d]`` times ``scales [...]``, computed in float32, returned as ``dtype``."""
    return (codes.float() * scales.unsqueeze(-1)).to(dtype)


def write_int8(layer_cache: torch.Tensor, layer_scales: torch.Tensor, slots: torch.Tensor,
               k: torch.Tensor, v: torch.Tensor) -> None:
    """Quantize ``k, v [T, kv_heads, d]`` into ``layer_cache [2, blocks, block_size,
    kv_heads, d]`` and ``layer_scales [2, blocks, block_size, kv_heads]`` at ``slots``."""
    kv_heads, d = k.shape[1], k.shape[2]
    for i, x in enumerate((k, v)):
        codes, scales = quantize_int8(x)
        layer_cache[i].view(-1, kv_heads, d).index_copy_(0, slots, codes)
        layer_scales[i].view(-1, kv_heads).index_copy_(0, slots, scales)


def read_int8(layer_cache: torch.Tensor, layer_scales: torch.Tensor, slots: torch.Tensor,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The dequantized K and V ``[T, kv_heads, d]`` at ``slots``: what attention over the
    cache reads for those tokens."""
    kv_heads, d = layer_cache.shape[-2], layer_cache.shape[-1]
    return tuple(dequantize_int8(layer_cache[i].view(-1, kv_heads, d)[slots],
                                 layer_scales[i].view(-1, kv_heads)[slots], dtype)
                 for i in range(2))


def quantize_fp8(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x [..., kv_heads, d]`` over ``scales [kv_heads]`` -> E4M3 codes as uint8."""
    q = (x.float() / scales.unsqueeze(-1)).clamp_(-E4M3_MAX, E4M3_MAX)
    return q.to(torch.float8_e4m3fn).view(torch.uint8)


def dequantize_fp8(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
                   ) -> torch.Tensor:
    """uint8 E4M3 ``codes [..., kv_heads, d]`` times ``scales`` (broadcast against
    ``[..., kv_heads]``), computed in float32, returned as ``dtype``."""
    return (codes.view(torch.float8_e4m3fn).float() * scales.unsqueeze(-1)).to(dtype)


class Int8Codec:
    """Per-token int8: ``layer_scales [2, blocks, block_size, kv_heads]``, written with
    the codes."""

    write = staticmethod(write_int8)
    read = staticmethod(read_int8)

    @staticmethod
    def dequantize_gathered(kv: torch.Tensor, layer_scales: torch.Tensor,
                            gather_index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``kv [2, B, S, kv_heads, d]``: the codes of the cache rows ``gather_index``
        (:class:`llmctl.serve.layers.attention.AttnGroup`); their scales gathered the same way."""
        _, b, s, kv_heads, _ = kv.shape
        rows = layer_scales.view(-1, layer_scales.shape[2] * kv_heads)
        gathered = rows.index_select(0, gather_index).view(2, b, s, kv_heads)
        return dequantize_int8(kv, gathered, dtype)


class Fp8Codec:
    """E4M3 with static ``layer_scales [2, kv_heads]``: read, never written."""

    @staticmethod
    def write(layer_cache: torch.Tensor, layer_scales: torch.Tensor, slots: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        kv_heads, d = k.shape[1], k.shape[2]
        for i, x in enumerate((k, v)):
            layer_cache[i].view(-1, kv_heads, d).index_copy_(0, slots,
                                                             quantize_fp8(x, layer_scales[i]))

    @staticmethod
    def read(layer_cache: torch.Tensor, layer_scales: torch.Tensor, slots: torch.Tensor,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        kv_heads, d = layer_cache.shape[-2], layer_cache.shape[-1]
        return tuple(dequantize_fp8(layer_cache[i].view(-1, kv_heads, d)[slots],
                                    layer_scales[i], dtype) for i in range(2))

    @staticmethod
    def dequantize_gathered(kv: torch.Tensor, layer_scales: torch.Tensor,
                            gather_index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_fp8(kv, layer_scales.view(2, 1, 1, -1), dtype)


# an 8-bit cache's storage dtype -> how it is written and read
CODECS = {torch.int8: Int8Codec, torch.uint8: Fp8Codec}

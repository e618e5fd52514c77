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

The native kernels (:file:`csrc/rope_kv.cpp`, :file:`csrc/paged_attention.cpp`) do the
same arithmetic in the same order: these functions are the reference they are tested
against and the torch path (``LLMCTL_CPU_KERNELS=0``) itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT8_MAX = 127


@dataclass(frozen=True)
class KVFormat:
    """How one ``--kv-cache-dtype`` stores K/V: the cache tensor's dtype, and the bytes of
    scale kept per (token, KV head, K or V) next to it."""

    name: str
    storage: torch.dtype
    scale_bytes: int = 0

    @property
    def quantized(self) -> bool:
        return self.scale_bytes > 0

    def describe(self) -> str:
        return (f"{self.name}, a float32 scale per token and KV head" if self.quantized
                else self.name)


# --kv-cache-dtype values other than "auto" (= the model's dtype)
KV_FORMATS: dict[str, KVFormat] = {
    "float32": KVFormat("float32", torch.float32),
    "bfloat16": KVFormat("bfloat16", torch.bfloat16),
    "float16": KVFormat("float16", torch.float16),
    "int8": KVFormat("int8", torch.int8, scale_bytes=4),
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

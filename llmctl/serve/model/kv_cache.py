"""Sizing and allocating the paged KV cache.

The whole cache is one preallocated tensor ``[layers, 2, blocks, block_size, kv_heads,
head_dim]`` (index 0 of dim 1 is K, 1 is V): a block id addresses the same slots in
every layer, so one block table serves the whole model.

An int8 cache (:mod:`llmctl.serve.layers.kv_quant`) adds a scale tensor ``[layers, 2, blocks,
block_size, kv_heads]`` addressed the same way; an fp8 cache's scales are static,
``[layers, 2, kv_heads]`` (:mod:`llmctl.serve.model.kv_scales`), and not part of the blocks.

Sizing: ``bytes_per_block = layers * 2 * block_size * kv_heads * (head_dim * itemsize +
scale_bytes)`` (scales are counted: int8 with a float32 scale per token and head holds
``2d / (d + 4)`` times the blocks of bf16, 1.88x at head_dim 64; fp8 exactly 2x); the block count is
the budget (bytes, or a fraction of the memory available once the weights are loaded)
over that, capped at what ``max_num_seqs`` full-length sequences could ever use.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from llmctl.errors import ResourceError
from llmctl.utils.sizes import parse_memory


@dataclass(frozen=True)
class KVCachePlan:
    num_blocks: int
    block_size: int
    bytes_per_block: int
    dtype: str = "float32"  # what the cache stores (kv_quant.KVFormat.describe)

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def describe(self) -> str:
        return (f"KV cache ({self.dtype}): {self.num_blocks} blocks x {self.block_size} tokens = "
                f"{self.num_tokens} tokens, {self.total_bytes / 2**20:.1f} MiB")


def available_memory(device: str = "cpu") -> int:
    """Bytes the cache may take: free device memory on CUDA, MemAvailable on the host."""
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info()
        return int(free)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def plan_kv_cache(*, num_layers: int, num_kv_heads: int, head_dim: int, itemsize: int,
                  block_size: int, budget: str | float, max_num_seqs: int, max_model_len: int,
                  num_blocks: int | None = None, available: int | None = None,
                  scale_bytes: int = 0, dtype: str = "float32") -> KVCachePlan:
    per_block = num_layers * 2 * block_size * num_kv_heads * (head_dim * itemsize + scale_bytes)
    blocks_per_seq = -(-max_model_len // block_size)
    if num_blocks is None:
        kind, amount = parse_memory(budget)
        if kind == "fraction":
            amount *= available if available is not None else available_memory()
        num_blocks = min(int(amount // per_block), max_num_seqs * blocks_per_seq)
    if num_blocks < blocks_per_seq:
        # one sequence of the maximum length must fit, or it could never finish
        raise ResourceError(
            f"the KV cache holds {num_blocks} blocks of {block_size} tokens, less than one "
            f"sequence of max_model_len={max_model_len} needs ({blocks_per_seq})",
            "raise --kv-cache-memory or lower --max-model-len")
    return KVCachePlan(num_blocks=num_blocks, block_size=block_size, bytes_per_block=per_block,
                       dtype=dtype)


def allocate_kv_cache(plan: KVCachePlan, *, num_layers: int, num_kv_heads: int, head_dim: int,
                      dtype, device) -> torch.Tensor:  # noqa: F821
    import torch

    # Zeros, not empty: padding slots of a gathered block are masked out of attention,
    # but a NaN left in them by uninitialised memory would still poison 0 * V.
    return torch.zeros((num_layers, 2, plan.num_blocks, plan.block_size, num_kv_heads, head_dim),
                       dtype=dtype, device=device)


def allocate_kv_scales(plan: KVCachePlan, *, num_layers: int, num_kv_heads: int,
                       device) -> torch.Tensor:  # noqa: F821
    """The scales of an 8-bit cache, ``[layers, 2, blocks, block_size, kv_heads]`` float32
    (zeros: an unwritten slot dequantizes to 0, like an unwritten float slot)."""
    import torch

    return torch.zeros((num_layers, 2, plan.num_blocks, plan.block_size, num_kv_heads),
                       dtype=torch.float32, device=device)

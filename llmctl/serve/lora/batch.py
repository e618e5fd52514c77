"""One step's LoRA work: the step's rows grouped by adapter, one small matmul pair per
adapter per fused linear (no merge into the base weights, no padding to a common rank).

For the rows ``R_a`` of adapter ``a`` and a fused linear with input ``x`` and output
``y = W x`` (already computed for every row by the base path)::

    y[R_a] += (x[R_a] @ A_a^T) @ B_a^T          # s_a folded into B_a (lora_adapter)

in float32 whatever the model's dtype (bf16 products this small are slower on the CPU
than converting ``x[R_a]``, and the adapter keeps its trained precision).

so a row costs ``in * r + r * out`` extra multiply-adds for its own adapter only, and
base rows cost nothing. A masked form over ``max_loras x rank`` columns for every row
(a previous attempt) paid every adapter for every row: ~0.42x base throughput at 4
adapters. The runner orders a step's sequences by adapter inside each attention group,
so an adapter's rows are one contiguous range per group: a step is a list of segments
(adapter, row range), an adapter in as many as the groups it has rows in (Punica's and
S-LoRA's segmented kernels work the same way on GPUs; gathering an adapter's rows
instead cost an ``index_select`` and an ``index_add_`` per adapter and linear).

Two implementations of those sums:

- native (:file:`csrc/lora.cpp`): bfloat16 activations on the CPU. The layer loop calls
  it per fused linear, and the fused decode layers (:mod:`llmctl.serve.layers.decode_layers`)
  call the same kernel from C, so a decode step with adapters keeps that path and both
  give the same bits;
- torch: float32 models, other devices, no C++ compiler (``x`` over the segments' span
  converted once, one delta, one add).

A step in which no row has an adapter builds no :class:`LoRABatch` at all: the model
runs exactly as without LoRA.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from llmctl.serve.kernels.cpu import lora_kernel
from llmctl.serve.lora.adapter import FUSED

if TYPE_CHECKING:
    from llmctl.serve.lora.adapter import LoRAAdapter


# Steps with at most this many adapter rows run their torch LoRA products on one thread:
# a rank-8 product of 64 rows is ~10 us of work, less than fork/join over the pool
# (measured on 2 busy cores: 30 layers x 4 linears x 4 adapters of 1-4 rows took 3-6 ms
# per step on one thread, several times that on two). Prefill chunks keep the pool.
SINGLE_THREAD_ROWS = 64
# a fused linear's index in an adapter's native table: layer * 4 + this (csrc/lora.h)
TARGETS = {name: i for i, name in enumerate(FUSED)}


class LoraPair(ctypes.Structure):
    """:file:`csrc/lora.h`'s ``LoraPair``."""

    _fields_ = [("a", ctypes.c_void_p), ("b", ctypes.c_void_p), ("r", ctypes.c_int64)]


class LoraSeg(ctypes.Structure):
    """:file:`csrc/lora.h`'s ``LoraSeg``."""

    _fields_ = [("start", ctypes.c_int64), ("end", ctypes.c_int64),
                ("pairs", ctypes.POINTER(LoraPair))]


def native_table(adapter: LoRAAdapter) -> ctypes.Array:
    """The adapter's ``LoraPair`` per (layer, fused linear), made once and kept on the
    adapter, whose tensors it points into (a null ``a``: not targeted there)."""
    if adapter.table is None:
        pairs = (LoraPair * (len(adapter.layers) * len(TARGETS)))()
        for i, layer in enumerate(adapter.layers):
            for target, (a, b_t) in layer.items():
                pairs[i * len(TARGETS) + TARGETS[target]] = LoraPair(
                    a.data_ptr(), b_t.data_ptr(), a.shape[0])
        adapter.table = pairs
    return adapter.table


class LoRABatch:
    """``segments``: (adapter, row range) in row order, an adapter possibly in several;
    ``native``: the same as :file:`csrc/lora.h` segments when the kernel is built, else
    None."""

    __slots__ = ("_kernel", "native", "rows", "segments")

    def __init__(self, segments: list[tuple[LoRAAdapter, slice]], kernel=None) -> None:
        self.segments = segments
        self.rows = sum(r.stop - r.start for _, r in segments)
        self._kernel = kernel
        self.native = None
        if kernel is not None:
            self.native = (LoraSeg * len(segments))(*(
                LoraSeg(r.start, r.stop, native_table(adapter)) for adapter, r in segments))

    @classmethod
    def from_runs(cls, runs: list[tuple[LoRAAdapter | None, int, int]],
                  device: torch.device) -> LoRABatch | None:
        """From (adapter or None, first row, end row) per sequence, in row order; None
        when no row has an adapter."""
        segments: list[tuple[LoRAAdapter, slice]] = []
        for adapter, start, end in runs:
            if adapter is None or end <= start:
                continue
            last = segments[-1] if segments else None
            if last is not None and last[0] is adapter and last[1].stop == start:
                segments[-1] = (adapter, slice(last[1].start, end))  # adjoining: extend
            else:
                segments.append((adapter, slice(start, end)))
        if not segments:
            return None
        kernel = lora_kernel() if torch.device(device).type == "cpu" else None
        return cls(segments, kernel)

    def apply(self, layer: int, target: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """``y += LoRA(x)`` on each adapter's rows, for fused linear ``target`` of
        ``layer`` (``y`` is that linear's output for ``x``, updated in place)."""
        if (self.native is not None and x.dtype == y.dtype == torch.bfloat16
                and x.stride(1) == 1 and y.stride(1) == 1):
            self._kernel(x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), x.shape[1],
                         y.shape[1], self.native, len(self.native),
                         layer * len(TARGETS) + TARGETS[target], torch.get_num_threads())
            return
        ranges = [(pair, rows) for adapter, rows in self.segments
                  if (pair := adapter.layers[layer].get(target)) is not None]
        if not ranges:
            return
        threads = torch.get_num_threads()
        if self.rows <= SINGLE_THREAD_ROWS:
            torch.set_num_threads(1)
        try:
            self._add_ranges(ranges, x, y)
        finally:
            torch.set_num_threads(threads)

    @staticmethod
    def _add_ranges(ranges: list[tuple[tuple[torch.Tensor, torch.Tensor], slice]],
                    x: torch.Tensor, y: torch.Tensor) -> None:
        """The torch path: ``x`` over the span the segments cover converted to float32
        once, each segment's product written into its rows of one delta, and the delta
        added once (about half the tensor ops of converting and adding per segment,
        which is what a rank-r product costs: ops, not FLOPs)."""
        lo = min(rows.start for _, rows in ranges)
        hi = max(rows.stop for _, rows in ranges)
        dtype = ranges[0][0][0].dtype
        part = x[lo:hi].to(dtype)
        # zeros: a span of several attention groups may hold base rows between adapters
        delta = torch.zeros((hi - lo, y.shape[1]), dtype=dtype, device=y.device)
        for (a, b_t), rows in ranges:
            here = slice(rows.start - lo, rows.stop - lo)
            torch.mm(part[here] @ a.T, b_t, out=delta[here])
        y[lo:hi] += delta.to(y.dtype)

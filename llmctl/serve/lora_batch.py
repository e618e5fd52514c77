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
so an adapter's rows are usually one contiguous range (a view: no gather, an in-place
``addmm_``); otherwise they are gathered and scattered back with ``index_add_``
(S-LoRA and Punica's kernels do the same gather/segment work on GPUs).

A step in which no row has an adapter builds no :class:`LoRABatch` at all: the model
runs exactly as without LoRA (fused native decode layers included).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from llmctl.serve.lora_adapter import LoRAAdapter


# Steps with at most this many adapter rows run their LoRA products on one thread: a
# rank-8 product of 64 rows is ~10 us of work, less than fork/join over the pool
# (measured on 2 busy cores: 30 layers x 4 linears x 4 adapters of 1-4 rows took 3-6 ms
# per step on one thread, several times that on two). Prefill chunks keep the pool.
SINGLE_THREAD_ROWS = 64


class LoRABatch:
    """``segments``: (adapter, rows) with rows a slice or a long index tensor."""

    __slots__ = ("segments", "rows")

    def __init__(self, segments: list[tuple[LoRAAdapter, slice | torch.Tensor]]) -> None:
        self.segments = segments
        self.rows = sum((r.stop - r.start) if isinstance(r, slice) else r.numel()
                        for _, r in segments)

    @classmethod
    def from_runs(cls, runs: list[tuple[LoRAAdapter | None, int, int]],
                  device: torch.device) -> LoRABatch | None:
        """From (adapter or None, first row, end row) per sequence, in row order; None
        when no row has an adapter."""
        rows: dict[int, list[tuple[int, int]]] = {}
        adapters: dict[int, LoRAAdapter] = {}
        for adapter, start, end in runs:
            if adapter is None or end <= start:
                continue
            adapters[adapter.lora_id] = adapter
            spans = rows.setdefault(adapter.lora_id, [])
            if spans and spans[-1][1] == start:
                spans[-1] = (spans[-1][0], end)  # adjoining: extend the range
            else:
                spans.append((start, end))
        if not rows:
            return None
        segments: list[tuple[LoRAAdapter, slice | torch.Tensor]] = []
        for lora_id, spans in rows.items():
            if len(spans) == 1:
                where: slice | torch.Tensor = slice(*spans[0])
            else:
                where = torch.cat([torch.arange(s, e) for s, e in spans]).to(device)
            segments.append((adapters[lora_id], where))
        return cls(segments)

    def apply(self, layer: int, target: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """``y += LoRA(x)`` on each adapter's rows, for fused linear ``target`` of
        ``layer`` (``y`` is that linear's output for ``x``, updated in place)."""
        work = [(pair, rows) for adapter, rows in self.segments
                if (pair := adapter.layers[layer].get(target)) is not None]
        if not work:
            return
        threads = torch.get_num_threads()
        if self.rows <= SINGLE_THREAD_ROWS:
            torch.set_num_threads(1)
        try:
            ranges = [(pair, rows) for pair, rows in work if isinstance(rows, slice)]
            if ranges:
                self._add_ranges(ranges, x, y)
            for (a_t, b_t), rows in work:
                if not isinstance(rows, slice):
                    part = x.index_select(0, rows).to(a_t.dtype)
                    y.index_add_(0, rows, ((part @ a_t) @ b_t).to(y.dtype))
        finally:
            torch.set_num_threads(threads)

    @staticmethod
    def _add_ranges(ranges: list[tuple[tuple[torch.Tensor, torch.Tensor], slice]],
                    x: torch.Tensor, y: torch.Tensor) -> None:
        """The adapters with one row range each: ``x`` over the span they cover converted
        to float32 once, each adapter's product written into its rows of one delta, and
        the delta added once (about half the tensor ops of converting and adding per
        adapter, which is what a rank-r product costs: ops, not FLOPs)."""
        lo = min(rows.start for _, rows in ranges)
        hi = max(rows.stop for _, rows in ranges)
        dtype = ranges[0][0][0].dtype
        part = x[lo:hi].to(dtype)
        # zeros: a span of several attention groups may hold base rows between adapters
        delta = torch.zeros((hi - lo, y.shape[1]), dtype=dtype, device=y.device)
        for (a_t, b_t), rows in ranges:
            here = slice(rows.start - lo, rows.stop - lo)
            torch.mm(part[here] @ a_t, b_t, out=delta[here])
        y[lo:hi] += delta.to(y.dtype)
